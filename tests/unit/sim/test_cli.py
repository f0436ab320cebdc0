"""`dualpath sim` end to end on small presets (JSON shape, ratios, plot)."""

from __future__ import annotations

import json

import pytest
from dualpath.cli import main
from dualpath.sim.presets import PRESETS


def _run(capsys, *argv: str) -> dict:
    assert main(["sim", *argv, "--json", "--quiet"]) == 0
    return json.loads(capsys.readouterr().out)


def test_tiny_offline_json_has_per_policy_results_and_ratios(capsys, tmp_path) -> None:
    png = tmp_path / "tiny.png"
    out = _run(capsys, "--preset", "tiny", "--plot", str(png))
    assert out["mode"] == "offline" and out["baseline"] == "prefill-read"
    assert [p["x"] for p in out["points"]] == list(PRESETS["tiny"].xs)  # each x, once, in order
    for pt in out["points"]:
        assert set(pt["policies"]) == {"dualpath", "prefill-read"}
        assert pt["policies"]["dualpath"]["agents_done"] == pt["x"]
    per_point = out["ratios"]["throughput_ratio_per_point"]
    for pt, ratio in zip(out["points"], per_point, strict=True):  # dual-path / baseline
        tps = {name: r["tokens_per_s"] for name, r in pt["policies"].items()}
        assert ratio == pytest.approx(tps["dualpath"] / tps["prefill-read"], abs=1e-3)
    # the headline is the saturated (last) point, reported beside the paper's figure
    assert out["ratios"]["offline_throughput_ratio"] == per_point[-1]
    assert out["paper"] and set(out["paper"]) <= set(out["ratios"])
    assert out["wall_s"] > 0 and out["sim_s"] > 0
    assert png.stat().st_size > 1000


def test_online_reports_max_rate_under_the_sla(capsys) -> None:
    out = _run(
        capsys,
        "--preset",
        "online",
        "--xs",
        "0.5,1",
        "--horizon",
        "40",
        "--prefill",
        "1",
        "--decode",
        "1",
        "--policies",
        "dualpath,prefill-read,round-robin",
        "--ttft-sla",
        "2.5",
    )
    assert out["x"] == "agent_arrivals_per_s"
    assert out["ttft_sla_s"] == 2.5  # the flag, not the preset's default
    best = out["max_arrival_rate_meeting_sla"]
    assert set(best) == {"dualpath", "prefill-read", "round-robin"}
    ttft = f"ttft_p{int(out['sla_percentile'])}_s"
    for pol, rate in best.items():  # the highest load whose TTFT percentile meets the SLA
        meeting = [
            pt["x"]
            for pt in out["points"]
            if (v := pt["policies"][pol][ttft]) is not None and v <= out["ttft_sla_s"]
        ]
        assert rate == (max(meeting) if meeting else None), pol
    assert "max_arrival_rate_ratio" in out["ratios"]


def test_scale_reports_linearity(capsys) -> None:
    out = _run(
        capsys, "--preset", "scale", "--xs", "1,2", "--horizon", "30", "--policies", "dualpath"
    )
    assert [p["decode_nodes"] for p in out["points"]] == [2, 4]
    assert len(out["scaling"]["dualpath"]["efficiency_vs_smallest"]) == 2


def test_recorded_trace_replays(capsys, tmp_path) -> None:
    from dualpath import trace

    path = tmp_path / "t.jsonl"
    trace.save_jsonl(path, trace.generate(trace.TraceSpec(agents=3, max_turns=3, seed=9)))
    out = _run(capsys, "--preset", "tiny", "--xs", "3", "--trace", str(path))
    assert out["points"][0]["policies"]["dualpath"]["turns"] == 9


def test_unknown_policy_is_refused(capsys) -> None:
    assert main(["sim", "--preset", "tiny", "--policies", "nope", "--quiet"]) == 2
    assert "--policies" in capsys.readouterr().err
