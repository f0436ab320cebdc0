"""A worker process: what a prefill or decode node holds, and its gRPC service.

`WorkerNode` owns the node's parts and stops them in order: the torch engine (one compute
thread), the KV store and its read queue (the node's storage NIC, optionally capped at
`storage.snicGbps`), the NIXL transfer engine with its registered KV buffer (and the
emulated compute link, `network.cnicGbps`), the scheduler registration with heartbeats, the
gRPC server (Worker service + standard health) and the /metrics, /livez, /readyz endpoints.

Its timeouts, KV cache size and drain time come from `spec.workers` (NodeOptions may override
them for tests and local experiments). On drain it tells the scheduler first, then lets every
call in flight finish (storage reads, D->P relays, prefill->decode handoffs, decoding) within
`spec.workers.drainSeconds`, then stops.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from dualpath.config import ClusterConfig, Role
from dualpath.grpc_auth import Auth, add_port, connected, server_interceptors
from dualpath.grpc_auth import channel as token_channel
from dualpath.scheduler.policy.types import NodeLoad
from dualpath.scheduler.wire import ROLE_TO_PB
from dualpath.units import gbps_to_bytes_per_s
from dualpath.v1 import worker_pb2 as wpb
from dualpath.v1 import worker_pb2_grpc as wpb_grpc
from dualpath.worker import metrics

if TYPE_CHECKING:  # the parts import torch and NIXL: loaded in start(), off the CLI's path
    from dualpath.engine import Engine
    from dualpath.kv.events import KvEventBuffer
    from dualpath.kv.protocol import BlockStore
    from dualpath.kv.queue import ReadQueue
    from dualpath.scheduler.client import NodeAgent
    from dualpath.scheduler.kv_events import KvEventPublisher
    from dualpath.transfer.protocol import KVTransfer
    from dualpath.worker.checks import Check
    from dualpath.worker.decode import DecodeRole
    from dualpath.worker.prefill import PrefillRole

log = logging.getLogger(__name__)

# After telling the scheduler it drains, a worker keeps serving at least this long even when
# idle: a request the scheduler routed here just before the drain may still be on its way.
DRAIN_SETTLE_S = 1.0
# How often a draining worker asks the scheduler how many requests routed to it are still open.
DRAIN_POLL_S = 0.2


@dataclass
class NodeOptions:
    role: Role
    node_id: str
    host: str = "127.0.0.1"
    port: int = 0
    advertise: str = ""  # host[:port] peers and the scheduler use (port: the bound one)
    advertise_host: str = ""  # with the bound port when `advertise` is empty (default host)
    scheduler: str = ""  # empty: run without a scheduler (tests)
    storage: str = ""
    # None: from spec.workers (kvCacheTokens, transferDeadlineSeconds, requestTimeoutSeconds,
    # drainSeconds); a value overrides the config for tests and local experiments
    kv_cache_tokens: int | None = None  # decode: the paged KV cache of the decode batch
    deadline_s: float | None = None  # one transfer, one notification wait, one buffer wait
    request_timeout_s: float | None = None  # one Prefill call, queueing for compute included
    drain_s: float | None = None  # drain bound on SIGTERM
    store_backend: str = "auto"
    # the cluster token every gRPC call to and from this node carries, or its mutual TLS
    # certificate (`dualpath.tls`); None: unauthenticated
    token: Auth | None = None


def _given_or(given: float | None, spec_value: float) -> float:
    return spec_value if given is None else given


class WorkerServicer(wpb_grpc.WorkerServicer):
    """Thin adapter: role objects do the work; errors become gRPC statuses."""

    def __init__(self, node: WorkerNode) -> None:
        self.node = node

    async def GetTransferInfo(self, request, context):  # noqa: N802, ANN001, ANN201
        n = self.node
        return wpb.TransferInfo(
            agent=n.transfer.name,
            metadata=n.transfer.metadata,
            node_id=n.node_id,
            role=ROLE_TO_PB[n.role.value],
            config_hash=n.cfg.config_hash,
        )

    async def Prefill(self, request, context):  # noqa: N802, ANN001, ANN201
        from dualpath.worker.prefill import VALID_HIT_KEY, HitUnavailable

        n = self.node
        if n.prefill is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"{n.node_id} is a decode node"
            )
        if n.stopping:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{n.node_id} is stopping")
        n.inflight += 1  # a drain waits for it: its reads, relays and handoff to decode
        n.claim(request.request_id)
        try:
            with n.transfer.active():
                await n.prefill.serve(request, context)
        except HitUnavailable as err:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"hit KV unavailable: {err}",
                # keeps what the role set (a WRITE that may still land: WRITES_IN_FLIGHT_KEY)
                trailing_metadata=(
                    (VALID_HIT_KEY, str(err.valid_tokens)),
                    *(context.trailing_metadata() or ()),
                ),
            )
        except ValueError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except Exception as err:
            log.exception("prefill %s failed", request.request_id)
            await context.abort(grpc.StatusCode.INTERNAL, f"prefill failed: {err}")
        finally:
            n.inflight -= 1

    async def Generate(self, request, context):  # noqa: N802, ANN001, ANN201
        from dualpath.worker import FAILED_NODE_KEY
        from dualpath.worker.decode import PrefillFailed

        n = self.node
        if n.decode is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"{n.node_id} is a prefill node"
            )
        # a draining node still serves what the scheduler routed before it learned of the drain
        if n.stopping:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{n.node_id} is stopping")
        n.inflight += 1
        n.claim(request.request_id)
        try:
            async for chunk in n.decode.generate(request):
                yield chunk
        except ValueError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except asyncio.CancelledError:
            raise
        except Exception as err:
            log.warning("request %s failed: %s", request.request_id, err)
            # which side failed, for the frontend's retry and the scheduler's breaker
            culprit = request.prefill_node if isinstance(err, PrefillFailed) else n.node_id
            context.set_trailing_metadata(((FAILED_NODE_KEY, culprit),))
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{n.node_id}: {err}")
        finally:
            n.inflight -= 1


class WorkerNode:
    """One worker process's parts. Every attribute exists from `__init__`: the parts `start()`
    builds are None until then (and `stop()` closes only those that exist). A `store` or a
    `transfer` given here is used instead of the one `start()` would build (the in-memory
    `kv.memory.MemoryStore` and `transfer.fake.MemoryTransfer` in tests without NIXL)."""

    def __init__(
        self,
        cfg: ClusterConfig,
        opts: NodeOptions,
        store: BlockStore | None = None,
        transfer: KVTransfer | None = None,
    ) -> None:
        self.cfg = cfg
        self.opts = opts
        self.role = opts.role
        self.node_id = opts.node_id
        metrics.INFO.labels(role=self.role.value, node=self.node_id).set(1)
        w = cfg.spec.workers
        self.kv_cache_tokens = int(_given_or(opts.kv_cache_tokens, w.kv_cache_tokens))
        self.deadline_s = float(_given_or(opts.deadline_s, w.transfer_deadline_seconds))
        self.request_timeout_s = float(_given_or(opts.request_timeout_s, w.request_timeout_seconds))
        self.drain_s = float(_given_or(opts.drain_s, w.drain_seconds))
        self.draining = False  # told the scheduler; still serving what is in flight
        self.stopping = False  # refusing new calls
        self.inflight = 0  # Prefill and Generate calls being served
        self.started = False  # model loaded, gRPC server up
        self._loop: asyncio.AbstractEventLoop | None = None
        self.checks: list[Check] = []  # start-up checks of the pod's environment
        self.engine: Engine | None = None
        self.store: BlockStore | None = store
        self.read_queue: ReadQueue | None = None
        self.transfer: KVTransfer | None = transfer
        self.prefill: PrefillRole | None = None
        self.decode: DecodeRole | None = None
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._server: grpc.aio.Server | None = None
        self._health: health.aio.HealthServicer | None = None
        self._agent: NodeAgent | None = None
        # the store's KV events (with a scheduler), and their publisher
        self.kv_events: KvEventBuffer | None = None
        self._publisher: KvEventPublisher | None = None
        self.port = 0

    # ---- start ----------------------------------------------------------------------------

    async def start(self) -> WorkerNode:
        from dualpath.engine import Engine
        from dualpath.kv import KVStore, ReadQueue
        from dualpath.transfer.engine import TransferEngine
        from dualpath.transfer.link import ComputeLink
        from dualpath.worker.checks import run_checks
        from dualpath.worker.decode import DecodeRole
        from dualpath.worker.prefill import PrefillRole

        spec = self.cfg.spec
        pool = spec.pool(self.role)
        self.checks = run_checks(spec, self.role)
        loop = self._loop = asyncio.get_running_loop()
        # the model loads on a thread so the loop stays responsive (/livez and /readyz answer
        # 503 "starting" meanwhile; the pod's startupProbe allows spec.workers.startupSeconds)
        cache_tokens = self.kv_cache_tokens if self.role is Role.DECODE else spec.model.block_tokens
        self.engine = await loop.run_in_executor(
            None, lambda: Engine(spec.model, kv_capacity_tokens=cache_tokens)
        )
        storage = self.opts.storage or spec.storage.path
        backend = self.opts.store_backend if spec.storage.use_nixl else "preadv"
        if self.store is None:
            if self.opts.scheduler:
                from dualpath.kv.events import KvEventBuffer

                self.kv_events = KvEventBuffer()
            self.store = KVStore(
                storage,
                spec.model,
                spec.storage.capacity_bytes,
                backend=backend,
                events=self.kv_events,
            )
        self.read_queue = ReadQueue(
            self.store,
            spec.storage.read_concurrency,
            spec.storage.snic_gbps,
            name=self.node_id,
            read_timeout_s=spec.storage.read_timeout_ms / 1000,
        )
        if self.transfer is None:
            self.transfer = TransferEngine(
                self.node_id,
                pool.kv_buffer_bytes,
                link=ComputeLink.from_spec(spec.network, name=self.node_id),
                deadline_s=self.deadline_s,
            )
        self.transfer.start()
        if self.role is Role.PREFILL:
            self.prefill = await PrefillRole(
                model=spec.model,
                engine=self.engine,
                transfer=self.transfer,
                read_queue=self.read_queue,
                deadline_s=self.deadline_s,
                batch_quota_ms=spec.workers.prefill_batch_quota_ms,
            ).start()
        else:
            self.decode = DecodeRole(
                node_id=self.node_id,
                model=spec.model,
                engine=self.engine,
                store=self.store,
                transfer=self.transfer,
                read_queue=self.read_queue,
                deadline_s=self.deadline_s,
                request_timeout_s=self.request_timeout_s,
                worker_stub=self.worker_stub,
                flush_kv_events=self.flush_kv_events,
            )
            self.decode.start()
        self._server = grpc.aio.server(
            interceptors=server_interceptors(self.opts.token, f"{self.role.value}-worker"),
            options=[
                ("grpc.max_receive_message_length", 64 << 20),
                ("grpc.max_send_message_length", 64 << 20),
            ],
        )
        wpb_grpc.add_WorkerServicer_to_server(WorkerServicer(self), self._server)
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        self.port = add_port(self._server, f"{self.opts.host}:{self.opts.port}", self.opts.token)
        await self._server.start()
        await self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self._health.set("dualpath.v1.Worker", health_pb2.HealthCheckResponse.SERVING)
        if self.opts.scheduler:
            await self._register()
        self.started = True
        log.info(
            "%s worker %s serving on %s (SNIC %s Gbps, KV buffer %d MiB, storage %s)",
            self.role.value,
            self.node_id,
            self.address,
            spec.storage.snic_gbps or "uncapped",
            pool.kv_buffer_bytes >> 20,
            storage,
        )
        return self

    @property
    def address(self) -> str:
        adv = self.opts.advertise
        if adv and adv.rsplit(":", 1)[-1].isdigit():
            return adv
        return f"{adv or self.opts.advertise_host or self.opts.host}:{self.port}"

    async def _register(self) -> None:
        from dualpath.scheduler.client import NodeAgent, Registration
        from dualpath.scheduler.kv_events import KvEventPublisher

        spec = self.cfg.spec
        pool = spec.pool(self.role)
        snic = gbps_to_bytes_per_s(spec.storage.snic_gbps) if spec.storage.snic_gbps else 0.0
        reg = Registration(
            node_id=self.node_id,
            role=self.role.value,
            address=self.address,
            transfer_address=self.transfer.name,
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
        if self.kv_events is not None:  # a store given to the node announces nothing
            self._publisher = KvEventPublisher(
                self._agent.stub, self.node_id, self.kv_events, self.store.scan_keys
            ).start()
            self._agent.on_kv_snapshot = self._publisher.request_snapshot
        self._agent.start()

    def claim(self, request_id: str) -> None:
        """A routed request's call reached this node: the scheduler stops its route lease."""
        if self._agent is not None:
            self._agent.claim(request_id)

    async def flush_kv_events(self) -> None:
        """Wait until the scheduler's block index has this store's events so far."""
        if self._publisher is not None:
            await self._publisher.flush()

    def load(self) -> NodeLoad:
        if self.prefill is not None:
            q, r, n = (
                self.prefill.load.tokens_queued,
                self.prefill.load.tokens_running,
                self.prefill.load.requests_running,
            )
        else:
            q, r, n = (
                self.decode.tokens_queued,
                self.decode.tokens_running,
                self.decode.requests_running,
            )
        free = self.transfer.pool.free_bytes
        if self.decode is not None:  # a decoding context lives in the paged cache afterwards
            cache = self.engine.cache
            cache_free = (
                cache.free_pages * cache.page_tokens * self.cfg.spec.model.kv_bytes_per_token
            )
            free = min(free, cache_free)
        load = NodeLoad(
            read_pending_bytes=self.read_queue.pending_bytes,
            tokens_queued=q,
            tokens_running=r,
            requests_running=n,
            buffer_free_bytes=free,
            draining=self.draining,
        )
        metrics.LOAD.labels("read_pending_bytes").set(load.read_pending_bytes)
        metrics.LOAD.labels("tokens_queued").set(q)
        metrics.LOAD.labels("tokens_running").set(r)
        metrics.LOAD.labels("buffer_free_bytes").set(load.buffer_free_bytes)
        return load

    def live(self) -> tuple[bool, str]:
        """Liveness (/livez): started, and the event loop answers; alive while draining."""
        from dualpath.observability import loop_answers

        if not self.started or self._loop is None:
            return False, "stopped" if self.stopping else "starting: loading the model"
        if not loop_answers(self._loop, 2.0):
            return False, "event loop did not answer within 2s"
        return True, f"{self.role.value} {self.node_id} alive"

    def health(self) -> tuple[bool, str]:
        """Readiness (/readyz, /health): model loaded, registered with the scheduler, not
        draining."""
        if not self.started:
            return False, "starting"
        if self.draining:
            return False, "draining"
        if self._agent is not None and not self._agent.registered:
            return False, (
                "not registered with the scheduler "
                + ("(registering again)" if self._agent.registrations else "yet")
            )
        return True, f"{self.role.value} {self.node_id} ok"

    # ---- helpers for the roles -------------------------------------------------------------

    async def worker_stub(self, address: str) -> wpb_grpc.WorkerStub:
        """A peer worker's stub, once its channel is connected (a bounded wait: `connected`)."""
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = token_channel(
                address,
                self.opts.token,
                options=[("grpc.max_receive_message_length", 64 << 20)],
                server_role="prefill",  # a decode node calls prefill nodes' Prefill only
            )
        await connected(ch)
        return wpb_grpc.WorkerStub(ch)

    # ---- stop -------------------------------------------------------------------------------

    async def drain_and_stop(self) -> None:
        """Tell the scheduler this node drains (it routes nothing new here), let the work in
        flight finish for at most `spec.workers.drainSeconds`, then stop. In flight: this node's
        Prefill and Generate calls (storage reads, D->P relays, prefill->decode handoffs,
        decoding) and the requests the scheduler routed here before the drain and that are not
        completed yet (their calls may still be on their way)."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        deadline = t0 + self.drain_s
        self.draining = True  # every heartbeat from now on says so too
        routed = await self._drain_call()
        log.info(
            "worker %s draining: %d calls in flight, %d routed requests open, up to %.0fs",
            self.node_id,
            self.inflight,
            routed,
            self.drain_s,
        )
        settle = min(deadline, loop.time() + DRAIN_SETTLE_S)
        next_ask = loop.time() + DRAIN_POLL_S
        while loop.time() < deadline and (self.inflight or routed or loop.time() < settle):
            await asyncio.sleep(0.02)
            if routed and loop.time() >= next_ask:
                routed = await self._drain_call()
                next_ask = loop.time() + DRAIN_POLL_S
        if self.inflight or routed:
            metrics.DRAINS.labels("timed_out").inc()
            log.warning(
                "worker %s: drain time %.0fs over with %d calls in flight and %d routed "
                "requests open: stopping them",
                self.node_id,
                self.drain_s,
                self.inflight,
                routed,
            )
        else:
            metrics.DRAINS.labels("clean").inc()
            log.info("worker %s drained in %.1fs", self.node_id, loop.time() - t0)
        await self.stop()

    async def _drain_call(self) -> int:
        """`Scheduler.Drain` (idempotent): the requests routed here and still open (0 when the
        scheduler cannot say: then only this node's own calls are waited for)."""
        if self._agent is None:
            return 0
        try:
            return await self._agent.drain()
        except grpc.aio.AioRpcError as err:
            log.warning("could not tell the scheduler we drain: %s", err.code().name)
            return 0

    async def stop(self) -> None:
        self.stopping = True
        self.started = False
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        if self._publisher is not None:
            await self._publisher.stop()
        if self._agent is not None:
            await self._agent.stop()
        if self._server is not None:
            await self._server.stop(grace=1.0)
        if self.decode is not None:
            await self.decode.stop()
        if self.prefill is not None:
            await self.prefill.stop()
        for ch in self._channels.values():
            await ch.close()
        if self.transfer is not None:
            await self.transfer.aclose()
        if self.read_queue is not None:
            self.read_queue.close()
        if self.store is not None:
            self.store.close()
        if self.engine is not None:
            self.engine.close()
        log.info("worker %s stopped (pid %d)", self.node_id, os.getpid())
