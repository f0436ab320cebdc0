"""The worker on engine vllm behind the shared gRPC edge, without a vLLM: a prefill and a
decode `VllmWorker` on `WorkerServer` under mutual TLS (each with its own node certificate),
their vLLM children replaced by an HTTP handler that records each completion request."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import httpx
import pytest
from dualpath.config import Role, from_resource
from dualpath.grpc_auth import auth_files, channel
from dualpath.integrations.vllm.connector_config import ConnectorConfig
from dualpath.integrations.vllm.plan import KvTarget, Route
from dualpath.integrations.vllm.rendezvous import Ready, RendezvousError, RendezvousServer
from dualpath.integrations.vllm.server import kv_transfer_config
from dualpath.sampling import SamplingParams
from dualpath.tls import LocalCA, TlsCredentials
from dualpath.v1 import scheduler_pb2 as spb
from dualpath.v1 import worker_pb2 as wpb
from dualpath.v1 import worker_pb2_grpc as wpb_grpc
from dualpath.worker.common import NodeOptions
from dualpath.worker.service import WorkerServer
from dualpath.worker.vllm import VllmServicer, VllmWorker, vllm_sampling
from dualpath.worker.wire import BadField, prefill_from_pb, prefill_to_pb

BT = 16


def _cfg(tmp_path):
    return from_resource(
        {
            "apiVersion": "dualpath.io/v1alpha1",
            "kind": "DualPathCluster",
            "metadata": {"name": "c1"},
            "spec": {
                "model": {"name": "dualpath-tiny", "preset": "tiny", "blockTokens": BT},
                "prefill": {"replicas": 1},
                "decode": {"replicas": 1},
                "storage": {"path": str(tmp_path / "kv")},
            },
        }
    )


def test_sampling_maps_to_vllms_request_fields_in_one_place() -> None:
    p = SamplingParams(
        temperature=0.7, max_tokens=9, stop_tokens=(3, 4), seed=7, top_p=0.5, top_k=3, min_tokens=2
    )
    assert vllm_sampling(p) == {
        "max_tokens": 9,
        "temperature": 0.7,
        "stop_token_ids": [3, 4],
        "min_tokens": 2,
        "seed": 7,
        "top_p": 0.5,
        "top_k": 3,
    }
    # off (seed 0, top_p 1, top_k 0): left to vLLM's defaults
    assert set(vllm_sampling(SamplingParams())) == {
        "max_tokens",
        "temperature",
        "stop_token_ids",
        "min_tokens",
    }


def test_a_prefill_through_the_store_needs_no_agent_but_is_checked(tmp_path) -> None:
    model = _cfg(tmp_path).spec.model
    msg = wpb.PrefillRequest(
        request_id="r1",
        prompt_tokens=list(range(1, 2 * BT + 3)),
        hit_tokens=BT,
        read_path=spb.READ_PATH_PREFILL,
        decode_node="decode-0",
    )
    order = prefill_from_pb(msg, model, via_store=True)
    assert (order.hit_tokens, order.read_path, order.decode_new) == (BT, "prefill", None)
    with pytest.raises(BadField, match="decode_agent"):
        prefill_from_pb(msg, model)  # the torch worker's needs the NIXL agent
    msg.hit_tokens = BT + 1
    with pytest.raises(BadField, match="hit_tokens"):
        prefill_from_pb(msg, model, via_store=True)

    # engine vllm over NIXL: the decode vLLM's cache, every field checked and named
    msg.hit_tokens = BT
    target = wpb.VllmKvTarget(
        layer_addresses=[1 << 20, 2 << 20], block_bytes=512, block_ids=[3, 4],
        deadline_unix=1e9, xfer_id="r1/x",
    )  # fmt: skip
    msg.decode_vllm.CopyFrom(target)
    with pytest.raises(BadField, match="decode_agent"):
        prefill_from_pb(msg, model, via_store=True)
    msg.decode_agent, msg.decode_agent_metadata = "decode-0-vllm-1", b"meta"
    order = prefill_from_pb(msg, model, via_store=True)
    assert order.decode_vllm.block_ids == (3, 4) and order.decode_agent == "decode-0-vllm-1"
    assert prefill_from_pb(prefill_to_pb(order), model, via_store=True) == order
    for field, bad in (("block_ids", {"block_ids": [-1]}), ("xfer_id", {"xfer_id": ""}),
                       ("deadline_unix", {"deadline_unix": 0.0}),
                       ("layer_addresses", {"layer_addresses": [0]})):  # fmt: skip
        msg.decode_vllm.CopyFrom(target)
        for k, v in bad.items():
            if isinstance(v, list):
                getattr(msg.decode_vllm, k)[:] = v
            else:
                setattr(msg.decode_vllm, k, v)
        with pytest.raises(BadField, match=f"decode_vllm.{field}"):
            prefill_from_pb(msg, model, via_store=True)


def test_the_connector_gets_the_workers_own_credentials(tmp_path) -> None:
    d = LocalCA(tmp_path / "tls", "c1").issue_dir("decode-0", "decode", "decode-0")
    token_file, tls_dir = auth_files(TlsCredentials(d))
    assert (token_file, tls_dir) == ("", str(d))
    cc = ConnectorConfig("c.yaml", "/kv", "decode-0", "s:1", token_file, tls_dir, 7)
    extra = kv_transfer_config(cc)
    assert extra["kv_connector_extra_config"]["tls_dir"] == str(d)
    # one dataclass both ends use: what the adapter writes is what the connector reads
    assert ConnectorConfig.of(extra["kv_connector_extra_config"]) == cc
    with pytest.raises(ValueError, match="rendezvous_port"):
        ConnectorConfig.of({"rendezvous_port": "x"})
    with pytest.raises(ValueError, match="unknown"):
        ConnectorConfig.of({"stroage": "/kv"})
    assert auth_files(None) == ("", "")


class _Agent:
    def __init__(self) -> None:
        self.claimed: list[str] = []
        self.registered = True

    def claim(self, request_id: str) -> None:
        self.claimed.append(request_id)


def _fake_vllm(bodies: list[dict], prefilled: asyncio.Event) -> httpx.AsyncClient:
    """A vLLM's /v1/completions: a non-streamed answer (a prefill) or two streamed chunks,
    a receiver's once a prefill ran (as vLLM parks a receiver until its KV arrived)."""

    async def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        bodies.append(body)
        if not body["stream"]:
            prefilled.set()
            usage = {"prompt_tokens_details": {"cached_tokens": 0}}
            return httpx.Response(200, json={"choices": [{"token_ids": [5]}], "usage": usage})
        if Route.of(body.get("kv_transfer_params")).receive:
            await asyncio.wait_for(prefilled.wait(), 30)
        events = [
            {"choices": [{"token_ids": [11, 12]}]},
            {"choices": [{"token_ids": [13], "finish_reason": "length"}]},
        ]
        sse = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
        return httpx.Response(200, content=sse + b"data: [DONE]\n\n")

    return httpx.AsyncClient(base_url="http://vllm", transport=httpx.MockTransport(handle))


@pytest.fixture
async def pair(tmp_path):
    cfg = _cfg(tmp_path)
    ca = LocalCA(tmp_path / "tls", "c1")
    workers, servers = {}, []
    prefilled = asyncio.Event()
    for role, name in ((Role.PREFILL, "prefill-0"), (Role.DECODE, "decode-0")):
        auth = TlsCredentials(ca.issue_dir(name, role.value, name))
        w = VllmWorker(cfg, NodeOptions(role=role, node_id=name, token=auth), config_file="")
        w.bodies = []
        w.http = _fake_vllm(w.bodies, prefilled)
        w._agent = _Agent()
        server = WorkerServer(w, auth, servicer=VllmServicer(w))
        w.port = await server.start("127.0.0.1", 0)
        w.started = True
        workers[name], servers = w, [*servers, server]
    frontend = TlsCredentials(ca.issue_dir("frontend", "frontend", "frontend"))
    # the connector's loopback rendezvous in the decode's vLLM: a target of 2 layers
    asked: list[str] = []

    def ready(xfer_id: str, timeout_s: float) -> Ready:
        asked.append(xfer_id)
        return Ready(
            KvTarget("decode-0-vllm-4242-a1b2c3", b"meta", (1 << 20, 2 << 20), 512, (3, 4, 5)), 0
        )

    rv = RendezvousServer(0, ready)
    workers["decode-0"].rendezvous_port = rv.port
    workers["decode-0"].asked = asked
    try:
        yield workers["prefill-0"], workers["decode-0"], frontend
    finally:
        rv.close()
        for w in workers.values():
            await w._prefills.close()
            await w.http.aclose()
        for s in servers:
            await s.stop(grace_s=0.1)


async def test_a_turn_over_mtls_claims_its_route_on_both_nodes_and_samples_as_asked(pair):
    prefill, decode, frontend = pair
    req = wpb.GenerateRequest(
        request_id="turn-1",
        prompt_tokens=list(range(1, 2 * BT + 5)),
        hit_tokens=BT,
        read_path=spb.READ_PATH_PREFILL,
        prefill_node="prefill-0",
        prefill_address=prefill.address,
        max_new_tokens=3,
        temperature=0.5,
        seed=7,
        top_k=3,
        stop_tokens=[2],
    )
    async with channel(decode.address, frontend, server_role="decode") as ch:
        chunks = [c async for c in wpb_grpc.WorkerStub(ch).Generate(req, timeout=30)]
    assert [list(c.tokens) for c in chunks] == [[11, 12], [13]]
    assert chunks[0].read_path == spb.READ_PATH_PREFILL and chunks[-1].finish_reason == "length"
    # the decode's vLLM was asked first, as a receiver of the transfer it then asked about
    (dbody,) = decode.bodies
    assert dbody["stream"] and dbody["prompt"] == list(req.prompt_tokens)
    recv = Route.of(dbody["kv_transfer_params"])
    assert recv.receive and recv.xfer_id.startswith("turn-1/") and recv.deadline_unix > 0
    assert decode.asked == [recv.xfer_id]
    # path P: the prefill node's vLLM computed the prompt (greedy, one token), sending its KV
    # to the target the rendezvous named, under the same transfer id and deadline
    (pbody,) = prefill.bodies
    assert (pbody["max_tokens"], pbody["temperature"], pbody["stream"]) == (1, 0.0, False)
    send = Route.of(pbody["kv_transfer_params"])
    assert (send.hit_tokens, send.read_path, send.peer, send.request_id) == (
        BT,
        "prefill",
        "decode-0",
        "turn-1",
    )
    assert (send.xfer_id, send.deadline_unix) == (recv.xfer_id, recv.deadline_unix)
    assert send.send_to == KvTarget(
        "decode-0-vllm-4242-a1b2c3", b"meta", (1 << 20, 2 << 20), 512, (3, 4, 5)
    )
    assert {k: dbody.get(k) for k in ("max_tokens", "temperature", "seed", "top_k")} == {
        "max_tokens": 3,
        "temperature": 0.5,
        "seed": 7,
        "top_k": 3,
    }
    assert dbody["stop_token_ids"] == [2] and "top_p" not in dbody
    assert prefill._agent.claimed == ["turn-1"] and decode._agent.claimed == ["turn-1"]
    assert decode.inflight == prefill.inflight == 0 and decode.read_pending_bytes == 0


async def test_bad_fields_wrong_roles_and_plaintext_are_refused(pair):
    prefill, decode, frontend = pair
    async with channel(decode.address, frontend, server_role="decode") as ch:
        stub = wpb_grpc.WorkerStub(ch)
        bad = wpb.GenerateRequest(request_id="r", prompt_tokens=[1 << 30], max_new_tokens=1)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            [c async for c in stub.Generate(bad, timeout=10)]
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "prompt_tokens" in err.value.details()
    async with channel(prefill.address, frontend, server_role="prefill") as ch:
        ok = wpb.GenerateRequest(request_id="r", prompt_tokens=[1], max_new_tokens=1)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            [c async for c in wpb_grpc.WorkerStub(ch).Generate(ok, timeout=10)]
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    # a frontend may not ask a prefill node for a Prefill (only a decode node, for itself)
    async with channel(prefill.address, frontend, server_role="prefill") as ch:
        order = wpb.PrefillRequest(request_id="r", prompt_tokens=[1, 2], decode_node="decode-0")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            [m async for m in wpb_grpc.WorkerStub(ch).Prefill(order, timeout=10)]
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    async with channel(decode.address, None) as ch:  # plaintext: no handshake, no call
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await wpb_grpc.WorkerStub(ch).GetTransferInfo(wpb.TransferInfoRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert prefill.bodies == [] and decode.bodies == []


async def test_a_receiver_vllm_refuses_fails_the_turn_without_waiting_or_a_prefill(pair):
    """The rendezvous would wait for a request vLLM never parks: the refusal ends the turn."""
    prefill, decode, frontend = pair

    def refuse(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"error": "bad request"})

    def never_ready(xfer_id: str, timeout_s: float) -> Ready:
        time.sleep(min(timeout_s, 30))  # a server thread: as the connector's, bounded
        raise RendezvousError(f"transfer {xfer_id} not ready")

    await decode.http.aclose()
    decode.http = httpx.AsyncClient(base_url="http://vllm", transport=httpx.MockTransport(refuse))
    rv = RendezvousServer(0, never_ready)
    decode.rendezvous_port = rv.port
    req = wpb.GenerateRequest(
        request_id="turn-2",
        prompt_tokens=list(range(1, BT + 5)),
        prefill_node="prefill-0",
        prefill_address=prefill.address,
        max_new_tokens=2,
    )
    async with channel(decode.address, frontend, server_role="decode") as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            [c async for c in wpb_grpc.WorkerStub(ch).Generate(req, timeout=30)]
    rv.close()
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "400" in err.value.details()
    assert prefill.bodies == [] and decode.inflight == 0


def test_metrics_dirs_of_dead_workers_are_removed_and_live_ones_kept(tmp_path):
    """A SIGKILLed worker never runs `stop`: the next worker on the node removes its metrics
    directory (a dead pid), never a live worker's."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from dualpath.worker.vllm import METRICS_DIR_PREFIX, metrics_dir

    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    dead = tmp_path / f"{METRICS_DIR_PREFIX}{gone.stdout.strip()}-abc"
    live = tmp_path / f"{METRICS_DIR_PREFIX}{os.getppid()}-def"
    other = tmp_path / "unrelated"
    for d in (dead, live, other):
        d.mkdir()
        (d / "counter_1.db").write_bytes(b"x")
    mine = metrics_dir(str(tmp_path))
    assert not dead.exists()
    assert live.exists() and other.exists()
    assert Path(mine).name.startswith(f"{METRICS_DIR_PREFIX}{os.getpid()}-")
