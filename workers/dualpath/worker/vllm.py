"""A DualPath worker whose engine is vLLM (`spec.workers.engine: vllm`).

The process the frontend and scheduler already know (`dualpath worker --role R`, built by
`process.process_command`): it registers with the scheduler, heartbeats its load, answers the
Worker service, and serves each turn on its own vLLM (`integrations.vllm.server.vllm_command`,
a child process with the DualPath connector), passing the route in `kv_transfer_params`
(`integrations.vllm.plan.Route`).

A turn on the decode node (docs/vllm.md, "The NIXL flow"): the adapter opens the streaming
request to its own vLLM first, as a *receiver* (`Route.receive`: vLLM parks it until the
prompt's KV arrives over NIXL); asks the connector inside its vLLM, on a loopback port
(`rendezvous.py`), where (the NIXL agent, the request's vLLM blocks), which it answers once
vLLM parked the request and, on path D, read the hit into its own blocks; then calls the
prefill node's `Prefill` with that target (`PrefillRequest.decode_vllm`). The prefill's vLLM
reads the hit from the store (path P) or streams it from the decode's blocks layer by layer
(path D), computes the rest and writes the blocks the decode lacks into them, then notifies;
the decode's vLLM recomputes the prompt's last token and decodes. No notification by the
deadline: the decode recomputes (same answer, slower, counted).
Its gRPC edge is the torch worker's: `service.WorkerServer` (mutual TLS or the cluster token,
the identity rules, the field bounds) with `VllmServicer`, which converts each call with
`wire.py` and claims each routed request (the route lease). The connector in vLLM speaks to
the scheduler with this worker's own credentials (`grpc_auth.auth_files`).
A vLLM that exits takes the worker with it (exit code 1), so the supervisor (or the kubelet)
restarts both.
Its `/metrics` is the node's: vLLM's processes write prometheus_client multiprocess files into
a directory of this worker's (PROMETHEUS_MULTIPROC_DIR), which `registry` adds to the worker's
own, so the connector's reads (`dualpath_kv_read_bytes_total`, `dualpath_vllm_*`) and vLLM's
`vllm:*` metrics are scraped where every worker's are.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import shutil
import signal
import socket
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import httpx

from dualpath.config import ClusterConfig, Role
from dualpath.grpc_auth import auth_files
from dualpath.integrations.vllm import metrics, rendezvous
from dualpath.integrations.vllm.blocks import received_tokens, usable_hit_tokens
from dualpath.integrations.vllm.connector_config import ConnectorConfig
from dualpath.integrations.vllm.plan import KvTarget, Route
from dualpath.integrations.vllm.server import VLLM_BLOCK_TOKENS, vllm_command
from dualpath.observability import WithChildMetrics
from dualpath.sampling import SamplingParams
from dualpath.scheduler.policy.types import NodeLoad
from dualpath.scheduler.wire import ROLE_TO_PB
from dualpath.v1 import worker_pb2 as wpb
from dualpath.v1 import worker_pb2_grpc as wpb_grpc
from dualpath.worker import FAILED_NODE_KEY
from dualpath.worker.common import NodeOptions, advertised_address, prefill_channels
from dualpath.worker.service import WorkerServer, WorkerServicer
from dualpath.worker.wire import (
    PrefillOrder,
    Turn,
    TurnChunk,
    VllmKvTarget,
    chunk_to_pb,
    generate_from_pb,
    prefill_from_pb,
    prefill_to_pb,
)

log = logging.getLogger(__name__)

VLLM_POLL_S = 0.5
PREFILL_SAMPLING = SamplingParams(max_tokens=1)  # a prefill on vLLM: the prompt, one token


def _free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the vLLM child before exec: SIGKILL it when this worker dies (a SIGKILLed worker
    must not leave a vLLM serving on)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


async def _sse_data(response: httpx.Response):  # noqa: ANN202
    """The `data:` payloads of a server-sent event stream, split on b"\\n" only: httpx's
    aiter_lines also splits on U+2028, U+0085, ..., which a generated text carries unescaped."""
    buf = b""
    async for part in response.aiter_bytes():
        buf += part
        *lines, buf = buf.split(b"\n")
        for line in lines:
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                yield line[6:]


METRICS_DIR_PREFIX = "dualpath-vllm-metrics-"


def metrics_dir(tmp: str | None = None) -> str:
    """A fresh directory for this worker's vLLM metrics files, named by this process's pid;
    those of workers no longer alive (a SIGKILL skips `stop`) are removed first."""
    tmp = tmp or tempfile.gettempdir()
    for old in Path(tmp).glob(f"{METRICS_DIR_PREFIX}*"):
        pid = old.name[len(METRICS_DIR_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{METRICS_DIR_PREFIX}{os.getpid()}-", dir=tmp)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def vllm_sampling(p: SamplingParams) -> dict:
    """`p` as vLLM's completion request spells it (fields left off are vLLM's "off")."""
    body = {
        "max_tokens": p.max_tokens,
        "temperature": p.temperature,
        "stop_token_ids": list(p.stop_tokens),
        "min_tokens": p.min_tokens,
    }
    if p.seed:
        body["seed"] = p.seed
    if p.top_p < 1:
        body["top_p"] = p.top_p
    if p.top_k:
        body["top_k"] = p.top_k
    return body


class VllmServicer(WorkerServicer):
    """The Worker service on engine vllm: the same checks and conversions as the torch
    worker's (`WorkerServicer._accept`, `wire`), each turn served by `VllmWorker`."""

    node: VllmWorker

    def _serves(self, role: Role) -> VllmWorker | None:
        return self.node if self.node.role is role else None

    async def GetTransferInfo(self, request, context):  # noqa: N802, ANN001, ANN201
        n = self.node
        return wpb.TransferInfo(
            node_id=n.node_id, role=ROLE_TO_PB[n.role.value], config_hash=n.cfg.config_hash
        )

    async def Prefill(self, request, context):  # noqa: N802, ANN001, ANN201
        n = self.node
        order = await self._accept(
            context,
            "Prefill",
            self._serves(Role.PREFILL),
            lambda msg, model: prefill_from_pb(msg, model, via_store=True),
            request,
        )
        n.claim(order.request_id)
        t0 = time.perf_counter()
        try:
            body = await n.prefill(order)
        except (httpx.HTTPError, RuntimeError) as err:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{n.node_id} vLLM: {err}")
        usage = body.get("usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        log.debug("prefill %s: %s hit tokens loaded", order.request_id, cached)
        yield wpb.PrefillMessage(done=wpb.PrefillDone(compute_seconds=time.perf_counter() - t0))

    async def Generate(self, request, context):  # noqa: N802, ANN001, ANN201
        n = self.node
        turn = await self._accept(
            context, "Generate", self._serves(Role.DECODE), generate_from_pb, request
        )
        n.claim(turn.request_id)
        try:
            async for chunk in n.generate(turn):
                yield chunk_to_pb(chunk)
        except grpc.aio.AioRpcError as err:  # the prefill node failed: name it for the retry
            context.set_trailing_metadata(((FAILED_NODE_KEY, turn.prefill_node),))
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"prefill {turn.prefill_node}: {err.code().name}: {err.details()}",
            )
        except (httpx.HTTPError, RuntimeError, rendezvous.RendezvousError) as err:
            context.set_trailing_metadata(((FAILED_NODE_KEY, n.node_id),))
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{n.node_id}: {err}")


class VllmWorker:
    """One worker process on engine vllm: the adapter and its vLLM child."""

    def __init__(self, cfg: ClusterConfig, opts: NodeOptions, config_file: str) -> None:
        self.cfg = cfg
        self.opts = opts
        self.role = opts.role
        self.node_id = opts.node_id
        self.config_file = config_file
        self.started = False
        self.draining = False  # told the scheduler; still serving what is in flight
        self.stopping = False  # refusing new calls
        self.inflight = 0
        self.tokens_running = 0
        self.read_pending_bytes = 0
        self.port = 0
        self.rendezvous_port = 0  # decode: the connector's loopback rendezvous in its vLLM
        self.proc: asyncio.subprocess.Process | None = None
        self.http: httpx.AsyncClient | None = None
        self._server: WorkerServer | None = None
        self._agent = None
        self._publisher = None
        self._prefills = prefill_channels(opts.token)
        self._watch: asyncio.Task | None = None
        self.exited = asyncio.Event()  # the vLLM child exited: the worker must exit too
        # vLLM's processes write their metrics here (fresh per worker process: a restarted
        # vLLM must not add its predecessor's counts); `/metrics` serves `registry`
        self.metrics_dir = metrics_dir()
        self.registry = WithChildMetrics(self.metrics_dir)

    # ---- start ----------------------------------------------------------------------------

    async def start(self) -> VllmWorker:
        spec = self.cfg.spec
        storage = self.opts.storage or spec.storage.path
        vport = _free_loopback_port()
        if self.role is Role.DECODE:
            self.rendezvous_port = _free_loopback_port()
        token_file, tls_dir = auth_files(self.opts.token)  # the connector speaks as this node
        cc = ConnectorConfig(
            config_file=self.config_file,
            storage=storage,
            node_id=self.node_id,
            scheduler=self.opts.scheduler,
            token_file=token_file,
            tls_dir=tls_dir,
            rendezvous_port=self.rendezvous_port,
        )
        cmd = vllm_command(self.cfg, port=vport, connector=cc)
        log.info("%s: starting vLLM on 127.0.0.1:%d", self.node_id, vport)
        self.proc = await asyncio.create_subprocess_exec(
            *cmd.argv,
            env={**os.environ, **cmd.env, "PROMETHEUS_MULTIPROC_DIR": self.metrics_dir},
            preexec_fn=_die_with_parent,
        )
        self._watch = asyncio.create_task(self._watch_child())
        self.http = httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{vport}",
            timeout=httpx.Timeout(spec.workers.request_timeout_seconds, connect=10.0),
        )
        await self._wait_vllm(spec.workers.startup_seconds)
        self._server = WorkerServer(self, self.opts.token, servicer=VllmServicer(self))
        self.port = await self._server.start(self.opts.host, self.opts.port)
        if self.opts.scheduler:
            await self._register(storage)
        if self.role is Role.DECODE:  # its channels to prefill nodes: idle ones closed
            self._prefills.start_sweeper()
        self.started = True
        log.info("%s worker %s (vLLM) serving on %s", self.role.value, self.node_id, self.address)
        return self

    async def _watch_child(self) -> None:
        rc = await self.proc.wait()
        if not self.draining:
            log.error("%s: vLLM exited (code %s): the worker exits too", self.node_id, rc)
        self.exited.set()

    async def _wait_vllm(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.exited.is_set():
                raise RuntimeError(f"{self.node_id}: vLLM exited while starting")
            with contextlib.suppress(httpx.HTTPError):
                if (await self.http.get("/health", timeout=2.0)).status_code == 200:
                    return
            await asyncio.sleep(VLLM_POLL_S)
        raise RuntimeError(
            f"{self.node_id}: vLLM not ready after {timeout_s}s (workers.startupSeconds)"
        )

    @property
    def address(self) -> str:
        return advertised_address(self.opts, self.port)

    async def _register(self, storage: str) -> None:
        from dualpath.kv.events import KvEventBuffer
        from dualpath.kv.store import KVStore
        from dualpath.scheduler.kv_events import KvEventPublisher
        from dualpath.worker.registration import node_agent, node_registration

        spec = self.cfg.spec
        reg = node_registration(self.cfg, self.role, self.node_id, self.address)
        self._agent = node_agent(self.cfg, self.opts, reg, self.load)
        # the connector in vLLM publishes what it stores; this node answers the scheduler's
        # store scans (a rebuilt index) with a scan of the same directory
        store = KVStore(storage, spec.model, spec.storage.capacity_bytes, backend="preadv")
        self._store = store
        self._publisher = KvEventPublisher(
            self._agent.stub, self.node_id, KvEventBuffer(), store.scan_keys
        ).start()
        self._agent.on_kv_snapshot = self._publisher.request_snapshot
        self._agent.start()

    def claim(self, request_id: str) -> None:
        """A routed request's call reached this node: the scheduler stops its route lease."""
        if self._agent is not None:
            self._agent.claim(request_id)

    def load(self) -> NodeLoad:
        return NodeLoad(
            read_pending_bytes=self.read_pending_bytes,
            tokens_queued=0,
            tokens_running=self.tokens_running,
            requests_running=self.inflight,
            buffer_free_bytes=self.cfg.spec.pool(self.role).kv_buffer_bytes,
            draining=self.draining,
        )

    def health(self) -> tuple[bool, str]:
        if not self.started:
            return False, "starting"
        if self.draining:
            return False, "draining"
        if self._agent is not None and not self._agent.registered:
            return False, "not registered with the scheduler yet"
        return True, f"{self.role.value} {self.node_id} (vLLM) ok"

    def live(self) -> tuple[bool, str]:
        if self.exited.is_set():
            return False, "vLLM exited"
        return (True, "alive") if self.started else (False, "starting vLLM")

    # ---- serving ----------------------------------------------------------------------------

    def _body(
        self, prompt: tuple[int, ...], route: Route, sampling: SamplingParams, stream: bool
    ) -> dict:
        return {
            "model": self.cfg.spec.model.name,
            "prompt": list(prompt),
            "return_token_ids": True,
            "kv_transfer_params": route.params(),
            "stream": stream,
            **vllm_sampling(sampling),
        }

    async def prefill(self, order: PrefillOrder) -> dict:
        """Compute the prompt on this node's vLLM (one greedy token, not streamed): its
        connector reads the hit (path P: this node's read queue; path D: the decode vLLM's
        blocks over NIXL), writes the blocks the decode lacks into the decode vLLM's cache
        (`order.decode_vllm`) and saves the new blocks to the store."""
        t = order.decode_vllm
        send_to = None
        if t is not None:
            send_to = KvTarget(
                order.decode_agent,
                order.decode_agent_metadata,
                t.layer_addresses,
                t.block_bytes,
                t.block_ids,
                t.progress_address,
            )
        path_d = order.read_path == "decode" and send_to is not None
        route = Route(
            hit_tokens=order.hit_tokens,
            read_path="decode" if path_d else "prefill",
            peer=order.decode_node,
            cache_salt=order.cache_salt,
            request_id=order.request_id,
            xfer_id=t.xfer_id if t else "",
            deadline_unix=t.deadline_unix if t else 0.0,
            send_to=send_to,
        )
        body = self._body(order.prompt, route, PREFILL_SAMPLING, stream=False)
        reads = 0 if path_d else route.hit_tokens * self.cfg.spec.model.kv_bytes_per_token
        self.inflight += 1
        self.tokens_running += len(order.prompt)
        self.read_pending_bytes += reads
        try:
            r = await self.http.post("/v1/completions", json=body)
            if r.status_code != 200:
                raise RuntimeError(f"vLLM answered {r.status_code}: {r.text[:200]}")
            return r.json()
        finally:
            self.inflight -= 1
            self.tokens_running -= len(order.prompt)
            self.read_pending_bytes -= reads

    async def _prefill_on_peer(
        self, turn: Turn, path: str, ready: rendezvous.Ready, xfer_id: str, deadline_unix: float
    ) -> None:
        """The prefill node computes the prompt and writes its KV into this vLLM's blocks."""
        t = ready.target
        order = PrefillOrder(
            request_id=turn.request_id,
            prompt=turn.prompt,
            # path D: the hit this node's vLLM holds or is reading (fewer tokens when a block
            # failed before the rendezvous answered)
            hit_tokens=ready.hit_tokens if path == "decode" else turn.hit_tokens,
            read_path="decode" if path == "decode" else "prefill",
            decode_node=self.node_id,
            decode_agent=t.agent,
            decode_agent_metadata=t.metadata,
            decode_hit=None,
            decode_new=None,
            cache_salt=turn.cache_salt,
            decode_vllm=VllmKvTarget(
                t.layer_addresses,
                t.block_bytes,
                t.block_ids,
                deadline_unix,
                xfer_id,
                t.progress_address,
            ),
        )
        stub = wpb_grpc.WorkerStub(await self._prefills.get(turn.prefill_address))
        call = stub.Prefill(
            prefill_to_pb(order), timeout=self.cfg.spec.workers.request_timeout_seconds
        )
        async for _ in call:
            pass

    async def _stream(self, body: dict, out: asyncio.Queue) -> None:
        """This node's vLLM's streamed answer, message by message, then None (or the error)."""
        try:
            async with self.http.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"vLLM answered {r.status_code}: {(await r.aread())[:200]}")
                async for line in _sse_data(r):
                    await out.put(json.loads(line))
            await out.put(None)
        except Exception as err:  # noqa: BLE001 (handed to the turn's generator)
            await out.put(err)

    async def generate(self, turn: Turn) -> AsyncIterator[TurnChunk]:
        """Serve one turn (decode node): receive the prompt's KV from the prefill node."""
        prompt = turn.prompt
        path = turn.read_path if turn.hit_tokens else "none"
        metrics.TURNS.labels(path=path).inc()
        hit = usable_hit_tokens(turn.hit_tokens, len(prompt), VLLM_BLOCK_TOKENS)
        timeout_s = self.cfg.spec.workers.request_timeout_seconds
        deadline = time.time() + timeout_s
        # a unique name per attempt: a retried turn never meets its earlier transfer
        xfer_id = f"{turn.request_id}/{uuid.uuid4().hex[:12]}"
        receive = received_tokens(len(prompt)) > 0
        route = Route(
            hit_tokens=turn.hit_tokens,
            read_path="decode" if path == "decode" else "prefill",
            peer=turn.prefill_node,
            cache_salt=turn.cache_salt,
            request_id=turn.request_id,
            xfer_id=xfer_id if receive else "",
            receive=receive,
            deadline_unix=deadline if receive else 0.0,
        )
        body = self._body(prompt, route, turn.sampling, stream=True)
        first = True
        self.inflight += 1
        self.tokens_running += len(prompt)
        # path D: this node's read queue reads the hit (the heartbeat's read-pending bytes)
        reads = hit * self.cfg.spec.model.kv_bytes_per_token if path == "decode" else 0
        self.read_pending_bytes += reads
        answers: asyncio.Queue = asyncio.Queue()
        reader = asyncio.create_task(self._stream(body, answers))
        try:
            if receive:
                ask = asyncio.create_task(rendezvous.ask(self.rendezvous_port, xfer_id, timeout_s))
                # vLLM may refuse the request or answer it without parking it (nothing to
                # receive): then its answer, or its error, is all there is
                done, _ = await asyncio.wait({ask, reader}, return_when=asyncio.FIRST_COMPLETED)
                if ask in done:
                    ready = ask.result()
                    # path D: the hit streams through this vLLM to the prefill while it is read
                    await self._prefill_on_peer(turn, path, ready, xfer_id, deadline)
                    self.read_pending_bytes -= reads  # the hit is in this vLLM's blocks now
                    reads = 0
                else:
                    ask.cancel()
                    with contextlib.suppress(asyncio.CancelledError, rendezvous.RendezvousError):
                        await ask
            while (msg := await answers.get()) is not None:
                if isinstance(msg, Exception):
                    raise msg
                for c in msg.get("choices") or ():
                    tokens = tuple(c.get("token_ids") or ())
                    finish = c.get("finish_reason") or ""
                    if first:  # the route's hit in whole vLLM blocks (docs/vllm.md)
                        first = False
                        yield TurnChunk(tokens, finish, hit_tokens=hit, read_path=path)
                    else:
                        yield TurnChunk(tokens, finish)
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            self.inflight -= 1
            self.tokens_running -= len(prompt)
            self.read_pending_bytes -= reads

    # ---- stop -------------------------------------------------------------------------------

    async def drain_and_stop(self) -> None:
        self.draining = True
        deadline = time.monotonic() + self.cfg.spec.workers.drain_seconds
        if self._agent is not None:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await self._agent.drain()
        while self.inflight and time.monotonic() < deadline and not self.exited.is_set():
            await asyncio.sleep(0.05)
        await self.stop()

    async def stop(self) -> None:
        self.draining = True
        self.stopping = True
        self.started = False
        if self._publisher is not None:
            await self._publisher.stop()
        if self._agent is not None:
            await self._agent.stop()
        if self._server is not None:
            await self._server.stop(grace_s=1.0)
        await self._prefills.close()
        if self.http is not None:
            await self.http.aclose()
        if self.proc is not None and self.proc.returncode is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), 15.0)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        shutil.rmtree(self.metrics_dir, ignore_errors=True)
        log.info("worker %s (vLLM) stopped", self.node_id)
