"""The in-memory store keeps the BlockStore contract the file store keeps: the same cases run
against both, through the real read queue, so the fake cannot drift from what it stands for."""

from __future__ import annotations

import asyncio
import errno

import pytest
import torch
from dualpath.config import ModelSpec
from dualpath.kv import KVLoadError, KVStore, ReadQueue, block_ids
from dualpath.kv.buffers import random_layers, request_layer_views
from dualpath.kv.memory import MemoryStore
from dualpath.kv.protocol import BlockStore

BT = 16


@pytest.fixture
def model() -> ModelSpec:
    return ModelSpec(preset="tiny", block_tokens=BT)


class _FileFaults:
    """The memory store's fault calls, done to block files."""

    def __init__(self, store: KVStore) -> None:
        self.store = store

    def corrupt(self, block_id, layer=0):  # noqa: ANN001
        f = self.store.path_of(block_id)
        raw = bytearray(f.read_bytes())
        raw[self.store.layout.layer_offset(layer)] ^= 0xFF
        f.write_bytes(bytes(raw))

    def remove(self, block_id):  # noqa: ANN001
        self.store.path_of(block_id).unlink()


@pytest.fixture(params=["memory", "file"])
def store(request, model, tmp_path):
    if request.param == "memory":
        s = MemoryStore(model)
        s.faults = s
    else:
        s = KVStore(tmp_path / "kv", model, 1 << 30, backend="preadv")
        s.faults = _FileFaults(s)
    yield s
    s.close()


def _context(store: BlockStore, blocks: int, seed: int = 0):
    """A context's tokens and per-layer (K, V) of `blocks` full blocks plus 3 tokens."""
    lo = store.layout
    tokens = [(seed * 31 + i) % 400 + 4 for i in range(blocks * BT + 3)]
    gen = torch.Generator().manual_seed(seed)
    per_block = [random_layers(lo, gen) for _ in range(blocks)]
    kv = [
        (torch.cat([b[i][0] for b in per_block]), torch.cat([b[i][1] for b in per_block]))
        for i in range(lo.layers)
    ]
    return tokens, kv


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


async def _read(store: BlockStore, ids, read_timeout_s: float = 5.0):
    with ReadQueue(store, concurrency=2, read_timeout_s=read_timeout_s) as queue:
        handle = queue.submit(ids)
        try:
            valid = await handle.ready()
            layers = [await handle.layer(i) for i in range(store.layout.layers)]
            return valid, layers, handle.failed
        finally:
            handle.close()


async def test_what_put_tokens_stores_reads_back_bit_exact(store):
    tokens, kv = _context(store, 3)
    written = store.put_tokens(tokens, kv)
    ids = block_ids(tokens, store.model)
    assert written == ids[:3] and store.lookup(ids) == 3
    assert store.put_tokens(tokens, kv) == []  # present: not written again
    valid, layers, failed = await _read(store, ids[:3])
    assert valid == 3 and failed == []
    for (k, v), (k0, v0) in zip(layers, kv, strict=True):  # bit patterns (NaNs too)
        assert torch.equal(_u8(k), _u8(k0[: 3 * BT])) and torch.equal(_u8(v), _u8(v0[: 3 * BT]))


async def test_put_tokens_from_a_start_token_skips_what_it_does_not_cover(store):
    tokens, kv = _context(store, 3)
    new_kv = [(k[BT:], v[BT:]) for k, v in kv]  # a turn's KV from token BT on
    ids = block_ids(tokens, store.model)
    assert store.put_tokens(tokens, new_kv, kv_start_token=BT) == ids[1:3]
    assert store.lookup(ids) == 0  # block 0 was never written: no prefix
    assert {block_ids(tokens, store.model, salt=b"t")[0]} & set(ids) == set()


async def test_a_corrupt_block_ends_the_hit_and_is_dropped(store):
    tokens, kv = _context(store, 3)
    store.put_tokens(tokens, kv)
    ids = block_ids(tokens, store.model)[:3]
    store.faults.corrupt(ids[1], layer=1)
    with pytest.raises(KVLoadError) as err:
        await _read(store, ids)
    assert err.value.valid_blocks == 1
    assert [(f.block_id, f.reason) for f in err.value.failed] == [(ids[1], "checksum")]
    assert store.lookup(ids) == 1  # dropped: the next turn writes it again


async def test_a_vanished_block_is_a_missing_miss_at_open(store):
    tokens, kv = _context(store, 3)
    store.put_tokens(tokens, kv)
    ids = block_ids(tokens, store.model)[:3]
    store.faults.remove(ids[2])
    valid, layers, failed = await _read(store, ids)
    assert valid == 2 and [(f.block_id, f.reason) for f in failed] == [(ids[2], "missing")]
    assert layers[0][0].shape[0] == 2 * BT


async def test_read_errors_and_stuck_reads_end_the_hit_by_their_reason(model):
    store = MemoryStore(model)
    tokens, kv = _context(store, 2)
    store.put_tokens(tokens, kv)
    ids = block_ids(tokens, model)[:2]
    store.fail_reads(ids[1], OSError(errno.EIO, "Input/output error"))
    with pytest.raises(KVLoadError) as err:
        await _read(store, ids)
    assert err.value.valid_blocks == 1 and err.value.failed[0].reason == "io_error"
    store.heal(ids[1])
    release = store.hold(ids[0])
    queue = ReadQueue(store, concurrency=2, read_timeout_s=0.3)
    handle = queue.submit(ids)
    try:
        with pytest.raises(KVLoadError) as err:
            await handle.layer(0)
    finally:
        release.set()  # the stuck read returns; then the queue's threads can stop
        handle.close()
        queue.close()
    assert err.value.valid_blocks == 0 and err.value.failed[0].reason == "timeout"
    assert store.misses["io_error"] >= 1 and store.misses["timeout"] == 1
    assert store.lookup(ids) == 2  # an I/O error leaves the block alone


def test_a_block_that_does_not_fit_the_layout_is_refused(store):
    tokens, kv = _context(store, 1)
    bad = [(k[:, :1], v) for k, v in kv]
    with pytest.raises(ValueError, match="layer 0 K: expected"):
        store.put_tokens(tokens, bad)


def test_request_layer_views_read_what_the_queue_laid_out(store):
    # the memory store fills the same layer-major request buffer as the file store
    lo = store.layout
    buf = torch.zeros(lo.payload_bytes * 2, dtype=torch.uint8)
    k, v = request_layer_views(buf, lo, 2, 0)
    assert k.shape == (2 * BT, lo.k_heads, lo.k_dim) and v.shape[0] == 2 * BT


async def test_a_hold_of_some_reads_holds_those_and_lets_the_later_ones_pass(model):
    store = MemoryStore(model)
    tokens, kv = _context(store, 1)
    store.put_tokens(tokens, kv)
    ids = block_ids(tokens, model)[:1]
    release = store.hold(ids[0], reads=1)
    queue = ReadQueue(store, concurrency=2, read_timeout_s=5.0)
    held = queue.submit(ids)
    try:
        for _ in range(200):  # the first read waits on the hold
            if store.waiting(ids[0]):
                break
            await asyncio.sleep(0.01)
        assert store.waiting(ids[0]) == 1 and held.busy
        valid, layers, _ = await _read(store, ids)  # a later read passes
        assert valid == 1 and torch.equal(_u8(layers[0][0]), _u8(kv[0][0][:BT]))
        assert held.busy  # the first is still held
    finally:
        release.set()
    await held.done()
    for _ in range(500):  # its last layer is delivered just before its pool thread returns
        if not held.busy:
            break
        await asyncio.sleep(0.01)
    assert not held.busy and store.waiting(ids[0]) == 0
    with pytest.raises(ValueError, match="reads must be >= 1"):
        store.hold(ids[0], reads=0)
    queue.close()
