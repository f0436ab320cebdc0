"""`dualpath bench local` end to end at a tiny size: seed, per-policy clusters, summary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dualpath.local import bench_cli

pytestmark = pytest.mark.slow


def test_bench_local_runs_both_policies_from_one_seed(tmp_path: Path, capsys, bench_args) -> None:
    args = bench_args(
        *["--agents", "2", "--turns", "3", "--first-tokens", "96", "--append-tokens", "8"],
        *["--gen-tokens", "2", "--snic-gbps", "1", "--plot", str(tmp_path / "p.png")],
    )
    assert bench_cli.run(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["same_greedy_answers"] and doc["ratio"] is not None
    runs = doc["policies"]
    for policy in ("prefill-read", "dualpath"):
        r = runs[policy]
        assert r["failed"] == 0 and r["hit_rate"] > 0.5
        assert r["turns"] == 2 * (3 - 1)  # 2 agents x 3 turns, the warm-up turn left out
    assert runs["prefill-read"]["bytes_read"]["decode"] == 0  # only the prefill SNIC reads
    assert runs["prefill-read"]["bytes_read"]["prefill"] > 0
    assert (tmp_path / "out" / "seed-kv" / "blocks").is_dir()
    assert (tmp_path / "p.png").stat().st_size > 0
