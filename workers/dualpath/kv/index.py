"""The store's index of the blocks in its directory: an LRU of ids and sizes, the bytes used,
and eviction beyond `capacity_bytes` (docs/design.md section 2).

Rebuilt on start from the directory's mtimes (oldest first), so recency survives a restart:
lookups and reads refresh a block's mtime (`touch`). Several processes may share a directory:
each indexes what it sees, and a block another process wrote is indexed when first asked for
(`present`). Dropping a block removes its file, invalidates its cached fd and announces it
(KV events) so the scheduler's block index stops offering it. A recency update or a removal
that fails is counted (`write_failed`) and the store goes on: it is a best-effort cache.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from dualpath.kv import errors, metrics
from dualpath.kv.events import KvEventBuffer
from dualpath.kv.files import OpenBlocks
from dualpath.kv.ids import BlockId, is_block_id

log = logging.getLogger(__name__)

_STALE_TMP_S = 600.0


class BlockIndex:
    """Thread-safe LRU index of one store directory (`lock` guards `lru` and `used`)."""

    def __init__(
        self,
        root: Path,
        capacity_bytes: int,
        files: OpenBlocks,
        events: KvEventBuffer | None,
        warn: errors.LogLimiter,
    ) -> None:
        self.root = root
        self.capacity_bytes = capacity_bytes
        self.events = events
        self.lock = threading.Lock()
        self.lru: OrderedDict[BlockId, int] = OrderedDict()  # id -> file bytes, oldest first
        self.used = 0
        self._blocks_dir = str(root / "blocks")
        self._files = files
        self._warn = warn

    def file(self, block_id: BlockId) -> str:
        return f"{self._blocks_dir}/{block_id[:2]}/{block_id}"

    def rebuild(self) -> None:
        found = []
        for shard in (self.root / "blocks").iterdir():
            if not shard.is_dir():
                continue
            for f in shard.iterdir():
                if is_block_id(f.name):
                    try:
                        st = f.stat()
                    except OSError:  # gone meanwhile, or unreadable: not a block we can use
                        continue
                    found.append((st.st_mtime_ns, f.name, st.st_size))
        now = time.time()
        for f in (self.root / "tmp").iterdir():
            try:  # temp files of writers that died; live writers finish well within this age
                if now - f.stat().st_mtime > _STALE_TMP_S:
                    f.unlink()
            except FileNotFoundError:
                pass
            except OSError as err:  # e.g. a read-only store: it still serves reads
                self.write_failed("evict", err, f"stale temp file {f}")
        found.sort()
        with self.lock:
            for _, name, size in found:
                self.lru[BlockId(name)] = size
                self.used += size
            self.evict_locked(keep=None)
            metrics.USED_BYTES.set(self.used)

    def present(self, block_id: BlockId) -> bool:
        with self.lock:
            if block_id in self.lru:
                return True
        try:  # written by another process sharing the directory
            size = os.stat(self.file(block_id)).st_size
        except OSError:  # not there, or not ours to read
            return False
        with self.lock:
            if block_id not in self.lru:
                self.lru[block_id] = size
                self.used += size
                self.evict_locked(keep=block_id)
                metrics.USED_BYTES.set(self.used)
        return True

    def touch(self, ids: Sequence[BlockId]) -> None:
        """Mark a chain prefix used. Deepest first, so a chain's first blocks end up the most
        recent: LRU then evicts chains from their tails and leaves no holes in what remains
        (a hole cuts every later block of the chain out of every hit)."""
        ids = ids[::-1]
        with self.lock:
            for b in ids:
                if b in self.lru:
                    self.lru.move_to_end(b)
        for b in ids:  # persist recency for the next start's rebuild (best effort)
            try:
                os.utime(self.file(b))
            except FileNotFoundError:
                pass
            except OSError as err:  # a read-only or full store still serves what it holds
                self.write_failed("touch", err, f"block {b}: refreshing its mtime")
                break

    def write_failed(self, op: str, err: OSError, what: str) -> None:
        """Count a failed write-side operation (op: block, touch, evict) and log it (limited)."""
        reason = errors.error_reason(err)
        metrics.WRITE_FAILURES.labels(op=op, reason=reason).inc()
        self._warn.warning(
            f"{op}:{reason}", "KV store %s: %s failed (%s): %s", self.root, what, reason, err
        )

    def evict_locked(self, keep: BlockId | None, room: int = 0) -> None:
        """Evict least recently used blocks (never `keep`) until `room` more bytes fit."""
        while self.used + room > self.capacity_bytes and self.lru:
            victim = next(iter(self.lru))
            if victim == keep:
                self.lru.move_to_end(victim)
                if len(self.lru) == 1:
                    break
                continue
            self.drop_locked(victim)
            metrics.EVICTIONS.inc()
            log.debug("evicted block %s", victim)

    def make_room(self, keep: BlockId, nbytes: int) -> None:
        """Evict to capacity so `nbytes` more fit (before a write)."""
        with self.lock:
            self.evict_locked(keep=keep, room=nbytes)
            metrics.USED_BYTES.set(self.used)

    def add(self, block_id: BlockId, nbytes: int) -> None:
        """A block was written: indexed as the most recent, then evict beyond capacity."""
        with self.lock:
            if block_id not in self.lru:
                self.lru[block_id] = nbytes
                self.used += nbytes
            self.lru.move_to_end(block_id)
            self.evict_locked(keep=block_id)
            metrics.USED_BYTES.set(self.used)

    def drop(self, block_id: BlockId) -> None:
        with self.lock:
            self.drop_locked(block_id)

    def drop_locked(self, block_id: BlockId) -> None:
        size = self.lru.pop(block_id, None)
        if size is not None:
            self.used -= size
        self._files.invalidate(block_id)
        try:
            self._unlink(block_id)
        except FileNotFoundError:
            pass
        if self.events is not None:
            self.events.removed_ids((block_id,))

    def _unlink(self, block_id: BlockId) -> None:
        """Remove a block's file; a failure other than its absence is counted, and the index
        forgets the block all the same (the file is left for a store that can remove it)."""
        try:
            os.unlink(self.file(block_id))
        except FileNotFoundError:
            raise
        except OSError as err:
            self.write_failed("evict", err, f"block {block_id}: removing it")

    def forget_missing(self, block_id: BlockId) -> None:
        """A read found the block's file gone (another process removed it): forget it."""
        with self.lock:
            size = self.lru.pop(block_id, None)
            if size is not None:
                self.used -= size
            self._files.invalidate(block_id)
            if self.events is not None:  # gone: the index must stop offering it
                self.events.removed_ids((block_id,))
            metrics.USED_BYTES.set(self.used)

    def drop_bad(self, block_id: BlockId) -> None:
        """A read found the block bad: remove it so the next turn rewrites it."""
        with self.lock:
            self.drop_locked(block_id)
            metrics.EVICTIONS.inc()
            metrics.USED_BYTES.set(self.used)

    def evict_for_space(self, nbytes: int, keep: BlockId) -> int:
        """The disk is full below capacity_bytes (other data, other writers): evict least
        recently used blocks worth `nbytes`; how many were evicted."""
        freed = evicted = 0
        with self.lock:
            for victim in list(self.lru):
                if freed >= nbytes:
                    break
                if victim == keep:
                    continue
                freed += self.lru[victim]
                self.drop_locked(victim)
                metrics.EVICTIONS.inc()
                evicted += 1
            metrics.USED_BYTES.set(self.used)
        self._warn.warning(
            "no_space_evict",
            "KV store %s full (no space): evicted %d blocks (%d bytes) to make room",
            self.root,
            evicted,
            freed,
        )
        return evicted

    def evict(self, block_id: BlockId) -> None:
        with self.lock:
            self.drop_locked(block_id)
            metrics.USED_BYTES.set(self.used)

    def promote_chain(self, ids: Sequence[BlockId]) -> None:
        """A turn's chain, deepest first (see `touch`): its tails go first."""
        with self.lock:
            for b in reversed(ids):
                if b in self.lru:
                    self.lru.move_to_end(b)

    def held_from(self, ids: Sequence[BlockId], end: int) -> int:
        """Where the unbroken run of indexed blocks ending at `ids[end - 1]` starts."""
        with self.lock:
            for i in range(end - 1, -1, -1):
                if ids[i] not in self.lru:
                    return i + 1
        return 0
