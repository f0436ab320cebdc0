"""An in-memory `BlockStore`: blocks in a dict, verified on every read as the file store does.

    store = MemoryStore(model)
    store.put_tokens(tokens, kv_layers)                 # chained ids, as KVStore writes them
    queue = ReadQueue(store)                            # the real read queue over it
    store.corrupt(ids[1]); store.remove(ids[2])         # faults a test sets
    store.fail_reads(ids[0], OSError(errno.EIO, "EIO")); store.hold(ids[0])

A block keeps its payload in the file store's layer-major layout and a checksum per layer
(`kv.format.layer_checksum`). Reads open a run (a block gone ends it: `missing`), then copy and
verify each layer they read: a checksum that fails ends the valid prefix (`checksum`) and drops
the block, an injected read error ends it by its reason (`kv.errors.error_reason`) and leaves
the block; `hold` makes reads of a block wait until released (a stuck mount: the read queue's
`read_timeout_s` then ends the wait as a `timeout` miss), or only its next few reads (one slow
read among fast ones), and `waiting` tells how many reads of it wait now. Misses are counted by reason in
`misses`. There is no capacity or eviction: a test sizes what it stores.

It lives in the runtime package, not under tests/, because it is the contract's second
implementation (as LMCache's in-memory backend is): any package's tests and tools that run the
read queue or the workers without a disk import it; the import-linter contracts keep the runtime
itself from using it.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dualpath.config import ModelSpec
from dualpath.kv import errors
from dualpath.kv.buffers import (
    BlockFailure,
    LayerKV,
    as_bytes,
    check_block,
    check_layers_read,
    covered_blocks,
)
from dualpath.kv.format import BlockLayout, layer_checksum
from dualpath.kv.ids import BlockId, block_ids, block_key

_HOLD_MAX_S = 120.0  # a held read gives up eventually, so a forgotten release cannot hang a test


@dataclass
class _Block:
    payload: torch.Tensor  # uint8, per layer K then V (the file store's layout, no header)
    checksums: list[int]


@dataclass
class MemoryRun:
    """`BlockRun` of a `MemoryStore`: the valid prefix's ids and the failure that ended it."""

    ids: list[BlockId] = field(default_factory=list)
    failed: list[BlockFailure] = field(default_factory=list)
    blocks: list[_Block] = field(default_factory=list)  # held: a later remove() is not seen
    closed: bool = False

    @property
    def valid_blocks(self) -> int:
        return len(self.ids)

    def close(self) -> None:
        self.closed = True

    def __enter__(self) -> MemoryRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class MemoryStore:
    """Thread-safe `BlockStore` of one model, in memory, with faults to inject."""

    def __init__(self, model: ModelSpec) -> None:
        self.model = model
        self.layout = BlockLayout.from_model(model)
        self.misses: Counter[str] = Counter()  # reason -> count
        self._blocks: dict[BlockId, _Block] = {}
        self._read_errors: dict[BlockId, BaseException] = {}
        self._holds: dict[BlockId, threading.Event] = {}
        self._hold_reads: dict[BlockId, int] = {}  # held block -> reads it still holds
        self._waiting: Counter[BlockId] = Counter()  # held block -> reads waiting now
        self._hold_events: list[threading.Event] = []  # every hold's (close releases them)
        self._lock = threading.Lock()

    # ---- faults -------------------------------------------------------------------------------

    def corrupt(self, block_id: BlockId, layer: int = 0) -> None:
        """Flip a byte of `layer`'s data: its checksum fails on the next read."""
        self.layout.layer_offset(layer)  # refuses a bad layer
        self._blocks[block_id].payload[layer * self.layout.layer_bytes] ^= 0xFF

    def remove(self, block_id: BlockId) -> None:
        """The block vanishes behind the index's back (another process evicted it)."""
        with self._lock:
            self._blocks.pop(block_id, None)

    def fail_reads(self, block_id: BlockId, err: BaseException) -> None:
        """Every read of the block's data raises `err` until `heal`."""
        self._read_errors[block_id] = err

    def hold(self, block_id: BlockId, reads: int | None = None) -> threading.Event:
        """Reads of the block's data wait until the returned event is set (a stuck mount);
        with `reads`, only the next `reads` reads of it wait, later ones pass."""
        if reads is not None and reads < 1:
            raise ValueError("reads must be >= 1 (None: every read until released)")
        with self._lock:
            ev = self._holds[block_id] = threading.Event()
            self._hold_events.append(ev)
            if reads is None:
                self._hold_reads.pop(block_id, None)
            else:
                self._hold_reads[block_id] = reads
        return ev

    def waiting(self, block_id: BlockId) -> int:
        """Reads of the block waiting on its hold now."""
        with self._lock:
            return self._waiting[block_id]

    def heal(self, block_id: BlockId) -> None:
        self._read_errors.pop(block_id, None)
        with self._lock:
            ev = self._holds.pop(block_id, None)
            self._hold_reads.pop(block_id, None)
        if ev is not None:
            ev.set()

    def _wait_hold(self, block_id: BlockId) -> None:
        """A read of the block waits here while the block is held for it."""
        with self._lock:
            ev = self._holds.get(block_id)
            if ev is None:
                return
            left = self._hold_reads.get(block_id)
            if left is not None:  # the last counted read: later ones pass
                if left <= 1:
                    del self._holds[block_id], self._hold_reads[block_id]
                else:
                    self._hold_reads[block_id] = left - 1
            self._waiting[block_id] += 1
        try:
            ev.wait(_HOLD_MAX_S)
        finally:
            with self._lock:
                self._waiting[block_id] -= 1

    # ---- the BlockStore contract ----------------------------------------------------------------

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._blocks

    def lookup(self, ids: Sequence[BlockId]) -> int:
        hits = 0
        for b in ids:
            if b not in self._blocks:
                break
            hits += 1
        return hits

    def open_run(self, ids: Sequence[BlockId]) -> MemoryRun:
        run = MemoryRun()
        for b in ids:
            block = self._blocks.get(b)
            if block is None:
                run.failed.append(self._miss(b, "missing"))
                break
            run.ids.append(b)
            run.blocks.append(block)
        return run

    def read_run_layers_into(
        self,
        run: MemoryRun,
        l0: int,
        l1: int,
        a: int,
        b: int,
        dests: Sequence[tuple[torch.Tensor, torch.Tensor]],
    ) -> tuple[int, list[BlockFailure]]:
        lo = self.layout
        check_layers_read(lo, run.valid_blocks, l0, l1, a, b, dests)
        kb, vb = lo.k_bytes, lo.v_bytes
        for i, (block_id, block) in enumerate(zip(run.ids[a:b], run.blocks[a:b], strict=True)):
            self._wait_hold(block_id)
            err = self._read_errors.get(block_id)
            if err is not None:
                return i, [self.fail_read(block_id, err)]
            for j, layer in enumerate(range(l0, l1)):
                base = layer * lo.layer_bytes
                k, v = dests[j][0][i * kb : (i + 1) * kb], dests[j][1][i * vb : (i + 1) * vb]
                k.copy_(block.payload[base : base + kb])
                v.copy_(block.payload[base + kb : base + kb + vb])
                if layer_checksum(k.numpy().data, v.numpy().data) != block.checksums[layer]:
                    with self._lock:
                        self._blocks.pop(block_id, None)  # dropped: the next turn rewrites it
                    return i, [self._miss(block_id, "checksum")]
        return b - a, []

    def fail_read(self, block_id: BlockId, err: BaseException) -> BlockFailure:
        return self._miss(block_id, errors.error_reason(err))

    def put(self, block_id: BlockId, layers: Sequence[LayerKV]) -> bool:
        """Store one block; False if present."""
        check_block(self.layout, block_id, layers)
        if block_id in self._blocks:
            return False
        parts, checksums = [], []
        for k, v in layers:
            kb, vb = (
                as_bytes(k.detach().cpu().contiguous()),
                as_bytes(v.detach().cpu().contiguous()),
            )
            checksums.append(layer_checksum(kb.numpy().data, vb.numpy().data))
            parts += [kb, vb]
        with self._lock:
            self._blocks[block_id] = _Block(torch.cat(parts), checksums)
        return True

    def put_tokens(
        self,
        tokens: Sequence[int],
        kv_layers: Sequence[LayerKV],
        kv_start_token: int = 0,
        salt: bytes = b"",
    ) -> list[BlockId]:
        ids = block_ids(tokens, self.model, salt=salt)
        _, blocks = covered_blocks(len(ids), kv_layers, kv_start_token, self.layout.block_tokens)
        return [ids[i] for i, blk in blocks if self.put(ids[i], blk)]

    def scan_keys(self) -> list[int]:
        return [block_key(b) for b in list(self._blocks)]

    def close(self) -> None:
        for ev in self._hold_events:
            ev.set()

    def _miss(self, block_id: BlockId, reason: str) -> BlockFailure:
        with self._lock:
            self.misses[reason] += 1
        return BlockFailure(block_id, reason)
