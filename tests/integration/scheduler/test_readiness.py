"""Readiness tells the truth: a worker's agent is `registered` only while the scheduler knows it,
and the frontend's /health is 503 while it cannot route (no prefill or no decode node)."""

import asyncio
import time

from asgi_client import serving
from dualpath import config
from dualpath.frontend.app import create_app
from dualpath.frontend.grpc_backend import GrpcBackend
from dualpath.scheduler.cli import build
from dualpath.scheduler.client import NodeAgent, Registration
from dualpath.scheduler.policy import NodeLoad


async def _until(cond, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


async def test_agent_is_registered_only_while_the_scheduler_knows_it() -> None:
    sched = build(config.local_default(), None, "127.0.0.1", 0)
    await sched.start()
    agent = NodeAgent(
        f"127.0.0.1:{sched.port}", Registration("d0", "decode", "127.0.0.1:7"), NodeLoad
    )
    assert not agent.registered
    agent.start()
    try:
        await _until(lambda: agent.registered)
        sched.servicer.state.nodes.pop("d0")  # the scheduler forgets it (as after a restart)
        await _until(lambda: agent.registrations >= 2)  # told known=false: registers again
        assert agent.registered
        await sched.stop(0.1)  # the scheduler is gone: not registered any more
        await _until(lambda: not agent.registered)
    finally:
        await agent.stop()
        await sched.stop(0.1)


async def test_frontend_health_is_503_until_it_can_route() -> None:
    cfg = config.local_default()
    sched = build(cfg, None, "127.0.0.1", 0)
    await sched.start()
    addr = f"127.0.0.1:{sched.port}"
    agents = [NodeAgent(addr, Registration("p0", "prefill", "127.0.0.1:7"), NodeLoad).start()]
    app = create_app(cfg, GrpcBackend(cfg, addr, timeout_s=5))
    try:
        async with serving(app) as c:
            await _until(lambda: agents[0].registered)
            r = await c.get("/health")
            assert r.status_code == 503 and "waiting for workers" in r.json()["detail"]
            agents.append(NodeAgent(addr, Registration("d0", "decode", "127.0.0.1:8"), NodeLoad))
            agents[-1].start()
            await _until(lambda: agents[-1].registered)
            assert (await c.get("/health")).status_code == 200
            await sched.stop(0.1)
            r = await c.get("/health")
            assert r.status_code == 503 and "scheduler" in r.json()["detail"]
    finally:
        for a in agents:
            await a.stop()
        await sched.stop(0.1)


async def test_overload_is_a_429_with_retry_after_within_the_queue_timeout() -> None:
    """No decode node has buffer room: the scheduler refuses at its queue timeout and the
    frontend answers 429 + Retry-After (streamed or not), not a bare 503."""
    cfg = config.local_default()
    sched = build(cfg, None, "127.0.0.1", 0)
    sched.servicer.default_queue_timeout_s = 0.3
    await sched.start()
    addr = f"127.0.0.1:{sched.port}"
    full = lambda: NodeLoad(buffer_free_bytes=1)  # noqa: E731 (no room for any prompt)
    agents = [
        NodeAgent(addr, Registration("p0", "prefill", "127.0.0.1:7"), NodeLoad).start(),
        NodeAgent(addr, Registration("d0", "decode", "127.0.0.1:8"), full).start(),
    ]
    app = create_app(cfg, GrpcBackend(cfg, addr, timeout_s=5))
    try:
        async with serving(app) as c:
            await _until(lambda: all(a.registered for a in agents))
            await asyncio.sleep(0.2)  # a heartbeat carries d0's full buffer
            for stream in (False, True):
                t0 = time.monotonic()
                r = await c.post(
                    "/v1/completions",
                    json={"model": cfg.spec.model.name, "prompt": "hi", "stream": stream},
                )
                assert r.status_code == 429, r.text
                assert r.headers["retry-after"] == "1"
                assert r.json()["error"]["code"] == "overloaded"
                assert time.monotonic() - t0 < 3.0
    finally:
        for a in agents:
            await a.stop()
        await sched.stop(0.1)
