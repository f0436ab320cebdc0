"""KV events of one store process: the blocks it stored and removed, for the scheduler's index.

`KvEventBuffer` is what `KVStore` writes into (from any thread, under its own lock) and what
the worker's publisher (`scheduler/kv_events.py`) drains in batches. The last event per key wins,
so a block removed and written again before a batch leaves goes out as stored. The buffer is
bounded: past `max_keys` it drops what it holds and says so (`lost`), and the publisher makes
the loss a gap the scheduler sees, which rebuilds its index from a store scan.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from dualpath.kv.ids import BlockId, block_key

# The events' vocabulary, shared by the stores that write them and the scheduler's index that
# applies them (`scheduler/index.py` imports these: the index sits above the store).
ROOT = 0  # parent key of a chain's first block (never a key: kv.ids.block_key)
UNLINKED = -1  # parent unknown (a key found by a scan, or a write that did not say)
Stored = tuple[int, int, int]  # (key, parent key, depth in the chain)


def chain_events(ids: list[BlockId], end: int, start: int = 0) -> list[Stored]:
    """Stored events of blocks [start, end) of a chain of ids (from the chain's first block)."""
    keys = [block_key(b) for b in ids[:end]]
    return [(keys[i], keys[i - 1] if i else ROOT, i) for i in range(start, end)]


class KvEventBuffer:
    def __init__(self, max_keys: int = 1 << 20, wake: Callable[[], None] | None = None) -> None:
        self.max_keys = max_keys
        self.wake = wake  # called (outside the lock) when the buffer stops being empty
        self._lock = threading.Lock()
        self._ops: dict[int, tuple[int, int] | None] = {}  # key -> (parent, depth) | removed
        self._lost = False

    def __len__(self) -> int:
        return len(self._ops)

    def stored(self, events: Iterable[Stored]) -> None:
        self._add((k, (p, d)) for k, p, d in events)

    def stored_ids(self, ids: Iterable[BlockId]) -> None:
        """Blocks written without their chain (the parent is unknown)."""
        self._add((block_key(b), (UNLINKED, 0)) for b in ids)

    def removed_ids(self, ids: Iterable[BlockId]) -> None:
        self._add((block_key(b), None) for b in ids)

    def _add(self, items: Iterable[tuple[int, tuple[int, int] | None]]) -> None:
        with self._lock:
            was_empty = not self._ops and not self._lost
            ops = self._ops
            for key, op in items:
                ops.pop(key, None)
                ops[key] = op
            if len(ops) > self.max_keys:
                ops.clear()
                self._lost = True
        if was_empty and self.wake is not None:
            self.wake()

    def take(self) -> tuple[list[Stored], list[int], bool]:
        """Drain: (stored, removed, whether events were dropped since the last take)."""
        with self._lock:
            ops, self._ops = self._ops, {}
            lost, self._lost = self._lost, False
        stored = [(k, op[0], op[1]) for k, op in ops.items() if op is not None]
        removed = [k for k, op in ops.items() if op is None]
        return stored, removed, lost
