"""`dualpath demo`: the main job on the embedded local default.

Runs the local benchmark (a local cluster per policy replaying a storage-bound agentic trace)
at a size that finishes in a few minutes on 2 cores, prints the table, writes the plot.
Without the worker processes (`dualpath.worker`) there is no cluster to run: it then says so
and runs the KV store benchmark instead.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="out/demo", help="output directory")


def run(args: argparse.Namespace) -> int:
    # find_spec of a submodule raises (not None) when its parent package is absent
    if importlib.util.find_spec("dualpath.worker") is None:
        log.warning("dualpath.worker is not installed: no local cluster; running the store bench")
        from dualpath.kv import bench as store_bench

        ns = argparse.Namespace(**{**vars(store_bench.default_args()), "out": args.out})
        return store_bench.run(ns)
    from dualpath.local import bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    ns = parser.parse_args(["--out", args.out, "--plot", f"{args.out}/local.png"])
    rc = bench.run(ns)
    print(f"plot: {args.out}/local.png", flush=True)
    return rc
