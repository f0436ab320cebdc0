"""Node identity (fake clock): a second process under a live node id is refused, a timed-out
or draining one is replaced cleanly, and the replaced incarnation's heartbeats are unknown."""

import pytest
from dualpath.scheduler.policy import NodeState, RouteRequest, Thresholds, get_policy
from dualpath.scheduler.state import NodeConflict, SchedulerState
from fake_clock import FakeClock


def make(clock):
    st = SchedulerState(get_policy("dualpath"), Thresholds(), node_timeout_s=1.0, clock=clock)
    st.register(NodeState("p0", "prefill"), "a:1", incarnation="p-one")
    st.register(NodeState("d0", "decode"), "b:1", incarnation="d-one")
    return st


def beat(st, node, incarnation, draining=False):
    return st.heartbeat(node, 0, 0, 0, 0, 1 << 40, draining, incarnation)


def route(st):
    return st.route(RouteRequest("", 1000, 0, 0, 1 << 20, 16))


def test_a_second_process_under_a_live_node_id_is_refused():
    clock = FakeClock()
    st = make(clock)
    clock.t = 0.5
    with pytest.raises(NodeConflict, match="d0"):
        st.register(NodeState("d0", "decode"), "evil:1", incarnation="d-two")
    assert st.nodes["d0"].address == "b:1"  # traffic stays where it was
    assert route(st).decode_node == "d0" and beat(st, "d0", "d-one")


def test_the_same_incarnation_registers_again_freely():
    st = make(FakeClock())
    st.register(NodeState("d0", "decode"), "b:1", incarnation="d-one")  # e.g. a stream error
    assert beat(st, "d0", "d-one")


def test_a_timed_out_incarnation_is_replaced_and_its_heartbeats_are_unknown():
    clock = FakeClock()
    st = make(clock)
    clock.t = 1.5
    st.expire()
    st.register(NodeState("d0", "decode"), "b:2", incarnation="d-two")
    assert st.nodes["d0"].address == "b:2"
    assert not beat(st, "d0", "d-one")  # the old process: it must register again (and is refused)
    assert beat(st, "d0", "d-two")
    with pytest.raises(NodeConflict):
        st.register(NodeState("d0", "decode"), "b:1", incarnation="d-one")


def test_a_silent_incarnation_is_replaced_even_before_the_liveness_sweep():
    clock = FakeClock()
    st = make(clock)
    clock.t = 1.2  # past the timeout, not expired yet
    st.register(NodeState("d0", "decode"), "b:2", incarnation="d-two")
    assert st.nodes["d0"].incarnation == "d-two"


def test_a_draining_incarnation_is_replaced_and_the_new_one_serves():
    clock = FakeClock()
    st = make(clock)
    assert st.drain("p0")
    assert beat(st, "p0", "p-one")  # still beating while it drains
    st.register(NodeState("p0", "prefill"), "a:2", incarnation="p-two")  # the replaced pod
    assert route(st).prefill_node == "p0"
    assert not beat(st, "p0", "p-one")


def test_a_replaced_incarnation_starts_with_a_closed_breaker():
    clock = FakeClock()
    st = SchedulerState(
        get_policy("dualpath"), Thresholds(), node_timeout_s=1.0, clock=clock, breaker_failures=1
    )
    st.register(NodeState("p0", "prefill"), "a:1", incarnation="p")
    st.register(NodeState("d0", "decode"), "b:1", incarnation="d0-one")
    st.register(NodeState("d1", "decode"), "c:1", incarnation="d1")
    while True:
        d = route(st)
        st.complete(d.request_id, ok=d.decode_node != "d0")
        if d.decode_node == "d0":
            break
    assert st.open_breakers() == 1
    clock.t = 2.0
    st.register(NodeState("d0", "decode"), "b:2", incarnation="d0-two")
    assert st.open_breakers() == 0 and not st.view.node("d0").held


def test_a_registrant_without_an_incarnation_cannot_take_over_a_live_node():
    clock = FakeClock()
    st = make(clock)
    with pytest.raises(NodeConflict):
        st.register(NodeState("d0", "decode"), "evil:1")  # sends none: still another identity
    assert st.nodes["d0"].address == "b:1"
