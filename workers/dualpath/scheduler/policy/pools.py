"""What the node choice reads per config pool, kept up to date by the nodes' own load changes.

A decision used to scan every prefill node and every decode engine of the pool: 144 nodes took
~36 us on a 2-core VM, most of a Route's budget. Between two decisions the loads of only a few
nodes change (the pair a decision charges, the nodes that heartbeat), and `NodeState`'s setters
tell the structure watching the node which one (`touch`). Both read the loads through the
slots' private names (`NodeState._tracks_changes`: the public names are properties). So:

- `PrefillRanking`: the available, non-overloaded prefill nodes in a heap by the paper's order
  (short read queue first, then fewest tokens, then shorter read queue, then node id). A touched
  node is pushed again; an entry whose node has changed since is dropped when it reaches the top
  (lazy deletion: its (read queue, tokens) no longer match). O(log n) per change, O(1) to read.
- `DecodeGroup`: one decode group's totals over its available engines (tokens, engines, most
  buffer room), recomputed from its few members only after one of them changed.

A node reports to one watcher. When another view's pool claims it, the first watcher is
`orphaned` and recomputes everything on every read: still correct, only as slow as the scan.
"""

from __future__ import annotations

import itertools
from heapq import heapify, heappop, heappush
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dualpath.scheduler.policy.types import NodeState


def watch(node: NodeState, watcher: PrefillRanking | DecodeGroup) -> None:
    """Make `watcher` the one told of `node`'s load changes (its previous one is orphaned)."""
    old = node._watch
    if old is not None and old is not watcher:
        old.orphaned = True
    node._watch = watcher


class PrefillRanking:
    """The pool's best prefill node by the paper's rule, in O(changes) per read."""

    __slots__ = ("_limits", "_nodes", "_heap", "_dirty", "_seq", "orphaned")

    def __init__(self, limits: list[tuple[NodeState, float, float]]) -> None:
        # node id -> (overloaded above these tokens, short read queue under these bytes)
        self._limits = {n.node_id: (max_tok, short) for n, max_tok, short in limits}
        self._nodes = [n for n, _, _ in limits]
        self._heap: list[tuple] = []
        self._dirty: dict[str, NodeState] = {}
        self._seq = itertools.count()  # entries never compare past it (nodes don't order)
        self.orphaned = False
        for n in self._nodes:
            watch(n, self)
        self._rebuild()

    def touch(self, node: NodeState) -> None:
        self._dirty[node.node_id] = node

    def _entry(self, n: NodeState) -> tuple | None:
        """The node's heap entry, or None when it cannot take a request (unavailable or
        overloaded)."""
        if not n.available:
            return None
        max_tok, short = self._limits[n.node_id]
        tok = n._tokens_queued + n._tokens_running
        if tok > max_tok:
            return None
        rp = n._read_pending_bytes
        return (rp >= short, tok, rp, n.node_id, next(self._seq), n)

    def _rebuild(self) -> None:
        self._dirty = {}
        self._heap = [e for e in map(self._entry, self._nodes) if e is not None]
        heapify(self._heap)

    def best(self) -> tuple[NodeState, bool, int] | None:
        """(node, has a short read queue, tokens) of the best non-overloaded available node."""
        heap = self._heap
        dirty = self._dirty
        if self.orphaned or len(heap) + len(dirty) > 4 * len(self._nodes) + 16:
            self._rebuild()  # stale entries piled up (or the nodes report elsewhere)
            heap = self._heap
        elif dirty:
            self._dirty = {}
            for n in dirty.values():
                e = self._entry(n)
                if e is not None:
                    heappush(heap, e)
        while heap:
            long, tok, rp, _, _, n = heap[0]
            if (
                n.available
                and n._read_pending_bytes == rp
                and n._tokens_queued + n._tokens_running == tok
            ):
                return n, not long, tok
            heappop(heap)  # the node changed since (it was pushed again if it still qualifies)
        return None


class DecodeGroup:
    """One decode group: its engines and their totals over the available ones."""

    __slots__ = ("name", "members", "tokens", "engines", "most_free", "stale", "orphaned")

    def __init__(self, name: str, members: list[NodeState]) -> None:
        self.name = name
        self.members = members
        self.tokens = 0  # tokens queued + running on its available engines
        self.engines = 0  # available engines
        self.most_free: int | None = None  # the most buffer room of one available engine
        self.stale = True
        self.orphaned = False
        for n in members:
            watch(n, self)

    def touch(self, node: NodeState) -> None:
        self.stale = True

    def refresh(self) -> None:
        tok = cnt = 0
        most: int | None = None
        for n in self.members:
            if n.available:
                tok += n._tokens_queued + n._tokens_running
                cnt += 1
                free = n._buffer_free_bytes
                if most is None or free > most:
                    most = free
        self.tokens, self.engines, self.most_free = tok, cnt, most
        self.stale = self.orphaned
