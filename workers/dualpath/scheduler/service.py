"""The scheduler's gRPC shell: a thin asyncio servicer over `SchedulerState` and the policy.

Route finds the request's hit in the block index (`index.py`) before the policy runs; KvEvents
and KvSnapshot feed the index, and a heartbeat ack asks a worker for a store scan while the
index is being rebuilt.

Also serves the standard health service (with graceful shutdown) and reflection.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from dualpath.grpc_auth import Auth, add_port, server_interceptors
from dualpath.grpc_bounds import BoundsInterceptor, refuse
from dualpath.scheduler import metrics as m
from dualpath.scheduler.index import Applied, keys_view, unpack_keys
from dualpath.scheduler.policy import ReadPath
from dualpath.scheduler.state import NodeConflict, SchedulerState
from dualpath.scheduler.wire import (
    ROLE_FROM_PB,
    ROLE_TO_PB,
    load_from_pb,
    load_to_pb,
    node_from_register,
    route_from_pb,
)
from dualpath.v1 import scheduler_pb2 as pb
from dualpath.v1 import scheduler_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

_PATH = {ReadPath.PREFILL: pb.READ_PATH_PREFILL, ReadPath.DECODE: pb.READ_PATH_DECODE}
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Scheduler"].full_name

# Bounds of what a request may claim: far above any real model or node, far below what would
# overflow the policy's arithmetic (an int64 of 2^63-1 tokens times bytes per token).
MAX_TOKENS = 1 << 32
MAX_BYTES = 1 << 50  # 1 PiB
MAX_QUEUE_TIMEOUT_S = 3600.0


def _out_of_range(field: str, value: float, hi: float) -> str | None:
    if not math.isfinite(value) or value < 0 or value > hi:
        return f"{field} must be in [0, {hi:g}]; got {value!r}"
    return None


def route_request_problem(r: pb.RouteRequest) -> str | None:
    """What makes a RouteRequest unservable, naming the field; None: it is well-formed."""
    if r.prompt_tokens <= 0:
        return f"prompt_tokens must be > 0; got {r.prompt_tokens}"
    return (
        _out_of_range("prompt_tokens", r.prompt_tokens, MAX_TOKENS)
        or _out_of_range("context_bytes", r.context_bytes, MAX_BYTES)
        or _out_of_range("max_new_tokens", r.max_new_tokens, MAX_TOKENS)
        or _out_of_range("queue_timeout_s", r.queue_timeout_s, MAX_QUEUE_TIMEOUT_S)
    )


def load_problem(prefix: str, load: pb.NodeLoad) -> str | None:
    return (
        _out_of_range(f"{prefix}.read_pending_bytes", load.read_pending_bytes, MAX_BYTES)
        or _out_of_range(f"{prefix}.tokens_queued", load.tokens_queued, MAX_TOKENS)
        or _out_of_range(f"{prefix}.tokens_running", load.tokens_running, MAX_TOKENS)
        or _out_of_range(f"{prefix}.requests_running", load.requests_running, MAX_TOKENS)
        or _out_of_range(f"{prefix}.buffer_free_bytes", load.buffer_free_bytes, MAX_BYTES)
    )


def register_request_problem(r: pb.RegisterRequest) -> str | None:
    """What makes a RegisterRequest unusable, naming the field; None: it is well-formed."""
    if not r.node_id or r.role not in ROLE_FROM_PB:
        return "node_id and role are required"
    host, sep, port = r.address.rpartition(":")
    if not (host and sep and port.isdigit() and 0 < int(port) < 65536):
        return f"address must be host:port; got {r.address!r}"
    return (
        _out_of_range("snic_bytes_per_s", r.snic_bytes_per_s, float(MAX_BYTES))
        or _out_of_range("prefill_tokens_per_s", r.prefill_tokens_per_s, float(MAX_TOKENS))
        or load_problem("load", r.load)
    )


async def _refuse(context, method: str, message: str, problem: str, field: str = "") -> None:  # noqa: ANN001
    """INVALID_ARGUMENT `<message>: <problem>`, counted under the field the problem names
    first (or `field`)."""
    name = field or problem.split(" ", 1)[0].rstrip(":,")
    await refuse(context, "scheduler", method, f"{message}.{name}", f"{message}: {problem}")


class SchedulerServicer(pb_grpc.SchedulerServicer):
    def __init__(
        self,
        state: SchedulerState,
        heartbeat_interval_ms: int,
        node_timeout_ms: int,
        default_queue_timeout_s: float = 5.0,
    ) -> None:
        self.state = state
        self.heartbeat_interval_ms = heartbeat_interval_ms
        self.node_timeout_ms = node_timeout_ms
        self.default_queue_timeout_s = default_queue_timeout_s
        self._changed = asyncio.Event()  # set on every load change: waiting routes retry

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def Register(self, request, context):  # noqa: N802 (gRPC API)
        problem = register_request_problem(request)
        if problem is not None:
            await _refuse(context, "Register", "RegisterRequest", problem)
        state = node_from_register(request)
        try:
            self.state.register(
                state,
                request.address,
                request.transfer_address,
                request.config_hash,
                request.incarnation,
            )
        except NodeConflict as err:
            m.REGISTRATIONS_REFUSED.inc()
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(err))
        self._notify()
        return pb.RegisterResponse(
            heartbeat_interval_ms=self.heartbeat_interval_ms, node_timeout_ms=self.node_timeout_ms
        )

    async def Heartbeats(self, request_iterator, context):  # noqa: N802
        # the stream's end (the worker died or stopped) takes its node out of the pool at once
        stream: tuple[str, object] | None = None
        try:
            async for hb in request_iterator:
                problem = "node_id is required" if not hb.node_id else load_problem("load", hb.load)
                if problem is not None:
                    m.HEARTBEATS_REFUSED.inc()
                    await _refuse(context, "Heartbeats", "Heartbeat", problem)
                ld = load_from_pb(hb.load)
                known = self.state.heartbeat(hb.node_id, **ld._asdict(), incarnation=hb.incarnation)
                snapshot_id = 0
                if known:
                    if hb.claimed_request_ids:
                        self.state.claim(hb.node_id, hb.claimed_request_ids)
                    if stream is None or stream[0] != hb.node_id:
                        token = self.state.stream_opened(hb.node_id)
                        stream = (hb.node_id, token) if token is not None else None
                    m.NODE_READ_PENDING.labels(hb.node_id).set(ld.read_pending_bytes)
                    m.NODE_TOKENS.labels(hb.node_id).set(ld.tokens_queued + ld.tokens_running)
                    m.NODE_HEALTHY.labels(hb.node_id).set(1)
                    self._notify()
                    snapshot_id = self.state.index.snapshot_wanted(hb.node_id, self.state.clock())
                    if snapshot_id:
                        log.info(
                            "block index: asking %s for a store scan (snapshot %d)",
                            hb.node_id,
                            snapshot_id,
                        )
                yield pb.HeartbeatAck(known=known, kv_snapshot_id=snapshot_id)
        finally:
            if stream is not None and self.state.stream_closed(*stream):
                m.NODE_HEALTHY.labels(stream[0]).set(0)
                self._notify()

    async def KvEvents(self, request, context):  # noqa: N802
        try:
            stored_keys = unpack_keys(request.stored_keys)
            parents = unpack_keys(request.stored_parents)
            depths = unpack_keys(request.stored_depths)
            removed = unpack_keys(request.removed_keys)
        except ValueError as err:
            await _refuse(context, "KvEvents", "KvEventBatch", str(err), field="keys")
        if not request.node_id or request.seq < 1:
            await _refuse(context, "KvEvents", "KvEventBatch", "node_id and seq >= 1 are required")
        if not len(stored_keys) == len(parents) == len(depths):
            await _refuse(
                context,
                "KvEvents",
                "KvEventBatch",
                "stored_keys, stored_parents and stored_depths differ in length",
            )
        index = self.state.index
        was_ready = index.ready
        result = index.apply(
            request.node_id,
            request.epoch,
            request.seq,
            list(zip(stored_keys, parents, depths, strict=True)),
            removed,
        )
        if result is not Applied.DUPLICATE:
            m.INDEX_EVENTS.labels("stored").inc(len(stored_keys))
            m.INDEX_EVENTS.labels("removed").inc(len(removed))
        if result is Applied.GAP:
            m.INDEX_GAPS.inc()
            log.warning(
                "block index: KV events of %s skipped to seq %d (a batch was lost)%s",
                request.node_id,
                request.seq,
                "; rebuilding from a store scan, hits are 0 until then" if was_ready else "",
            )
        self._index_gauges()
        return pb.KvEventAck(gap=result is Applied.GAP)

    async def KvSnapshot(self, request_iterator, context):  # noqa: N802
        keys: list[int] = []
        snapshot_id, node = 0, ""
        async for chunk in request_iterator:
            snapshot_id, node = chunk.snapshot_id, chunk.node_id
            try:
                keys.extend(unpack_keys(chunk.keys))
            except ValueError as err:
                await _refuse(context, "KvSnapshot", "KvSnapshotChunk", str(err), field="keys")
        installed = self.state.index.install_snapshot(snapshot_id, keys)
        if installed:
            m.INDEX_REBUILDS.inc()
            log.info(
                "block index rebuilt from %s's store scan: %d blocks (snapshot %d)",
                node,
                len(self.state.index),
                snapshot_id,
            )
        else:
            log.info("block index: ignored snapshot %d from %s (not awaited)", snapshot_id, node)
        self._index_gauges()
        return pb.KvSnapshotAck(installed=installed, blocks=len(keys))

    def _index_gauges(self) -> None:
        index = self.state.index
        m.INDEX_BLOCKS.set(len(index))
        m.INDEX_HOLES.set(index.holes)
        m.INDEX_READY.set(1 if index.ready else 0)

    async def Route(self, request, context):  # noqa: N802
        problem = route_request_problem(request)
        if problem is not None:
            await _refuse(context, "Route", "RouteRequest", problem)
        try:
            keys = keys_view(request.block_keys)
        except ValueError as err:
            await _refuse(context, "Route", "RouteRequest", f"block_keys: {err}")
        hit = self.state.hit_tokens(request.prompt_tokens, keys)
        m.INDEX_LOOKUPS.labels(
            "unready" if not self.state.index.ready else "hit" if hit else "miss"
        ).inc()
        m.INDEX_HIT_BLOCKS.inc(hit // self.state.block_tokens)
        rr = route_from_pb(request, hit)
        if request.exclude_nodes and not self.state.has_pair_without(request.exclude_nodes):
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "no available prefill/decode pair without the excluded nodes "
                f"({', '.join(request.exclude_nodes)})",
            )
        timeout_s = request.queue_timeout_s or self.default_queue_timeout_s
        remaining = context.time_remaining()
        if remaining is not None:
            timeout_s = min(timeout_s, max(remaining - 0.05, 0.0))
        deadline = time.monotonic() + timeout_s
        waited = False
        while True:
            t0 = time.perf_counter()
            decision = self.state.route(rr, request.exclude_nodes)
            m.DECISION_LATENCY.observe(time.perf_counter() - t0)
            if decision is not None:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                m.REFUSED.inc()
                unpaired, why = self.state.refusal()
                if unpaired:
                    m.UNPAIRED.inc()
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"no prefill/decode node can take the request within {timeout_s:.1f}s ({why})",
                )
            if not waited:
                m.WAITS.inc()
                waited = True
            changed = self._changed
            try:
                await asyncio.wait_for(changed.wait(), timeout=min(left, 0.05))
            except TimeoutError:
                pass
        if context.cancelled():  # the caller is gone: nobody will send its Complete
            self.state.complete(decision.request_id, ok=False, cancelled=True)
            await context.abort(grpc.StatusCode.CANCELLED, "the caller cancelled the route")
        m.DECISIONS.labels(self.state.policy.name, decision.read_path.value).inc()
        m.IN_FLIGHT.set(len(self.state.in_flight))
        nodes = self.state.nodes
        return pb.RouteResponse(
            request_id=decision.request_id,
            prefill_node=decision.prefill_node,
            prefill_address=nodes[decision.prefill_node].address,
            decode_node=decision.decode_node,
            decode_address=nodes[decision.decode_node].address,
            read_path=_PATH[decision.read_path],
            policy=self.state.policy.name,
            est_read_finish_s=decision.est_read_finish_s,
            hit_tokens=rr.hit_tokens,
            hit_bytes=rr.hit_bytes,
        )

    async def Complete(self, request, context):  # noqa: N802
        # Unknown ids are fine: a restarted scheduler forgets requests that still finish.
        st = self.state
        opens = st.breaker_opens_total
        st.complete(request.request_id, request.ok, request.cancelled, request.failed_node)
        self._notify()  # a slot freed: routes waiting for room try again now
        m.IN_FLIGHT.set(len(st.in_flight))
        m.COMPLETIONS.labels(
            "ok" if request.ok else "cancelled" if request.cancelled else "failed"
        ).inc()
        m.BREAKER_OPENS.inc(st.breaker_opens_total - opens)
        m.BREAKERS_OPEN.set(st.open_breakers())
        return pb.CompleteResponse()

    async def Drain(self, request, context):  # noqa: N802
        known = self.state.drain(request.node_id)
        return pb.DrainResponse(
            known=known, routed_in_flight=self.state.routed_in_flight(request.node_id)
        )

    async def ClusterView(self, request, context):  # noqa: N802
        now = self.state.clock()
        out = pb.ClusterViewResponse(
            policy=self.state.policy.name,
            routed_total=self.state.routed_total,
            in_flight=len(self.state.in_flight),
        )
        for rec in self.state.nodes.values():
            s = rec.state
            out.nodes.add(
                node_id=s.node_id,
                role=ROLE_TO_PB[s.role],
                address=rec.address,
                healthy=s.healthy,
                group=s.group,
                config_hash=s.config_hash,
                seconds_since_heartbeat=now - rec.last_seen_s,
                load=load_to_pb(s.load),
            )
        return out


class SchedulerServer:
    """Owns the grpc.aio server, the health service and the liveness task."""

    def __init__(
        self,
        servicer: SchedulerServicer,
        host: str = "0.0.0.0",
        port: int = 0,
        token: Auth | None = None,
    ) -> None:
        self.servicer = servicer
        # every call but health and reflection needs the cluster token or, under mutual TLS, an
        # identity that may make it (Register binds a node id to its caller's identity)
        self.server = grpc.aio.server(
            # bounds first: an oversized field is refused before the identity check echoes it
            interceptors=[
                BoundsInterceptor("scheduler"),
                *server_interceptors(token, "scheduler", bind_nodes=True),
            ]
        )
        pb_grpc.add_SchedulerServicer_to_server(servicer, self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, reflection.SERVICE_NAME, health.SERVICE_NAME), self.server
        )
        self.port = add_port(self.server, f"{host}:{port}", token)
        self._liveness: asyncio.Task | None = None

    async def start(self) -> None:
        await self.server.start()
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self.servicer._index_gauges()
        self._liveness = asyncio.create_task(self._expire_loop(), name="scheduler-liveness")
        log.info("scheduler serving on :%d (policy %s)", self.port, self.servicer.state.policy.name)

    async def _expire_loop(self) -> None:
        period = max(self.servicer.node_timeout_ms / 4000.0, 0.005)
        while True:
            await asyncio.sleep(period)
            state = self.servicer.state
            for node_id in state.expire():
                m.NODE_HEALTHY.labels(node_id).set(0)
            released = state.release_unclaimed()
            if released:
                m.ROUTES_RELEASED.inc(len(released))
                m.IN_FLIGHT.set(len(state.in_flight))
                self.servicer._notify()  # slots freed: routes waiting for room try again
            for node_id in state.forget_silent():
                m.NODES_FORGOTTEN.inc()
                for gauge in (m.NODE_HEALTHY, m.NODE_READ_PENDING, m.NODE_TOKENS):
                    try:
                        gauge.remove(node_id)
                    except KeyError:
                        pass

    async def stop(self, grace_s: float = 2.0) -> None:
        await self.health.enter_graceful_shutdown()
        if self._liveness:
            self._liveness.cancel()
        await self.server.stop(grace_s)
        log.info("scheduler stopped")
