"""`dualpath bench local --online` at a tiny size: Poisson arrivals, a two-rate sweep per
policy, the SLA, the sustained rates and the plot; and its pure parts."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from dualpath.local import bench, online


def _turn(ttft: float, latency: float, gen: int, ok: bool = True) -> bench.TurnResult:
    return bench.TurnResult("a", 0, 100, list(range(gen)), 0, "prefill", ttft, latency, ok)


def test_point_and_sustained_rate() -> None:
    turns = [_turn(0.1 * i, 0.1 * i + 0.3, 4) for i in range(1, 11)]
    p = online.point(0.5, 3, turns + [_turn(9, 9, 0, ok=False)], elapsed_s=10.0)
    assert (p.turns, p.failed, p.agents) == (10, 1, 3)
    assert p.ttft_p50_s == pytest.approx(0.5) and p.ttft_p90_s == pytest.approx(0.9)
    assert p.tpot_p50_s == pytest.approx(0.1)  # 0.3 s over the 3 tokens after the first
    assert p.tokens_per_s == pytest.approx(10 * 104 / 10.0)
    ok = online.point(1.0, 3, turns, 10.0)
    slow = online.point(2.0, 3, [_turn(5, 6, 2)] * 3, 10.0)
    assert online.sustained_rate([ok, slow], sla_s=1.0) == 1.0
    assert online.sustained_rate([p, slow], sla_s=1.0) == 0.0  # a failed turn does not count
    assert online.sustained_rate([ok, slow], sla_s=10.0) == 2.0


def test_trajectories_arrive_as_a_poisson_process_with_fresh_ids() -> None:
    args = argparse.Namespace(
        agents=200,
        context=4096,
        turns=3,
        append_tokens=8,
        gen_tokens=2,
        first_tokens=64,
        seed=0,
        think_s=1.5,
    )
    a, b = online._trajectories(args, 4.0, 0), online._trajectories(args, 4.0, 1)
    starts = [t.start_s for t in a]
    assert starts == sorted(starts) and starts[0] > 0
    assert 200 / starts[-1] == pytest.approx(4.0, rel=0.2)  # mean gap 1/rate
    assert not {t.agent_id for t in a} & {t.agent_id for t in b}
    thinks = [turn.think_s for t in a for turn in t.turns[1:]]
    assert sum(thinks) / len(thinks) == pytest.approx(1.5, rel=0.2)


@pytest.mark.slow
def test_bench_local_online_sweeps_both_policies(tmp_path: Path, capsys, bench_args) -> None:
    args = bench_args(
        *["--online", "--rates", "1,4", "--agents", "3", "--turns", "2", "--think-s", "0.1"],
        *["--first-tokens", "96", "--append-tokens", "8", "--gen-tokens", "3"],
        *["--snic-gbps", "1", "--plot", str(tmp_path / "p.png")],
    )
    assert bench.run(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["sla_s"] > 0 and set(doc["sustained_rate_per_s"]) == {"prefill-read", "dualpath"}
    for policy in ("prefill-read", "dualpath"):
        pts = doc["policies"][policy]
        assert [p["rate_per_s"] for p in pts] == [1.0, 4.0]
        assert all(p["failed"] == 0 and p["turns"] == 3 * 2 for p in pts)
        assert all(0 < p["ttft_p50_s"] <= p["ttft_p90_s"] <= p["ttft_p99_s"] for p in pts)
    assert (tmp_path / "p.png").stat().st_size > 0
    assert json.loads((tmp_path / "out" / "online.json").read_text())["sla_s"] == doc["sla_s"]
    assert (tmp_path / "out" / "seed-kv" / "blocks").is_dir()  # agents arrive with stored context
