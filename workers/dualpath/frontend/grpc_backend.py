"""The real backend: `Scheduler.Route` -> decode worker `Generate` (server-streaming tokens)
-> `Scheduler.Complete`.

The frontend never touches storage: it sends the keys of the prompt's block ids (the kv
module's `block_ids` over the session's full token history) and the scheduler answers with the
hit its block index found (docs/design.md section 3), which the decode worker then verifies as it loads.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing

import grpc
from prometheus_client import Counter

from dualpath.config import ClusterConfig
from dualpath.frontend.backend import BackendError, Event, Finished, Routed, Tokens, TurnRequest
from dualpath.grpc_auth import Auth
from dualpath.grpc_channels import ChannelCache, Unreachable
from dualpath.kv.ids import block_ids, block_keys
from dualpath.scheduler.index import pack_keys
from dualpath.scheduler.policy.types import RouteRequest
from dualpath.scheduler.wire import route_fields
from dualpath.worker import FAILED_NODE_KEY
from dualpath.worker.wire import PATH_FROM_PB, Turn, chunk_from_pb, generate_to_pb

log = logging.getLogger(__name__)

# Generate failures that say something of the nodes: retried (before the first token) on
# another pair and counted against the pair by the scheduler's breaker. Others (a bad request,
# the turn's own deadline or cancel) are neither.
_NODE_FAULTS = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.FAILED_PRECONDITION,
    }
)
# Route refusals a client may retry after a while (the `Retry-After` of its 429 or 503).
_ROUTE_TRANSIENT = frozenset(
    {
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.FAILED_PRECONDITION,
    }
)
_ROUTE_RETRY_AFTER_S = 1.0
# A turn failing on a node: routed again up to MAX_ATTEMPTS times in all, within RETRY_WINDOW_S
# of its start or of its last progress (a restarted worker serves again within a few seconds),
# backing off from RETRY_BACKOFF_S, doubling up to MAX_BACKOFF_S. One that fails mid-answer
# resumes where it stopped (`continuation`).
MAX_ATTEMPTS = 6
RETRY_WINDOW_S = 20.0  # under a client's usual 30 s deadline: an answer, not a hang
RETRY_BACKOFF_S = 0.25
MAX_BACKOFF_S = 2.0
# Deadline of one `Complete` (sent in the background): a scheduler down must not pile them up.
COMPLETE_TIMEOUT_S = 5.0


def continuation(req: TurnRequest, done: list[int]) -> TurnRequest | None:
    """The turn that goes on after `done`, the tokens its failed attempts already gave: their
    tokens joined to the prompt, the budgets (`max_tokens`, `min_tokens`) less what was spent.
    Greedy decoding gives the very tokens the unbroken turn would have; a sampled turn a valid
    continuation (its sampler starts again from the seed). None: nothing is left to generate."""
    if not done:
        return req
    left = req.sampling.max_tokens - len(done)
    if left <= 0:
        return None
    sampling = dataclasses.replace(
        req.sampling, max_tokens=left, min_tokens=max(0, req.sampling.min_tokens - len(done))
    )
    return dataclasses.replace(req, prompt_ids=req.prompt_ids + done, sampling=sampling)


class GrpcBackend:
    def __init__(
        self,
        config: ClusterConfig,
        scheduler_address: str,
        timeout_s: float = 900.0,  # a whole turn: queueing behind other prefills included
        token: Auth | None = None,  # presented on every scheduler and worker call
    ) -> None:
        self.token = token
        self.config = config
        self.model = config.spec.model
        self.scheduler_address = scheduler_address
        self.timeout_s = timeout_s
        self._sched = None
        # to decode nodes, by address: closed when unreachable, idle or gone from the cluster
        self._decodes = ChannelCache(token, server_role="decode")
        self._completing: set[asyncio.Task] = set()
        # registered by the app on its /metrics registry
        self.retries = Counter(
            "dualpath_frontend_retries_total",
            "Turns routed again after failing before their first token (each attempt counted)",
            registry=None,
        )
        self.resumed = Counter(
            "dualpath_frontend_resumed_turns_total",
            "Turns continued on a new route after a node failed mid-answer (each resume counted)",
            registry=None,
        )
        self.complete_failures = Counter(
            "dualpath_frontend_complete_failures_total",
            "Complete calls to the scheduler that failed (the entry stays until it restarts)",
            registry=None,
        )
        self.collectors = (self.retries, self.resumed, self.complete_failures)

    async def start(self) -> None:
        from dualpath.scheduler.client import SchedulerClient

        self._sched = SchedulerClient(self.scheduler_address, timeout_s=30.0, token=self.token)
        self._decodes.start_sweeper(self._live_addresses)

    async def _live_addresses(self) -> set[str]:
        assert self._sched is not None
        return {n.address for n in (await self._sched.cluster_view()).nodes}

    async def close(self) -> None:
        if self._completing:  # the last turns' Complete calls, within their own deadline
            await asyncio.wait(list(self._completing), timeout=COMPLETE_TIMEOUT_S)
        await self._decodes.close()
        if self._sched is not None:
            await self._sched.close()

    async def health(self) -> tuple[bool, str]:
        if self._sched is None:
            return False, "not started"
        try:
            view = await self._sched.stub.ClusterView(
                __import__("dualpath.v1.scheduler_pb2", fromlist=["x"]).ClusterViewRequest(),
                timeout=2.0,
            )
        except grpc.aio.AioRpcError as err:
            return False, f"scheduler {self.scheduler_address}: {err.code().name}"
        roles = {n.role for n in view.nodes if n.healthy and not n.load.draining}
        if {1, 2} - roles:
            return False, f"waiting for workers ({len(view.nodes)} registered)"
        return True, f"{len(view.nodes)} nodes, policy {view.policy}"

    async def _worker(self, address: str):
        """The decode node's stub, once its channel is connected (a bounded wait); one that
        does not connect fails as its call would (UNAVAILABLE: the turn is routed again)."""
        from dualpath.v1 import worker_pb2_grpc

        try:
            ch = await self._decodes.get(address)
        except Unreachable as err:
            md = grpc.aio.Metadata()
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, md, md, str(err)) from None
        return worker_pb2_grpc.WorkerStub(ch)

    async def generate(self, req: TurnRequest) -> AsyncIterator[Event]:
        """Route, then stream from the decode node. A turn whose node fails (a node fault:
        `_NODE_FAULTS`) is routed again, the failed node excluded while another of its role can
        take it, and waited for (a restarting node) when it is the only one: up to
        `MAX_ATTEMPTS` within `RETRY_WINDOW_S` of the start or of the last token, backing off.
        One that failed mid-answer resumes where it stopped (`continuation`): the caller sees
        one answer, its first `Routed` and every token once. Every routed attempt ends with
        exactly one `Complete`, sent in the background (never delaying the client's last
        chunk), also when the client goes away."""
        assert self._sched is not None, "GrpcBackend.start() was not awaited"
        done: list[int] = []  # the tokens already given to the caller
        keys_for, keys = -1, b""  # the block keys of the prompt with len(done) tokens joined
        routed_sent = False
        exclude: list[str] = []
        first_error = ""
        loop = asyncio.get_running_loop()
        retry_until = loop.time() + min(RETRY_WINDOW_S, self.timeout_s)
        for attempt in range(MAX_ATTEMPTS):
            rid = req.request_id if not attempt else f"{req.request_id}.retry{attempt}"
            cur = continuation(req, done)
            if cur is None:  # the node failed after the last token but before saying so
                yield Finished("length", 0)
                return
            if keys_for != len(done):  # the prompt's block keys, hashed again only when it grew
                keys_for = len(done)
                keys = pack_keys(
                    block_keys(block_ids(cur.prompt_ids, self.model, salt=cur.cache_salt))
                )
            try:
                route = await self._route(cur, rid, keys, exclude)
            except asyncio.CancelledError:
                # the scheduler may have routed it just before the cancel reached it
                self._complete_later(rid, 0, False, True, "")
                raise
            except BackendError as err:
                backoff_s = min(RETRY_BACKOFF_S * 2**attempt, MAX_BACKOFF_S)
                waiting = attempt + 1 < MAX_ATTEMPTS and loop.time() + backoff_s < retry_until
                if first_error and err.retry_after_s is not None and waiting:
                    # a retry's route refused for now (no node free yet: the failed one still
                    # restarting): routed again after a pause, within the window
                    log.info("turn %s: route refused (%s): again in %.2fs", rid, err, backoff_s)
                    await asyncio.sleep(backoff_s)
                    continue
                if first_error:  # nowhere else to go: the turn's own failure is the answer
                    raise BackendError(
                        f"{first_error} (no retry: {err})", err.status, err.retry_after_s
                    ) from None
                raise
            generated, ok, cancelled, started, failed = 0, False, True, False, ""
            try:
                async with aclosing(self._stream(cur, route)) as events:
                    async for ev in events:
                        started = True
                        if isinstance(ev, Routed):
                            if routed_sent:  # a resumed attempt: the caller has its route
                                continue
                            routed_sent = True
                        if isinstance(ev, Tokens):
                            generated += len(ev.ids)
                            done.extend(ev.ids)
                        if isinstance(ev, Finished):
                            ok = True
                            ev = Finished(ev.reason, len(done))  # every attempt's tokens
                        yield ev
                cancelled = False
                return
            except grpc.aio.AioRpcError as err:
                code = err.code()
                # the turn's deadline passed before the node sent anything: the node hung (a
                # slow one has started streaming); a client's cancel is never an AioRpcError
                hung = code == grpc.StatusCode.DEADLINE_EXCEEDED and not started
                cancelled = code not in _NODE_FAULTS and not hung
                # the decode node names the side that failed; a call that failed to connect
                # (or a node that says nothing) is the decode node's own failure
                trailer = dict(err.trailing_metadata() or ())
                failed = trailer.get(FAILED_NODE_KEY) or route.decode_node
                error = f"decode {route.decode_node} Generate: {code.name}: {err.details()}"
                backoff_s = min(RETRY_BACKOFF_S * 2**attempt, MAX_BACKOFF_S)
                if generated:  # progress: a fresh window to resume in
                    retry_until = loop.time() + min(RETRY_WINDOW_S, self.timeout_s)
                last = attempt + 1 == MAX_ATTEMPTS or loop.time() + backoff_s >= retry_until
                # capacity (the turn's KV over the whole buffer) is retried once, not waited for
                capacity = code == grpc.StatusCode.RESOURCE_EXHAUSTED and attempt > 0
                if last or capacity or code not in _NODE_FAULTS:
                    raise BackendError(error) from None
                (self.resumed if started else self.retries).inc()
                log.warning(
                    "turn %s failed %s (%s): attempt %d of %d in %.2fs, without %s if another "
                    "node can take it",
                    req.request_id,
                    f"after {len(done)} tokens, resumed there" if started else "before its answer",
                    error,
                    attempt + 2,
                    MAX_ATTEMPTS,
                    backoff_s,
                    failed,
                )
                exclude, first_error = [failed], error
            except BackendError:
                cancelled = False
                raise
            finally:
                self._complete_later(route.request_id, generated, ok, cancelled, failed)
            await asyncio.sleep(backoff_s)  # the failed attempt completed first (its slot freed)

    async def _route(self, req: TurnRequest, rid: str, keys: bytes, exclude: list[str]):
        try:
            turn = RouteRequest.for_turn(
                rid,
                len(req.prompt_ids),
                0,  # the hit is the scheduler's to find (its block index)
                self.model.kv_bytes_per_token,
                req.sampling.max_tokens,
                req.session_id,
            )
            return await self._sched.route(
                **route_fields(turn), block_keys=keys, exclude_nodes=exclude
            )
        except grpc.aio.AioRpcError as err:
            code = err.code()
            if exclude and code == grpc.StatusCode.FAILED_PRECONDITION:
                # no pair without the failed node: it is the only one of its role (restarting,
                # most likely); routed again with it, the scheduler waits for it to take turns
                log.info("turn %s: no pair without %s; routing with it", rid, ", ".join(exclude))
                return await self._route(req, rid, keys, [])
            # no node can take it now (queues or buffers full): 429, retry later; a scheduler
            # unreachable or restarting: 503, retry later; anything else: 503
            status = 429 if code == grpc.StatusCode.RESOURCE_EXHAUSTED else 503
            retry = _ROUTE_RETRY_AFTER_S if code in _ROUTE_TRANSIENT else None
            raise BackendError(
                f"scheduler Route: {code.name}: {err.details()}", status, retry
            ) from None

    async def _stream(self, req: TurnRequest, route) -> AsyncIterator[Event]:  # noqa: ANN001
        turn = Turn(
            request_id=route.request_id,
            session_id=req.session_id,
            prompt=tuple(req.prompt_ids),
            hit_tokens=route.hit_tokens,
            read_path=PATH_FROM_PB.get(route.read_path, "prefill"),
            prefill_node=route.prefill_node,
            prefill_address=route.prefill_address,
            cache_salt=req.cache_salt,
            sampling=req.sampling,
        )
        call = (await self._worker(route.decode_address)).Generate(
            generate_to_pb(turn), timeout=self.timeout_s
        )
        generated, reason, routed = 0, "", False
        try:
            async for msg in call:
                chunk = chunk_from_pb(msg)
                if not routed:  # the first chunk says what served the turn (a bad block may
                    routed = True  # have shortened the hit or turned it into a recompute)
                    yield Routed(
                        route.request_id,
                        route.prefill_node,
                        route.decode_node,
                        chunk.read_path,
                        chunk.hit_tokens,
                        route.policy,
                    )
                if chunk.tokens:
                    generated += len(chunk.tokens)
                    yield Tokens(list(chunk.tokens))
                if chunk.finish_reason:
                    reason = chunk.finish_reason
        finally:
            call.cancel()  # a turn abandoned early (a no-op once the call has ended)
        if not reason:  # an answer cut short is an error, never an empty success
            raise BackendError(
                f"decode {route.decode_node} Generate ended without a finish reason "
                f"after {generated} tokens"
            )
        yield Finished(reason, generated)

    def _complete_later(
        self, request_id: str, generated: int, ok: bool, cancelled: bool, failed_node: str
    ) -> None:
        """`Complete` in the background with its own deadline: it survives the turn's
        cancellation and never delays the client's last chunk."""
        task = asyncio.get_running_loop().create_task(
            self._complete(request_id, generated, ok, cancelled, failed_node)
        )
        self._completing.add(task)
        task.add_done_callback(self._completing.discard)

    async def _complete(
        self, request_id: str, generated: int, ok: bool, cancelled: bool, failed_node: str
    ) -> None:
        try:
            await self._sched.complete(
                request_id,
                generated,
                ok,
                cancelled=cancelled,
                timeout_s=COMPLETE_TIMEOUT_S,
                failed_node=failed_node,
            )
        except grpc.aio.AioRpcError as err:
            self.complete_failures.inc()
            log.warning("Complete(%s) failed: %s", request_id, err.code().name)
