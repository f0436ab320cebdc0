"""`dualpath bench local --online` at a tiny size: Poisson arrivals, a two-point auto sweep per
policy from its predicted capacity, the SLA, the brackets and the plot; the sweep's pure parts
(and --rates lists) are in tests/unit/local/test_online.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dualpath.local import bench, bench_cli, online


def _turn(ttft: float, latency: float, gen: int, ok: bool = True) -> bench.TurnResult:
    err = "" if ok else "x"
    return bench.TurnResult("a", 0, 100, list(range(gen)), 0, "prefill", ttft, latency, ok, err)


def test_point_and_sustained_rate() -> None:
    turns = [_turn(0.1 * i, 0.1 * i + 0.3, 4) for i in range(1, 11)]
    p = online.point(0.5, 3, turns + [_turn(9, 9, 0, ok=False)], elapsed_s=10.0)
    assert (p.turns, p.failed, p.agents) == (10, 1, 3)
    assert p.errors == {"x": 1} and p.refused == 0
    assert p.ttft_p50_s == pytest.approx(0.5) and p.ttft_p90_s == pytest.approx(0.9)
    assert p.tpot_p50_s == pytest.approx(0.1)  # 0.3 s over the 3 tokens after the first
    assert p.tokens_per_s == pytest.approx(10 * 104 / 10.0) and p.turns_per_s == 1.0
    ok = online.point(1.0, 3, turns, 10.0)
    slow = online.point(2.0, 3, [_turn(5, 6, 2)] * 3, 10.0)
    assert online.sustained_rate([ok, slow], sla_s=1.0) == 1.0
    assert online.sustained_rate([p, slow], sla_s=1.0) == 0.0  # a failed turn does not count
    assert online.sustained_rate([ok, slow], sla_s=10.0) == 2.0


def _run(tmp_path: Path, capsys, bench_args, *extra: str) -> dict:
    args = bench_args(
        *["--online", "--agents", "3", "--turns", "2", "--think-s", "0.1", "--point-s", "0.75"],
        *["--first-tokens", "96", "--append-tokens", "8", "--gen-tokens", "3"],
        *["--plot", str(tmp_path / "p.png"), *extra],
    )
    assert bench_cli.run(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["sla_s"] > 0 and set(doc["sustained_rate_per_s"]) == {"prefill-read", "dualpath"}
    assert set(doc["unloaded_ttft_p50_s"]) == {"prefill-read", "dualpath"}
    assert doc["sla_s"] == pytest.approx(4.0 * doc["unloaded_ttft_p50_s"]["prefill-read"], 1e-3)
    for policy in ("prefill-read", "dualpath"):
        pts = doc["policies"][policy]
        assert all(p["failed"] == 0 and p["turns"] == p["agents"] * 2 for p in pts)
        assert all(0 < p["ttft_p50_s"] <= p["ttft_p90_s"] <= p["ttft_p99_s"] for p in pts)
        assert all(p["met_sla"] == (p["ttft_p90_s"] <= doc["sla_s"]) for p in pts)
        met = max((p["rate_per_s"] for p in pts if p["met_sla"]), default=None)
        assert doc["bracket"][policy]["met"] == met == (doc["sustained_rate_per_s"][policy] or None)
    assert (tmp_path / "p.png").stat().st_size > 0
    assert json.loads((tmp_path / "out" / "online.json").read_text())["sla_s"] == doc["sla_s"]
    assert (tmp_path / "out" / "seed-kv" / "blocks").is_dir()  # agents arrive with stored context
    return doc


@pytest.mark.slow
def test_bench_local_online_auto_rates_start_from_each_policys_capacity(
    tmp_path: Path, capsys, bench_args
) -> None:
    # --rates auto, --snic-gbps auto; a short window: the tiny model's capacity is high
    doc = _run(tmp_path, capsys, bench_args, "--max-points", "2", "--point-s", "0.1")
    cap = doc["predicted_capacity"]
    assert cap["dualpath"]["readers"] == 3 and cap["prefill-read"]["readers"] == 1
    for policy in ("prefill-read", "dualpath"):
        first, second = doc["policies"][policy]
        assert first["rate_per_s"] == pytest.approx(
            online.START_LOAD * cap[policy]["agents_per_s"], rel=1e-3
        )
        step = online.STEP if first["met_sla"] else 1 / online.STEP
        assert second["rate_per_s"] == pytest.approx(first["rate_per_s"] * step, rel=1e-3)
