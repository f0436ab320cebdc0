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
        *["--kv-dir", str(tmp_path / "kv"), "--keep"],
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
    assert (tmp_path / "kv" / "seed-kv" / "blocks").is_dir()  # kept: --keep
    assert (tmp_path / "p.png").stat().st_size > 0


def test_a_budget_bounds_the_replay_and_both_policies_replay_the_same_turns(
    tmp_path: Path, capsys, bench_args
) -> None:
    # reads slow enough (0.00025 Gbit/s: ~3.6 s a turn) that 4 agents x 12 turns can never fit
    # in 180 s; the warm-up's share of it (half, calibration and a cluster start included) must
    # hold on a busy 2-core machine too
    args = bench_args(
        *["--agents", "4", "--turns", "12", "--first-tokens", "96", "--append-tokens", "8"],
        *["--gen-tokens", "2", "--snic-gbps", "0.00025", "--budget-s", "180"],
        *["--kv-dir", str(tmp_path / "kv")],
    )
    assert bench_cli.run(args) == 0
    doc = json.loads(capsys.readouterr().out)
    cut = doc["cut"]
    assert cut["budget_s"] == 180 and cut["trace_turns"] == 4 * 12
    assert 2 <= cut["turns_per_agent"] < 12 and cut["left_out_turns"] > 0
    runs = doc["policies"]
    measured = {p: r["turns"] for p, r in runs.items()}
    if not cut.get("deadline"):  # the plan held: every planned measured turn ran
        assert measured["prefill-read"] == cut["replayed_turns"] - 4  # the warm-up served once
        assert doc["compared_turns"] + doc["warmup_turns"] == cut["replayed_turns"]
    assert measured["dualpath"] == measured["prefill-read"] > 0  # the same turns, both
    assert doc["same_greedy_answers"] and doc["compared_turns"] == measured["dualpath"]
    assert not (tmp_path / "kv").exists()  # scratch removed (no --keep)


def test_a_budget_too_short_for_any_warm_up_is_an_error_not_an_empty_success(
    tmp_path: Path, capsys, bench_args
) -> None:
    args = bench_args(
        *["--agents", "2", "--turns", "3", "--first-tokens", "96", "--append-tokens", "8"],
        *["--gen-tokens", "2", "--snic-gbps", "1", "--budget-s", "1"],
        *["--kv-dir", str(tmp_path / "kv")],
    )
    assert bench_cli.run(args) == 1
    assert "no agent's warm-up ended" in capsys.readouterr().err
