"""What the node choice reads per config pool, kept up to date by the nodes' own load changes.

A decision used to scan every prefill node and every decode engine of the pool: 144 nodes took
~36 us on a 2-core VM, most of a Route's budget. Between two decisions the loads of only a few
nodes change (the pair a decision charges, the nodes that heartbeat), and `NodeState`'s setters
tell the structure watching the node which one (`touch`). Both read the loads through the
slots' private names (`NodeState._tracks_changes`: the public names are properties). So:

- `PrefillRanking`: the available, non-overloaded prefill nodes in one sorted list by the
  paper's order (short read queue first, then fewest tokens, then shorter read queue, then node
  id). A touched node's key is taken out and put back in place: O(log n) comparisons per
  change, O(1) to read, nothing stale left behind (a heap with lazy deletion had to be rebuilt
  now and then, a spike in the p99).
- `DecodeGroup`: one decode group's totals over its available engines (tokens, engines, most
  buffer room), recomputed from its few members only after one of them changed. A charge
  (`policy.account`, every decision) is added to the totals instead (`charged`), unless the
  engine charged had the most room: then the group is summed again at the next read.

A node reports to one watcher. When another view's pool claims it, the first watcher is
orphaned (`orphan()`) and recomputes everything on every read: still correct, only as slow as
the scan.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dualpath.scheduler.policy.types import NodeState


def watch(node: NodeState, watcher: PrefillRanking | DecodeGroup) -> None:
    """Make `watcher` the one told of `node`'s load changes (its previous one is orphaned)."""
    old = node._watch
    if old is not None and old is not watcher:
        old.orphan()
    node._watch = watcher


class PrefillRanking:
    """The pool's best prefill node by the paper's rule, in O(changes) per read.

    The available, non-overloaded nodes' keys (long read queue, tokens, read queue, node id,
    then the node's `id` so equal ids never compare further) are kept in one sorted list; a
    touched node's key is taken out and put back (bisect, C-level `insort`) when the next
    decision reads. Nothing stale stays behind, so no read ever pays for a rebuild.
    """

    __slots__ = ("_limits", "_nodes", "_by_ref", "_order", "_placed", "_dirty", "orphaned")

    def __init__(self, limits: list[tuple[NodeState, float, float]]) -> None:
        # id(node) -> (overloaded above these tokens, short read queue under these bytes)
        self._limits = {id(n): (max_tok, short) for n, max_tok, short in limits}
        self._nodes = [n for n, _, _ in limits]
        self._by_ref = {id(n): n for n in self._nodes}
        self._order: list[tuple[bool, int, int, str, int]] = []
        self._placed: dict[int, tuple[bool, int, int, str, int]] = {}
        self._dirty: dict[int, NodeState] = {}
        self.orphaned = False
        for n in self._nodes:
            watch(n, self)
        self._rebuild()

    def touch(self, node: NodeState) -> None:
        self._dirty[id(node)] = node

    def orphan(self) -> None:
        self.orphaned = True

    def charged(self, node: NodeState, tokens: int, old_free: int) -> None:
        self.touch(node)  # a node's key is its whole load: placed again

    def _rebuild(self) -> None:
        """Read every node again: all of them are placed as if each had changed."""
        self._order, self._placed = [], {}
        self._dirty = {id(n): n for n in self._nodes}
        self._place_changed()

    def _place_changed(self) -> None:
        """Take each changed node's key out of the order and put its new one in (none when
        it cannot take a request: unavailable or overloaded). Runs on every decision."""
        order, placed, limits = self._order, self._placed, self._limits
        for ref, n in self._dirty.items():
            old = placed.pop(ref, None)
            if old is not None:
                del order[bisect_left(order, old)]
            if n.available:
                max_tok, short = limits[ref]
                tok = n._tokens_queued + n._tokens_running
                if tok <= max_tok:
                    rp = n._read_pending_bytes
                    key = placed[ref] = (rp >= short, tok, rp, n.node_id, ref)
                    insort(order, key)
        self._dirty.clear()

    def best(self) -> tuple[NodeState, bool, int] | None:
        """(node, has a short read queue, tokens) of the best non-overloaded available node."""
        if self.orphaned:
            self._rebuild()  # the nodes report to another view's pool: read them all
        elif self._dirty:
            self._place_changed()
        if not self._order:
            return None
        long, tok, _, _, ref = self._order[0]
        return self._by_ref[ref], not long, tok


class DecodeGroup:
    """One decode group: its engines and their totals over the available ones."""

    __slots__ = ("name", "members", "tokens", "engines", "most_free", "stale", "orphaned")

    def __init__(self, name: str, members: list[NodeState]) -> None:
        self.name = name
        self.members = members
        self.tokens = 0  # tokens queued + running on its available engines
        self.engines = 0  # available engines
        self.most_free = -1  # the most buffer room of one available engine (-1: none is)
        self.stale = True
        self.orphaned = False
        for n in members:
            watch(n, self)

    def touch(self, node: NodeState) -> None:
        self.stale = True

    def orphan(self) -> None:
        self.orphaned = self.stale = True  # stale from now on: `refresh` keeps it so

    def charged(self, node: NodeState, tokens: int, old_free: int) -> None:
        """`node` took a request (`policy.account`): `tokens` more, less room than `old_free`.
        The totals follow without a refresh, unless it had the most room (then who has it
        now is not known)."""
        if self.stale or not node.available:
            return  # refreshed at the next read anyway; an unavailable engine is not counted
        self.tokens += tokens
        if old_free >= self.most_free:
            self.stale = True

    def refresh(self) -> None:
        tok = cnt = 0
        most = -1
        for n in self.members:
            if n.available:
                tok += n._tokens_queued + n._tokens_running
                cnt += 1
                free = n._buffer_free_bytes
                if free > most:
                    most = free
        self.tokens, self.engines, self.most_free = tok, cnt, most
        self.stale = self.orphaned
