#!/usr/bin/env bash
# Simulator benchmarks: speed (48P+96D, one simulated hour), scale sweep, preset ratios.
# Prints JSON per run (wall_s and sim_s included); writes plots into ${OUT:-out/bench}.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-out/bench}"
mkdir -p "$out"
py="${PYTHON:-.venv/bin/python}"
# Speed bar: one simulated hour of the offline workload on 48P+96D with the dual-path policy.
"$py" -m dualpath.cli sim --preset bench --policies dualpath --json --quiet > "$out/sim_bench.json"
# Scale sweep 2P+4D .. 48P+96D (steady-state throughput per prefill node vs the smallest).
"$py" -m dualpath.cli sim --preset scale --json --quiet --plot "$out/sim_scale.png" \
  > "$out/sim_scale.json"
for preset in offline online; do
  "$py" -m dualpath.cli sim --preset "$preset" --json --quiet --plot "$out/sim_$preset.png" \
    > "$out/sim_$preset.json"
done
cat "$out"/sim_bench.json
# Real agentic traffic (issue 16), when the shared traces are next to the repository: import the
# 119 Claude Code sessions, then all of them through both policies at 2P4D (bar: < 60 s).
traces="${DUALPATH_TRACES:-../shared/traces}"
if [ -d "$traces/claude-code" ]; then
  "$py" -m dualpath.cli trace import claude-code "$traces/claude-code" -o "$out/cc.jsonl" \
    > "$out/trace_import.json"
  "$py" -m dualpath.cli sim --preset offline-64k --trace "$out/cc.jsonl" --xs 119 --steady \
    --json --quiet > "$out/sim_claude_code.json"
fi
