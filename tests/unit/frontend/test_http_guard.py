"""The HTTP front cannot be held open (`frontend.http_guard`): a client dripping its header or
its body is closed by the timeouts, a connection over the cap is answered 503 at once, and a
normal request is served alongside. A real uvicorn server on loopback, raw sockets as clients."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import uvicorn
from dualpath.frontend.http_guard import ConnectionLimits, dropped_counter, guarded_protocol
from prometheus_client import CollectorRegistry

LIMITS = ConnectionLimits(header_timeout_s=1.0, body_timeout_s=1.0, max_connections=4)
HELD_S = 15.0  # far past every limit: a connection still open then was held


async def app(scope, receive, send):  # a minimal ASGI app that reads the body, then answers
    if scope["type"] != "http":
        return
    more = True
    while more:
        more = (await receive()).get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
async def front():
    registry = CollectorRegistry()
    dropped = dropped_counter(registry)
    cfg = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=0,
        http=guarded_protocol(LIMITS, dropped),
        log_level="warning",
        lifespan="off",
    )
    server = uvicorn.Server(cfg)
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield port, registry
    finally:
        server.should_exit = True
        await task


async def _drip_until_closed(port: int, head: bytes, drip: bytes) -> bytes:
    """Send `head`, then `drip` every 0.2 s until the server closes; what it answered."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head)
    answer = b""

    async def drip_forever() -> None:
        with contextlib.suppress(ConnectionError):
            while True:
                await asyncio.sleep(0.2)
                writer.write(drip)
                await writer.drain()

    dripping = asyncio.create_task(drip_forever())
    try:
        answer = await asyncio.wait_for(reader.read(), HELD_S)
    finally:
        dripping.cancel()
        writer.close()
    return answer


async def _get(port: int) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    try:
        return await asyncio.wait_for(reader.read(), HELD_S)
    finally:
        writer.close()


def _dropped(registry: CollectorRegistry, reason: str) -> float:
    return (
        registry.get_sample_value("dualpath_frontend_connections_dropped_total", {"reason": reason})
        or 0.0
    )


async def test_a_client_dripping_its_header_is_answered_408_and_closed(front):
    port, registry = front
    answer = await _drip_until_closed(port, b"GET / HTTP/1.1\r\n", b"x-slow: 1\r\n")
    assert answer.startswith(b"HTTP/1.1 408")
    assert _dropped(registry, "header") == 1
    assert (await _get(port)).startswith(b"HTTP/1.1 200")  # others are served


async def test_a_client_dripping_its_body_is_closed(front):
    port, registry = front
    head = b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 100000\r\n\r\n"
    await _drip_until_closed(port, head, b"a")
    assert _dropped(registry, "body") == 1


async def test_a_connection_over_the_cap_is_answered_503_at_once(front):
    port, registry = front
    held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(LIMITS.max_connections)]
    try:
        over = await _get(port)
        assert over.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in over
        assert _dropped(registry, "connections") == 1
    finally:
        for _, w in held:
            w.close()
