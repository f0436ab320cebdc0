"""Block writes (docs/design.md section 2): checked, checksummed, atomic, indexed and announced.

A block goes to `<root>/tmp/` first and is renamed into place after fsync (`durable`), so a
reader sees a whole block or none. Room is made first (capacity); a write that finds the disk
full evicts least recently used blocks and tries once more; a write that fails is counted and
raised. Each stored block is announced as a KV event (`put_tokens`: the chain with its links).
"""

from __future__ import annotations

import contextlib
import errno
import os
import uuid
from collections.abc import Sequence
from pathlib import Path

from dualpath.config import ModelSpec
from dualpath.kv import errors, metrics
from dualpath.kv.buffers import LayerKV, as_bytes, check_block, covered_blocks
from dualpath.kv.events import chain_events
from dualpath.kv.format import BlockLayout, encode_header, layer_checksum
from dualpath.kv.ids import BlockId, block_ids
from dualpath.kv.index import BlockIndex


class BlockWriter:
    """Writes the blocks of one store directory, keeping its index."""

    def __init__(
        self, root: Path, model: ModelSpec, layout: BlockLayout, index: BlockIndex, durable: bool
    ) -> None:
        self.root = root
        self.model = model
        self.layout = layout
        self.index = index
        self.durable = durable

    def put(self, block_id: BlockId, layers: Sequence[LayerKV], announce: bool = True) -> bool:
        """Write one block (per layer K, V of (block_tokens, heads, dim)); False if present.

        `announce`: publish a stored event without a chain link (put_tokens announces its
        blocks with their links instead)."""
        written = self._put(block_id, layers)
        events = self.index.events
        if announce and events is not None:
            # a block already present is announced too: it heals an index that lost the event
            # of its first write
            events.stored_ids((block_id,))
        return written

    def _put(self, block_id: BlockId, layers: Sequence[LayerKV]) -> bool:
        check_block(self.layout, block_id, layers)
        index = self.index
        if index.present(block_id):
            if os.path.exists(index.file(block_id)):
                index.touch([block_id])
                return False
            # indexed here but dropped by another process sharing the directory (evicted, or
            # found bad by its reader): forget it and write it again, so the store heals
            index.drop(block_id)
        bufs = []
        checksums = []
        for k, v in layers:
            kb = as_bytes(k.detach().cpu().contiguous())
            vb = as_bytes(v.detach().cpu().contiguous())
            checksums.append(layer_checksum(kb.numpy().data, vb.numpy().data))
            bufs += [kb, vb]
        header = encode_header(self.layout, block_id, checksums)
        self._write_or_make_room(block_id, header, bufs)
        size = self.layout.file_bytes
        index.add(block_id, size)
        metrics.WRITE_BYTES.inc(size)
        metrics.BLOCKS_WRITTEN.inc()
        return True

    def _write_or_make_room(self, block_id: BlockId, header: bytes, bufs: list) -> None:
        """Write a block file, making room first (capacity) and, when the disk is full anyway,
        evicting least recently used blocks and trying once more; a failure is counted, raised."""
        size = self.layout.file_bytes
        index = self.index
        index.make_room(block_id, size)
        try:
            self._write_file(block_id, header, bufs)
            return
        except OSError as err:
            if errors.error_reason(err) != "no_space" or not index.evict_for_space(size, block_id):
                index.write_failed("block", err, f"block {block_id}: writing it")
                raise
        try:
            self._write_file(block_id, header, bufs)
        except OSError as err:
            index.write_failed("block", err, f"block {block_id}: writing it after evicting")
            raise

    def _write_file(self, block_id: BlockId, header: bytes, bufs: list) -> None:
        final = Path(self.index.file(block_id))
        tmp = self.root / "tmp" / f"{block_id}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            try:
                _write_all(fd, memoryview(header))
                for b in bufs:
                    _write_all(fd, memoryview(b.numpy()))
                if self.durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
            final.parent.mkdir(exist_ok=True)
            os.rename(tmp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise
        if self.durable:
            dfd = os.open(final.parent, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

    def put_tokens(
        self,
        tokens: Sequence[int],
        kv_layers: Sequence[LayerKV],
        kv_start_token: int = 0,
        salt: bytes = b"",
    ) -> list[BlockId]:
        """Write the full blocks of `tokens` whose KV `kv_layers` covers; returns written ids
        (the chain under the request's cache `salt`, see `ids.block_ids`).

        `kv_layers[l]` = (K, V) of shape (tokens covered, heads, dim) for tokens
        `tokens[kv_start_token:]` (e.g. a turn's new tokens). Blocks not fully covered are
        skipped; blocks already present are not rewritten.
        """
        ids = block_ids(tokens, self.model, salt=salt)
        end, blocks = covered_blocks(len(ids), kv_layers, kv_start_token, self.layout.block_tokens)
        written = [ids[i] for i, blk in blocks if self._put(ids[i], blk)]
        self.index.promote_chain(ids[:end])
        events = self.index.events
        if events is not None and end:
            # the whole chain with its links: the blocks written here, and the prefix this
            # process still holds (it links keys a scan found, and heals lost events)
            events.stored(chain_events(ids, end, self.index.held_from(ids, end)))
        return written


def _write_all(fd: int, view: memoryview) -> None:
    view = view.cast("B")
    while view:
        n = os.write(fd, view)
        if n <= 0:
            raise OSError(errno.EIO, "write returned 0")
        view = view[n:]
