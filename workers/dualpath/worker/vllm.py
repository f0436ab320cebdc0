"""A DualPath worker whose engine is vLLM (`spec.workers.engine: vllm`).

The process the frontend and scheduler already know (`dualpath worker --role R`, built by
`process.process_command`): it registers with the scheduler, heartbeats its load, answers the
Worker service, and serves each turn on its own vLLM (`integrations.vllm.server.vllm_command`,
a child process with the DualPath connector), passing the route in `kv_transfer_params`
(`integrations.vllm.plan.Route`).

- decode node, path P (and a turn with no hit): the prefill node computes the prompt on its
  vLLM (`Prefill`: its connector reads the hit from the store through the prefill node's read
  queue and saves the prompt's new blocks); then this node's vLLM loads the prompt's full
  blocks from the store and decodes. The prefill->decode hand-off goes through the store, not
  NIXL (docs/vllm.md, limits).
- decode node, path D: this node's vLLM reads the hit itself (its read queue) and computes the
  new tokens too; the prefill node is not called.
A vLLM that exits takes the worker with it (exit code 1), so the supervisor (or the kubelet)
restarts both.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import signal
import socket
import time

import grpc
import httpx
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from dualpath.config import ClusterConfig, Role
from dualpath.grpc_auth import channel as token_channel
from dualpath.grpc_auth import connected, server_interceptors
from dualpath.integrations.vllm import metrics
from dualpath.integrations.vllm.blocks import usable_hit_tokens
from dualpath.integrations.vllm.plan import Route
from dualpath.integrations.vllm.server import VLLM_BLOCK_TOKENS, vllm_command
from dualpath.scheduler.policy.types import NodeLoad
from dualpath.scheduler.wire import ROLE_TO_PB
from dualpath.v1 import scheduler_pb2 as spb
from dualpath.v1 import worker_pb2 as wpb
from dualpath.v1 import worker_pb2_grpc as wpb_grpc
from dualpath.worker import FAILED_NODE_KEY
from dualpath.worker.node import NodeOptions

log = logging.getLogger(__name__)

_PATH_NAMES = {spb.READ_PATH_PREFILL: "prefill", spb.READ_PATH_DECODE: "decode"}
_PATH_PB = {"prefill": spb.READ_PATH_PREFILL, "decode": spb.READ_PATH_DECODE}
VLLM_POLL_S = 0.5


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


class VllmServicer(wpb_grpc.WorkerServicer):
    def __init__(self, node: VllmWorker) -> None:
        self.node = node

    async def GetTransferInfo(self, request, context):  # noqa: N802, ANN001, ANN201
        n = self.node
        return wpb.TransferInfo(
            node_id=n.node_id, role=ROLE_TO_PB[n.role.value], config_hash=n.cfg.config_hash
        )

    async def Prefill(self, request, context):  # noqa: N802, ANN001, ANN201
        n = self.node
        if n.role is not Role.PREFILL:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{n.node_id} is decode")
        route = Route(
            hit_tokens=int(request.hit_tokens),
            read_path="prefill",
            peer=request.decode_node,
            cache_salt=bytes(request.cache_salt),
            request_id=request.request_id,
        )
        t0 = time.perf_counter()
        try:
            body = await n.complete(list(request.prompt_tokens), route, max_tokens=1)
        except (httpx.HTTPError, RuntimeError) as err:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{n.node_id} vLLM: {err}")
        usage = body.get("usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        log.debug("prefill %s: %s hit tokens loaded", request.request_id, cached)
        yield wpb.PrefillMessage(done=wpb.PrefillDone(compute_seconds=time.perf_counter() - t0))

    async def Generate(self, request, context):  # noqa: N802, ANN001, ANN201
        n = self.node
        if n.role is not Role.DECODE:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{n.node_id} is prefill")
        try:
            async for chunk in n.generate(request):
                yield chunk
        except grpc.aio.AioRpcError as err:  # the prefill node failed: name it for the retry
            context.set_trailing_metadata(((FAILED_NODE_KEY, request.prefill_node),))
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"prefill {request.prefill_node}: {err.code().name}: {err.details()}",
            )
        except (httpx.HTTPError, RuntimeError) as err:
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
        self.draining = False
        self.inflight = 0
        self.tokens_running = 0
        self.read_pending_bytes = 0
        self.port = 0
        self.proc: asyncio.subprocess.Process | None = None
        self.http: httpx.AsyncClient | None = None
        self._server: grpc.aio.Server | None = None
        self._agent = None
        self._publisher = None
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._watch: asyncio.Task | None = None
        self.exited = asyncio.Event()  # the vLLM child exited: the worker must exit too

    # ---- start ----------------------------------------------------------------------------

    async def start(self) -> VllmWorker:
        spec = self.cfg.spec
        storage = self.opts.storage or spec.storage.path
        vport = _free_loopback_port()
        cmd = vllm_command(
            self.cfg,
            config_file=self.config_file,
            port=vport,
            storage=storage,
            node_id=self.node_id,
            scheduler=self.opts.scheduler,
            token_file=str(self.opts.token.path) if self.opts.token else "",
        )
        log.info("%s: starting vLLM on 127.0.0.1:%d", self.node_id, vport)
        self.proc = await asyncio.create_subprocess_exec(
            *cmd.argv, env={**os.environ, **cmd.env}, preexec_fn=_die_with_parent
        )
        self._watch = asyncio.create_task(self._watch_child())
        self.http = httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{vport}",
            timeout=httpx.Timeout(spec.workers.request_timeout_seconds, connect=10.0),
        )
        await self._wait_vllm(spec.workers.startup_seconds)
        self._server = grpc.aio.server(
            interceptors=server_interceptors(self.opts.token, f"{self.role.value}-worker")
        )
        wpb_grpc.add_WorkerServicer_to_server(VllmServicer(self), self._server)
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        self.port = self._server.add_insecure_port(f"{self.opts.host}:{self.opts.port}")
        await self._server.start()
        await self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        if self.opts.scheduler:
            await self._register(storage)
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
        adv = self.opts.advertise
        if adv and adv.rsplit(":", 1)[-1].isdigit():
            return adv
        return f"{adv or self.opts.advertise_host or self.opts.host}:{self.port}"

    async def _register(self, storage: str) -> None:
        from dualpath.kv.events import KvEventBuffer
        from dualpath.kv.store import KVStore
        from dualpath.scheduler.client import NodeAgent, Registration
        from dualpath.scheduler.kv_events import KvEventPublisher
        from dualpath.units import gbps_to_bytes_per_s

        spec = self.cfg.spec
        pool = spec.pool(self.role)
        snic = gbps_to_bytes_per_s(spec.storage.snic_gbps) if spec.storage.snic_gbps else 0.0
        reg = Registration(
            node_id=self.node_id,
            role=self.role.value,
            address=self.address,
            snic_bytes_per_s=snic,
            prefill_tokens_per_s=float(pool.prefill_tokens_per_s),
            config_hash=self.cfg.config_hash,
        )
        self._agent = NodeAgent(
            self.opts.scheduler,
            reg,
            self.load,
            interval_s=spec.scheduler.heartbeat_interval_ms / 1000.0,
            token=self.opts.token,
        )
        # the connector in vLLM publishes what it stores; this node answers the scheduler's
        # store scans (a rebuilt index) with a scan of the same directory
        store = KVStore(storage, spec.model, spec.storage.capacity_bytes, backend="preadv")
        self._store = store
        self._publisher = KvEventPublisher(
            self._agent.stub, self.node_id, KvEventBuffer(), store.scan_keys
        ).start()
        self._agent.on_kv_snapshot = self._publisher.request_snapshot
        self._agent.start()

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

    def _body(self, prompt: list[int], route: Route, max_tokens: int, **sampling) -> dict:
        return {
            "model": self.cfg.spec.model.name,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "return_token_ids": True,
            "kv_transfer_params": route.params(),
            **sampling,
        }

    async def complete(self, prompt: list[int], route: Route, max_tokens: int) -> dict:
        """One non-streamed completion on this node's vLLM (a prefill: max_tokens 1)."""
        return await self._tracked(prompt, route, self._post(prompt, route, max_tokens))

    async def _post(self, prompt: list[int], route: Route, max_tokens: int) -> dict:
        r = await self.http.post(
            "/v1/completions", json=self._body(prompt, route, max_tokens, temperature=0.0)
        )
        if r.status_code != 200:
            raise RuntimeError(f"vLLM answered {r.status_code}: {r.text[:200]}")
        return r.json()

    async def _tracked(self, prompt: list[int], route: Route, coro):  # noqa: ANN001, ANN202
        reads = route.hit_tokens * self.cfg.spec.model.kv_bytes_per_token
        self.inflight += 1
        self.tokens_running += len(prompt)
        self.read_pending_bytes += reads
        try:
            return await coro
        finally:
            self.inflight -= 1
            self.tokens_running -= len(prompt)
            self.read_pending_bytes -= reads

    async def _prefill_on_peer(self, req) -> None:  # noqa: ANN001
        stub = await self._stub(req.prefill_address)
        call = stub.Prefill(
            wpb.PrefillRequest(
                request_id=req.request_id,
                prompt_tokens=req.prompt_tokens,
                hit_tokens=req.hit_tokens,
                read_path=spb.READ_PATH_PREFILL,
                decode_node=self.node_id,
                cache_salt=req.cache_salt,
            ),
            timeout=self.cfg.spec.workers.request_timeout_seconds,
        )
        async for _ in call:
            pass

    async def _stub(self, address: str) -> wpb_grpc.WorkerStub:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = token_channel(address, self.opts.token)
        await connected(ch)
        return wpb_grpc.WorkerStub(ch)

    async def generate(self, req):  # noqa: ANN001, ANN201
        """Serve one turn (decode node); yields GenerateChunks."""
        prompt = list(req.prompt_tokens)
        bt = self.cfg.spec.model.block_tokens
        path = _PATH_NAMES.get(req.read_path, "prefill") if req.hit_tokens else "none"
        salt = bytes(req.cache_salt)
        if path == "decode":  # path D: this node reads the hit and computes the new tokens
            route = Route(req.hit_tokens, "decode", req.prefill_node, salt, req.request_id)
        else:  # path P: the prefill node reads and computes; its blocks come through the store
            await self._prefill_on_peer(req)
            route = Route(len(prompt) // bt * bt, "prefill", req.prefill_node, salt, req.request_id)
        metrics.TURNS.labels(path=path).inc()
        hit = usable_hit_tokens(req.hit_tokens, len(prompt), VLLM_BLOCK_TOKENS)
        sampling = {
            "temperature": req.temperature,
            "stream": True,
            "stop_token_ids": list(req.stop_tokens),
            "min_tokens": req.min_tokens,
        }
        if req.seed:
            sampling["seed"] = req.seed
        if 0 < req.top_p < 1:
            sampling["top_p"] = req.top_p
        if req.top_k:
            sampling["top_k"] = req.top_k
        body = self._body(prompt, route, req.max_new_tokens, **sampling)
        first = True
        self.inflight += 1
        self.tokens_running += len(prompt)
        # path D: this node's read queue reads the hit (the heartbeat's read-pending bytes)
        reads = route.hit_tokens * self.cfg.spec.model.kv_bytes_per_token if path == "decode" else 0
        self.read_pending_bytes += reads
        try:
            async with self.http.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"vLLM answered {r.status_code}: {(await r.aread())[:200]}")
                async for line in _sse_data(r):
                    msg = json.loads(line)
                    for c in msg.get("choices") or ():
                        chunk = wpb.GenerateChunk(
                            tokens=c.get("token_ids") or [],
                            finish_reason=c.get("finish_reason") or "",
                        )
                        if first:  # the route's hit in whole vLLM blocks (docs/vllm.md)
                            first = False
                            self.read_pending_bytes -= reads  # read before the first token
                            reads = 0
                            chunk.hit_tokens = hit
                            chunk.read_path = _PATH_PB.get(path, spb.READ_PATH_UNSPECIFIED)
                        yield chunk
        finally:
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
        self.started = False
        if self._publisher is not None:
            await self._publisher.stop()
        if self._agent is not None:
            await self._agent.stop()
        if self._server is not None:
            await self._server.stop(grace=1.0)
        for ch in self._channels.values():
            await ch.close()
        if self.http is not None:
            await self.http.aclose()
        if self.proc is not None and self.proc.returncode is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), 15.0)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        log.info("worker %s (vLLM) stopped", self.node_id)
