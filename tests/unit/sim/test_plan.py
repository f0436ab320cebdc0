"""`dualpath plan`: the P:D search over the simulator, its report, plot and emitted spec."""

from __future__ import annotations

import json

import pytest
from dualpath import trace
from dualpath.cli import main
from dualpath.config import ModelSpec, load
from dualpath.sim.model import Hardware
from dualpath.sim.plan import Planner, Slo


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
        refine=1,
        progress=msgs.append,
    )
    best, tried = pl.best_split("dualpath", 4)
    # The grid (P = 1, 2 of 4) plus the best's neighbours: the best is a local maximum.
    assert {1, 2} <= set(tried) <= {1, 2, 3}
    assert all(q in tried for q in (best.prefill - 1, best.prefill + 1) if 1 <= q < 4)
    assert best is max(tried.values(), key=lambda p: (p.meets_slo, p.tokens_per_s))
    assert best.prefill + best.decode == 4 and best.binding
    assert len(msgs) == pl.runs >= 3 and msgs[0].startswith("[plan] run 1: dualpath")
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
        refine=0,
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
        "--refine",
        "0",
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
        refine=0,
    )
    small = pl.goodput("dualpath", 1, 1)
    assert small.meets_slo
    # A target the 2-node cluster reaches needs 2 nodes; one far above any cluster: None.
    pt = pl.nodes_for("dualpath", 0.5, small.tokens_per_s * 0.9, max_nodes=4)
    assert pt is not None and pt.prefill + pt.decode == 2
    assert pl.nodes_for("dualpath", 0.5, 1e12, max_nodes=3) is None
