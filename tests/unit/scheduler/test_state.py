"""Scheduler state: liveness, draining, re-registration, in-flight bookkeeping (fake clock)."""

from dualpath.scheduler.policy import NodeState, RouteRequest, Thresholds, get_policy
from dualpath.scheduler.state import SchedulerState
from fake_clock import FakeClock


def make(clock):
    st = SchedulerState(get_policy("dualpath"), Thresholds(), node_timeout_s=1.0, clock=clock)
    st.register(NodeState("p0", "prefill"), "a:1")
    st.register(NodeState("p1", "prefill"), "a:2")
    st.register(NodeState("d0", "decode"), "b:1")
    return st


def req(i=0):
    return RouteRequest("", 1000, 960, 1 << 20, 1 << 20, 16)


def test_silent_node_leaves_the_pool_and_comes_back_on_heartbeat():
    clock = FakeClock()
    st = make(clock)
    clock.t = 0.9
    st.heartbeat("p0", 0, 0, 0, 0, 1 << 40, False)
    st.heartbeat("d0", 0, 0, 0, 0, 1 << 40, False)
    clock.t = 1.5
    assert st.expire() == ["p1"]
    for _ in range(5):
        assert st.route(req()).prefill_node == "p0"
    clock.t = 1.6
    assert st.heartbeat("p1", 0, 0, 0, 0, 1 << 40, False)
    assert st.nodes["p1"].state.healthy


def test_draining_node_gets_no_new_requests():
    st = make(FakeClock())
    assert st.drain("p0")
    assert all(st.route(req()).prefill_node == "p1" for _ in range(5))
    assert not st.drain("nope")


def test_unknown_node_heartbeat_asks_for_registration():
    st = make(FakeClock())
    assert not st.heartbeat("ghost", 0, 0, 0, 0, 0, False)


def test_route_assigns_ids_and_tracks_in_flight():
    st = make(FakeClock())
    d = st.route(req())
    assert d.request_id and d.request_id in st.in_flight
    assert st.complete(d.request_id) is not None
    assert st.complete(d.request_id) is None  # idempotent: unknown ids are fine
