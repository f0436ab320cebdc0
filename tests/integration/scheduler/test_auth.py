"""The cluster token against a real scheduler process (`dualpath scheduler --token-file`): a rogue
`Register` without it (or with a wrong one) is refused and takes over no turn; token holders
route; a rotated token file is picked up without a restart."""

import asyncio
import os
import signal
import time
from pathlib import Path

import grpc
import pytest
from dualpath.grpc_auth import ClusterToken, write_token_file
from dualpath.scheduler.client import NodeAgent, Registration, SchedulerClient
from dualpath.scheduler.policy import NodeLoad
from dualpath.scheduler.wire import load_to_pb
from dualpath.v1 import scheduler_pb2 as pb
from dualpath.v1 import scheduler_pb2_grpc as pb_grpc
from dualpath_proc import spawn_ready
from grpc_health.v1 import health_pb2, health_pb2_grpc
from schedtools import free_port, wait_nodes

TURNS = 36  # the hijack tried in issue 21 took over 29 of 36 turns
LEGIT_DECODE = "127.0.0.1:7401"
ROGUE_DECODE = "127.0.0.1:6666"


def load():
    return lambda: NodeLoad(buffer_free_bytes=1 << 40)


def _rotate(path: Path, *tokens: str) -> None:
    """Swap the file as the kubelet swaps a mounted Secret (a new inode)."""
    tmp = path.with_suffix(".new")
    tmp.write_text("".join(t + "\n" for t in tokens))
    os.replace(tmp, path)


@pytest.fixture
def token_file(tmp_path):
    return write_token_file(tmp_path / "token")


@pytest.fixture
def scheduler(token_file):
    port = free_port()
    proc, _ = spawn_ready(
        ["scheduler", "--host", "127.0.0.1", "--port", str(port), "--token-file", str(token_file)]
    )
    try:
        yield f"127.0.0.1:{port}"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)


def _register(node_id: str, address: str) -> pb.RegisterRequest:
    return pb.RegisterRequest(
        node_id=node_id,
        role=pb.ROLE_DECODE,
        address=address,
        snic_bytes_per_s=1e9,
        load=load_to_pb(load()()),
    )


async def _code(coro) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await coro
    return err.value.code()


async def test_a_rogue_register_is_refused_and_takes_over_no_turn(scheduler, token_file, tmp_path):
    token = ClusterToken(token_file)
    wrong = ClusterToken(write_token_file(tmp_path / "wrong"))
    agents = [
        NodeAgent(scheduler, Registration("p0", "prefill", "127.0.0.1:7400"), load(), token=token),
        NodeAgent(scheduler, Registration("d0", "decode", LEGIT_DECODE), load(), token=token),
    ]
    client = SchedulerClient(scheduler, timeout_s=5, token=token)
    for a in agents:
        a.start()
    rogues = [
        NodeAgent(scheduler, Registration("d0", "decode", ROGUE_DECODE), load()),
        NodeAgent(scheduler, Registration("d0", "decode", ROGUE_DECODE), load(), token=wrong),
    ]
    try:
        await wait_nodes(client, 2)
        for r in rogues:  # the same id at another address, as a hijacker would register
            r.start()
        # a direct Register with no token and with a wrong one: refused before the servicer
        async with grpc.aio.insecure_channel(scheduler) as ch:
            stub = pb_grpc.SchedulerStub(ch)
            req = _register("d0", ROGUE_DECODE)
            assert await _code(stub.Register(req, timeout=5)) == grpc.StatusCode.UNAUTHENTICATED
            bad = (("authorization", f"Bearer {wrong.first}"),)
            refused = stub.Register(req, timeout=5, metadata=bad)
            assert await _code(refused) == grpc.StatusCode.UNAUTHENTICATED
            not_bearer = (("authorization", token.first),)  # the token, without the scheme
            refused = stub.Register(req, timeout=5, metadata=not_bearer)
            assert await _code(refused) == grpc.StatusCode.UNAUTHENTICATED
            route = stub.Route(pb.RouteRequest(prompt_tokens=10), timeout=5)
            assert await _code(route) == grpc.StatusCode.UNAUTHENTICATED
            # the health service stays open: probes carry no token
            h = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service="dualpath.v1.Scheduler"), timeout=2
            )
            assert h.status == health_pb2.HealthCheckResponse.SERVING
        await asyncio.sleep(0.5)  # the rogues retry meanwhile
        assert all(r.registrations == 0 for r in rogues)
        taken = 0
        for _ in range(TURNS):
            r = await client.route(prompt_tokens=500, max_new_tokens=4)
            taken += r.decode_address == ROGUE_DECODE
            assert r.decode_address == LEGIT_DECODE
            await client.complete(r.request_id)
        assert taken == 0
        view = await client.cluster_view()
        assert {n.node_id: n.address for n in view.nodes if n.role == pb.ROLE_DECODE} == {
            "d0": LEGIT_DECODE
        }
    finally:
        for a in [*agents, *rogues]:
            await a.stop()
        await client.close()


async def test_a_rotated_token_file_is_picked_up_without_a_restart(scheduler, token_file, tmp_path):
    old = token_file.read_text().strip()
    new = "rotated-" + old[::-1]
    holder = ClusterToken(token_file)  # re-reads the file, as every process does
    old_only = ClusterToken(write_token_file(tmp_path / "old", old))
    new_only = ClusterToken(write_token_file(tmp_path / "new", new))
    clients = {
        name: SchedulerClient(scheduler, timeout_s=5, token=t)
        for name, t in (("holder", holder), ("old", old_only), ("new", new_only))
    }
    try:
        await clients["old"].cluster_view()
        assert await _code(clients["new"].cluster_view()) == grpc.StatusCode.UNAUTHENTICATED
        # step 1: the new token added second: both accepted, holders still present the old
        _rotate(token_file, old, new)
        await _wait_accepted(clients["new"])
        await clients["old"].cluster_view()
        # step 2: the new token alone: the old one is refused, holders present the new one
        _rotate(token_file, new)
        deadline = time.monotonic() + 10
        while True:
            try:
                await clients["old"].cluster_view()
            except grpc.aio.AioRpcError as err:
                assert err.code() == grpc.StatusCode.UNAUTHENTICATED
                break
            assert time.monotonic() < deadline, "the old token is still accepted"
            await asyncio.sleep(0.2)
        await clients["new"].cluster_view()
        assert holder.first == new
        await clients["holder"].cluster_view()
    finally:
        for c in clients.values():
            await c.close()


async def _wait_accepted(client: SchedulerClient, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await client.cluster_view()
            return
        except grpc.aio.AioRpcError as err:
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED
            assert time.monotonic() < deadline, "the new token was never accepted"
            await asyncio.sleep(0.2)
