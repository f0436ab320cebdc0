"""Properties every policy keeps over random cluster views (hypothesis).

Views mix config hashes ("" included, as local runs register without one), so every property
also runs over rollouts where some versions have no full prefill/decode pair.
"""

import copy

from dualpath.scheduler.policy import (
    POLICY_NAMES,
    ClusterView,
    NodeState,
    ReadPath,
    RouteRequest,
    Thresholds,
    account,
    get_policy,
)
from dualpath.scheduler.policy.inter_node import (
    _pick_engine,
    has_short_read_queue,
    is_overloaded,
    path_finish_s,
    pick_pair,
)
from hypothesis import given, settings
from hypothesis import strategies as st

SNIC = 1.0e9


@st.composite
def nodes(draw, role: str, n_min: int, n_max: int, hashes=("",)):
    count = draw(st.integers(n_min, n_max))
    out = []
    for i in range(count):
        out.append(
            NodeState(
                node_id=f"{role[0]}{i}",
                role=role,
                read_pending_bytes=draw(st.integers(0, int(10 * SNIC))),
                snic_bytes_per_s=draw(st.sampled_from([0.5e9, 1e9, 5e9])),
                tokens_queued=draw(st.integers(0, 100_000)),
                tokens_running=draw(st.integers(0, 50_000)),
                requests_running=draw(st.integers(0, 64)),
                buffer_free_bytes=draw(st.integers(0, 1 << 34)),
                prefill_tokens_per_s=draw(st.sampled_from([5_000.0, 10_000.0, 20_000.0])),
                group=draw(st.sampled_from(["a", "b", "c"])),
                config_hash=draw(st.sampled_from(hashes)),
                healthy=draw(st.booleans()) or draw(st.booleans()),
                draining=draw(st.integers(0, 4)) == 0,
            )
        )
    return out


# One version, a rollout of two, a messy three (one of them the empty local hash).
HASH_SETS = [("",), ("v1", "v2"), ("", "v1", "v2")]


@st.composite
def views(draw):
    hashes = draw(st.sampled_from(HASH_SETS))
    return ClusterView(
        prefill=draw(nodes("prefill", 0, 8, hashes)),
        decode=draw(nodes("decode", 0, 10, hashes)),
        thresholds=Thresholds(draw(st.sampled_from([1.0, 3.0])), draw(st.sampled_from([2.0, 5.0]))),
        cnic_bytes_per_s=draw(st.sampled_from([2e9, 25e9])),
    )


@st.composite
def requests(draw):
    prompt = draw(st.integers(1, 64_000))
    hit = draw(st.integers(0, prompt))
    return RouteRequest(
        "r",
        prompt,
        hit,
        hit * 16_384,
        prompt * 16_384 // draw(st.sampled_from([1, 1000])),
        draw(st.integers(0, 500)),
    )


def _by_id(view):
    return {n.node_id: n for n in (*view.prefill, *view.decode)}


@settings(max_examples=300, deadline=None)
@given(view=views(), request=requests(), name=st.sampled_from(POLICY_NAMES))
def test_never_an_unavailable_node(view, request, name):
    d = get_policy(name).decide(request, view)
    if d is None:
        return
    nodes = _by_id(view)
    p, dn = nodes[d.prefill_node], nodes[d.decode_node]
    assert p.role == "prefill" and dn.role == "decode"
    assert p.healthy and not p.draining and dn.healthy and not dn.draining
    assert dn.buffer_free_bytes >= request.context_bytes


@settings(max_examples=300, deadline=None)
@given(view=views(), request=requests(), name=st.sampled_from(POLICY_NAMES))
def test_never_a_pair_of_different_config_hashes(view, request, name):
    d = get_policy(name).decide(request, view)
    if d is None:
        return
    nodes = _by_id(view)
    assert nodes[d.prefill_node].config_hash == nodes[d.decode_node].config_hash


def _available(n):
    return n.healthy and not n.draining


def _pairable_prefill(view, request, load_aware):
    """Prefill nodes the policy may choose: available (and, load-aware, not overloaded), with an
    available decode engine of the same hash that has room for the context."""
    hashes = {
        d.config_hash
        for d in view.decode
        if _available(d) and d.buffer_free_bytes >= request.context_bytes
    }
    return [
        p
        for p in view.prefill
        if _available(p)
        and p.config_hash in hashes
        and not (load_aware and is_overloaded(p, view.thresholds))
    ]


@settings(max_examples=300, deadline=None)
@given(view=views(), request=requests(), name=st.sampled_from(POLICY_NAMES))
def test_a_matching_pair_means_a_decision(view, request, name):
    d = get_policy(name).decide(request, view)
    if _pairable_prefill(view, request, load_aware=name != "round-robin"):
        assert d is not None
    else:
        assert d is None


@settings(max_examples=300, deadline=None)
@given(view=views(), request=requests())
def test_prefill_choice_is_the_best_node_that_has_a_pair(view, request):
    # Across config pools the paper's order holds: short read queue first, then fewest tokens.
    d = get_policy("dualpath").decide(request, view)
    if d is None:
        return
    t = view.thresholds

    def key(n):
        return (not has_short_read_queue(n, t), n.tokens)

    chosen = _by_id(view)[d.prefill_node]
    assert all(key(chosen) <= key(q) for q in _pairable_prefill(view, request, True))


@settings(max_examples=300, deadline=None)
@given(view=views(), request=requests())
def test_never_overloaded_while_another_is_not(view, request):
    for name in ("dualpath", "prefill-read", "decode-read"):
        d = get_policy(name).decide(request, view)
        if d is None:
            continue
        t = view.thresholds
        chosen = _by_id(view)[d.prefill_node]
        some_ok = any(
            n.healthy and not n.draining and not is_overloaded(n, t) for n in view.prefill
        )
        assert not (some_ok and is_overloaded(chosen, t))


@settings(max_examples=300, deadline=None)
@given(view=views(), request=requests())
def test_dualpath_never_picks_the_later_path(view, request):
    d = get_policy("dualpath").decide(request, view)
    if d is None:
        return
    nodes = _by_id(view)
    via_p, via_d = path_finish_s(request, nodes[d.prefill_node], nodes[d.decode_node], view)
    chosen = via_d if d.read_path is ReadPath.DECODE else via_p
    assert chosen <= min(via_p, via_d) + 1e-12
    assert d.est_read_finish_s <= d.est_other_finish_s + 1e-12


@settings(max_examples=200, deadline=None)
@given(view=views(), request=requests(), name=st.sampled_from(POLICY_NAMES))
def test_same_input_same_decision(view, request, name):
    a = get_policy(name).decide(request, copy.deepcopy(view))
    b = get_policy(name).decide(request, copy.deepcopy(view))
    assert a == b


@settings(max_examples=100, deadline=None)
@given(view=views(), request=requests())
def test_decide_does_not_mutate_the_view(view, request):
    before = copy.deepcopy(view)
    get_policy("dualpath").decide(request, view)
    assert [vars_(n) for n in view.prefill + view.decode] == [
        vars_(n) for n in before.prefill + before.decode
    ]


def vars_(n):
    # `_watch` points at the pool structure ranking the node: a cache pointer, not its state
    return tuple(getattr(n, f) for f in n.__slots__ if f != "_watch")


def test_waits_when_every_prefill_node_is_overloaded():
    p = NodeState("p0", "prefill", tokens_queued=10**9)
    view = ClusterView([p], [NodeState("d0", "decode")])
    assert get_policy("dualpath").decide(RouteRequest("r", 100, 64, 1 << 20), view) is None


def test_prefers_short_read_queue_then_fewest_tokens():
    busy_reader = NodeState(
        "p0", "prefill", read_pending_bytes=int(10 * SNIC), snic_bytes_per_s=SNIC
    )
    loaded = NodeState("p1", "prefill", tokens_queued=1000, snic_bytes_per_s=SNIC)
    idle = NodeState("p2", "prefill", tokens_queued=10, snic_bytes_per_s=SNIC)
    view = ClusterView([busy_reader, loaded, idle], [NodeState("d0", "decode")])
    assert (
        get_policy("dualpath").decide(RouteRequest("r", 1000, 960, 1 << 20), view).prefill_node
        == "p2"
    )
    idle.read_pending_bytes = int(10 * SNIC)
    assert (
        get_policy("dualpath").decide(RouteRequest("r", 1000, 960, 1 << 20), view).prefill_node
        == "p1"
    )


def test_reads_through_the_idle_decode_snic_and_accounting_spreads_a_burst():
    view = ClusterView(
        [NodeState("p0", "prefill", snic_bytes_per_s=SNIC)],
        [
            NodeState("d0", "decode", snic_bytes_per_s=SNIC),
            NodeState("d1", "decode", snic_bytes_per_s=SNIC),
        ],
        cnic_bytes_per_s=25e9,
    )
    policy = get_policy("dualpath")
    paths = []
    for i in range(30):
        req = RouteRequest(f"r{i}", 10_000, 9_984, 100_000_000, 0, 10)
        d = policy.decide(req, view)
        account(view, req, d)
        paths.append((d.read_path, d.decode_node))
    # Three equal SNICs: a burst splits about a third each between p0, d0 and d1.
    readers = [p.value if p is ReadPath.PREFILL else dn for p, dn in paths]
    for who in ("prefill", "d0", "d1"):
        assert 8 <= readers.count(who) <= 12, readers


def test_prefill_read_and_decode_read_fix_the_path():
    view = ClusterView([NodeState("p0", "prefill")], [NodeState("d0", "decode")])
    req = RouteRequest("r", 1000, 960, 1 << 20)
    assert get_policy("prefill-read").decide(req, view).read_path is ReadPath.PREFILL
    assert get_policy("decode-read").decide(req, view).read_path is ReadPath.DECODE


def test_unknown_policy_name_is_refused():
    import pytest

    with pytest.raises(ValueError, match="choose one of"):
        get_policy("fastest")


def scan_pair(request, view):
    """The paper's pair choice by a full scan of every node (the oracle of the incremental
    pool structures): per pool the best prefill node by (long read queue, tokens, read queue,
    id), its pool's least-loaded group with room, the engine of `_pick_engine`."""
    t = view.thresholds
    ranked = []
    for rank, pool in enumerate(view.pools()):
        ok = [n for n in pool.prefill if n.available and not is_overloaded(n, t) and pool.decode]
        if ok:
            p = min(
                ok,
                key=lambda n: (
                    not has_short_read_queue(n, t),
                    n.tokens,
                    n.read_pending_bytes,
                    n.node_id,
                ),
            )
            ranked.append(
                ((not has_short_read_queue(p, t), p.tokens, p.read_pending_bytes, rank), p, pool)
            )
    for _, p, pool in sorted(ranked, key=lambda r: r[0]):
        groups = {}
        for n in pool.decode:
            groups.setdefault(n.group, []).append(n)
        best = None
        for name in sorted(groups):
            live = [n for n in groups[name] if n.available]
            tok = sum(n.tokens for n in live)
            if any(n.buffer_free_bytes >= request.context_bytes for n in live) and (
                best is None or tok < best[0]
            ):
                best = (tok, len(live), groups[name])
        if best is not None:
            return p, _pick_engine(request, best[2], best[0], best[1])
    return None


CHANGES = st.lists(
    st.tuples(
        st.integers(0, 17),
        st.sampled_from(
            ["read_pending_bytes", "tokens_queued", "tokens_running", "buffer_free_bytes"]
            + ["healthy", "draining", "held"]
        ),
        st.integers(0, 10 * int(SNIC)),
    ),
    max_size=12,
)


def _decide_as_the_scan_does(policy, request, view):
    """The incremental pair equals the full scan's over the same loads; then decide and
    charge it, as the service does."""
    want = scan_pair(request, view)
    got = pick_pair(request, view)
    assert (got and (got[0].node_id, got[1].node_id)) == (
        want and (want[0].node_id, want[1].node_id)
    )
    d = policy.decide(request, view)
    if d is not None:
        account(view, request, d)


@settings(max_examples=300, deadline=None)
@given(view=views(), rounds=st.lists(st.tuples(requests(), CHANGES), min_size=1, max_size=6))
def test_incremental_choice_equals_a_full_scan(view, rounds):
    """Decisions, their accounting and arbitrary load/flag changes in between: every pair the
    pools' incremental structures give equals the full scan's over the same loads."""
    policy = get_policy("dualpath")
    nodes = view.prefill + view.decode
    for request, changes in rounds:
        for i, field, value in changes:
            if nodes:
                n = nodes[i % len(nodes)]
                setattr(
                    n, field, bool(value % 2) if field in {"healthy", "draining", "held"} else value
                )
        _decide_as_the_scan_does(policy, request, view)


@settings(max_examples=300, deadline=None)
@given(view=views(), burst=st.lists(requests(), min_size=2, max_size=40))
def test_a_burst_between_two_heartbeats_equals_a_full_scan_at_every_decision(view, burst):
    """Decisions and their accounting only, as between two heartbeats: the groups' totals
    follow the charges without a refresh (`DecodeGroup.charged`), and every pair still equals
    the full scan's."""
    policy = get_policy("dualpath")
    for request in burst:
        _decide_as_the_scan_does(policy, request, view)


@settings(max_examples=300, deadline=None)
@given(view=views(), burst=st.lists(requests(), min_size=1, max_size=20))
def test_a_decode_group_that_is_not_stale_has_the_totals_of_a_refresh(view, burst):
    """After every charge, each group that did not mark itself stale holds what summing its
    members again gives."""
    policy = get_policy("dualpath")
    for request in burst:
        d = policy.decide(request, view)
        if d is None:
            break
        account(view, request, d)
        for pool in view.pools():
            for g in pool.decode_groups:
                if not g.stale:
                    kept = (g.tokens, g.engines, g.most_free)
                    g.refresh()
                    assert (g.tokens, g.engines, g.most_free) == kept, g.name


def test_a_node_claimed_by_a_second_view_keeps_the_first_one_right():
    """A node ranked by two views' pools reports to the newest; the first falls back to
    recomputing (orphaned) instead of deciding on loads it no longer hears about."""
    p0, p1 = NodeState("p0", "prefill"), NodeState("p1", "prefill", tokens_queued=10)
    d0 = NodeState("d0", "decode")
    first = ClusterView([p0, p1], [d0])
    req = RouteRequest.for_turn("r", 100, 0, 1)
    assert pick_pair(req, first)[0] is p0
    second = ClusterView([p0, p1], [d0])
    assert pick_pair(req, second)[0] is p0  # the second view's pools now watch the nodes
    p0.tokens_queued = 50
    assert pick_pair(req, first)[0] is p1
    assert pick_pair(req, second)[0] is p1


def test_a_decode_group_claimed_by_a_second_view_keeps_the_first_one_right():
    """The same for the decode groups' order: the first view's ranking recomputes its groups."""
    p0 = NodeState("p0", "prefill")
    d0 = NodeState("d0", "decode", group="a")
    d1 = NodeState("d1", "decode", group="b", tokens_queued=10)
    first = ClusterView([p0], [d0, d1])
    req = RouteRequest.for_turn("r", 100, 0, 1)
    assert pick_pair(req, first)[1] is d0
    second = ClusterView([p0], [d0, d1])
    assert pick_pair(req, second)[1] is d0
    d0.tokens_running = 50
    assert pick_pair(req, first)[1] is d1
    assert pick_pair(req, second)[1] is d1
    d1.buffer_free_bytes = 0  # no room in the least-loaded group: the next one with room
    assert pick_pair(req, first)[1] is d0
    assert pick_pair(req, second)[1] is d0
