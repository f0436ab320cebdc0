"""Fixtures of the local-cluster tests."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import pytest
from dualpath.local import bench_cli
from tiny_configs import tiny_local, write_config


@pytest.fixture
def bench_args(tmp_path: Path) -> Callable[..., argparse.Namespace]:
    """`dualpath bench local`'s arguments: the tiny cluster (16 MiB KV buffers) as `-f`,
    `--out tmp_path/out`, `--json`, then the test's own."""
    cfg_file = write_config(tiny_local(buffer_bytes=16 << 20), tmp_path / "c.yaml")
    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)

    def parse(*argv: str) -> argparse.Namespace:
        return parser.parse_args(
            ["-f", str(cfg_file), "--out", str(tmp_path / "out"), "--json", *argv]
        )

    return parse
