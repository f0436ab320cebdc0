"""`dualpath plan`: the P:D search over the simulator, its report, plot and emitted spec."""

from __future__ import annotations

import json

import pytest
from dualpath import trace
from dualpath.cli import main
from dualpath.config import ModelSpec, load
from dualpath.sim.model import Hardware
from dualpath.sim.plan import Planner, Slo, capacity_bound
from dualpath.sim.points import Point, interval, ratio_interval, ties


def _sessions() -> list[trace.Trajectory]:
    return trace.generate(
        trace.preset_spec("32k", agents=24, max_turns=8, mean_think_s=0.5, seed=3)
    )


def test_planner_searches_every_split_it_needs_and_ranks_by_goodput() -> None:
    msgs: list[str] = []
    pl = Planner(
        _sessions(),
        ModelSpec(preset="deepseek-v3.2"),
        Hardware(),
        Slo(ttft_p90_s=4.0, tpot_p90_s=0.2),
        horizon_s=40.0,
        warmup_s=10.0,
        ladder=(8, 32),
        seeds=(0, 1),
        progress=msgs.append,
    )
    best, tried = pl.best_split("dualpath", 4)
    # A climb to a local maximum: the best's neighbours were simulated (or bounded below it).
    assert best.prefill in tried and len(tried) >= 2
    assert all(q in tried for q in (best.prefill - 1, best.prefill + 1) if 1 <= q < 4)
    simulated = [p for p in tried.values() if not p.pruned_bound]
    assert best is max(simulated, key=lambda p: (p.meets_slo, p.tokens_per_s, -p.prefill))
    assert best.prefill + best.decode == 4 and best.binding
    # Every figure is over both seeds, and each run is reported once, with an ETA after a split.
    assert best.seeds == [0, 1] and len(best.tokens_per_s_seeds) == 2
    assert 0 < len(msgs) <= pl.runs and msgs[0].startswith("[plan] run 1 (")
    assert any("ETA" in m for m in msgs)
    # The same run is never simulated twice.
    runs = pl.runs
    pl.best_split("dualpath", 4)
    assert pl.runs == runs


def test_a_load_over_the_slo_is_not_goodput() -> None:
    pl = Planner(
        _sessions(),
        ModelSpec(preset="deepseek-v3.2"),
        Hardware(),
        Slo(ttft_p90_s=1e-6, tpot_p90_s=1e-6),  # nothing can meet it
        horizon_s=40.0,
        warmup_s=10.0,
        ladder=(8, 16),
        seeds=(0,),
    )
    pt = pl.goodput("prefill-read", 1, 1)
    assert not pt.meets_slo and pt.sessions == 8 and pl.runs == 1


def test_plan_cli_prints_table_json_plot_and_spec(tmp_path, capsys) -> None:
    path = tmp_path / "t.jsonl"
    trace.save_jsonl(path, _sessions(), meta={"name": "synthetic-24"})
    png, spec = tmp_path / "plan.png", tmp_path / "cluster.yaml"
    argv = [
        "plan",
        "--trace",
        str(path),
        "--nodes",
        "3",
        "--sessions",
        "8,24",
        "--horizon",
        "30",
        "--seeds",
        "2",
        "--quiet",
    ]
    assert main([*argv, "--json", "--plot", str(png), "--emit-spec", str(spec)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["trace"] == "synthetic-24" and out["nodes"] == 3
    for pol in ("prefill-read", "dualpath"):
        b = out["best"][pol]
        assert b["prefill"] + b["decode"] == 3
        assert {"tokens_per_s", "ttft_p90_s", "binding", "path_d_fraction"} <= set(b)
    assert out["best"]["prefill-read"]["path_d_fraction"] == 0.0
    assert "dualpath_over_baseline" in out
    lo, hi = out["dualpath_over_baseline_interval"]
    assert lo <= out["dualpath_over_baseline"] <= hi
    assert len(out["dualpath_over_baseline_per_seed"]) == 2 == len(out["seeds"])
    for b in out["best"].values():
        assert b["tokens_per_s_interval"][0] <= b["tokens_per_s"] <= b["tokens_per_s_interval"][1]
    assert png.stat().st_size > 1000
    cfg = load(spec)
    assert cfg.spec.prefill.replicas == out["best"]["dualpath"]["prefill"]
    assert cfg.spec.storage.snic_gbps == 400
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "best per policy" in text and "dualpath / prefill-read" in text


def test_plan_evaluates_given_splits(tmp_path, capsys) -> None:
    path = tmp_path / "t.jsonl"
    trace.save_jsonl(path, _sessions())
    argv = ["plan", "--trace", str(path), "--splits", "1:1,1:2", "--sessions", "8", "--json"]
    assert main([*argv, "--horizon", "30", "--policies", "dualpath", "--quiet"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = out["splits"]["dualpath"]
    assert [(r["prefill"], r["decode"]) for r in rows] == [(1, 1), (1, 2)]
    assert out["nodes"] is None and out["best"]["dualpath"] in rows


@pytest.mark.parametrize(
    ("extra", "flag"),
    [
        (["--nodes", "1"], "--nodes"),
        (["--policies", "nope"], "--policies"),
        (["--ttft-slo", "0"], "--ttft-slo"),
        (["--sessions", "0"], "--sessions"),
        (["--splits", "2-4"], "--splits"),
        (["--max-context", "-1"], "--max-context"),
    ],
)
def test_plan_refuses_bad_options_by_name(tmp_path, capsys, extra, flag) -> None:
    path = tmp_path / "t.jsonl"
    trace.save_jsonl(path, _sessions()[:2])
    assert main(["plan", "--trace", str(path), "--quiet", *extra]) == 2
    assert flag in capsys.readouterr().err


def test_node_count_for_a_target_is_the_fewest_that_reach_it() -> None:
    pl = Planner(
        _sessions(),
        ModelSpec(preset="deepseek-v3.2"),
        Hardware(),
        Slo(ttft_p90_s=10.0, tpot_p90_s=0.5),
        horizon_s=30.0,
        warmup_s=5.0,
        ladder=(16,),
        seeds=(0,),
    )
    small = pl.goodput("dualpath", 1, 1)
    assert small.meets_slo
    # A target the 2-node cluster reaches needs 2 nodes; one far above any cluster: None.
    pt = pl.nodes_for("dualpath", 0.5, small.tokens_per_s * 0.9, max_nodes=4)
    assert pt is not None and pt.prefill + pt.decode == 2
    assert pl.nodes_for("dualpath", 0.5, 1e12, max_nodes=3) is None


def test_capacity_is_bisected_to_the_tolerance() -> None:
    pl = Planner(
        _sessions(),
        ModelSpec(preset="deepseek-v3.2"),
        Hardware(),
        Slo(ttft_p90_s=0.5, tpot_p90_s=0.2),  # TTFT passes it before tokens/s saturate
        horizon_s=40.0,
        warmup_s=10.0,
        seeds=(0, 1),
        tolerance=0.1,
    )
    pt = pl.goodput("prefill-read", 1, 1, guess=8)
    assert pt.meets_slo and pt.sessions_missed > pt.sessions
    assert pt.seeds == [0, 1] and len(pt.sessions_seeds) == 2 and 1.0 < pt.resolution <= 1.1
    for seed in (0, 1):
        # Each seed's capacity, bracketed: the lightest load that missed is within 10% of it.
        cap = pl.capacity("prefill-read", 1, 1, seed)
        assert cap.meets_slo and cap.seeds == [seed]
        assert cap.sessions < cap.sessions_missed <= max(cap.sessions * 1.1, cap.sessions + 1)
        assert not pl.run("prefill-read", 1, 1, cap.sessions_missed, (seed,)).meets_slo
    # Cached: asking again simulates nothing.
    runs = pl.runs
    assert pl.goodput("prefill-read", 1, 1) is pt and pl.runs == runs


def test_intervals_cover_their_estimates() -> None:
    m, lo, hi = interval([10.0, 12.0, 14.0])
    assert m == 12.0 and lo < 12.0 < hi
    assert hi - m == pytest.approx(4.303 * 2.0 / 3**0.5)
    assert interval([5.0]) == (5.0, 5.0, 5.0)
    # A ratio the same on every seed has no spread but the capacity resolution.
    r, lo, hi = ratio_interval([20.0, 30.0], [10.0, 15.0], widen=1.03)
    assert r == pytest.approx(2.0) and lo == pytest.approx(2.0 / 1.03)
    assert hi == pytest.approx(2.0 * 1.03)
    r, lo, hi = ratio_interval([20.0, 36.0, 25.0], [10.0, 15.0, 12.0])
    assert lo < r < hi


def _point(p: int, tokens: list[float], **kw) -> Point:
    return Point(
        policy="dualpath",
        prefill=p,
        decode=8 - p,
        sessions=100,
        tokens_per_s=sum(tokens) / len(tokens),
        ttft_p90_s=1.0,
        tpot_p90_s=0.02,
        slo_attainment=0.95,
        meets_slo=True,
        binding="prefill_snic",
        utilisation=kw.pop("util", {"prefill_snic": 0.5, "prefill_gpu": 0.2}),
        path_d_fraction=kw.pop("path_d", 0.0),
        refused=0,
        truncated=0,
        wall_s=0.1,
        seeds=[0, 1, 2],
        tokens_per_s_seeds=tokens,
        **kw,
    )


def test_splits_whose_intervals_overlap_are_not_told_apart() -> None:
    best = _point(2, [100.0, 104.0, 102.0])
    near = _point(3, [99.0, 103.0, 100.0])
    far = _point(4, [60.0, 61.0, 62.0])
    assert ties(best, {2: best, 3: near, 4: far}) == [near]


def test_capacity_bound_scales_with_the_resource_that_binds() -> None:
    # Prefill SNICs half busy on 2 prefill nodes at 1000 tokens/s: at most 2000 there, 3000
    # with 3 prefill nodes; reading through every SNIC (path D), the pool is all 8 nodes.
    pt = _point(2, [1000.0])
    assert capacity_bound(pt, 2, 6) == pytest.approx(2000.0)
    assert capacity_bound(pt, 3, 5) == pytest.approx(3000.0)
    dual = _point(2, [1000.0], path_d=0.5, util={"prefill_snic": 0.5, "decode_snic": 0.5})
    assert capacity_bound(dual, 1, 7) == pytest.approx(8 / (4.0 / 1000.0))


def test_sweep_prints_a_table_json_and_a_heatmap(tmp_path, capsys) -> None:
    path = tmp_path / "t.jsonl"
    trace.save_jsonl(path, _sessions(), meta={"name": "synthetic-24"})
    png = tmp_path / "sweep.png"
    argv = ["plan", "--trace", str(path), "--sweep", "--sweep-nodes", "3"]
    argv += ["--sweep-snic-gbps", "200,400", "--sweep-kv-gb", "400", "--sessions", "8,24"]
    argv += ["--horizon", "30", "--seeds", "2", "--quiet"]
    assert main([*argv, "--json", "--plot", str(png)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["cells"]) == 2 and png.stat().st_size > 1000
    for c in out["cells"]:
        assert c["nodes"] == 3 and set(c["best"]) == {"prefill-read", "dualpath"}
        assert c["best"]["dualpath"]["binding"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "sweep for synthetic-24" in text and "dualpath / prefill-read" in text
    assert main([*argv[:3], "--sweep", "--splits", "1:2", "--quiet"]) == 2
    assert "--sweep" in capsys.readouterr().err


@pytest.mark.parametrize(("rule", "effect"), [("truncate", "served cut"), ("refuse", "skipped")])
def test_the_plan_says_how_many_turns_exceeded_the_context_and_what_it_did(
    tmp_path, capsys, rule, effect
) -> None:
    sessions = _sessions()
    turns = list(trace.iter_turns(sessions))
    limit = sorted(p + t.gen_tokens for _, _, t, p, _ in turns)[len(turns) // 2]
    over = sum(p + t.gen_tokens > limit for _, _, t, p, _ in turns)
    assert 0 < over < len(turns)
    path = tmp_path / "t.jsonl"
    trace.save_jsonl(path, sessions, meta={"name": "synthetic-24"})
    argv = ["plan", "--trace", str(path), "--splits", "1:2", "--sessions", "8", "--horizon",
            "20", "--seeds", "1", "--quiet", "--max-context", str(limit), "--context-rule", rule]  # fmt: skip
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["context"] == {"turns": len(turns), "over_limit": over,
                              "share": round(over / len(turns), 4)}  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert f"{over:,} of {len(turns):,} turns" in text and f"--context-rule {rule}" in text
    assert effect in text
