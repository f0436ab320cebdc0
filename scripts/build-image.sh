#!/usr/bin/env bash
# Build (and with PUSH=1 push) the DualPath image with whichever builder this machine has:
# docker, podman, buildah, nerdctl, or kaniko's /kaniko/executor (BUILDER=<command> picks one:
# any command with docker's build/push arguments, a path or a wrapper included).
#   ENGINE=dualpath (the CPU image) | vllm (the same plus vLLM's CPU build), tagged <version>-vllm
#   IMAGE=registry/name:tag   default: dualpath.default_image(ENGINE), the one source of the
#                             repository and version (workers/dualpath/__init__.py)
#   PYTHON_IMAGE=base         the base (default: the Dockerfile's; docs/image.md makes one with
#                             debootstrap where Docker Hub is out of reach)
# For machines that reach PyPI but not the PyTorch index (podman and buildah: a build volume):
#   WHEELS=dir                pip's local wheel directory (the CPU torch), mounted into the build;
#                             the PyTorch index is then not asked
#   CA_CERTS=dir              the host's CA directory (/etc/ssl/certs), mounted over the base's,
#                             pip told to trust its bundle (a TLS-intercepting proxy's CA)
#   ARCHIVE=file.tar          also write the image as an OCI archive (for `ctr images import`,
#                             `kind load image-archive`)
# Exit 2 with a message when no builder is found or ENGINE is unknown (docs/image.md).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
ENGINE=${ENGINE:-dualpath}
PUSH=${PUSH:-0}
PY=${PY:-python3}
FILE=Dockerfile
case "$ENGINE" in
  dualpath | vllm) ;;
  *) echo "build-image: ENGINE must be dualpath or vllm (got '$ENGINE')" >&2; exit 2 ;;
esac
read -r DEFAULT VERSION < <(PYTHONPATH="$ROOT/workers" "$PY" -c \
  'import sys, dualpath; print(dualpath.default_image(sys.argv[1]), dualpath.__version__)' "$ENGINE")
IMAGE=${IMAGE:-$DEFAULT}

# A builder is usable when its command is here and, for docker and nerdctl, their engine answers
# (a docker CLI without a reachable daemon cannot build).
usable() {
  command -v "$1" >/dev/null 2>&1 || return 1
  case "$1" in
    docker | nerdctl) "$1" info >/dev/null 2>&1 ;;
    *) return 0 ;;
  esac
}
BUILDER=${BUILDER:-}
SKIPPED=""
if [ -z "$BUILDER" ]; then
  for candidate in docker podman buildah nerdctl; do
    if usable "$candidate"; then BUILDER=$candidate; break; fi
    if command -v "$candidate" >/dev/null 2>&1; then SKIPPED+=" $candidate"; fi
  done
fi
if [ -z "$BUILDER" ] && [ -x /kaniko/executor ]; then BUILDER=kaniko; fi
if [ -z "$BUILDER" ]; then
  echo "build-image: no image builder found: install docker, podman, buildah or nerdctl, run" \
    "inside kaniko (/kaniko/executor), or set BUILDER=<command> (docs/image.md)" >&2
  if [ -n "$SKIPPED" ]; then
    echo "build-image: installed but without a reachable engine:$SKIPPED" >&2
  fi
  exit 2
fi

BUILD_ARGS=(--build-arg "DUALPATH_VERSION=$VERSION" --build-arg "ENGINE=$ENGINE")
if [ -n "${PYTHON_IMAGE:-}" ]; then BUILD_ARGS+=(--build-arg "PYTHON_IMAGE=$PYTHON_IMAGE"); fi
# BUILDER may be any command that takes docker's `build -f -t --build-arg` and `push` (docker,
# podman, buildah, nerdctl, a path to one, or a wrapper such as `sudo podman`), or kaniko.
read -r -a BUILDER_CMD <<<"$BUILDER"
if ! command -v "${BUILDER_CMD[0]}" >/dev/null 2>&1 && [ "$BUILDER" != kaniko ]; then
  echo "build-image: BUILDER=$BUILDER: '${BUILDER_CMD[0]}' is not a command here" >&2
  exit 2
fi
BUILDER_NAME=${BUILDER_CMD[-1]##*/} # `sudo podman` is podman
# build-time volumes: podman and buildah only (docker and kaniko have no `build -v`)
VOLUMES=()
if [ -n "${WHEELS:-}" ]; then
  WHEELS=$(cd "$WHEELS" && pwd)
  VOLUMES+=(-v "$WHEELS:/wheels:ro")
  BUILD_ARGS+=(--build-arg PIP_FIND_LINKS=/wheels --build-arg TORCH_INDEX_URL=)
fi
if [ -n "${CA_CERTS:-}" ]; then
  VOLUMES+=(-v "$CA_CERTS:/etc/ssl/certs:ro")
  BUILD_ARGS+=(--build-arg PIP_CERT=/etc/ssl/certs/ca-certificates.crt)
fi
if [ ${#VOLUMES[@]} -gt 0 ] && [ "$BUILDER_NAME" != podman ] && [ "$BUILDER_NAME" != buildah ]; then
  echo "build-image: WHEELS and CA_CERTS need podman or buildah (a build-time volume);" \
    "$BUILDER has none (docs/image.md)" >&2
  exit 2
fi
ARGS=(-f "$ROOT/$FILE" -t "$IMAGE" "${BUILD_ARGS[@]}" "${VOLUMES[@]}")
# buildah caches no step unless asked (podman's and docker's default): with --layers a rebuild
# after a code change redoes the project's step only, not the ~1 GB torch step before it
if [ "$BUILDER_NAME" = buildah ]; then ARGS+=(--layers); fi
case "${BUILDER_CMD[0]##*/}" in
  kaniko | executor)
    BUILD=(/kaniko/executor --context "dir://$ROOT" --dockerfile "$ROOT/$FILE"
      --destination "$IMAGE" "${BUILD_ARGS[@]}")
    [ "$PUSH" = 1 ] || BUILD+=(--no-push)
    if [ -n "${ARCHIVE:-}" ]; then BUILD+=(--tar-path "$ARCHIVE"); fi
    PUSH_CMD=()
    SAVE_CMD=()
    ;;
  *)
    BUILD=("${BUILDER_CMD[@]}" build "${ARGS[@]}" "$ROOT")
    PUSH_CMD=("${BUILDER_CMD[@]}" push "$IMAGE")
    case "$BUILDER_NAME" in
      podman | buildah) SAVE_CMD=("${BUILDER_CMD[@]}" push "$IMAGE" "oci-archive:${ARCHIVE:-}:$IMAGE") ;;
      *) SAVE_CMD=("${BUILDER_CMD[@]}" save -o "${ARCHIVE:-}" "$IMAGE") ;;
    esac
    ;;
esac

echo "+ ${BUILD[*]}"
"${BUILD[@]}"
if [ "$PUSH" = 1 ] && [ ${#PUSH_CMD[@]} -gt 0 ]; then
  echo "+ ${PUSH_CMD[*]}"
  "${PUSH_CMD[@]}"
fi
if [ -n "${ARCHIVE:-}" ] && [ ${#SAVE_CMD[@]} -gt 0 ]; then
  rm -f "$ARCHIVE"
  echo "+ ${SAVE_CMD[*]}"
  "${SAVE_CMD[@]}"
fi
echo "built $IMAGE${ARCHIVE:+ (archive: $ARCHIVE)}"
