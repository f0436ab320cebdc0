"""A drained node id serves again when a new process registers under it (StatefulSet pods
keep their names across a rolling update), and a draining process stays drained."""

from dualpath.scheduler.policy import NodeState, RouteRequest, Thresholds, get_policy
from dualpath.scheduler.state import SchedulerState


def _state() -> SchedulerState:
    st = SchedulerState(get_policy("dualpath"), Thresholds(), node_timeout_s=1.0)
    st.register(NodeState("p0", "prefill"), "a:1")
    st.register(NodeState("d0", "decode"), "b:1")
    return st


def _route(st: SchedulerState):
    return st.route(RouteRequest("", 1000, 960, 1 << 20, 1 << 20, 16))


def test_a_replaced_pod_under_a_drained_id_takes_requests_again():
    st = _state()
    assert st.drain("p0")
    assert st.heartbeat("p0", 0, 0, 0, 0, 1 << 40, False)  # the old process, still beating
    assert _route(st) is None  # drained: sticky over its heartbeats
    st.register(NodeState("p0", "prefill"), "a:2")  # the new pod, same name
    assert _route(st).prefill_node == "p0"


def test_a_draining_process_that_registers_again_stays_drained():
    st = _state()
    assert st.drain("p0")
    st.register(NodeState("p0", "prefill", draining=True), "a:1")  # e.g. after a stream error
    assert _route(st) is None


def test_a_drain_reports_the_requests_still_routed_to_the_node():
    st = _state()
    d = _route(st)
    assert (st.routed_in_flight("p0"), st.routed_in_flight("d0")) == (1, 1)
    st.drain("p0")
    assert st.routed_in_flight("p0") == 1  # routed before the drain: the worker waits for it
    st.complete(d.request_id)
    assert st.routed_in_flight("p0") == st.routed_in_flight("d0") == 0
