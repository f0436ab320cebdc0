"""`dualpath demo`: the main job on the embedded local default.

Until the local cluster lands this runs the most complete real thing: the store benchmark.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="out/demo", help="output directory")


def run(args: argparse.Namespace) -> int:
    from dualpath.kv import bench

    ns = argparse.Namespace(**{**vars(bench.default_args()), "out": args.out})
    return bench.run(ns)
