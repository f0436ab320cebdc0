"""The block index: prefix lookups (binary search + holes), events, gaps, snapshots."""

import random

import pytest
from dualpath.scheduler.index import ROOT, UNLINKED, Applied, BlockIndex


def chain(n, start=100):
    return list(range(start, start + n))


def stored(keys, first_depth=0, parent=ROOT):
    out = []
    for i, k in enumerate(keys):
        out.append((k, parent if i == 0 else keys[i - 1], first_depth + i))
    return out


def ready_index(keys=(), anchor_every=64):
    idx = BlockIndex(anchor_every=anchor_every)
    sid = idx.snapshot_wanted("w0", 0.0)
    assert idx.install_snapshot(sid, list(keys))
    return idx


def walk(present, keys, limit=None):
    n = len(keys) if limit is None else min(len(keys), limit)
    for i in range(n):
        if keys[i] not in present:
            return i
    return n


def test_not_ready_until_a_snapshot_then_prefix_hits():
    idx = BlockIndex()
    keys = chain(10)
    idx.apply("w0", "e", 1, stored(keys[:6]))
    assert idx.hit_blocks(keys) == 0  # rebuilding: every turn a recompute, never a wrong hit
    assert idx.counters.lookups_unready == 1
    sid = idx.snapshot_wanted("w0", 0.0)
    assert sid and idx.snapshot_wanted("w1", 1.0) == 0  # one request outstanding
    assert idx.install_snapshot(sid, keys[:6])
    assert idx.ready and idx.hit_blocks(keys) == 6
    assert idx.hit_blocks(keys, limit=4) == 4
    assert idx.hit_blocks([999] + keys) == 0


def test_a_removed_block_ends_the_hit_even_with_descendants_present():
    idx = ready_index()
    keys = chain(20)
    idx.apply("w0", "e", 1, stored(keys))
    assert idx.hit_blocks(keys) == 20
    idx.apply("w0", "e", 2, removed=[keys[7]])  # a hole: 8..19 stay in the store
    assert idx.holes == 1
    assert idx.hit_blocks(keys) == 7
    assert idx.hit_blocks(keys[:5]) == 5  # a prefix before the hole is untouched
    idx.apply("w0", "e", 3, stored([keys[7]], first_depth=7, parent=keys[6]))
    assert idx.holes == 0 and idx.hit_blocks(keys) == 20
    idx.apply("w0", "e", 4, removed=keys[15:])  # leaves go: no hole
    assert idx.holes == 0 and idx.hit_blocks(keys) == 15


def test_a_chain_head_evicted_first_is_a_miss():
    idx = ready_index()
    keys = chain(8)
    idx.apply("w0", "e", 1, stored(keys))
    idx.apply("w0", "e", 2, removed=[keys[0]])
    assert idx.hit_blocks(keys) == 0


def test_blocks_stored_deepest_first_link_once_the_parent_arrives():
    idx = ready_index()
    keys = chain(6)
    idx.apply("w0", "e", 1, stored(keys)[3:])  # 3..5 before their parents: 2 is a hole
    assert idx.holes == 1 and idx.hit_blocks(keys) == 0
    idx.apply("w0", "e", 2, stored(keys)[:3])
    assert idx.holes == 0 and idx.hit_blocks(keys) == 6


def test_shared_prefix_branches():
    idx = ready_index()
    a = chain(10)
    b = a[:4] + chain(6, start=500)
    idx.apply("w0", "e", 1, stored(a))
    idx.apply("w1", "f", 1, [(k, b[i - 1], i) for i, k in enumerate(b) if i >= 4])
    assert idx.hit_blocks(b) == 10
    idx.apply("w1", "f", 2, removed=[a[2]])
    assert idx.hit_blocks(a) == 2 and idx.hit_blocks(b) == 2
    idx.apply("w0", "e", 2, removed=a[4:])  # one branch gone; the hole still has b's children
    assert idx.holes == 1 and idx.hit_blocks(b) == 2


@pytest.mark.parametrize("anchor_every", [64, 4, 1])
@pytest.mark.parametrize("seed", range(20))
def test_lookup_matches_a_walk_under_random_events(seed, anchor_every):
    rng = random.Random(seed)
    idx = ready_index(anchor_every=anchor_every)
    chains = [chain(rng.randrange(1, 40), start=1000 * (c + 1)) for c in range(6)]
    chains.append(chains[0][:5] + chain(10, start=90_000))  # a branch
    present = set()
    seq = 0
    for _ in range(200):
        seq += 1
        c = rng.choice(chains)
        if rng.random() < 0.6:
            i = rng.randrange(len(c))
            j = rng.randrange(i, len(c)) + 1
            idx.apply("w0", "e", seq, [(c[d], c[d - 1] if d else ROOT, d) for d in range(i, j)])
            present.update(c[i:j])
        else:
            gone = rng.sample(c, rng.randrange(1, min(4, len(c)) + 1))
            idx.apply("w0", "e", seq, removed=gone)
            present.difference_update(gone)
        for q in chains:
            limit = rng.randrange(0, len(q) + 2)
            assert idx.hit_blocks(q, limit) == walk(present, q, limit)
    assert len(idx) == len(present)


@pytest.mark.parametrize("anchor_every", [64, 8, 2])
@pytest.mark.parametrize("seed", range(10))
def test_holes_in_many_branches_of_a_shared_trunk_match_a_walk(seed, anchor_every):
    """An agent's system prompt is every session's trunk: the holes of many branches share
    the trunk's anchors (a big bucket), and some lie in the trunk itself; scanned keys (no
    links) and parents that arrive after their children leave holes without an anchor."""
    rng = random.Random(seed)
    trunk = chain(rng.randrange(4, 30), start=1)
    branches = [trunk + chain(rng.randrange(1, 50), start=1000 * (b + 1)) for b in range(40)]
    idx = ready_index(rng.sample(trunk, rng.randrange(0, 3)), anchor_every=anchor_every)
    present = set(idx._parent)
    for seq, q in enumerate(branches, start=1):
        events = [(q[d], q[d - 1] if d else ROOT, d) for d in range(len(q))]
        if rng.random() < 0.3:
            events.reverse()  # deepest first: links arrive before their parents
        idx.apply("w0", "e", seq, events)
        present.update(q)
    seq = len(branches)
    for _ in range(60):
        q = rng.choice(branches)
        gone = rng.sample(q, rng.randrange(1, 3))
        seq += 1
        idx.apply("w0", "e", seq, removed=gone)
        present.difference_update(gone)
        if rng.random() < 0.3:  # a recompute writes part of a branch back
            i = rng.randrange(len(q))
            seq += 1
            idx.apply(
                "w0", "e", seq, [(q[d], q[d - 1] if d else ROOT, d) for d in range(i, len(q))]
            )
            present.update(q[i:])
        for b in branches:
            limit = rng.randrange(0, len(b) + 2)
            assert idx.hit_blocks(b, limit) == walk(present, b, limit)


def test_duplicates_are_ignored_and_a_gap_starts_a_rebuild():
    idx = ready_index()
    keys = chain(6)
    assert idx.apply("w0", "e", 1, stored(keys[:3])) is Applied.APPLIED
    assert idx.apply("w0", "e", 1, removed=keys[:3]) is Applied.DUPLICATE  # a retried batch
    assert idx.hit_blocks(keys) == 3
    assert idx.apply("w0", "e", 3, stored(keys[3:], 3, keys[2])) is Applied.GAP  # 2 was lost
    assert idx.counters.gaps == 1 and not idx.ready
    assert idx.hit_blocks(keys) == 0
    # a new epoch (the worker restarted) may start anywhere; another node is independent
    assert idx.apply("w0", "e2", 7) is Applied.APPLIED
    assert idx.apply("w1", "x", 5) is Applied.APPLIED
    with pytest.raises(ValueError, match="seq"):
        idx.apply("w1", "x", 0)


def test_snapshot_replaces_the_set_and_replays_what_happened_meanwhile():
    idx = ready_index()
    old = chain(5)
    idx.apply("w0", "e", 1, stored(old))
    idx.invalidate()
    sid = idx.snapshot_wanted("w1", 10.0)
    new = chain(8, start=700)
    # while w1 scans: w0 removes one block the scan will still report and stores another
    idx.apply("w0", "e", 2, removed=[new[7]])
    idx.apply("w0", "e", 3, stored([900]))
    assert not idx.install_snapshot(sid + 1, [1, 2, 3])  # not the awaited scan: ignored
    assert idx.install_snapshot(sid, new)
    assert idx.ready and idx.counters.rebuilds == 2
    assert idx.hit_blocks(old) == 0  # gone from the store: gone from the index
    assert idx.hit_blocks(new) == 7
    assert 900 in idx and len(idx) == 8
    # scanned keys carry no links until an event says them; a walk-free lookup still works
    assert idx._parent[new[0]] == UNLINKED


def test_an_unanswered_snapshot_is_asked_of_another_node_after_the_timeout():
    idx = BlockIndex(snapshot_timeout_s=5.0)
    first = idx.snapshot_wanted("w0", 0.0)
    idx.apply("w1", "e", 1, stored([42]))
    assert idx.snapshot_wanted("w1", 4.0) == 0
    second = idx.snapshot_wanted("w1", 6.0)
    assert second and second != first and idx.pending_snapshot == (second, "w1")
    assert not idx.install_snapshot(first, [])  # the late answer of the first is refused
    assert idx.install_snapshot(second, [])
    assert 42 in idx  # logged since the first request, replayed on the second's scan
