"""`ChannelCache`: channels by address, none left open to an address that does not answer, the
idle and the least recently used closed, those of nodes gone from the cluster closed. The
TCP sockets are counted (/proc): a channel grpc keeps reconnects forever."""

from __future__ import annotations

import asyncio
import os

import grpc
import pytest
from dualpath.grpc_channels import ChannelCache, Unreachable
from dualpath.local.supervisor import tcp_sockets


def sockets() -> int:
    """This process's TCP sockets (a channel's connection or connect attempt; not grpc's
    internal socket pairs)."""
    return len(tcp_sockets(os.getpid()))


async def settle(at_most: int, timeout_s: float = 10.0) -> int:
    """The socket count once it is at most `at_most` (or after `timeout_s`): grpc closes a
    channel's sockets on its own threads."""
    for _ in range(int(timeout_s / 0.1)):
        if (n := sockets()) <= at_most:
            return n
        await asyncio.sleep(0.1)
    return sockets()


@pytest.fixture
async def server():
    srv = grpc.aio.server()
    port = srv.add_insecure_port("127.0.0.1:0")
    await srv.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await srv.stop(0)


async def test_100_bad_addresses_leave_no_channel_and_no_socket_open():
    cache = ChannelCache(None, connect_wait_s=0.5)
    with pytest.raises(Unreachable):  # grpc's own sockets, made once per process
        await cache.get("127.0.0.1:1")
    base = await settle(sockets())
    got = await asyncio.gather(
        *(cache.get(f"127.0.0.1:{port}") for port in range(1, 101)), return_exceptions=True
    )
    assert all(isinstance(g, Unreachable) for g in got), got[:3]
    assert len(cache) == 0
    assert await settle(base) <= base
    await cache.close()


async def test_a_channel_is_reused_by_address_and_closed_when_idle(server):
    now = [0.0]
    cache = ChannelCache(None, idle_s=10.0, clock=lambda: now[0])
    ch = await cache.get(server)
    assert await cache.get(server) is ch and len(cache) == 1
    now[0] = 9.0
    assert cache.sweep() == []
    now[0] = 20.0
    assert cache.sweep() == [server] and len(cache) == 0
    await cache.close()


async def test_the_least_recently_used_is_closed_over_the_cap(server):
    cache = ChannelCache(None, max_channels=2)
    a, b = server, server.replace("127.0.0.1", "localhost")
    await cache.get(a)
    await cache.get(b)
    await cache.get(a)  # b is now the least recently used
    with pytest.raises(Unreachable):
        cache.connect_wait_s = 0.3
        await cache.get("127.0.0.1:1")
    assert a in cache and b not in cache
    await cache.close()


async def test_channels_of_nodes_gone_from_the_cluster_are_closed(server):
    cache = ChannelCache(None)
    await cache.get(server)
    assert cache.keep_only({server, "10.0.0.9:7000"}) == []
    assert cache.keep_only({"10.0.0.9:7000"}) == [server]
    assert len(cache) == 0
    await cache.close()


async def test_the_sweeper_closes_idle_channels_and_those_gone_from_the_view(server, monkeypatch):
    import dualpath.grpc_channels as gc

    monkeypatch.setattr(gc, "SWEEP_S", 0.05)
    live = {server}

    async def view():
        return set(live)

    cache = ChannelCache(None)
    await cache.get(server)
    cache.start_sweeper(view)
    await asyncio.sleep(0.2)
    assert server in cache  # in the view and not idle: kept
    live.clear()  # its node left the cluster
    for _ in range(100):
        if server not in cache:
            break
        await asyncio.sleep(0.05)
    assert server not in cache
    await cache.close()  # stops the sweeper too
    assert cache._sweeper is None
