#!/usr/bin/env bash
# KV block store read throughput vs a plain read of the same bytes; pass --snic-gbps X for the cap.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${BIN:-.venv/bin}/dualpath" bench store --json "$@"
