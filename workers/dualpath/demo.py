"""`dualpath demo`: the main job on the embedded local default, in a bounded time.

Runs the local benchmark (`dualpath bench local`): a fresh local cluster per policy (scheduler,
1 prefill and 2 decode worker processes, frontend) replays the same storage-bound agentic
trace under `prefill-read`, then `dualpath`; prints the table, writes the plot and the JSON.
It takes at most about `--budget-s` (5 minutes) on an idle or a busy machine: the calibrated SNIC
cap makes every turn slower on a slower CPU, so the replayed turns are cut to what fits
(`local/budget.py`) and the table says what was cut. Everything it writes goes to a new
temporary directory (printed), the KV stores in it removed at the end unless `--keep`.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile

log = logging.getLogger(__name__)

# What `make demo` may take, end to end, on a 2-core machine idle or busy: the bench plans for
# PLAN_SHARE of it, and the stops and start-up fit in the rest.
DEMO_BUDGET_S = 300.0
# A turn's hit read over its prefill compute (the bench's default is 4, a GPU cluster's
# balance). The calibration times the prefill alone, but in the cluster the prefill shares the
# CPU with the decode workers, the frontend and the client, and on a busy machine with others'
# work too: measured at load 9-15 with 4, dualpath turned compute-bound (pooled SNIC utilisation
# 0.64, ratio 1.94). 6 keeps it storage-bound there; the budget pays for the slower reads.
DEMO_READ_TO_COMPUTE = 6.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-f", "--file", help="DualPathCluster YAML (default: embedded local)")
    parser.add_argument(
        "--out", default=None, help="output directory (default: a new temporary directory)"
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=DEMO_BUDGET_S,
        help="about how long the demo may take, in seconds (the replayed turns are cut to fit)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the KV stores (OUT/kv)")


def run(args: argparse.Namespace) -> int:
    from dualpath.local import bench_cli

    out = args.out or tempfile.mkdtemp(prefix="dualpath-demo-")
    print(
        f"dualpath demo: prefill-read, then dualpath, on the same agentic trace and SNIC cap; "
        f"at most about {args.budget_s / 60:.0f} minutes; output in {out}",
        file=sys.stderr,
        flush=True,
    )
    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    argv = ["--out", out, "--plot", f"{out}/local.png", "--budget-s", str(args.budget_s)]
    argv += ["--kv-dir", f"{out}/kv", "--read-to-compute", str(DEMO_READ_TO_COMPUTE)]
    if args.file:
        argv += ["-f", args.file]
    if args.keep:
        argv.append("--keep")
    return bench_cli.run(parser.parse_args(argv))
