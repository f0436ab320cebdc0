"""`dualpath bench local`: the offline replay (`bench_run.py`) or, with `--online`, the rate sweep
(`online.py`, which builds on the replay): the one module above both, so neither imports the
other's caller. It owns what both modes share around a run: the KV scratch directory (a new
temporary one unless `--kv-dir`, removed at the end unless `--keep`) and the stop signals
(SIGINT/SIGTERM end every cluster process; the exit status is 128 + the signal)."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from dualpath.local import bench, bench_run, online, peers
from dualpath.local.interrupt import Interrupted, interruptible


def add_arguments(parser: argparse.ArgumentParser) -> None:
    bench.add_arguments(parser)
    online.add_arguments(parser)
    peers.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    # --agents and --turns when not given: each mode has its own sizes
    for name, value in (online.ONLINE_SIZE if args.online else bench.OFFLINE_SIZE).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if getattr(args, "read_to_compute", None) is None:  # the engine's (-f or --engine)
        args.read_to_compute = bench.default_read_to_compute(args)
    made = args.kv_dir is None
    if made:
        args.kv_dir = tempfile.mkdtemp(prefix="dualpath-kv-")
    try:
        with interruptible():
            return online.run(args) if args.online else bench_run.run(args)
    except Interrupted as stop:
        if not stop.reported:
            print(f"interrupted ({bench.signal_name(stop.signum)})", file=sys.stderr)
        return stop.exit_code
    finally:
        bench.remove_scratch(Path(args.kv_dir), made, args.keep)
