"""DualPath runtime: config, KV store, engine, transfer, scheduler, frontend, local cluster, sim.

`__version__` and `IMAGE_REPOSITORY` are the one source of the release and of the container
image every process runs: the config's default images, the CRD's defaults, `make image` and
pyproject's version read them; the chart's appVersion and image repository are checked
against them by tests/unit/test_image.py.
"""

__version__ = "0.1.0"
IMAGE_REPOSITORY = "ghcr.io/dualpath/dualpath"
# The vLLM build (`make image ENGINE=vllm`) is the same repository, tag `<version>-vllm`.
VLLM_TAG_SUFFIX = "-vllm"


def default_image(engine: str = "dualpath") -> str:
    """The released image of `engine` (dualpath or vllm)."""
    suffix = VLLM_TAG_SUFFIX if engine == "vllm" else ""
    return f"{IMAGE_REPOSITORY}:{__version__}{suffix}"
