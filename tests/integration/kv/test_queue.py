"""The per-node read queue: the per-layer KV source contract, pending bytes, SNIC cap."""

import asyncio
import os
import threading

import pytest
import torch
from dualpath.kv import KVLoadError, ReadQueue, request_buffer_bytes
from dualpath.kv.backend import PreadvBackend
from fake_clock import FakeClock


class GatedBackend(PreadvBackend):
    """preadv that waits for a gate: lets a test look at the queue mid-read."""

    def __init__(self) -> None:
        self.gate = threading.Event()

    def read(self, batch):
        assert self.gate.wait(timeout=30)
        super().read(batch)

    def read_run(self, fd, views, offset):
        assert self.gate.wait(timeout=30)
        super().read_run(fd, views, offset)


def gated_store(tmp_path, tiny, kvh, blocks):
    """A store whose reads wait for `backend.gate`, filled with `blocks` blocks."""
    from dualpath.kv import KVStore

    backend = GatedBackend()
    store = KVStore(tmp_path / "kv", tiny, 1 << 30, backend=backend)
    ids, data = kvh.fill(store, blocks)
    return backend, store, ids, data


def corrupt_layer(store, block_id, layer):
    """Flip two bytes inside one layer of a stored block: its checksum no longer matches."""
    with open(store.path_of(block_id), "r+b") as f:
        f.seek(store.layout.layer_offset(layer) + 7)
        f.write(b"\xff\xfe")


async def test_layer_source_contract_round_trips(make_store, kvh):
    store = make_store()
    ids, blocks = kvh.fill(store, 5)
    with ReadQueue(store, concurrency=3, chunk_blocks=2) as q:
        handle = q.submit(ids)
        assert await handle.ready() == 5
        for layer in reversed(range(store.layout.layers)):  # any order works
            k, v = await handle.layer(layer)
            assert k.shape == (5 * 64, 2, 16) and v.shape == (5 * 64, 2, 16)
            assert torch.equal(kvh.u8(k), kvh.u8(torch.cat([b[layer][0] for b in blocks])))
            assert torch.equal(kvh.u8(v), kvh.u8(torch.cat([b[layer][1] for b in blocks])))
        assert q.pending_bytes == 0
        assert q.read_bytes == 5 * store.layout.payload_bytes
        handle.close()
    # the request's run handed its fds back to the store's cache (none held, none leaked)
    assert len(store._files) == 5
    assert all(e.refs == 0 for e in store._files._open.values())


async def test_arrived_is_the_layer_once_read_and_never_blocks(tmp_path, tiny, kvh):
    # the prefill's compute thread polls arrived(); only wait_arrival, on the loop, waits
    backend, store, ids, blocks = gated_store(tmp_path, tiny, kvh, 3)
    with ReadQueue(store, concurrency=1, chunk_blocks=3) as q:
        h = q.submit(ids)
        assert h.arrived(0) == ([], False)  # the gate is closed: nothing read, no wait
        backend.gate.set()
        await h.wait_arrival(0, 0)
        got, complete = h.arrived(0)
        assert complete and len(got) == 1
        assert torch.equal(kvh.u8(got[0][0]), kvh.u8(torch.cat([b[0][0] for b in blocks])))
        h.close()


async def test_arrived_hides_a_failed_layer_and_wait_arrival_raises(make_store, kvh):
    store = make_store()
    ids, _ = kvh.fill(store, 2)
    corrupt_layer(store, ids[1], 1)
    with ReadQueue(store, concurrency=1, chunk_blocks=2) as q:
        h = q.submit(ids)
        with pytest.raises(KVLoadError):
            await h.wait_arrival(1, 0)
        assert h.arrived(1) == ([], False)
        assert h.arrived(0)[1]
        h.close()


async def test_read_into_caller_buffer(make_store, kvh):
    store = make_store()
    ids, blocks = kvh.fill(store, 3)
    buf = torch.zeros(request_buffer_bytes(store.layout, 3), dtype=torch.uint8)
    with ReadQueue(store, concurrency=2) as q:
        r = await q.read_into(ids, buf)
    assert r.valid_blocks == 3 and r.buffer.data_ptr() == buf.data_ptr()
    k, v = r.layer(1)
    assert torch.equal(kvh.u8(v[64:128]), kvh.u8(blocks[1][1][1]))


def test_pending_bytes_observable_and_drop_as_read(tmp_path, tiny, kvh):
    backend, store, ids, _ = gated_store(tmp_path, tiny, kvh, 4)
    with ReadQueue(store, concurrency=1, chunk_blocks=4) as q:
        h = q.submit(ids)
        total = 4 * store.layout.payload_bytes
        assert q.pending_bytes == total
        assert h._ready.result(timeout=30) == 4
        assert q.pending_bytes == total  # nothing read yet: the gate is closed
        backend.gate.set()
        h.wait(timeout=30)
        assert q.pending_bytes == 0


async def test_close_drops_queued_reads_and_releases_pending(tmp_path, tiny, kvh):
    backend, store, ids, _ = gated_store(tmp_path, tiny, kvh, 4)
    q = ReadQueue(store, concurrency=1, chunk_blocks=1)
    try:
        h = q.submit(ids)
        await h.ready()
        h.close()
        backend.gate.set()
        with pytest.raises(asyncio.CancelledError):
            await h.layer(3)
        q.close()
        assert q.pending_bytes == 0
        assert all(e.refs == 0 for e in store._files._open.values())  # cancelled: run closed
    finally:
        backend.gate.set()
        q.close()


async def test_invalid_block_shortens_prefix(make_store, kvh):
    store = make_store()
    ids, blocks = kvh.fill(store, 4)
    os.truncate(store.path_of(ids[2]), 100)
    with ReadQueue(store, concurrency=2) as q:
        h = q.submit(ids)
        assert await h.ready() == 2
        assert h.failed[0].reason == "truncated" and h.hit_tokens == 128
        k, _ = await h.layer(0)
        assert torch.equal(kvh.u8(k), kvh.u8(torch.cat([b[0][0] for b in blocks[:2]])))
        assert (await h.done()).valid_blocks == 2
        assert q.pending_bytes == 0


async def test_corrupt_layer_raises_load_error_with_valid_prefix(make_store, kvh):
    store = make_store()
    ids, _ = kvh.fill(store, 4)
    corrupt_layer(store, ids[3], 1)
    with ReadQueue(store, concurrency=1, chunk_blocks=4) as q:
        h = q.submit(ids)
        await h.layer(0)
        with pytest.raises(KVLoadError) as e:
            await h.layer(1)
        assert e.value.valid_blocks == 3 and e.value.failed[0].block_id == ids[3]
        assert h.result().valid_blocks == 3
        h.close()


def test_snic_cap_accounting_on_injected_clock(make_store, kvh):
    store = make_store()
    ids, _ = kvh.fill(store, 8)
    clock = FakeClock()
    with ReadQueue(
        store, concurrency=1, snic_gbps=0.01, chunk_blocks=1, clock=clock, sleep=clock.sleep
    ) as q:
        q.submit(ids).wait(timeout=60)
        nbytes = 8 * store.layout.payload_bytes
        assert q.bucket.granted_bytes == nbytes
        measured_gbps = nbytes * 8 / clock.t / 1e9
        # debt-based bucket: elapsed = (bytes - burst) / rate, so the cap holds to the burst
        assert clock.t == pytest.approx((nbytes - q.bucket.burst) / q.bucket.rate)
        assert 0.01 <= measured_gbps <= 0.01 * 1.2


@pytest.mark.parametrize("max_group", [1, 2, 4])
async def test_layer_groups_read_the_same_bytes(tmp_path, kvh, max_group):
    from dualpath.config import ModelSpec
    from dualpath.kv import KVStore

    model = ModelSpec(preset="tiny", layers=9, block_tokens=8)  # groups 1, 1, 2, 4, 1
    store = KVStore(tmp_path / "kv", model, 1 << 30, backend="preadv")
    ids, blocks = kvh.fill(store, 5)
    with ReadQueue(store, concurrency=2, chunk_blocks=2, max_group_layers=max_group) as q:
        handle = q.submit(ids)
        for layer in range(model.layers):
            k, v = await handle.layer(layer)
            assert torch.equal(kvh.u8(k), kvh.u8(torch.cat([b[layer][0] for b in blocks])))
            assert torch.equal(kvh.u8(v), kvh.u8(torch.cat([b[layer][1] for b in blocks])))
        assert q.pending_bytes == 0
    store.close()


async def test_corrupt_layer_inside_a_group_keeps_the_valid_prefix(tmp_path, kvh):
    from dualpath.config import ModelSpec
    from dualpath.kv import KVStore

    model = ModelSpec(preset="tiny", layers=8, block_tokens=8)  # layer 5 is in group [4, 8)
    store = KVStore(tmp_path / "kv", model, 1 << 30, backend="preadv")
    ids, _ = kvh.fill(store, 4)
    lo = store.layout
    with open(store.path_of(ids[2]), "r+b") as f:  # flip a byte of block 2, layer 5, V
        off = lo.layer_offset(5) + lo.k_bytes + 3
        f.seek(off)
        byte = f.read(1)
        f.seek(off)
        f.write(bytes([byte[0] ^ 0xFF]))
    with ReadQueue(store, concurrency=2, max_group_layers=4) as q:
        handle = q.submit(ids)
        with pytest.raises(KVLoadError) as err:
            for layer in range(model.layers):
                await handle.layer(layer)
        assert err.value.valid_blocks == 2
        assert err.value.failed[0].block_id == ids[2]
        assert err.value.failed[0].reason == "checksum"
    store.close()
