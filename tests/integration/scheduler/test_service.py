"""The scheduler over real gRPC: registration, heartbeats, routing, drain, restart under load."""

import asyncio
import os
import signal

import grpc
import pytest
from dualpath import config
from dualpath.scheduler.cli import build
from dualpath.scheduler.client import NodeAgent, Registration, SchedulerClient
from dualpath.scheduler.policy import NodeLoad
from dualpath_proc import spawn_ready
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY
from schedtools import free_port, wait_nodes


def load(pending=0):
    return lambda: NodeLoad(read_pending_bytes=pending, buffer_free_bytes=1 << 40)


def agents_for(address, prefill=2, decode=2):
    nodes = [(f"p{i}", "prefill", 7000 + i) for i in range(prefill)]
    nodes += [(f"d{i}", "decode", 7100 + i) for i in range(decode)]
    return [
        NodeAgent(address, Registration(n, role, f"127.0.0.1:{port}", snic_bytes_per_s=1e9), load())
        for n, role, port in nodes
    ]


@pytest.fixture
async def server():
    srv = build(config.local_default(), None, "127.0.0.1", 0)
    await srv.start()
    yield srv
    await srv.stop(0)


async def test_route_drain_and_liveness(server):
    addr = f"127.0.0.1:{server.port}"
    agents = [a.start() for a in agents_for(addr)]
    client = SchedulerClient(addr, timeout_s=5)
    try:
        await wait_nodes(client, 4)
        resp = await client.route(
            prompt_tokens=1000,
            context_bytes=1 << 20,
            max_new_tokens=16,
        )
        assert resp.request_id and resp.prefill_node.startswith("p")
        assert resp.prefill_address.startswith("127.0.0.1:")
        await client.complete(resp.request_id)

        assert await client.drain("p0")
        for _ in range(5):
            r = await client.route(
                prompt_tokens=100,
            )
            assert r.prefill_node == "p1"

        await agents[1].stop()  # p1's heartbeats stop: out of the pool after the timeout
        timeout_s = config.local_default().spec.scheduler.node_timeout_ms / 1000
        await asyncio.sleep(timeout_s + 0.5)
        view = await client.cluster_view()
        assert not next(n for n in view.nodes if n.node_id == "p1").healthy
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.route(prompt_tokens=100, queue_timeout_s=0.2)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.route(prompt_tokens=0)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.route(prompt_tokens=10, block_keys=b"12345")
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "block_keys" in err.value.details()

        async with grpc.aio.insecure_channel(addr) as ch:
            h = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service="dualpath.v1.Scheduler"), timeout=2
            )
            assert h.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        for a in agents:
            await a.stop()
        await client.close()


def start_scheduler(port):
    return spawn_ready(["scheduler", "--host", "127.0.0.1", "--port", str(port)])[0]


@pytest.mark.slow
async def test_kill_and_restart_under_load_loses_nothing():
    port = free_port()
    addr = f"127.0.0.1:{port}"
    proc = start_scheduler(port)
    agents = [a.start() for a in agents_for(addr)]
    client = SchedulerClient(addr, timeout_s=15)
    routed, failures, stop = [], [], asyncio.Event()

    async def load_loop():
        i = 0
        while not stop.is_set() and i < 2000:
            i += 1
            try:
                r = await client.route(prompt_tokens=500, max_new_tokens=4)
                routed.append(r.request_id)
                await client.complete(r.request_id)
            except grpc.aio.AioRpcError as err:
                failures.append(err.code())
            await asyncio.sleep(0.005)

    async def until(done, what: str, timeout_s: float = 30.0) -> None:
        # progress by count, not by a fixed sleep: a slow machine takes longer, not fails
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not done():
            assert loop.time() < deadline, f"{what}: not within {timeout_s}s"
            await asyncio.sleep(0.02)

    try:
        await wait_nodes(client, 4)
        task = asyncio.create_task(load_loop())
        await until(lambda: len(routed) >= 5, "routes before the kill")
        before = len(routed)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=5)
        proc = start_scheduler(port)  # a fresh scheduler with an empty view
        await wait_nodes(client, 4)  # rebuilt from re-registrations
        await until(lambda: len(routed) > before + 5, "routes after the restart")
        stop.set()
        await asyncio.wait_for(task, timeout=30)
        assert before > 0 and len(routed) > before + 5, (before, len(routed))
        assert not [f for f in failures if f != grpc.StatusCode.UNAVAILABLE], failures
        # Routes that were in flight at the kill are retried by the channel's retry policy.
        assert len(failures) <= 2, failures
        assert all(a.registrations >= 2 for a in agents)
    finally:
        stop.set()
        for a in agents:
            await a.stop()
        await client.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=5)


def versioned_agent(address, node_id, role, config_hash, port):
    reg = Registration(
        node_id, role, f"127.0.0.1:{port}", snic_bytes_per_s=1e9, config_hash=config_hash
    )
    return NodeAgent(address, reg, load())


def unpaired_total():
    return REGISTRY.get_sample_value("dualpath_scheduler_route_unpaired_total") or 0.0


async def route_pair(client):
    r = await client.route(prompt_tokens=1000, max_new_tokens=8)
    await client.complete(r.request_id)
    return r.prefill_node, r.decode_node


async def test_two_config_hashes_never_pair(server):
    addr = f"127.0.0.1:{server.port}"
    client = SchedulerClient(addr, timeout_s=5)
    agents = [
        versioned_agent(addr, "p-v1", "prefill", "v1", 7200).start(),
        versioned_agent(addr, "d-v2", "decode", "v2", 7300).start(),
    ]
    try:
        view = await wait_nodes(client, 2)
        assert {n.node_id: n.config_hash for n in view.nodes} == {"p-v1": "v1", "d-v2": "v2"}
        before = unpaired_total()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.route(prompt_tokens=100, queue_timeout_s=0.2)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "share a config hash (prefill: v1; decode: v2)" in err.value.details()
        assert unpaired_total() == before + 1

        # Each version gets its other half: both pairs serve, never a mixed one.
        agents.append(versioned_agent(addr, "d-v1", "decode", "v1", 7301).start())
        agents.append(versioned_agent(addr, "p-v2", "prefill", "v2", 7201).start())
        await wait_nodes(client, 4)
        pairs = {await route_pair(client) for _ in range(20)}
        assert pairs <= {("p-v1", "d-v1"), ("p-v2", "d-v2")}, pairs
        assert await client.drain("p-v1")  # old version drains: the new pair takes everything
        assert {await route_pair(client) for _ in range(10)} == {("p-v2", "d-v2")}
        assert await client.drain("d-v2")  # new decode gone too: v2 prefill and v1 decode left
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.route(prompt_tokens=100, queue_timeout_s=0.2)
        assert "config hash" in err.value.details()
        assert unpaired_total() == before + 2
    finally:
        for a in agents:
            await a.stop()
        await client.close()
