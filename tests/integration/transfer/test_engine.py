"""The NIXL/UCX transfer engine between real processes: bytes, notifications, deadlines."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

pytest.importorskip("nixl_cu12")

from dualpath.transfer.engine import TransferEngine, TransferError  # noqa: E402
from dualpath.transfer.peer import PeerProcess  # noqa: E402


@pytest.fixture
def peer():
    with PeerProcess("peer", pool_bytes=16 << 20) as p:
        yield p


async def test_write_lands_bit_exact_with_one_notification_per_layer(peer):
    engine = TransferEngine("local", 16 << 20, deadline_s=10).start()
    try:
        name = engine.add_peer(peer.metadata)
        peer.call("add_peer", metadata=engine.metadata)
        region = engine.pool.alloc(4 << 20)
        region.tensor.copy_(torch.randint(0, 256, (4 << 20,), dtype=torch.uint8))
        layer = 1 << 20
        peer.send("wait", peer=engine.name, prefix="r1/hit/", count=4)
        assert engine.stats.writes == 0
        await asyncio.gather(
            *(
                engine.write(
                    name,
                    region.address + i * layer,
                    layer,
                    peer.address + i * layer,
                    notif=f"r1/hit/{i}".encode(),
                )
                for i in range(4)
            )
        )
        await asyncio.to_thread(peer.result)
        got = peer.call("read", offset=0, nbytes=4 << 20)["data"]
        assert got == region.tensor.numpy().tobytes()
        assert engine.stats.writes == 4 and engine.stats.inflight == 0
        engine.pool.free(region)
        assert engine.pool.regions == 0
    finally:
        await engine.aclose()
    assert not engine.registered


async def test_notifications_both_ways_and_early_arrival(peer):
    engine = TransferEngine("local", 8 << 20, deadline_s=10).start()
    try:
        engine.add_peer(peer.metadata)
        peer.call("add_peer", metadata=engine.metadata)
        dst = engine.pool.alloc(1 << 20)
        # the peer writes before anyone waits: the notification is kept until asked for
        peer.call("fill", offset=0, nbytes=1 << 20, value=7)
        peer.send(
            "write", peer=engine.name, offset=0, nbytes=1 << 20, dst=dst.address, notif=b"r2/new/0"
        )
        await asyncio.to_thread(peer.result)  # our loop keeps polling: UCX progress here
        await engine.wait_notif(peer.name, b"r2/new/0", deadline_s=5)
        assert bool((dst.tensor == 7).all())
        with pytest.raises(TransferError, match="did not arrive"):
            await engine.wait_notif(peer.name, b"r2/new/1", deadline_s=0.3)
    finally:
        await engine.aclose()


async def test_write_to_a_dead_peer_fails_within_its_deadline_and_leaks_nothing():
    engine = TransferEngine("local", 8 << 20, deadline_s=3).start()
    p = PeerProcess("doomed", pool_bytes=8 << 20)
    try:
        name = engine.add_peer(p.metadata)
        region = engine.pool.alloc(4 << 20)
        await engine.write(name, region.address, 1 << 20, p.address)  # connected and working
        p.kill()
        t0 = time.monotonic()
        with pytest.raises(TransferError, match=name):
            for _ in range(50):  # UCX may accept a write or two before it sees the peer gone
                await engine.write(name, region.address, 4 << 20, p.address, deadline_s=2)
                if not engine.knows(name):
                    break
        assert time.monotonic() - t0 < 10
        assert not engine.knows(name)  # dropped: the next request reconnects from metadata
        assert engine.stats.inflight == 0 and engine.stats.failed >= 1
        with pytest.raises(TransferError, match="unknown KV peer"):
            await engine.write(name, region.address, 1 << 20, p.address)
        engine.pool.free(region)
        assert engine.pool.regions == 0 and engine.pool.free_bytes == engine.pool.nbytes
        with pytest.raises(TransferError, match="did not arrive"):
            await engine.wait_notif(name, b"r3/hit/0", deadline_s=0.5)
    finally:
        p.close()
        await engine.aclose()
    assert not engine.registered and engine.stats.leaked_handles == 0


async def test_write_outside_the_registered_buffer_is_refused(peer):
    engine = TransferEngine("local", 8 << 20, deadline_s=5)
    try:
        name = engine.add_peer(peer.metadata)
        outside = torch.zeros(1024, dtype=torch.uint8)
        with pytest.raises(ValueError, match="registered KV buffer"):
            await engine.write(name, outside.data_ptr(), 1024, peer.address)
    finally:
        await engine.aclose()
