"""`dualpath sim --trace`: every option honoured on a recorded trace, or refused by name."""

from __future__ import annotations

import json

import pytest
from dualpath import trace
from dualpath.cli import main
from dualpath.trace import Trajectory, Turn


@pytest.fixture
def recorded(tmp_path):
    # Three sessions shaped like the real ones: recorded prompts and hits, one subagent.
    def session(i: int) -> Trajectory:
        turns = [
            Turn(20_000 + 1000 * i, 200, 0.0, prompt_tokens=20_000 + 1000 * i, hit_tokens=8192)
        ]
        ctx = turns[0].prompt_tokens + 200
        for j in range(1, 5):
            prompt = ctx + 400
            turns.append(Turn(400, 150, 2.0 * j, prompt, (ctx // 64) * 64))
            ctx = prompt + 150
        sub = Trajectory(
            f"s{i}/c", [Turn(6000, 100), Turn(300, 80, 1.0)], start_s=1.0, after_turn=2
        )
        return Trajectory(f"s{i}", turns, subagents=[sub] if i == 0 else [])

    path = tmp_path / "rec.jsonl"
    trace.save_jsonl(path, [session(i) for i in range(3)], meta={"name": "hand:three"})
    return path


def _run(capsys, *argv: str) -> dict:
    assert main(["sim", *argv, "--json", "--quiet"]) == 0
    return json.loads(capsys.readouterr().out)


def test_offline_trace_cycles_sessions_to_x_and_names_the_trace(capsys, recorded) -> None:
    out = _run(capsys, "--preset", "tiny", "--trace", str(recorded), "--xs", "3,6")
    assert out["trace"] == "hand:three" and out["trace_file"] == str(recorded)
    a, b = (pt["policies"]["dualpath"] for pt in out["points"])
    # 3 sessions: 5 + 5 + 5 turns + the subagent's 2; x = 6 cycles the list twice.
    assert a["turns"] == 17 and b["turns"] == 34
    assert a["agents_done"] == 3 and b["agents_done"] == 6 and a["complete"]
    assert set(a["utilisation"]) >= {"prefill_snic", "decode_kv_memory"} and a["binding"]


def test_think_is_refused_on_a_recorded_trace_and_think_cap_is_honoured(capsys, recorded) -> None:
    assert main(["sim", "--preset", "tiny", "--trace", str(recorded), "--think", "3"]) == 2
    assert "--think-cap" in capsys.readouterr().err
    slow = _run(capsys, "--preset", "tiny", "--trace", str(recorded), "--xs", "3")
    fast = _run(
        capsys, "--preset", "tiny", "--trace", str(recorded), "--xs", "3", "--think-cap", "0"
    )
    js = slow["points"][0]["policies"]["dualpath"]["jct_s"]
    jf = fast["points"][0]["policies"]["dualpath"]["jct_s"]
    assert jf < js - 10  # 2+4+6+8 s of thinking gone
    assert fast["think_cap_s"] == 0


def test_online_rates_and_seed_are_honoured_on_a_recorded_trace(capsys, recorded) -> None:
    args = [
        "--preset",
        "online",
        "--trace",
        str(recorded),
        "--horizon",
        "60",
        "--prefill",
        "1",
        "--decode",
        "1",
        "--policies",
        "dualpath",
    ]
    out = _run(capsys, *args, "--xs", "0.2,1")
    lo, hi = (pt["policies"]["dualpath"] for pt in out["points"])
    assert hi["sessions_started"] > 2 * lo["sessions_started"]
    other = _run(capsys, *args, "--xs", "0.2", "--seed", "5")
    assert other["seed"] == 5
    seeded = other["points"][0]["policies"]["dualpath"]
    assert {k: v for k, v in seeded.items() if k != "wall_s"} != {
        k: v for k, v in lo.items() if k != "wall_s"
    }


def test_steady_state_runs_beside_offline_completion(capsys, recorded) -> None:
    out = _run(
        capsys,
        "--preset",
        "tiny",
        "--trace",
        str(recorded),
        "--xs",
        "2",
        "--steady",
        "--horizon",
        "120",
        "--warmup",
        "30",
        "--ttft-sla",
        "2",
    )
    pt = out["points"][0]["policies"]
    for pol in ("dualpath", "prefill-read"):
        st = pt[pol]["steady"]
        assert st["sessions_started"] > 3 and st["sim_s"] == 120.0
        assert 0 <= st["slo_attainment"] <= 1
    assert out["steady"]["warmup_s"] == 30
    assert "steady_throughput_ratio" in out["ratios"]


def test_context_limit_rule_is_reported(capsys, recorded) -> None:
    out = _run(
        capsys,
        "--preset",
        "tiny",
        "--trace",
        str(recorded),
        "--xs",
        "3",
        "--max-context",
        "20000",
        "--context-rule",
        "refuse",
        "--policies",
        "dualpath",
    )
    st = out["points"][0]["policies"]["dualpath"]
    assert out["context_limit_tokens"] == 20000 and out["context_rule"] == "refuse"
    assert st["refused_context"] == 15 and st["turns"] == 2


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--preset", "tiny", "--ttft-sla", "3"], "--ttft-sla"),
        (["--preset", "tiny", "--warmup", "3"], "--warmup"),
        (["--preset", "online", "--steady"], "--steady"),
        (["--preset", "tiny", "--steady", "--sla-percentile", "99"], "--sla-percentile"),
        (["--preset", "tiny", "--xs", "0"], "--xs"),
        (["--preset", "tiny", "--xs", "a,b"], "--xs"),
        (["--preset", "scale", "--prefill", "2"], "--prefill"),
        (["--preset", "tiny", "--trace", "/nonexistent.jsonl"], "--trace"),
    ],
)
def test_options_a_run_cannot_honour_are_refused_by_name(capsys, argv, flag) -> None:
    assert main(["sim", *argv, "--quiet"]) == 2
    assert flag in capsys.readouterr().err
