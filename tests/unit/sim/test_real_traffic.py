"""The simulator on real-traffic shapes: recorded prompts and hits, subagents, context limits,
requests that fit nowhere, recycled sessions (steady state), per-resource utilisation."""

from __future__ import annotations

import math

import pytest
from dualpath import trace
from dualpath.config import ModelSpec
from dualpath.scheduler.policy import get_policy
from dualpath.sim.engine import RESOURCES, SimConfig, Simulator
from dualpath.sim.model import CostModel, Hardware
from dualpath.trace import Trajectory, Turn

MODEL = ModelSpec(preset="deepseek-v3.2")
HW = Hardware()
COST = CostModel.build(MODEL, HW)


def _run(trs, policy="dualpath", **kw):
    cfg = SimConfig(kw.pop("prefill", 1), kw.pop("decode", 2), kw.pop("hw", HW), COST, **kw)
    return Simulator(cfg, get_policy(policy), trs).run()


def test_recorded_hits_are_read_not_the_growth_models() -> None:
    # Turn 1 re-sends a compacted prompt: only 1024 of its 4000 tokens are stored.
    partial = Trajectory(
        "s", [Turn(8000, 100), Turn(-4100, 50, 1.0, prompt_tokens=4000, hit_tokens=1024)]
    )
    grown = Trajectory("g", [Turn(8000, 100), Turn(100, 50, 1.0)])
    kvpt = COST.kv_bytes_per_token
    r = _run([partial], "prefill-read")
    assert r.read_bytes_prefill == 1024 * kvpt
    assert r.prompt_tokens == 8000 + 4000
    g = _run([grown], "prefill-read")
    assert g.read_bytes_prefill == (8100 // 64) * 64 * kvpt
    # A shared prefix on turn 0 is read from storage too.
    shared = Trajectory("f", [Turn(8000, 100, 0.0, hit_tokens=4096)])
    assert _run([shared], "prefill-read").read_bytes_prefill == 4096 * kvpt


def test_subagents_run_after_their_parent_turn_and_the_session_waits_for_them() -> None:
    child = Trajectory("s/c", [Turn(3000, 40), Turn(200, 40, 0.5)], start_s=2.0, after_turn=1)
    root = Trajectory("s", [Turn(5000, 50), Turn(300, 50, 0.1)], subagents=[child])
    r = _run([root])
    assert r.turns_done == 4 and r.agents_done == 1 and r.agents == 1
    assert r.gen_tokens == 180
    # The child starts 2 s after the parent's first turn: the session outlasts the parent.
    assert r.jct_s > 2.0


def test_context_over_the_limit_is_truncated_or_refused_and_reported() -> None:
    long = Trajectory("l", [Turn(20_000, 100), Turn(200_000, 100, 0.0)])
    t = _run([long], max_context_tokens=131_072)
    assert t.truncated_context == 1 and t.refused_context == 0
    assert t.truncated_tokens == 20_100 + 200_000 + 100 - 131_072
    assert t.prompt_tokens == 20_000 + 131_072 - 100 and t.turns_done == 2
    r = _run([long], max_context_tokens=131_072, context_rule="refuse")
    assert r.refused_context == 1 and r.turns_done == 1 and r.agents_done == 1
    with pytest.raises(ValueError, match="context_rule"):
        SimConfig(1, 1, HW, COST, context_rule="drop")


def test_a_turn_that_fits_no_decode_node_is_refused_not_retried_forever() -> None:
    # 895K tokens x 8 agents of KV is ~500 GB, over a 400 GB decode node: the run must end.
    huge = Trajectory("h", [Turn(895_000, 100)])
    small = trace.generate(trace.TraceSpec(agents=3, max_turns=3, seed=1))
    r = _run([huge, *small], agent_group=8)
    assert r.refused_unfittable == 1
    assert r.agents_done == 4 * 8 and math.isfinite(r.jct_s)
    assert r.turns_done == 8 * sum(len(t.turns) for t in small)


def test_a_policy_that_refuses_on_an_idle_cluster_cannot_hang_the_run() -> None:
    class Never:
        name = "never"

        def decide(self, req, view):
            return None

    trs = trace.generate(trace.TraceSpec(agents=2, max_turns=2, seed=1))
    cfg = SimConfig(1, 1, HW, COST)
    r = Simulator(cfg, Never(), trs).run()
    assert r.refused_unfittable == 4 and r.turns_done == 0 and r.agents_done == 2


def test_recycled_sessions_reach_a_steady_state_over_the_window() -> None:
    trs = trace.generate(trace.TraceSpec(agents=4, max_turns=3, mean_think_s=0.2, seed=2))
    r = _run(trs, horizon_s=60.0, warmup_s=15.0, max_active_agents=2, recycle=True)
    assert r.sim_s == 60.0 and math.isnan(r.jct_s)
    assert r.sessions_started > len(trs)  # the list cycled
    assert 0 < r.window_gen_tokens < r.gen_tokens
    assert r.steady_tokens_per_s == pytest.approx(r.window_gen_tokens / 45.0)
    with pytest.raises(ValueError, match="recycle"):
        SimConfig(1, 1, HW, COST, recycle=True)


def test_utilisation_names_the_binding_resource() -> None:
    # Storage-bound: slow SNIC, fast GPUs -> the baseline's prefill SNIC binds.
    hw = Hardware(gpu_tflops=1e6, snic_gbps=100, decode_overhead_s=0.0005)
    cost = CostModel.build(MODEL, hw)
    spec = trace.TraceSpec(
        agents=96,
        max_context_tokens=16_384,
        max_turns=12,
        mean_think_s=0.0,
        first_tokens=8_192,
        seed=1,
    )
    trs = trace.generate(spec)
    cfg = SimConfig(1, 2, hw, cost, horizon_s=20.0, warmup_s=5.0, mean_context_tokens=12_000)
    base = Simulator(cfg, get_policy("prefill-read"), trs).run()
    assert set(base.utilisation) == set(RESOURCES)
    assert base.binding == "prefill_snic" and base.utilisation["prefill_snic"] > 0.9
    assert base.utilisation["decode_snic"] == 0.0
    dual = Simulator(cfg, get_policy("dualpath"), trs).run()
    assert dual.utilisation["decode_snic"] > 0.5
    # Memory-bound: decode nodes that hold only a few long contexts.
    small_kv = Hardware(decode_kv_capacity_bytes=40 << 30)
    cost2 = CostModel.build(MODEL, small_kv)
    long = [Trajectory(f"a{i}", [Turn(100_000, 400), Turn(500, 400, 0.0)]) for i in range(24)]
    cfg2 = SimConfig(2, 1, small_kv, cost2, horizon_s=60.0, mean_context_tokens=100_000)
    mem = Simulator(cfg2, get_policy("dualpath"), long).run()
    assert mem.binding == "decode_kv_memory" and mem.utilisation["decode_kv_memory"] > 0.5
