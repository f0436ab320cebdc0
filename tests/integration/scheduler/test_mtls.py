"""Mutual TLS between pods (`--tls-dir`): a real scheduler process and a worker gRPC server in
this process (the real `WorkerServicer` over a node without a model), each process with its own
certificate from one CA (`dualpath.tls.LocalCA`, as `dualpath up` makes them).

A decode pod's certificate registers its own node only (not another decode node, not a prefill
node), heartbeats for itself only, and calls Prefill only for KV sent to itself; a plaintext
client, a client of another CA and a frontend certificate are refused."""

import os
import signal
from types import SimpleNamespace

import grpc
import pytest
from dualpath.config import Role
from dualpath.grpc_auth import add_port, channel, server_interceptors
from dualpath.scheduler.client import NodeAgent, Registration, SchedulerClient
from dualpath.scheduler.policy import NodeLoad
from dualpath.scheduler.wire import load_to_pb
from dualpath.tls import LocalCA, TlsCredentials
from dualpath.v1 import scheduler_pb2 as pb
from dualpath.v1 import scheduler_pb2_grpc as pb_grpc
from dualpath.v1 import worker_pb2 as wpb
from dualpath.v1 import worker_pb2_grpc as wpb_grpc
from dualpath.worker.service import WorkerServicer
from dualpath_proc import spawn_ready
from schedtools import free_port, wait_nodes

DENIED = grpc.StatusCode.PERMISSION_DENIED
CLUSTER = "local"  # the embedded config's name: the scheduler's identity is of this cluster


@pytest.fixture(scope="module")
def ca(tmp_path_factory):
    ca = LocalCA(tmp_path_factory.mktemp("tls"), CLUSTER)
    for name, role in (
        ("scheduler", "scheduler"),
        ("decode-0", "decode"),
        ("decode-1", "decode"),
        ("prefill-0", "prefill"),
        ("frontend", "frontend"),
    ):
        ca.issue_dir(name, role, name)
    return ca


def creds(ca: LocalCA, name: str) -> TlsCredentials:
    return TlsCredentials(ca.dir / name)


@pytest.fixture(scope="module")
def scheduler(ca):
    port = free_port()
    proc, _ = spawn_ready(
        ["scheduler", "--host", "127.0.0.1", "--port", str(port)]
        + ["--tls-dir", str(ca.dir / "scheduler")]
    )
    try:
        yield f"127.0.0.1:{port}"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)


def _register(node_id: str, role=pb.ROLE_DECODE) -> pb.RegisterRequest:
    return pb.RegisterRequest(
        node_id=node_id,
        role=role,
        address="127.0.0.1:7401",
        snic_bytes_per_s=1e9,
        load=load_to_pb(NodeLoad(buffer_free_bytes=1 << 40)),
    )


async def _code(coro) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await coro
    return err.value.code()


async def test_a_decode_certificate_registers_its_own_node_only(ca, scheduler):
    async with channel(scheduler, creds(ca, "decode-0"), server_role="scheduler") as ch:
        stub = pb_grpc.SchedulerStub(ch)
        assert await _code(stub.Register(_register("decode-1"), timeout=30)) == DENIED
        assert await _code(stub.Register(_register("prefill-0", pb.ROLE_PREFILL), timeout=30)) == (
            DENIED
        )
        assert await _code(stub.Register(_register("decode-0", pb.ROLE_PREFILL), timeout=30)) == (
            DENIED
        )
        await stub.Register(_register("decode-0"), timeout=30)  # its own: accepted

        async def beats(node_id):
            yield pb.Heartbeat(node_id=node_id, load=load_to_pb(NodeLoad()))

        call = stub.Heartbeats(beats("decode-1"), timeout=30)
        assert await _code(call.read()) == DENIED
        assert await _code(stub.Drain(pb.DrainRequest(node_id="decode-1"), timeout=30)) == DENIED
        assert await _code(stub.Route(pb.RouteRequest(prompt_tokens=8), timeout=30)) == DENIED

    async with channel(scheduler, creds(ca, "frontend"), server_role="scheduler") as ch:
        stub = pb_grpc.SchedulerStub(ch)
        assert await _code(stub.Register(_register("decode-9"), timeout=30)) == DENIED

    # the real agent, with its own certificate, registers and heartbeats: the scheduler lists it
    agent = NodeAgent(
        scheduler,
        Registration("decode-1", "decode", "127.0.0.1:7402", snic_bytes_per_s=1e9),
        lambda: NodeLoad(buffer_free_bytes=1 << 40),
        token=creds(ca, "decode-1"),
    ).start()
    client = SchedulerClient(scheduler, token=creds(ca, "frontend"))
    try:
        await wait_nodes(client, 2)
        view = await client.cluster_view()
        assert {n.node_id for n in view.nodes} == {"decode-0", "decode-1"}
    finally:
        await agent.stop()
        await client.close()


async def test_an_oversized_field_is_refused_by_its_bound_before_the_identity_check(ca, scheduler):
    """Bounds before identity: a 1 MB node id under another node's certificate is refused
    INVALID_ARGUMENT with a short message, never PERMISSION_DENIED echoing the id (a client
    with default settings got RESOURCE_EXHAUSTED for the echo's size instead)."""
    async with channel(scheduler, creds(ca, "decode-0"), server_role="scheduler") as ch:
        stub = pb_grpc.SchedulerStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Register(_register("d" * (1 << 20)), timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert len(err.value.details()) < 200, err.value.details()[:300]


async def test_a_plaintext_or_foreign_client_is_refused(ca, scheduler, tmp_path):
    plain = grpc.aio.insecure_channel(scheduler)
    try:
        code = await _code(
            pb_grpc.SchedulerStub(plain).ClusterView(pb.ClusterViewRequest(), timeout=30)
        )
        assert code == grpc.StatusCode.UNAVAILABLE  # the TLS handshake fails: no call at all
    finally:
        await plain.close()
    other = LocalCA(tmp_path, CLUSTER)  # the same names, another CA
    other.issue_dir("decode-0", "decode", "decode-0")
    async with channel(scheduler, creds(other, "decode-0"), server_role="scheduler") as ch:
        stub = pb_grpc.SchedulerStub(ch)
        assert await _code(stub.Register(_register("decode-0"), timeout=30)) == (
            grpc.StatusCode.UNAVAILABLE
        )


@pytest.fixture
async def prefill_server(ca):
    """The real WorkerServicer of a node without a prefill role: a call the identity check lets
    through is answered FAILED_PRECONDITION by the servicer itself."""
    me = creds(ca, "prefill-0")
    server = grpc.aio.server(interceptors=server_interceptors(me, "prefill-worker"))
    node = SimpleNamespace(
        prefill=None, decode=None, node_id="prefill-0", stopping=False, role=Role.DECODE
    )
    wpb_grpc.add_WorkerServicer_to_server(WorkerServicer(node), server)
    port = add_port(server, "127.0.0.1:0", me)
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


async def _prefill_code(address: str, who: TlsCredentials, decode_node: str, agent: str = ""):
    async with channel(address, who, server_role="prefill") as ch:
        req = wpb.PrefillRequest(
            request_id="r1", prompt_tokens=[1, 2], decode_node=decode_node, decode_agent=agent
        )
        return await _code(wpb_grpc.WorkerStub(ch).Prefill(req, timeout=30).read())


async def test_prefill_only_from_a_decode_certificate_for_its_own_node(ca, prefill_server):
    reached = grpc.StatusCode.FAILED_PRECONDITION
    assert await _prefill_code(prefill_server, creds(ca, "decode-0"), "decode-0") == reached
    agent = "decode-0-4242-a1b2c3"  # a real agent's name: <node id>-<pid>-<random>
    assert await _prefill_code(prefill_server, creds(ca, "decode-0"), "decode-0", agent) == reached
    assert await _prefill_code(prefill_server, creds(ca, "decode-0"), "decode-1") == DENIED
    assert (
        await _prefill_code(prefill_server, creds(ca, "decode-0"), "decode-0", "decode-1-42-ab")
        == DENIED
    )
    for evil in ("decode-0-evil", "decode-0-4242-a1b2c3-evil", "decode-0-x-4242-a1b2c3"):
        # the agent's name matched whole: a prefix of decode-0's shape names another agent
        assert await _prefill_code(prefill_server, creds(ca, "decode-0"), "decode-0", evil) == (
            DENIED
        )
    assert await _prefill_code(prefill_server, creds(ca, "frontend"), "decode-0") == DENIED
    assert await _prefill_code(prefill_server, creds(ca, "prefill-0"), "prefill-0") == DENIED
    # a client that expects a decode server at this address refuses the prefill certificate
    async with channel(prefill_server, creds(ca, "decode-0"), server_role="decode") as ch:
        req = wpb.PrefillRequest(request_id="r2", decode_node="decode-0")
        code = await _code(wpb_grpc.WorkerStub(ch).Prefill(req, timeout=30).read())
        assert code == grpc.StatusCode.UNAVAILABLE
