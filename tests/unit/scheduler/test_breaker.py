"""Failure-aware routing in the scheduler's state (fake clock): a circuit breaker per node over
the outcomes of its requests, and a retry's exclusions, both applied before the policy runs."""

import pytest
from dualpath.scheduler.policy import NodeState, RouteRequest, Thresholds, get_policy
from dualpath.scheduler.state import SchedulerState
from fake_clock import FakeClock


def make(clock, decodes=("d0", "d1")):
    st = SchedulerState(
        get_policy("dualpath"),
        Thresholds(),
        node_timeout_s=60.0,
        clock=clock,
        breaker_failures=3,
        breaker_cooldown_s=5.0,
    )
    st.register(NodeState("p0", "prefill"), "a:1")
    for d in decodes:
        st.register(NodeState(d, "decode"), f"b:{d}")
    return st


def route(st, exclude=()):
    return st.route(RouteRequest("", 1000, 0, 0, 1 << 20, 16), exclude)


def fail_on(st, node, n):
    """Route until `n` requests went to `node` and failed (others succeed)."""
    failed = 0
    for _ in range(100 * n):
        d = route(st)
        assert d is not None
        bad = node in (d.prefill_node, d.decode_node)
        st.complete(d.request_id, ok=not bad)
        failed += bad
        if failed == n:
            return
    raise AssertionError(f"{node} got fewer than {n} requests")


def test_consecutive_failures_open_the_breaker_and_route_around_the_node():
    st = make(FakeClock())
    fail_on(st, "d0", 3)
    assert st.open_breakers() == 1 and st.breaker_opens_total == 1
    assert {route(st).decode_node for _ in range(20)} == {"d1"}


def test_failures_below_the_threshold_or_broken_by_a_success_do_not_open_it():
    st = make(FakeClock())
    fail_on(st, "d0", 2)
    d = next(x for x in iter(lambda: route(st), None) if x.decode_node == "d0")
    st.complete(d.request_id, ok=True)  # the streak ends
    fail_on(st, "d0", 2)
    assert st.open_breakers() == 0


def test_cancelled_requests_say_nothing_of_the_node():
    st = make(FakeClock())
    for _ in range(10):
        d = route(st)
        st.complete(d.request_id, ok=False, cancelled=True)
    assert st.open_breakers() == 0 and not st.in_flight


def test_half_open_after_the_cooldown_one_probe_then_closed_on_success():
    clock = FakeClock()
    st = make(clock)
    fail_on(st, "d0", 3)
    clock.t = 4.9
    assert all(route(st).decode_node == "d1" for _ in range(5))
    clock.t = 5.0
    decisions = [route(st) for _ in range(10)]
    probes = [d for d in decisions if d.decode_node == "d0"]
    assert len(probes) == 1  # one probe at a time while half-open
    st.complete(probes[0].request_id, ok=True)
    assert st.open_breakers() == 0
    assert "d0" in {route(st).decode_node for _ in range(20)}


def test_a_failed_probe_opens_the_breaker_for_another_cooldown():
    clock = FakeClock()
    st = make(clock)
    fail_on(st, "d0", 3)
    clock.t = 5.0
    probe = next(d for d in iter(lambda: route(st), None) if d.decode_node == "d0")
    st.complete(probe.request_id, ok=False)
    clock.t = 9.9
    assert all(route(st).decode_node == "d1" for _ in range(10))
    clock.t = 10.1
    assert "d0" in {route(st).decode_node for _ in range(10)}


def test_the_last_available_node_of_a_role_is_never_taken_out():
    st = make(FakeClock(), decodes=("d0",))
    for _ in range(10):
        d = route(st)
        st.complete(d.request_id, ok=False)
    assert st.open_breakers() == 0  # shedding everything is worse than trying
    assert route(st) is not None


def test_a_retry_excludes_the_failed_pair_for_that_request_only():
    st = make(FakeClock())
    assert {route(st, exclude=["d0"]).decode_node for _ in range(10)} == {"d1"}
    assert route(st, exclude=["p0"]) is None  # the only prefill node: no pair for this one
    assert "d0" in {route(st).decode_node for _ in range(10)}  # others still go there


@pytest.mark.parametrize("ok", [True, False])
def test_every_completion_ends_its_in_flight_entry(ok):
    st = make(FakeClock())
    ids = [route(st).request_id for _ in range(4)]
    for rid in ids:
        st.complete(rid, ok=ok)
    assert not st.in_flight


def test_a_failure_naming_its_node_counts_against_that_node_only():
    st = make(FakeClock())
    st.register(NodeState("p1", "prefill"), "a:2")
    for _ in range(5):
        d = route(st)
        st.complete(d.request_id, ok=False, failed_node=d.decode_node)
    assert st.breakers.get("p0") is None or st.breakers["p0"].failures == 0
    assert st.breakers.get("p1") is None or st.breakers["p1"].failures == 0
    assert st.open_breakers() >= 1  # a decode node's


def test_a_node_at_its_in_flight_cap_takes_no_more_until_one_completes():
    st = SchedulerState(
        get_policy("dualpath"), Thresholds(), node_timeout_s=60.0, max_in_flight_per_node=2
    )
    st.register(NodeState("p0", "prefill"), "a:1")
    for d in ("d0", "d1"):
        st.register(NodeState(d, "decode"), f"b:{d}")
    first, second = route(st), route(st)
    assert first and second and route(st) is None  # p0 holds 2: every pair is at the cap
    assert st.routed_in_flight("p0") == 2
    st.complete(first.request_id, cancelled=True)  # a cancel frees its slot too
    third = route(st)
    assert third is not None and route(st) is None
    for d in (second, third):
        st.complete(d.request_id)
    assert st.routed_in_flight("p0") == 0 and not st._routed


def test_failures_of_a_restarted_nodes_old_process_do_not_count_against_the_new_one():
    st = SchedulerState(get_policy("dualpath"), Thresholds(), node_timeout_s=60.0)
    st.register(NodeState("p0", "prefill"), "a:1", incarnation="p")
    st.register(NodeState("d0", "decode"), "b:1", incarnation="old")
    st.register(NodeState("d1", "decode"), "b:2", incarnation="x")
    st.nodes["d1"].state.healthy = False  # every request goes to d0
    routed = [route(st) for _ in range(3)]
    assert {d.decode_node for d in routed} == {"d0"}
    st.nodes["d0"].state.draining = True  # the old process is gone; a new one registers
    st.register(NodeState("d0", "decode"), "b:1", incarnation="new")
    for d in routed:  # the old process's turns complete (failed) after the new registration
        st.complete(d.request_id, ok=False, failed_node="d0")
    assert "d0" not in st.breakers or st.breakers["d0"].failures == 0
    assert not st.in_flight and st.routed_in_flight("d0") == 0
