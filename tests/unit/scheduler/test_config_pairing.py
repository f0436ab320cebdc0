"""Config hashes: prefill and decode of different versions never pair (docs/design.md section 9)."""

import logging

import pytest
from dualpath.scheduler.policy import (
    POLICY_NAMES,
    ClusterView,
    NodeState,
    RouteRequest,
    Thresholds,
    account,
    config_mismatch,
    get_policy,
)
from dualpath.scheduler.state import SchedulerState
from fake_clock import FakeClock


def p(node_id, config_hash, **kw):
    return NodeState(node_id, "prefill", config_hash=config_hash, **kw)


def d(node_id, config_hash, **kw):
    return NodeState(node_id, "decode", config_hash=config_hash, **kw)


def req(i=0, context_bytes=1 << 20):
    return RouteRequest(f"r{i}", 1000, 960, 1 << 20, context_bytes, 16)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_a_version_without_a_full_pair_gets_nothing(name):
    # Rollout: v2's prefill node is up (and idle), its decode node is not yet.
    view = ClusterView(
        [p("p-old", "v1", tokens_queued=5_000), p("p-new", "v2")], [d("d-old", "v1")]
    )
    policy = get_policy(name)
    for i in range(6):
        dec = policy.decide(req(i), view)
        assert (dec.prefill_node, dec.decode_node) == ("p-old", "d-old")
    assert config_mismatch(view) is None  # v1 has a pair: not a mismatch


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_no_shared_hash_means_no_decision_and_a_mismatch(name):
    view = ClusterView([p("p0", "v1")], [d("d0", "v2"), d("d1", "v2")])
    assert get_policy(name).decide(req(), view) is None
    assert config_mismatch(view) == (["v1"], ["v2"])


def test_empty_hashes_pair_and_a_draining_pair_is_no_mismatch():
    view = ClusterView([p("p0", "")], [d("d0", "")])
    assert get_policy("dualpath").decide(req(), view).decode_node == "d0"
    view = ClusterView([p("p0", "v1", draining=True), p("p1", "v2")], [d("d0", "v1")])
    # v1's only prefill node drains: what is left (v2 prefill, v1 decode) cannot pair.
    assert config_mismatch(view) == (["v2"], ["v1"])
    view = ClusterView([p("p0", "v1", draining=True)], [d("d0", "v1")])
    assert config_mismatch(view) is None  # nothing available at all: not a version problem


def test_equal_loads_go_to_the_newest_hash_then_load_spreads_over_both():
    view = ClusterView(
        [p("p-old", "v1"), p("p-new", "v2")],
        [d("d-old", "v1"), d("d-new", "v2")],
        config_hash_seq={"v1": 0, "v2": 1},
    )
    policy = get_policy("dualpath")
    first = policy.decide(req(0), view)
    assert (first.prefill_node, first.decode_node) == ("p-new", "d-new")
    account(view, req(0), first)
    pairs = set()
    for i in range(1, 20):
        dec = policy.decide(req(i), view)
        account(view, req(i), dec)
        pairs.add((dec.prefill_node, dec.decode_node))
    assert pairs == {("p-old", "d-old"), ("p-new", "d-new")}


def test_a_pool_whose_decode_engines_are_full_gives_way_to_the_next():
    # v2's prefill node is the better one, but v2's decode engine has no room for the context.
    view = ClusterView(
        [p("p1", "v1", tokens_queued=9_000), p("p2", "v2")],
        [d("d1", "v1"), d("d2", "v2", buffer_free_bytes=1 << 10)],
    )
    dec = get_policy("dualpath").decide(req(context_bytes=1 << 20), view)
    assert (dec.prefill_node, dec.decode_node) == ("p1", "d1")


def test_least_loaded_decode_group_without_room_gives_way_to_one_with_room():
    view = ClusterView(
        [p("p0", "")],
        [
            d("d-idle", "", group="a", buffer_free_bytes=1 << 10),
            d("d-busy", "", group="b", tokens_running=50_000),
        ],
    )
    assert get_policy("dualpath").decide(req(context_bytes=1 << 20), view).decode_node == "d-busy"


def test_pools_follow_membership_changes():
    view = ClusterView([p("p0", "v1")], [d("d0", "v2")])
    assert get_policy("dualpath").decide(req(), view) is None
    view.decode[0].config_hash = "v1"  # e.g. the node re-registered with the new config
    view.membership_changed()
    assert get_policy("dualpath").decide(req(), view).decode_node == "d0"


def test_state_registers_hashes_and_counts_unpaired_refusals(caplog):
    clock = FakeClock()
    st = SchedulerState(get_policy("dualpath"), Thresholds(), node_timeout_s=1.0, clock=clock)
    st.register(NodeState("p0", "prefill"), "a:1", config_hash="v1")
    st.register(NodeState("d0", "decode"), "b:1", config_hash="v2")
    assert st.nodes["d0"].config_hash == "v2"
    assert st.route(RouteRequest("", 1000, 960, 1 << 20)) is None
    with caplog.at_level(logging.WARNING, logger="dualpath.scheduler.state"):
        for _ in range(3):
            unpaired, why = st.refusal()
            assert unpaired and "prefill: v1; decode: v2" in why
        clock.t = 10.0
        st.refusal()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2  # rate-limited: one line per interval, with the count
    assert warnings[0].startswith("refused 1 request(s)")
    assert warnings[1].startswith("refused 3 request(s)")
    assert st.refused_unpaired_total == 4

    st.register(NodeState("d1", "decode"), "b:2", config_hash="v1")
    assert st.route(RouteRequest("", 1000, 960, 1 << 20)).decode_node == "d1"
    st.drain("d1")
    assert st.refusal()[0]  # v1 decode drained: v1 prefill and v2 decode are left
    st.register(NodeState("p1", "prefill"), "a:2", config_hash="v2")  # v2 now has a pair
    assert st.route(RouteRequest("", 1000, 960, 1 << 20)).prefill_node == "p1"
    assert st.refusal()[0] is False
