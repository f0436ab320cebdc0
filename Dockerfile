# syntax=docker/dockerfile:1
# The DualPath image (CPU build): one image runs every process (`dualpath operator | scheduler |
# frontend | worker ...`). ENGINE=vllm adds vLLM's CPU build (scripts/install-vllm.sh, the
# integration's tested install) for `spec.workers.engine: vllm`: the pods still run
# `dualpath worker`, which starts its own `vllm serve` child (docs/vllm.md).
# Build: `make image [ENGINE=vllm]` (docs/image.md). Read-only-root friendly: nothing is written
# outside /tmp (the pods mount it writable); runs as uid 65532.
# Any Debian bookworm base with python3 and its venv module (docs/image.md makes one with
# debootstrap, for machines without Docker Hub).
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
# CPU torch first, from the PyTorch CPU index: PyPI's Linux torch is the multi-GB CUDA build.
# Empty: no index; the CPU wheel then comes from a local wheel directory that the builder mounts
# (PIP_FIND_LINKS, `make image WHEELS=dir`), as may any other package.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# Set by `make image` only when asked (WHEELS=..., CA_CERTS=...): pip reads them from the
# environment of the RUN steps; unset they change nothing.
ARG PIP_FIND_LINKS
ARG PIP_CERT
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore
RUN python3 -m venv /opt/dualpath
ENV PATH=/opt/dualpath/bin:$PATH
WORKDIR /src
# every package at the version the test suite ran with: requirements.lock, the one lock of
# make venv, CI and this image (`make lock`), used as constraints so the image takes its subset
COPY requirements.lock ./
# (torch==<version>+cpu in the lock exists on the CPU index or in a local wheel directory only;
# its dependencies come from PyPI at their locked versions)
RUN pip install ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} --constraint requirements.lock torch
COPY pyproject.toml README.md ./
COPY workers ./workers
COPY operator ./operator
# a wheel install (not editable): the runtime stage copies the venv alone, not /src
RUN pip install --constraint requirements.lock ".[nixl,operator]" \
 && python -c "import dualpath.cli, dualpath_operator.main, torch; print(torch.__version__)"
# ENGINE is declared here, not at the stage's top: a build argument is part of every later
# step's cache key, so both engines' builds share the torch and project steps above
ARG ENGINE=dualpath
COPY scripts ./scripts
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN case "${ENGINE}" in \
      dualpath) ;; \
      vllm) bash scripts/install-vllm.sh /opt/dualpath requirements.lock ;; \
      *) echo "ENGINE must be dualpath or vllm (got ${ENGINE})" >&2; exit 2 ;; \
    esac

FROM ${PYTHON_IMAGE}
ARG DUALPATH_VERSION=dev
ARG ENGINE=dualpath
LABEL org.opencontainers.image.title="dualpath" \
      org.opencontainers.image.version="${DUALPATH_VERSION}" \
      org.opencontainers.image.description="DualPath (engine: ${ENGINE})" \
      org.opencontainers.image.licenses="Apache-2.0"
# rdma-core's verbs providers and RDMA CM for UCX's InfiniBand/RoCE transports (NIXL bundles
# libibverbs and mlx5; other NICs' providers come from here), libnuma for vLLM's CPU build.
# Pinned to bookworm's releases.
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      ibverbs-providers=44.0-2 librdmacm1=44.0-2 libnuma1=2.0.16-1 \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/dualpath /opt/dualpath
# HOME and the caches on /tmp: the only writable path of a read-only root (an emptyDir there;
# vLLM pods mount a larger cache and point HOME at it)
ENV PATH=/opt/dualpath/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    MPLCONFIGDIR=/tmp/matplotlib \
    VLLM_NO_USAGE_STATS=1 \
    DO_NOT_TRACK=1
# a name for uid 65532: getpass.getuser() (kopf's peer identity, torch's cache paths) raises
# for a uid without a passwd entry
RUN echo "dualpath:x:65532:65532:dualpath:/tmp:/usr/sbin/nologin" >> /etc/passwd \
 && echo "dualpath:x:65532:" >> /etc/group
USER 65532:65532
WORKDIR /tmp
# The pods' command is this entry point (dualpath.process.ENTRY_POINT; tests/unit/test_image.py).
ENTRYPOINT ["dualpath"]
CMD ["--help"]
