"""Analytic checks of the event loop, with the scheduler's real policies."""

from __future__ import annotations

import pytest
from dualpath import trace
from dualpath.config import ModelSpec
from dualpath.scheduler.policy import get_policy
from dualpath.sim import engine as sim_engine
from dualpath.sim.engine import SimConfig, Simulator
from dualpath.sim.model import CostModel, Hardware

MODEL = ModelSpec(preset="deepseek-v3.2")


def _storage_bound(prefill: int = 1, decode: int = 2, agents: int = 96, horizon: float = 20.0):
    # Near-infinite GPUs and a slow SNIC: every turn's time is its storage read.
    hw = Hardware(gpu_tflops=1e6, snic_gbps=100, decode_overhead_s=0.0005)
    cost = CostModel.build(MODEL, hw)
    spec = trace.TraceSpec(
        agents=agents,
        max_context_tokens=16_384,
        max_turns=12,
        mean_think_s=0.0,
        first_tokens=8_192,
        seed=1,
    )
    cfg = SimConfig(prefill, decode, hw, cost, horizon_s=horizon, mean_context_tokens=12_000)
    return cfg, trace.generate(spec), hw


@pytest.mark.parametrize(("prefill", "decode"), [(1, 2), (2, 2)])
def test_storage_bound_throughput_meets_but_never_exceeds_the_snic_bounds(
    prefill: int, decode: int
) -> None:
    cfg, trs, hw = _storage_bound(prefill, decode)
    snic = hw.snic_bytes_per_s
    base = Simulator(cfg, get_policy("prefill-read"), trs).run()
    dual = Simulator(cfg, get_policy("dualpath"), trs).run()
    prefill_bound = prefill * snic
    all_bound = (prefill + decode) * snic
    assert base.read_bytes_decode == 0
    assert base.read_bytes_per_s <= prefill_bound * 1.0001
    assert base.read_bytes_per_s >= 0.9 * prefill_bound
    assert dual.read_bytes_per_s <= all_bound * 1.0001
    assert dual.read_bytes_per_s >= 0.85 * all_bound
    assert dual.tokens_per_s > 1.5 * base.tokens_per_s


def test_offline_runs_every_turn_to_completion_and_conserves_tokens() -> None:
    hw = Hardware()
    cost = CostModel.build(MODEL, hw)
    trs = trace.generate(trace.TraceSpec(agents=12, max_turns=6, seed=3))
    cfg = SimConfig(1, 2, hw, cost)
    for name in ("dualpath", "prefill-read", "decode-read", "round-robin"):
        r = Simulator(cfg, get_policy(name), trs).run()
        assert r.agents_done == 12
        assert r.turns_done == sum(len(t.turns) for t in trs)
        assert r.gen_tokens == sum(t.total_gen_tokens for t in trs)
        assert r.jct_s == r.sim_s > 0
        assert len(r.ttft_s) == r.turns_done
        assert min(r.ttft_s) > 0
        if name == "decode-read":
            assert r.read_bytes_prefill == 0 and r.read_bytes_decode > 0


def test_every_decision_goes_through_the_policy() -> None:
    calls = []

    class Counting:
        def __init__(self) -> None:
            self.inner = get_policy("dualpath")
            self.name = self.inner.name

        def decide(self, req, view):
            calls.append(req.request_id)
            return self.inner.decide(req, view)

    trs = trace.generate(trace.TraceSpec(agents=5, max_turns=4, seed=2))
    hw = Hardware()
    cfg = SimConfig(1, 1, hw, CostModel.build(MODEL, hw))
    r = Simulator(cfg, Counting(), trs).run()
    assert r.decisions == len(calls) >= r.turns_done == sum(len(t.turns) for t in trs)


def test_same_inputs_same_result() -> None:
    cfg, trs, _ = _storage_bound(agents=16, horizon=5.0)
    a = Simulator(cfg, get_policy("dualpath"), trs).run()
    b = Simulator(cfg, get_policy("dualpath"), trs).run()
    assert (a.turns_done, a.read_bytes_decode, a.ttft_s) == (
        b.turns_done,
        b.read_bytes_decode,
        b.ttft_s,
    )


def test_agent_group_scales_work_not_events() -> None:
    hw = Hardware()
    cost = CostModel.build(MODEL, hw)
    trs = trace.generate(trace.TraceSpec(agents=4, max_turns=5, seed=4))
    one = Simulator(SimConfig(1, 2, hw, cost), get_policy("dualpath"), trs).run()
    four = Simulator(SimConfig(1, 2, hw, cost, agent_group=4), get_policy("dualpath"), trs).run()
    assert four.gen_tokens == 4 * one.gen_tokens
    assert four.agents_done == 16
    assert four.events == one.events


def test_needs_nodes() -> None:
    hw = Hardware()
    with pytest.raises(ValueError, match="at least one prefill"):
        Simulator(SimConfig(0, 1, hw, CostModel.build(MODEL, hw)), get_policy("dualpath"), [])


@pytest.mark.parametrize("group", [1, 4])
def test_the_sim_charges_through_account_and_releases_every_charge(group: int) -> None:
    """The simulator charges a routed turn with the scheduler's `account()` (the service's own
    accounting) and its nodes release exactly that: at the end every counter is back to idle."""
    hw = Hardware()
    cost = CostModel.build(MODEL, hw)
    trs = trace.generate(trace.TraceSpec(agents=6, max_turns=4, seed=5))
    cfg = SimConfig(1, 2, hw, cost, agent_group=group)
    for name in ("dualpath", "round-robin"):
        sim = Simulator(cfg, get_policy(name), trs)
        charged = []
        original = sim_engine.account

        def spy(view, request, decision, _charged=charged, _account=original):
            _charged.append(request)
            _account(view, request, decision)

        sim_engine.account = spy
        try:
            r = sim.run()
        finally:
            sim_engine.account = original
        assert r.agents_done == 6 * group
        assert len(charged) == r.turns_done // group  # one charge per routed turn
        assert all(c.max_new_tokens % group == 0 and c.prompt_tokens % group == 0 for c in charged)
        for n in (*sim.pre, *sim.dec):
            s = n.state
            assert (s.tokens_queued, s.tokens_running, s.requests_running) == (0, 0, 0)
            assert s.buffer_free_bytes == hw.decode_kv_capacity_bytes
