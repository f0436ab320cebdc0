"""The scheduler's block index: which KV blocks the shared store holds (DESIGN section 3).

Pure and synchronous (the gRPC servicer feeds it and exports its counters). It holds compact
keys (`kv.ids.block_key`: 63 bits of a block id), fed by **KV events** from the processes that
write and evict blocks: batches of stored blocks (key, parent key, depth in the chain) and
removed keys, numbered per publisher (`node`, `epoch` = one process's run, `seq` from 1). A
batch whose `seq` skips one is a **gap**: the index stops answering hits (0 = recompute, always
safe) and asks one worker for a **snapshot**, a scan of the store, which replaces the set; the
events applied while the snapshot was outstanding are replayed on top of it, so nothing that
happened during the scan is lost. A fresh index (scheduler start) starts the same way, which is
also how a store left by an earlier run or written by another cluster is found.

A request's hit is the longest prefix of its block keys that is present. Block ids are chained,
so a block is only reachable through its parent: the index keeps each stored block's parent
link, counts present children per parent and records **holes** (an absent key with present
children, e.g. a block evicted or found bad while its descendants stay). The lookup is then a
binary search (O(log n) set probes, flat in the store's size) plus a check of the holes that fall
inside the found prefix by their depth (the prompt's keys at those depths, read in one C call and
tested against the holes in one set operation): the first one ends the prefix, which is
bisected again below it. Only with more holes than prefix blocks is the prefix walked block by block. Keys
found by a scan carry no links: they are taken as prefix-closed until an event links them, so
a hole among them can cost one recompute (the reader verifies every block it loads) and never
wrong output.
"""

from __future__ import annotations

import itertools
import math
import sys
from array import array
from bisect import bisect_left, insort
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from operator import itemgetter

from dualpath.kv.events import ROOT, UNLINKED  # the vocabulary of the events it applies

ANCHOR_EVERY = 64  # default depth between two anchors of the holes (BlockIndex._anchored)
_COUNT = 1 << 24  # _kids value: children count * _COUNT + the parent's depth
_DEPTH = _COUNT - 1


def pack_keys(values: Sequence[int]) -> bytes:
    """Keys, parents or depths as little-endian int64s: their form in the scheduler contract."""
    arr = array("q", values)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tobytes()


def keys_view(data: bytes) -> Sequence[int]:
    """Packed keys as a sequence without converting them all: a lookup reads the few it probes."""
    if len(data) % 8:
        raise ValueError(f"packed int64s must be a multiple of 8 bytes (got {len(data)})")
    if sys.byteorder != "little":
        return unpack_keys(data)
    return memoryview(data).cast("q")


def unpack_keys(data: bytes) -> list[int]:
    if len(data) % 8:
        raise ValueError(f"packed int64s must be a multiple of 8 bytes (got {len(data)})")
    arr = array("q")
    arr.frombytes(data)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tolist()


class Applied(Enum):
    APPLIED = "applied"
    DUPLICATE = "duplicate"  # a retried batch already applied
    GAP = "gap"  # applied, but a batch before it was lost: a rebuild was started


@dataclass
class _Snapshot:
    snapshot_id: int
    node: str
    requested_s: float
    log: dict[int, tuple[int, int] | None] = field(default_factory=dict)  # None: removed


@dataclass
class IndexCounters:
    events_applied: int = 0  # stored + removed entries applied
    gaps: int = 0
    rebuilds: int = 0  # snapshots installed
    lookups: int = 0
    lookups_unready: int = 0  # answered 0 because the index was being rebuilt
    hole_cuts: int = 0  # lookups whose prefix crossed a hole (bisected again before it)
    walks: int = 0  # ... with more holes than prefix blocks (walked block by block)


class BlockIndex:
    """The set of block keys in the shared store, its chain links, and its recovery state."""

    def __init__(self, snapshot_timeout_s: float = 30.0, anchor_every: int = ANCHOR_EVERY) -> None:
        if anchor_every < 1:
            raise ValueError(f"anchor_every must be >= 1 (got {anchor_every})")
        self.snapshot_timeout_s = snapshot_timeout_s
        self.anchor_every = anchor_every
        self._parent: dict[int, int] = {}  # present key -> parent key (ROOT, UNLINKED)
        self._kids: dict[int, int] = {}  # key (present or not) -> linked present children
        self._holes: dict[int, int] = {}  # absent key with present children -> its depth
        # Holes by **anchor**: the key of their chain at the depth anchor_every * k at or
        # above them (found once, walking the parent links up from the hole). A prompt passes
        # through a hole only if its key at that depth is the anchor, so a lookup probes
        # b / anchor_every keys, not one per hole depth. Anchor key -> {hole: depth}.
        self._anchored: dict[int, dict[int, int]] = {}
        self._hole_anchor: dict[int, int] = {}
        # Holes whose chain above them is not known (a parent never linked or itself absent):
        # their distinct depths, sorted, and how many each has. A lookup reads its keys at the
        # depths inside its prefix (one C-level `itemgetter` call, cached per count of depths in
        # `_probes`) and checks them against the holes in one set operation
        self._hole_depths: list[int] = []
        self._depth_holes: dict[int, int] = {}
        self._probes: dict[int, Callable[[Sequence[int]], tuple[int, ...]]] = {}
        self._publishers: dict[str, tuple[str, int]] = {}  # node -> (epoch, last seq)
        self._snapshot: _Snapshot | None = None
        self._ids = itertools.count(1)
        self.ready = False  # False until a snapshot is installed: hits are 0
        self.counters = IndexCounters()

    def __len__(self) -> int:
        return len(self._parent)

    def __contains__(self, key: object) -> bool:
        return key in self._parent

    @property
    def holes(self) -> int:
        return len(self._holes)

    # ---- events ----------------------------------------------------------------------------

    def apply(
        self,
        node: str,
        epoch: str,
        seq: int,
        stored: Sequence[tuple[int, int, int]] = (),
        removed: Sequence[int] = (),
    ) -> Applied:
        """One batch from publisher (`node`, `epoch`): stored (key, parent, depth), removed keys.

        A retried batch (seq already seen) is ignored; a skipped seq starts a rebuild. The first
        batch of an epoch may have any seq: the ones before it were acknowledged by an earlier
        scheduler, so they happened before this index asked for its snapshot.
        """
        if seq < 1:
            raise ValueError(f"seq must be >= 1 (got {seq})")
        result = Applied.APPLIED
        last = self._publishers.get(node)
        if last is not None and last[0] == epoch:
            if seq <= last[1]:
                return Applied.DUPLICATE
            if seq > last[1] + 1:
                result = Applied.GAP
                self.counters.gaps += 1
                self.invalidate()
        self._publishers[node] = (epoch, seq)
        log = self._snapshot.log if self._snapshot is not None else None
        for key, parent, depth in stored:
            self._store(key, parent, depth)
            if log is not None:
                log[key] = (parent, depth)
        for key in removed:
            self._remove(key)
            if log is not None:
                log[key] = None
        self.counters.events_applied += len(stored) + len(removed)
        return result

    def forget_publisher(self, node: str) -> None:
        self._publishers.pop(node, None)

    def _store(self, key: int, parent: int, depth: int) -> None:
        old = self._parent.get(key)
        if old is not None:
            if old == UNLINKED and parent != UNLINKED:  # an event links a scanned key
                self._parent[key] = parent
                self._link(parent, depth)
            return  # links never change: the id is a hash of the parent
        self._parent[key] = parent
        self._drop_hole(key)
        if parent != UNLINKED:
            self._link(parent, depth)

    def _link(self, parent: int, depth: int) -> None:
        if parent == ROOT or depth < 1 or depth > _DEPTH:
            return
        v = self._kids.get(parent)
        self._kids[parent] = v + _COUNT if v else _COUNT | (depth - 1)
        if parent not in self._parent:
            self._add_hole(parent, depth - 1)  # its own parent is unknown

    def _remove(self, key: int) -> None:
        parent = self._parent.pop(key, None)
        if parent is None:
            return
        if parent > ROOT:
            v = self._kids.get(parent)
            if v is not None:
                v -= _COUNT
                if v >= _COUNT:
                    self._kids[parent] = v
                else:
                    del self._kids[parent]
                    self._drop_hole(parent)
        v = self._kids.get(key)
        if v:
            self._add_hole(key, v & _DEPTH, parent)

    def _add_hole(self, key: int, depth: int, parent: int = UNLINKED) -> None:
        if key in self._holes:
            return
        self._holes[key] = depth
        anchor = self._anchor_of(key, depth, parent)
        if anchor is not None:
            self._hole_anchor[key] = anchor
            self._anchored.setdefault(anchor, {})[key] = depth
            return
        n = self._depth_holes.get(depth, 0)
        self._depth_holes[depth] = n + 1
        if not n:
            insort(self._hole_depths, depth)
            self._probes.clear()

    def _anchor_of(self, key: int, depth: int, parent: int) -> int | None:
        """The key at depth anchor_every * k at or above this hole on its chain, or None when
        the parent links up to it are not all known."""
        top = depth - depth % self.anchor_every
        if top == depth:
            return key
        present = self._parent
        k, d = parent, depth - 1
        while d > top:
            if k <= ROOT:  # ROOT or UNLINKED: the chain above is not known
                return None
            k = present.get(k, UNLINKED)
            d -= 1
        return k if k > ROOT else None

    def _drop_hole(self, key: int) -> None:
        depth = self._holes.pop(key, None)
        if depth is None:
            return
        anchor = self._hole_anchor.pop(key, None)
        if anchor is not None:
            bucket = self._anchored[anchor]
            del bucket[key]
            if not bucket:
                del self._anchored[anchor]
            return
        n = self._depth_holes.pop(depth) - 1
        if n:
            self._depth_holes[depth] = n
        else:
            del self._hole_depths[bisect_left(self._hole_depths, depth)]
            self._probes.clear()

    # ---- rebuild ---------------------------------------------------------------------------

    def invalidate(self) -> None:
        """Stop answering hits until a snapshot is installed (a gap, or told to)."""
        self.ready = False

    def snapshot_wanted(self, node: str, now_s: float) -> int:
        """A snapshot id to ask `node` for (its next heartbeat ack carries it), or 0.

        One request is outstanding at a time; one not answered within `snapshot_timeout_s`
        (the worker died mid-scan) is asked of the next node that heartbeats.
        """
        if self.ready:
            return 0
        snap = self._snapshot
        if snap is not None and now_s - snap.requested_s < self.snapshot_timeout_s:
            return 0
        log = snap.log if snap is not None else {}  # from the first request on: a superset
        self._snapshot = _Snapshot(next(self._ids), node, now_s, log)
        return self._snapshot.snapshot_id

    def snapshot_lost(self, node: str) -> None:
        """`node` left the pool: a scan awaited from it is asked of the next node that
        heartbeats, not after `snapshot_timeout_s` (what it sent meanwhile is kept)."""
        snap = self._snapshot
        if snap is not None and snap.node == node:
            snap.requested_s = -math.inf

    @property
    def pending_snapshot(self) -> tuple[int, str] | None:
        snap = self._snapshot
        return None if snap is None else (snap.snapshot_id, snap.node)

    def install_snapshot(self, snapshot_id: int, keys: Sequence[int]) -> bool:
        """Replace the set with a scan's keys, replay what happened since it was asked for,
        and answer hits again. False (nothing changed) for an id no longer awaited."""
        snap = self._snapshot
        if snap is None or snap.snapshot_id != snapshot_id:
            return False
        self._parent = dict.fromkeys(keys, UNLINKED)
        self._kids = {}
        self._holes = {}
        self._anchored = {}
        self._hole_anchor = {}
        self._hole_depths = []
        self._depth_holes = {}
        self._probes.clear()
        for key, op in snap.log.items():
            if op is None:
                self._remove(key)
            else:
                self._store(key, *op)
        self._snapshot = None
        self.ready = True
        self.counters.rebuilds += 1
        return True

    # ---- lookups ---------------------------------------------------------------------------

    def hit_blocks(self, keys: Sequence[int], limit: int | None = None) -> int:
        """Length of the longest present prefix of `keys` (at most `limit`); 0 while the index
        is being rebuilt."""
        c = self.counters
        c.lookups += 1
        if not self.ready:
            c.lookups_unready += 1
            return 0
        n = len(keys) if limit is None else min(len(keys), limit)
        b = self._boundary(keys, n)
        holes = self._holes
        if not (b and holes):
            return b
        cut = b  # the first hole inside the prefix ends it
        anchored = self._anchored
        if anchored:
            every = self.anchor_every
            for top in range(0, b, every):
                bucket = anchored.get(keys[top])
                if bucket is None:
                    continue
                if len(bucket) <= every:
                    for hole, d in bucket.items():
                        if d < cut and keys[d] == hole:
                            cut = d
                else:  # a shared block anchors many chains' holes: read the prompt's keys
                    for d in range(top, min(top + every, cut)):
                        if keys[d] in bucket:
                            cut = d
                            break
        depths = self._hole_depths
        if depths:
            inside = bisect_left(depths, cut)  # distinct unanchored hole depths inside
            if inside >= cut:  # many holes: one pass, then walk
                if not holes.keys().isdisjoint(keys[:cut]):
                    c.walks += 1
                    present = self._parent
                    for i in range(cut):
                        if keys[i] not in present:
                            return i
            elif inside:
                at = self._probe(inside)(keys)  # the prompt's keys at those depths
                if not holes.keys().isdisjoint(at):
                    cut = next(d for d, k in zip(depths, at, strict=False) if k in holes)
        if cut < b:  # bisect again before the first hole (none lies below it)
            c.hole_cuts += 1
            return self._boundary(keys, cut)
        return b

    def _probe(self, inside: int) -> Callable[[Sequence[int]], tuple[int, ...]]:
        """A function giving a prompt's keys at the first `inside` hole depths, as a tuple."""
        probe = self._probes.get(inside)
        if probe is None:
            if len(self._probes) >= 256:
                self._probes.clear()  # bounded: at most 256 getters of the current depths
            if inside == 1:
                d = self._hole_depths[0]
                probe = lambda keys: (keys[d],)  # noqa: E731 (itemgetter of one is no tuple)
            else:
                probe = itemgetter(*self._hole_depths[:inside])
            self._probes[inside] = probe
        return probe

    def _boundary(self, keys: Sequence[int], n: int) -> int:
        """The end of the present run that starts keys[:n], if presence is monotone there."""
        present = self._parent
        if n <= 0 or keys[0] not in present:
            return 0
        if keys[n - 1] in present:
            return n
        lo, hi = 0, n - 1  # keys[lo] present, keys[hi] absent; a turn's new blocks sit at
        step = 1  # the end, so gallop back from it first, then bisect
        while hi - step > lo:
            if keys[hi - step] in present:
                lo = hi - step
                break
            hi -= step
            step <<= 1
        while hi - lo > 1:
            mid = (lo + hi) >> 1
            if keys[mid] in present:
                lo = mid
            else:
                hi = mid
        return lo + 1
