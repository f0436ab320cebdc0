"""`dualpath bench local`: the offline replay (`bench.py`) or, with `--online`, the rate sweep
(`online.py`, which builds on the replay): the one module above both, so neither imports the
other's caller."""

from __future__ import annotations

import argparse

from dualpath.local import bench, online


def add_arguments(parser: argparse.ArgumentParser) -> None:
    bench.add_arguments(parser)
    online.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    # --agents and --turns when not given: each mode has its own sizes
    for name, value in (online.ONLINE_SIZE if args.online else bench.OFFLINE_SIZE).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return online.run(args) if args.online else bench.run(args)
