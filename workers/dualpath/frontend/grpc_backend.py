"""The real backend: `Scheduler.Route` -> decode worker `Generate` (server-streaming tokens)
-> `Scheduler.Complete`.

The frontend never touches storage: it sends the keys of the prompt's block ids (the kv
module's `block_ids` over the session's full token history) and the scheduler answers with the
hit its block index found (DESIGN section 3), which the decode worker then verifies as it loads.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc

from dualpath.config import ClusterConfig
from dualpath.frontend.backend import BackendError, Event, Finished, Routed, Tokens, TurnRequest
from dualpath.grpc_auth import ClusterToken
from dualpath.grpc_auth import channel as token_channel
from dualpath.kv.ids import block_ids, block_keys
from dualpath.scheduler.index import pack_keys

log = logging.getLogger(__name__)

_PATHS = {0: "none", 1: "prefill", 2: "decode"}


class GrpcBackend:
    def __init__(
        self,
        config: ClusterConfig,
        scheduler_address: str,
        timeout_s: float = 900.0,  # a whole turn: queueing behind other prefills included
        token: ClusterToken | None = None,  # presented on every scheduler and worker call
    ) -> None:
        self.token = token
        self.config = config
        self.model = config.spec.model
        self.scheduler_address = scheduler_address
        self.timeout_s = timeout_s
        self._sched = None
        self._channels: dict[str, grpc.aio.Channel] = {}

    async def start(self) -> None:
        from dualpath.scheduler.client import SchedulerClient

        self._sched = SchedulerClient(self.scheduler_address, timeout_s=30.0, token=self.token)

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
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
        roles = {n.role for n in view.nodes if n.healthy}
        if {1, 2} - roles:
            return False, f"waiting for workers ({len(view.nodes)} registered)"
        return True, f"{len(view.nodes)} nodes, policy {view.policy}"

    def _worker(self, address: str):
        from dualpath.v1 import worker_pb2_grpc

        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = token_channel(address, self.token)
        return worker_pb2_grpc.WorkerStub(ch)

    async def generate(self, req: TurnRequest) -> AsyncIterator[Event]:
        from dualpath.v1 import worker_pb2

        assert self._sched is not None, "GrpcBackend.start() was not awaited"
        keys = block_keys(block_ids(req.prompt_ids, self.model))
        per_tok = self.model.kv_bytes_per_token
        try:
            route = await self._sched.route(
                request_id=req.request_id,
                session_id=req.session_id,
                prompt_tokens=len(req.prompt_ids),
                block_keys=pack_keys(keys),
                context_bytes=len(req.prompt_ids) * per_tok,
                max_new_tokens=req.max_new_tokens,
            )
        except grpc.aio.AioRpcError as err:
            raise BackendError(f"scheduler Route: {err.code().name}: {err.details()}") from None
        generated, ok, reason = 0, False, "length"
        routed = False
        try:
            call = self._worker(route.decode_address).Generate(
                worker_pb2.GenerateRequest(
                    request_id=route.request_id,
                    session_id=req.session_id,
                    prompt_tokens=req.prompt_ids,
                    hit_tokens=route.hit_tokens,
                    max_new_tokens=req.max_new_tokens,
                    read_path=route.read_path,
                    prefill_node=route.prefill_node,
                    prefill_address=route.prefill_address,
                    stop_tokens=list(req.stop_ids),
                    temperature=req.temperature,
                ),
                timeout=self.timeout_s,
            )
            async for msg in call:
                if not routed:  # the first chunk says what served the turn (a bad block may
                    routed = True  # have shortened the hit or turned it into a recompute)
                    used = int(msg.hit_tokens)
                    path = _PATHS.get(msg.read_path, "none") if used else "none"
                    yield Routed(
                        route.request_id,
                        route.prefill_node,
                        route.decode_node,
                        path,
                        used,
                        route.policy,
                    )
                if msg.tokens:
                    generated += len(msg.tokens)
                    yield Tokens(list(msg.tokens))
                if msg.finish_reason:
                    reason = msg.finish_reason
            ok = True
            yield Finished(reason, generated)
        except grpc.aio.AioRpcError as err:
            raise BackendError(
                f"decode {route.decode_node} Generate: {err.code().name}: {err.details()}"
            ) from None
        finally:
            try:
                await self._sched.complete(route.request_id, generated, ok)
            except grpc.aio.AioRpcError as err:
                log.warning("Complete(%s) failed: %s", route.request_id, err.code().name)
