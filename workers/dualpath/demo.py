"""`dualpath demo`: the main job on the embedded local default.

Runs the local benchmark (`dualpath bench local`): a fresh local cluster per policy (scheduler,
1 prefill and 2 decode worker processes, frontend) replays the same storage-bound agentic
trace under `prefill-read` and `dualpath`; prints the table, writes the plot and the JSON.
"""

from __future__ import annotations

import argparse
import logging

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="out/demo", help="output directory")


def run(args: argparse.Namespace) -> int:
    from dualpath.local import bench_cli

    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    ns = parser.parse_args(["--out", args.out, "--plot", f"{args.out}/local.png"])
    return bench_cli.run(ns)
