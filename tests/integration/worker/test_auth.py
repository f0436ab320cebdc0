"""The cluster token on the workers' gRPC: a real scheduler and a real prefill worker process
(`--token-file`) and a decode worker in this process. A rogue `Prefill`, `Generate` or
`GetTransferInfo` without the token (or with a wrong one) is refused; with it a whole turn runs
(the decode worker's call to the prefill worker carries it); a rotated file is picked up by
every process without a restart."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import grpc
import pytest

pytest.importorskip("nixl_cu12")

from dualpath.config import Role  # noqa: E402
from dualpath.grpc_auth import ClusterToken, channel, write_token_file  # noqa: E402
from dualpath.scheduler.client import SchedulerClient  # noqa: E402
from dualpath.v1 import worker_pb2 as wpb  # noqa: E402
from dualpath.v1 import worker_pb2_grpc as wpb_grpc  # noqa: E402
from dualpath.worker.common import NodeOptions  # noqa: E402
from dualpath.worker.node import WorkerNode  # noqa: E402
from dualpath_proc import spawn_ready  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402
from tiny_configs import pools, tiny_cluster, write_config  # noqa: E402

pytestmark = pytest.mark.slow

UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED


def _config(tmp: Path):
    return tiny_cluster(
        "auth",
        **pools(1, 16 << 20),
        storage={"path": str(tmp / "kv")},
    )


@pytest.fixture(scope="module")
def processes(tmp_path_factory):
    """(config, token file, scheduler address, prefill worker address)."""
    tmp = tmp_path_factory.mktemp("auth")
    cfg = _config(tmp)
    cfg_file = write_config(cfg, tmp / "cluster.yaml")
    token_file = write_token_file(tmp / "token")
    common = ["-f", str(cfg_file), "--host", "127.0.0.1", "--token-file", str(token_file)]
    procs = []
    try:
        sched, line = spawn_ready(["scheduler", *common, "--port", "0"])
        procs.append(sched)
        scheduler = f"127.0.0.1:{line.split('grpc=')[1].split()[0]}"
        prefill, line = spawn_ready(
            ["worker", "--role", "prefill", *common, "--node-id", "prefill-0"]
            + ["--scheduler", scheduler, "--deadline", "20"]
        )
        procs.append(prefill)
        yield cfg, token_file, scheduler, line.split("grpc=")[1].split()[0]
    finally:
        for p in procs:
            os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            p.wait(30)


@pytest.fixture
async def decode(processes, request):
    cfg, token_file, scheduler, _ = processes
    opts = NodeOptions(
        role=Role.DECODE,
        node_id="decode-" + request.node.name.split("_")[1],  # one per test: no stale twin
        scheduler=scheduler,
        kv_cache_tokens=4096,
        deadline_s=20,
        token=ClusterToken(token_file),
    )
    node = await WorkerNode(cfg, opts).start()
    deadline = time.monotonic() + 30
    while not node.health()[0]:  # registered with the scheduler: with the token
        assert time.monotonic() < deadline, node.health()
        await asyncio.sleep(0.05)
    yield node
    await node.stop()


def _generate(rid: str, prefill_address: str) -> wpb.GenerateRequest:
    return wpb.GenerateRequest(
        request_id=rid,
        prompt_tokens=list(range(5, 45)),
        max_new_tokens=4,
        prefill_node="prefill-0",
        prefill_address=prefill_address,
    )


async def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        if hasattr(call, "__aiter__"):
            _ = [m async for m in call]
        else:
            await call
    return err.value.code()


async def _turn(token: ClusterToken, decode_address: str, prefill_address: str, rid: str):
    async with channel(decode_address, token) as ch:
        chunks = [
            c async for c in wpb_grpc.WorkerStub(ch).Generate(_generate(rid, prefill_address))
        ]
    return [t for c in chunks for t in c.tokens]


async def test_rogue_worker_calls_are_refused_and_token_holders_served(processes, decode, tmp_path):
    _, token_file, scheduler, prefill = processes
    wrong = ClusterToken(write_token_file(tmp_path / "wrong"))
    for rogue in (None, wrong):
        for address in (prefill, decode.address):
            async with channel(address, rogue) as ch:
                stub = wpb_grpc.WorkerStub(ch)
                info = stub.GetTransferInfo(wpb.TransferInfoRequest(), timeout=5)
                assert await _code(info) == UNAUTHENTICATED
                req = wpb.PrefillRequest(request_id="rogue", prompt_tokens=[5, 6, 7])
                assert await _code(stub.Prefill(req, timeout=5)) == UNAUTHENTICATED
                gen = stub.Generate(_generate("rogue", prefill), timeout=5)
                assert await _code(gen) == UNAUTHENTICATED
                # the health service stays open (probes carry no token)
                h = await health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service="dualpath.v1.Worker"), timeout=2
                )
                assert h.status == health_pb2.HealthCheckResponse.SERVING
    # with the token: the transfer metadata, and a whole turn (decode -> prefill worker)
    token = ClusterToken(token_file)
    async with channel(prefill, token) as ch:
        info = await wpb_grpc.WorkerStub(ch).GetTransferInfo(wpb.TransferInfoRequest(), timeout=5)
    assert info.node_id == "prefill-0" and info.metadata
    assert len(await _turn(token, decode.address, prefill, "ok-1")) == 4
    # both workers registered with the token-holding scheduler
    client = SchedulerClient(scheduler, timeout_s=5, token=token)
    try:
        view = await client.cluster_view()
        assert {"prefill-0", decode.node_id} <= {n.node_id for n in view.nodes if n.healthy}
    finally:
        await client.close()


async def test_a_rotated_token_reaches_every_process(processes, decode, tmp_path):
    _, token_file, scheduler, prefill = processes
    old = token_file.read_text().split()[0]
    new = "rotated-" + old[::-1]
    old_only = ClusterToken(write_token_file(tmp_path / "old", old))
    new_only = ClusterToken(write_token_file(tmp_path / "new", new))
    tmp = token_file.with_suffix(".new")
    tmp.write_text(new + "\n")
    os.replace(tmp, token_file)  # as the kubelet swaps a mounted Secret
    await asyncio.sleep(1.5)  # files are re-checked at most every second
    # the prefill worker process refuses the old token and serves the new one; the decode
    # worker presents the new one on its Prefill call (the turn would fail otherwise)
    async with channel(prefill, old_only) as ch:
        info = wpb_grpc.WorkerStub(ch).GetTransferInfo(wpb.TransferInfoRequest(), timeout=5)
        assert await _code(info) == UNAUTHENTICATED
    assert len(await _turn(new_only, decode.address, prefill, "rotated-1")) == 4
    client = SchedulerClient(scheduler, timeout_s=5, token=new_only)
    try:
        view = await client.cluster_view()
        assert {"prefill-0", decode.node_id} <= {n.node_id for n in view.nodes if n.healthy}
        r = await client.route(prompt_tokens=100, max_new_tokens=4)
        assert r.decode_node.startswith("decode-")
        await client.complete(r.request_id)
    finally:
        await client.close()
