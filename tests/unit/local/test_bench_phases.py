"""`dualpath bench local`: the SNIC cap against the serving engine's compute (engine vllm: the
warm-up's probe; or re-calibrated just before each phase), and each phase judged storage- or
compute-bound against the compute it actually got (no cluster, no vLLM)."""

from __future__ import annotations

import argparse
import json

import pytest
from dualpath.config import local_default
from dualpath.local import bench, bench_cli, bench_run
from dualpath.local.cluster import with_overrides
from dualpath.trace import TraceSpec, Trajectory, Turn
from tiny_configs import tiny_model

NODES = {"prefill": 1, "decode": 2}


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def _phase(policy: str, **over) -> bench.PolicyResult:
    res = bench.PolicyResult(
        policy=policy,
        elapsed_s=100.0,
        turns=50,
        failed=0,
        tokens_per_s=1000.0,
        generated_tokens_per_s=2.0,
        jct_s=100.0,
        ttft_p50_s=1.0,
        ttft_p99_s=2.0,
        hit_rate=0.9,
        bytes_read={"prefill": 0, "decode": 0},
        snic_caps_bytes_per_s=3 * 1e9 / 8,  # 3 nodes at 1 Gbps
        pooled_snic_util=0.5,
        snic_gbps=1.0,
    )
    for k, v in over.items():
        setattr(res, k, v)
    return res


def _cal(prefill_s: float, scale: float = 1.0) -> bench.SnicCalibration:
    return bench.SnicCalibration(1024, 32, 10**7, prefill_s, 3, 4.0, 0.1, scale)


def test_the_cap_makes_the_hit_read_take_read_to_compute_times_the_compute() -> None:
    gbps = bench.snic_gbps_for(10**9, compute_s=2.0, read_to_compute=4.0)
    assert 10**9 * 8 / (gbps * 1e9) == pytest.approx(8.0)
    # a slower engine (scale 2) halves the cap: the read stays 4x its compute
    assert bench.snic_gbps_for(10**9, 2.0 * 2, 4.0) == pytest.approx(gbps / 2)
    with pytest.raises(ValueError):
        bench.snic_gbps_for(10**9, 0.0, 4.0)


def test_the_compute_scale_is_the_measured_compute_per_turn_over_the_calibrated_one() -> None:
    # vLLM computed 100 s over 50 turns (2 s a turn) where the in-process prefill took 0.5 s
    assert bench.measured_compute_scale({"prefill_compute_s": 100.0}, 50, 0.5) == 4.0
    # nothing measured (torch engine, no turns, a cut phase): the calibration stands
    assert bench.measured_compute_scale({}, 50, 0.5) == 1.0
    assert bench.measured_compute_scale({"prefill_compute_s": 100.0}, 0, 0.5) == 1.0


def test_a_vllm_phase_is_judged_on_the_compute_its_counters_measured() -> None:
    breakdown = {"busiest_snic_busy": 0.37, "prefill_compute_busy": 0.55}
    v = bench.phase_verdict(_phase("dualpath", breakdown=breakdown), _cal(0.1), NODES)
    assert v == {
        "bound": "compute",
        "busiest_snic_busy": 0.37,
        "prefill_compute_busy": 0.55,
        "compute_from": "measured",
    }
    breakdown = {"busiest_snic_busy": 0.92, "prefill_compute_busy": 0.40}
    v = bench.phase_verdict(_phase("prefill-read", breakdown=breakdown), None, NODES)
    assert v["bound"] == "storage"
    # neither busy most of the phase: not storage-bound either (the turns' time went elsewhere)
    breakdown = {"busiest_snic_busy": 0.53, "prefill_compute_busy": 0.23}
    v = bench.phase_verdict(_phase("dualpath", breakdown=breakdown), None, NODES)
    assert v["bound"] == "other"
    assert "NOT storage-bound (neither" in bench.verdict_line(_phase("dualpath", verdict=v))


def test_a_torch_engine_phase_is_judged_on_its_own_calibrated_prefill() -> None:
    # prefill-read: 11e9 bytes through the one prefill SNIC at 1 Gbps = 88 s of 100;
    # 50 turns x 0.5 s = 25 s of compute
    res = _phase("prefill-read", bytes_read={"prefill": 11 * 10**9, "decode": 0})
    v = bench.phase_verdict(res, _cal(0.5), NODES)
    assert (v["bound"], v["compute_from"]) == ("storage", "calibrated")
    assert v["busiest_snic_busy"] == pytest.approx(0.88)
    assert v["prefill_compute_busy"] == pytest.approx(0.25)
    # the same reads at 1.8 s a turn of compute: 90 s > 88 s
    assert bench.phase_verdict(res, _cal(1.8), NODES)["bound"] == "compute"
    # nothing measured: no verdict rather than a guess
    assert bench.phase_verdict(res, None, NODES) == {}
    assert bench.phase_verdict(_phase("x", turns=0), _cal(0.5), NODES) == {}


def test_the_table_says_per_phase_whether_it_was_storage_bound() -> None:
    pr = _phase(
        "prefill-read",
        verdict={
            "bound": "storage",
            "busiest_snic_busy": 0.8,
            "prefill_compute_busy": 0.3,
            "compute_from": "measured",
        },
        calibration={"prefill_s": 0.5, "compute_scale": 1.0},
        loadavg=[14.0, 20.0],
    )
    dp = _phase(
        "dualpath",
        tokens_per_s=1500.0,
        snic_gbps=0.5,
        verdict={
            "bound": "compute",
            "busiest_snic_busy": 0.3,
            "prefill_compute_busy": 0.6,
            "compute_from": "measured",
        },
        calibration={"prefill_s": 0.5, "compute_scale": 2.0},
    )
    text = bench.table([pr, dp], 1.5)
    assert "prefill-read: storage-bound" in text and "load 14-20" in text
    assert "dualpath: NOT storage-bound" in text and "x 2.00 measured" in text
    # the caps differ: per unit of cap 1500/0.5 over 1000/1 = 3
    assert bench.ratio_per_cap([pr, dp]) == 3.0
    assert "ratio per unit of SNIC cap" in text and "not storage-bound" in text
    assert bench.ratio_per_cap([pr, _phase("dualpath")]) is None  # one cap: the ratio is it


def test_recalibration_sets_the_phase_cap_from_a_fresh_timing_and_the_measured_scale() -> None:
    cfg = with_overrides(local_default(), model=tiny_model(16))
    tr = Trajectory("a", [Turn(8, 2)] * 4, first_tokens=64)
    args = _args("--read-to-compute", "4")
    pcfg, cal = bench_run.recalibrate(args, cfg, [tr], compute_scale=3.0, label="3/4 dualpath")
    assert cal.compute_scale == 3.0 and pcfg.spec.storage.snic_gbps == cal.snic_gbps
    read_s = cal.hit_bytes / (cal.snic_gbps * 1e9 / 8)
    assert read_s == pytest.approx(4.0 * 3.0 * cal.prefill_s, rel=0.01)
    # default: one cap for every phase (the "same trace and cap"); re-calibrating is
    # asked for
    assert not _args().recalibrate and _args("--recalibrate").recalibrate


def test_a_cap_scaled_to_the_serving_engines_compute_keeps_the_read_to_compute_ratio() -> None:
    cal = _cal(0.2)
    slow = cal.scaled(5.0)  # vLLM computes the median turn 5x slower than the in-process engine
    assert slow.compute_s == pytest.approx(1.0) and slow.compute_scale == 5.0
    read_s = slow.hit_bytes / (slow.snic_gbps * 1e9 / 8)
    assert read_s == pytest.approx(slow.read_to_compute * 1.0)
    assert (cal.hit_tokens, cal.prefill_s) == (slow.hit_tokens, slow.prefill_s)


def test_the_probe_replays_each_agents_first_turns_under_a_name_of_its_own() -> None:
    trs = [
        Trajectory("a", [Turn(8, 2)] * 5, first_tokens=64),
        Trajectory("b", [Turn(8, 2)] * 2, first_tokens=32),
        Trajectory("c", [Turn(8, 2)], first_tokens=32),  # warm-up only: nothing to measure
    ]
    probe = bench_run.probe_trajectories(trs, warmup_turns=1)
    assert [t.agent_id for t in probe] == ["probe-a", "probe-b"]
    assert [len(t.turns) for t in probe] == [1 + bench_run.PROBE_TURNS, 2]
    # the trace's own shapes: the same prompts turn by turn
    assert [probe[0].prompt_tokens(i) for i in range(3)] == [
        trs[0].prompt_tokens(i) for i in range(3)
    ]


def test_the_replay_sends_the_salt_it_is_given() -> None:
    import asyncio

    import httpx

    salts: list[object] = []

    def handler(request: httpx.Request) -> httpx.Response:
        salts.append(json.loads(request.content).get("cache_salt"))
        final = {"choices": [{"finish_reason": "length"}]}
        final["dualpath"] = {"token_ids": [7], "read_path": "prefill"}
        usage = {"choices": [], "usage": {"prompt_tokens_details": {"cached_tokens": 0}}}
        text = f"data: {json.dumps(final)}\n\ndata: {json.dumps(usage)}\n\ndata: [DONE]\n\n"
        return httpx.Response(200, text=text)

    trs = [Trajectory("a", [Turn(4, 1)], first_tokens=8)]

    async def go(salt: str) -> None:
        transport = httpx.MockTransport(handler)
        async with httpx.AsyncClient(base_url="http://x", transport=transport) as client:
            await bench.replay(client, trs, "m", 300, cache_salt=salt)

    asyncio.run(go(bench_run.PROBE_SALT))
    asyncio.run(go(""))
    assert salts == [bench_run.PROBE_SALT, None]  # the trace's own turns carry none


def test_the_json_carries_each_phases_verdict_and_cap() -> None:
    args = _args()
    args.warmup_turns, args.budget_s = 1, None
    pr = _phase("prefill-read", verdict={"bound": "storage"}, snic_gbps=1.0)
    dp = _phase("dualpath", verdict={"bound": "compute"}, snic_gbps=0.5, tokens_per_s=1500.0)
    doc = bench_run.result_doc(
        args, local_default(), None, TraceSpec(), [pr, dp], {}, {}, 0.0, None
    )
    doc = json.loads(json.dumps(doc))
    assert doc["bound"] == {"prefill-read": "storage", "dualpath": "compute"}
    assert doc["ratio_per_snic_cap"] == 3.0
    assert doc["policies"]["dualpath"]["snic_gbps"] == 0.5


def test_the_read_to_compute_default_is_the_serving_engines() -> None:
    assert bench.default_read_to_compute(_args()) == bench.READ_TO_COMPUTE
    assert bench.default_read_to_compute(_args("--engine", "vllm")) == bench.VLLM_READ_TO_COMPUTE
    assert _args("--engine", "vllm", "--read-to-compute", "3").read_to_compute == 3.0


def test_a_compute_bound_phase_runs_every_phase_again_at_a_lower_cap() -> None:
    storage = {"bound": "storage", "busiest_snic_busy": 0.95, "prefill_compute_busy": 0.3}
    compute = {"bound": "compute", "busiest_snic_busy": 0.4, "prefill_compute_busy": 0.6}
    pr, dp = _phase("prefill-read", verdict=storage), _phase("dualpath", verdict=compute)
    args, cal = _args(), _cal(0.2)
    # the cap 2x (0.8 / 0.4: busy past STORAGE_BOUND_BUSY and the compute) x the margin lower
    lower = bench_run.storage_bound_retry([pr, dp], cal, args, budgeted=False)
    assert lower == pytest.approx(0.8 / 0.4 * bench_run.RETRY_MARGIN)
    slow = _phase("dualpath", verdict={**compute, "prefill_compute_busy": 0.9})
    assert bench_run.storage_bound_retry([slow], cal, args, False) == pytest.approx(
        0.9 / 0.4 * bench_run.RETRY_MARGIN
    )
    assert bench_run.storage_bound_retry([pr], cal, args, budgeted=False) is None  # all were
    # not the bench's cap to lower: a fixed cap, a cap per phase, a budget with no time for it
    assert bench_run.storage_bound_retry([dp], cal, _args("--snic-gbps", "1"), False) is None
    assert bench_run.storage_bound_retry([dp], cal, _args("--recalibrate"), False) is None
    assert bench_run.storage_bound_retry([dp], cal, args, budgeted=True) is None
    assert bench_run.storage_bound_retry([dp], None, args, budgeted=False) is None
    first = bench_run.first_attempt([pr, dp])
    assert first["not_storage_bound"] == ["dualpath"] and first["ratio"] == 1.0
    assert first["verdicts"]["dualpath"] == compute
