"""The in-memory transfer engine keeps the KVTransfer contract the NIXL engine keeps
(tests/integration/transfer/test_engine.py runs the same cases against NIXL)."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from dualpath.transfer.fake import MemoryFabric, MemoryTransfer
from dualpath.transfer.protocol import KVTransfer, TransferError


@pytest.fixture
async def pair():
    fabric = MemoryFabric()
    a = MemoryTransfer("a", 4 << 20, fabric, deadline_s=5).start()
    b = MemoryTransfer("b", 4 << 20, fabric, deadline_s=5).start()
    yield fabric, a, b
    await a.aclose()
    await b.aclose()


def test_it_is_a_kv_transfer():
    engine: KVTransfer = MemoryTransfer("x", 1 << 20, MemoryFabric())
    assert engine.name.startswith("x-") and engine.metadata


async def test_write_lands_bit_exact_with_one_notification_per_layer(pair):
    _, a, b = pair
    name = a.add_peer(b.metadata)
    assert a.knows(name) and name == b.name
    region = a.pool.alloc(1 << 20)
    region.tensor.copy_(torch.randint(0, 256, (1 << 20,), dtype=torch.uint8))
    dst = b.pool.alloc(1 << 20)
    layer = 1 << 18
    await asyncio.gather(
        *(
            a.write(
                name, region.address + i * layer, layer, dst.address + i * layer, f"r1/{i}".encode()
            )
            for i in range(4)
        )
    )
    for i in range(4):
        await b.wait_notif(a.name, f"r1/{i}".encode(), deadline_s=1)
    assert torch.equal(dst.tensor, region.tensor)
    assert a.stats.writes == 4 and a.stats.bytes_written == 1 << 20 and a.stats.inflight == 0


async def test_a_missing_notification_fails_at_its_deadline_and_discard_forgets(pair):
    _, a, b = pair
    name = a.add_peer(b.metadata)
    region, dst = a.pool.alloc(4096), b.pool.alloc(4096)
    await a.write(name, region.address, 4096, dst.address, b"r2/x")
    b.discard_notifs(b"r2/")
    t0 = time.monotonic()
    with pytest.raises(TransferError, match="did not arrive"):
        await b.wait_notif(a.name, b"r2/x", deadline_s=0.2)
    assert time.monotonic() - t0 < 2


async def test_a_dead_peer_fails_the_write_and_is_dropped(pair):
    fabric, a, b = pair
    name = a.add_peer(b.metadata)
    region = a.pool.alloc(4096)
    fabric.kill(b.name)
    with pytest.raises(TransferError, match=name):
        await a.write(name, region.address, 4096, b.pool.address)
    assert not a.knows(name) and a.stats.failed == 1
    with pytest.raises(TransferError, match="unknown KV peer"):
        await a.write(name, region.address, 4096, b.pool.address)


async def test_a_hung_peer_fails_the_write_at_its_deadline(pair):
    fabric, a, b = pair
    name = a.add_peer(b.metadata)
    region = a.pool.alloc(4096)
    fabric.hang(b.name)
    t0 = time.monotonic()
    with pytest.raises(TransferError, match="deadline") as caught:
        await a.write(name, region.address, 4096, b.pool.address, deadline_s=0.2)
    assert 0.15 < time.monotonic() - t0 < 2 and not a.knows(name)
    assert not caught.value.in_flight  # a plain hang: the WRITE was cancelled, lands nowhere


async def test_a_write_abandoned_in_flight_says_so_and_lands_later(pair):
    fabric, a, b = pair
    name = a.add_peer(b.metadata)
    region = a.pool.alloc(4096)
    region.tensor.fill_(7)
    fabric.hang(b.name, lands_late=True)
    with pytest.raises(TransferError, match="deadline") as caught:
        await a.write(name, region.address, 4096, b.pool.address, notif=b"r/x", deadline_s=0.1)
    assert caught.value.in_flight
    assert int(b.pool.tensor[:4096].sum()) == 0  # not yet
    fabric.heal(b.name)  # the stray WRITE lands now, data then notification
    assert bool((b.pool.tensor[:4096] == 7).all())
    await b.wait_notif(a.name, b"r/x", deadline_s=0.1)


async def test_writes_outside_either_buffer_are_refused(pair):
    _, a, b = pair
    name = a.add_peer(b.metadata)
    outside = torch.zeros(1024, dtype=torch.uint8)
    with pytest.raises(ValueError, match="registered KV buffer"):
        await a.write(name, outside.data_ptr(), 1024, b.pool.address)
    region = a.pool.alloc(4096)
    with pytest.raises(TransferError, match="outside its buffer"):
        await a.write(name, region.address, 4096, b.pool.address + b.pool.nbytes)


async def test_close_fails_waits_in_progress_and_refuses_writes(pair):
    _, a, b = pair
    name = a.add_peer(b.metadata)
    wait = asyncio.create_task(a.wait_notif(name, b"r9/0", deadline_s=5))
    await asyncio.sleep(0)
    await a.aclose()
    with pytest.raises(TransferError, match="closed"):
        await wait
    with pytest.raises(TransferError, match="closed"):
        await a.write(name, a.pool.address, 16, b.pool.address)
    with pytest.raises(TransferError, match="no KV peer"):
        b.add_peer(a.metadata)  # gone from the fabric
