"""proto <-> domain in one module (`scheduler.wire`), the one RouteRequest constructor, the
one registry of policies and the one availability filter."""

from __future__ import annotations

import pytest
from dualpath import config
from dualpath.scheduler.policy import (
    DEFAULT_BUFFER_FREE_BYTES,
    DEFAULT_PREFILL_TOKENS_PER_S,
    DEFAULT_SNIC_BYTES_PER_S,
    POLICIES,
    POLICY_NAMES,
    ClusterView,
    NodeLoad,
    NodeState,
    RouteRequest,
    get_policy,
)
from dualpath.scheduler.wire import (
    ROLE_FROM_PB,
    load_from_pb,
    load_to_pb,
    node_from_register,
    route_fields,
    route_from_pb,
)
from dualpath.units import gbps_to_bytes_per_s
from dualpath.v1 import scheduler_pb2 as pb
from hypothesis import given
from hypothesis import strategies as st

_int = st.integers(min_value=0, max_value=1 << 50)


@given(_int, _int, _int, st.integers(0, 1 << 30), _int, st.booleans())
def test_a_load_survives_the_wire_both_ways(pending, queued, running, requests, free, draining):
    load = NodeLoad(pending, queued, running, requests, free, draining)
    assert load_from_pb(load_to_pb(load)) == load
    msg = load_to_pb(load)
    assert msg.tokens_queued == queued and msg.buffer_free_bytes == free


def test_node_state_load_is_what_cluster_view_shows():
    n = NodeState("d0", "decode", read_pending_bytes=5, tokens_queued=7, requests_running=2)
    n.draining = True
    assert n.load == NodeLoad(5, 7, 0, 2, n.buffer_free_bytes, True)
    assert load_to_pb(n.load).draining


def test_a_registration_that_leaves_fields_out_takes_the_one_set_of_defaults():
    msg = pb.RegisterRequest(node_id="p0", role=pb.ROLE_PREFILL, address="h:1")
    n = node_from_register(msg)
    assert (n.role, n.group) == ("prefill", "default")
    assert n.snic_bytes_per_s == DEFAULT_SNIC_BYTES_PER_S
    assert n.buffer_free_bytes == DEFAULT_BUFFER_FREE_BYTES
    assert n.prefill_tokens_per_s == DEFAULT_PREFILL_TOKENS_PER_S
    # and NodeState's own defaults are the same numbers
    assert NodeState("x", "decode").buffer_free_bytes == DEFAULT_BUFFER_FREE_BYTES
    told = pb.RegisterRequest(
        node_id="d0",
        role=pb.ROLE_DECODE,
        address="h:2",
        snic_bytes_per_s=5e9,
        load=load_to_pb(NodeLoad(tokens_running=9, buffer_free_bytes=123, draining=True)),
    )
    n = node_from_register(told)
    assert (n.role, n.snic_bytes_per_s, n.tokens_running) == ("decode", 5e9, 9)
    assert (n.buffer_free_bytes, n.draining) == (123, True)
    assert set(ROLE_FROM_PB.values()) == {"prefill", "decode"}


def test_for_turn_turns_tokens_into_bytes_once_and_weights_every_count():
    r = RouteRequest.for_turn("r1", 1000, 640, 70, max_new_tokens=50, session_id="s")
    assert (r.prompt_tokens, r.hit_tokens, r.new_tokens) == (1000, 640, 360)
    assert (r.hit_bytes, r.context_bytes, r.max_new_tokens) == (640 * 70, 1000 * 70, 50)
    w = RouteRequest.for_turn("r2", 1000, 640, 70, max_new_tokens=50, weight=8)
    assert (w.prompt_tokens, w.hit_tokens, w.max_new_tokens) == (8000, 5120, 400)
    assert (w.hit_bytes, w.context_bytes) == (8 * 640 * 70, 8 * 1000 * 70)


def test_the_frontend_s_request_means_the_same_on_the_scheduler_side():
    sent = RouteRequest.for_turn("r1", 1000, 0, 70, max_new_tokens=50, session_id="s")
    msg = pb.RouteRequest(**route_fields(sent), block_keys=b"")
    got = route_from_pb(msg, hit_tokens=640)
    assert got == RouteRequest.for_turn("r1", 1000, 640, 70, max_new_tokens=50, session_id="s")
    assert msg.context_bytes == got.context_bytes == 1000 * 70  # the prompt's KV, both sides


def test_one_registry_names_the_policies_everywhere():
    assert POLICY_NAMES == tuple(POLICIES)
    assert [p.value for p in config.PolicyName] == list(POLICY_NAMES)
    assert config.SchedulerSpec().policy.value == "dualpath"
    for name in POLICY_NAMES:
        a, b = get_policy(name), get_policy(name)
        assert a.name == name and a is not b  # fresh instances, never singletons
    with pytest.raises(ValueError, match="round-robin"):
        get_policy("nope")


@pytest.mark.parametrize("name", POLICY_NAMES)
@pytest.mark.parametrize("why", ["unhealthy", "draining", "held"])
def test_every_policy_skips_a_node_that_is_not_available(name, why):
    prefill = [NodeState("p0", "prefill"), NodeState("p1", "prefill")]
    decode = [NodeState("d0", "decode"), NodeState("d1", "decode")]
    for n in (prefill[0], decode[0]):
        if why == "unhealthy":
            n.healthy = False
        elif why == "draining":
            n.draining = True
        else:
            n.held = True
        assert not n.available
    view = ClusterView(prefill, decode)
    policy = get_policy(name)
    for i in range(4):
        d = policy.decide(RouteRequest.for_turn(f"r{i}", 1000, 0, 70, 10), view)
        assert d is not None and (d.prefill_node, d.decode_node) == ("p1", "d1")


def test_gigabits_per_second_to_bytes():
    assert gbps_to_bytes_per_s(400) == 50e9
    assert gbps_to_bytes_per_s(0) == 0


def test_a_command_without_a_file_runs_the_embedded_default(tmp_path):
    assert config.load_or_default(None) == config.local_default()
    assert config.load_or_default("") == config.local_default()
    with pytest.raises(config.ConfigError, match="no such file"):
        config.load_or_default(tmp_path / "missing.yaml")


@given(
    st.booleans(),
    st.booleans(),
    st.lists(st.tuples(st.sampled_from(["healthy", "draining", "held"]), st.booleans())),
)
def test_available_follows_every_assignment_of_its_three_flags(healthy, draining, changes):
    n = NodeState("n", "decode", healthy=healthy, draining=draining)
    assert n.available == (healthy and not draining)
    for name, value in changes:
        setattr(n, name, value)
        assert getattr(n, name) is value
        assert n.available == (n.healthy and not n.draining and not n.held)
