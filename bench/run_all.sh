#!/usr/bin/env bash
# `make bench`: every benchmark, each printing JSON measured side by side in one run.
# Results land in out/bench/<name>.json; a summary line per benchmark goes to stdout.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
mkdir -p out/bench
status=0
run() {
  local name=$1; shift
  echo "== $name: dualpath $*" >&2
  if "$BIN/dualpath" "$@" >"out/bench/$name.json"; then
    echo "$name: $(tr -d '\n' <"out/bench/$name.json" | cut -c1-400)"
  else
    echo "$name: FAILED (see stderr above)"; status=1
  fi
}
run store bench store --json
run store_capped bench store --json --snic-gbps 1
run engine bench engine --json
run transfer bench transfer --json
run scheduler bench scheduler --nodes 144 --json
run sim_bench sim --preset bench --policies dualpath --json --quiet
run sim_scale sim --preset scale --json --quiet --plot out/bench/sim_scale.png
run sim_offline sim --preset offline --json --quiet --plot out/bench/sim_offline.png
run sim_online sim --preset online --json --quiet --plot out/bench/sim_online.png
run local bench local --json --plot out/bench/local.png
exit $status
