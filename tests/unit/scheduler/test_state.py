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


def test_a_silent_node_is_forgotten_after_five_node_timeouts_and_may_register_again():
    clock = FakeClock()
    st = make(clock)  # node timeout 1 s
    st.drain("p1")
    clock.t = 4.9
    for n in ("p0", "d0"):
        st.heartbeat(n, 0, 0, 0, 0, 1 << 40, False)
    assert st.forget_silent() == []  # p1 is out of the pool, still listed
    clock.t = 5.1
    assert st.forget_silent() == ["p1"]
    assert "p1" not in st.nodes and "p1" not in st.drained
    assert [n.node_id for n in st.view.prefill] == ["p0"]
    assert not st.heartbeat("p1", 0, 0, 0, 0, 1 << 40, False)  # told to register again
    st.register(NodeState("p1", "prefill"), "a:2")
    assert st.nodes["p1"].state.healthy


def test_a_closed_heartbeat_stream_takes_its_node_out_at_once_unless_a_newer_one_runs():
    st = make(FakeClock())
    old = st.stream_opened("p0")
    assert st.stream_opened("nope") is None
    new = st.stream_opened("p0")  # the node re-registered and heartbeats on a new stream
    assert not st.stream_closed("p0", old) and st.nodes["p0"].state.healthy
    assert st.stream_closed("p0", new)
    assert not st.nodes["p0"].state.healthy
    assert all(st.route(req()).prefill_node == "p1" for _ in range(5))
    st.heartbeat("p0", 0, 0, 0, 0, 1 << 40, False)  # back on its next heartbeat
    assert st.nodes["p0"].state.healthy


def test_breaker_defaults_are_the_spec_defaults():
    from dualpath.config import SchedulerSpec
    from dualpath.scheduler.state import BREAKER_COOLDOWN_S, BREAKER_FAILURES

    spec = SchedulerSpec()
    assert (BREAKER_FAILURES, BREAKER_COOLDOWN_S) == (
        spec.breaker_failures,
        spec.breaker_open_seconds,
    )
    st = SchedulerState(get_policy("dualpath"), Thresholds(), node_timeout_s=2.0)
    assert st.forget_after_s == 10.0


def test_a_route_no_node_claims_is_released_after_its_lease():
    """Three routes: one claimed by its decode node, one by a node not of its pair (ignored),
    one by nobody. After the lease the two unclaimed are released (cancels: no breaker counts
    them), their nodes' routed counts drop; the claimed one stays until its Complete."""
    clock = FakeClock()
    st = SchedulerState(
        get_policy("round-robin"), Thresholds(), node_timeout_s=60.0, clock=clock, route_lease_s=5.0
    )
    st.register(NodeState("p0", "prefill"), "a:1")
    st.register(NodeState("d0", "decode"), "b:1")
    claimed, stray, idle = (st.route(req()) for _ in range(3))
    assert st.claim("d0", [claimed.request_id, "unknown"]) == 1
    assert st.claim("d9", [stray.request_id]) == 0  # not of its pair
    clock.t = 4.9
    assert st.release_unclaimed() == []
    assert st.routed_in_flight("d0") == 3
    clock.t = 5.1
    assert st.release_unclaimed() == [stray.request_id, idle.request_id]
    assert set(st.in_flight) == {claimed.request_id}
    assert st.routed_in_flight("d0") == st.routed_in_flight("p0") == 1
    assert st.released_total == 2 and not st.breakers.get("d0")
    assert st.complete(idle.request_id) is None  # its late Complete: an unknown id, fine
    clock.t = 100.0
    assert st.release_unclaimed() == []  # claimed: held until its Complete
    assert st.complete(claimed.request_id) is not None
    assert st.routed_in_flight("d0") == 0
