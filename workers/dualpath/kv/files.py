"""Open block files: a bounded LRU of read-only fds with their validated headers.

Reading a layer of a block used to cost an open, an fstat and a close per range read; the store
now keeps each block's fd (and the header read through it) open across reads. An entry is tied to
the inode it was opened on: the store stats the block's path before every read and only reuses an
entry whose (device, inode) still matches, so a block deleted or replaced by another process is
never read through an old fd. This process's own evictions and drops invalidate the entry.

An entry in use by a read (`refs > 0`) is never closed under it: invalidation and LRU overflow
take it out of the cache and the last `release` closes it, so its fd number cannot be reused by
another open while a backend still reads from it.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from dualpath.kv.format import BlockHeader


@dataclass(eq=False)
class OpenBlock:
    block_id: str
    fd: int
    dev: int
    ino: int
    header: BlockHeader
    refs: int = 0
    cached: bool = True  # False once invalidated or pushed out: closed when refs reach 0


class OpenBlocks:
    """Thread-safe cache of at most `max_open` idle block fds, least recently used dropped."""

    def __init__(self, max_open: int) -> None:
        if max_open < 1:
            raise ValueError("max_open must be >= 1")
        self.max_open = max_open
        self._lock = threading.Lock()
        self._open: OrderedDict[str, OpenBlock] = OrderedDict()

    def __len__(self) -> int:
        return len(self._open)

    def acquire(self, block_id: str, dev: int, ino: int) -> OpenBlock | None:
        """The cached entry of `block_id` if it is still that inode (refs + 1), else None."""
        with self._lock:
            e = self._open.get(block_id)
            if e is None:
                return None
            if e.dev != dev or e.ino != ino:  # replaced or rewritten since we opened it
                self._uncache_locked(e)
                return None
            e.refs += 1
            self._open.move_to_end(block_id)
            return e

    def add(self, entry: OpenBlock) -> OpenBlock:
        """Cache a freshly opened entry and hand it out acquired; a racing open of the same
        inode wins and `entry`'s fd is closed."""
        with self._lock:
            old = self._open.get(entry.block_id)
            if old is not None and (old.dev, old.ino) == (entry.dev, entry.ino):
                old.refs += 1
                self._open.move_to_end(entry.block_id)
                os.close(entry.fd)
                return old
            if old is not None:
                self._uncache_locked(old)
            entry.refs = 1
            entry.cached = True
            self._open[entry.block_id] = entry
            while len(self._open) > self.max_open:
                self._uncache_locked(next(iter(self._open.values())))
            return entry

    def release(self, entries: Iterable[OpenBlock]) -> None:
        with self._lock:
            for e in entries:
                e.refs -= 1
                if e.refs == 0 and not e.cached:
                    os.close(e.fd)

    def invalidate(self, block_id: str) -> None:
        """Forget `block_id` (evicted, dropped, gone): its fd closes once no read uses it."""
        with self._lock:
            e = self._open.get(block_id)
            if e is not None:
                self._uncache_locked(e)

    def close(self) -> None:
        with self._lock:
            for e in list(self._open.values()):
                self._uncache_locked(e)

    def _uncache_locked(self, e: OpenBlock) -> None:
        del self._open[e.block_id]
        e.cached = False
        if e.refs == 0:
            os.close(e.fd)
