#!/usr/bin/env bash
# D->P layer stream vs raw NIXL WRITEs between two processes, and traffic-class isolation.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${BIN:-.venv/bin}/dualpath" bench transfer --json "$@"
