"""Clients of the scheduler: `SchedulerClient` (frontend: route/complete) and `NodeAgent`
(worker: register + heartbeat stream, re-registering when the scheduler restarts).
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from dualpath import grpc_auth
from dualpath.scheduler.policy.types import NodeLoad
from dualpath.scheduler.wire import ROLE_TO_PB, load_to_pb
from dualpath.v1 import scheduler_pb2 as pb
from dualpath.v1 import scheduler_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

# Retries declared in the channel's service config, not in loops (grpc examples' habit).
_SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": [{"service": "dualpath.v1.Scheduler"}],
                "retryPolicy": {
                    "maxAttempts": 5,
                    "initialBackoff": "0.05s",
                    "maxBackoff": "1s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    }
)


def channel(address: str, token: grpc_auth.Auth | None = None) -> grpc.aio.Channel:
    return grpc_auth.channel(
        address,
        token,
        options=[("grpc.service_config", _SERVICE_CONFIG), ("grpc.enable_retries", 1)],
        server_role="scheduler",
    )


class SchedulerClient:
    def __init__(
        self,
        address: str,
        timeout_s: float = 10.0,
        token: grpc_auth.Auth | None = None,
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._channel = channel(address, token)
        self.stub = pb_grpc.SchedulerStub(self._channel)

    async def route(self, **fields) -> pb.RouteResponse:
        return await self.stub.Route(
            pb.RouteRequest(**fields), timeout=self.timeout_s, wait_for_ready=True
        )

    async def complete(
        self,
        request_id: str,
        generated_tokens: int = 0,
        ok: bool = True,
        cancelled: bool = False,
        timeout_s: float | None = None,
        failed_node: str = "",
    ) -> None:
        await self.stub.Complete(
            pb.CompleteRequest(
                request_id=request_id,
                generated_tokens=generated_tokens,
                ok=ok,
                cancelled=cancelled,
                failed_node=failed_node,
            ),
            timeout=timeout_s or self.timeout_s,
            wait_for_ready=True,
        )

    async def cluster_view(self) -> pb.ClusterViewResponse:
        # waits (within the deadline) for a scheduler that is restarting, like route()
        return await self.stub.ClusterView(
            pb.ClusterViewRequest(), timeout=self.timeout_s, wait_for_ready=True
        )

    async def drain(self, node_id: str) -> bool:
        resp = await self.stub.Drain(pb.DrainRequest(node_id=node_id), timeout=self.timeout_s)
        return resp.known

    async def close(self) -> None:
        await self._channel.close()


@dataclass(slots=True)
class Registration:
    node_id: str
    role: str  # "prefill" | "decode"
    address: str
    transfer_address: str = ""
    snic_bytes_per_s: float = 0.0
    prefill_tokens_per_s: float = 0.0
    group: str = "default"
    config_hash: str = ""


class _CurrentStub:
    """The agent's stub of the moment, for every holder (the KV event publisher): a channel
    replaced after a lost scheduler is used by all of them at once."""

    def __init__(self, agent: NodeAgent) -> None:
        self._agent = agent

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self._agent._stub, name)


# Re-registration backoff: from REGISTER_BACKOFF_S, doubling, at most REGISTER_BACKOFF_MAX_S.
REGISTER_BACKOFF_S = 0.05
REGISTER_BACKOFF_MAX_S = 0.5
# Claims kept for the next heartbeat while none flows: the newest (an older route is released by
# its lease at worst, or was forgotten by a restarted scheduler anyway).
MAX_CLAIMS_KEPT = 4096


class NodeAgent:
    """Keeps one worker registered and heartbeating. `load()` returns the node's `NodeLoad`.

    On a stream error or a `known=False` ack (scheduler restarted and lost its view) it
    registers again, with bounded, logged backoff (at most REGISTER_BACKOFF_MAX_S between
    tries). A scheduler that stops acknowledging heartbeats for its node timeout (hung, or its
    host gone without closing the connection) counts as lost too: the stream is cancelled, the
    channel replaced (a new connection, a fresh name resolution) and the node registers
    again. `stop()` ends the task.
    """

    def __init__(
        self,
        scheduler_address: str,
        reg: Registration,
        load: Callable[[], NodeLoad],
        interval_s: float = 0.02,
        rpc_timeout_s: float = 2.0,
        on_kv_snapshot: Callable[[int], None] | None = None,
        token: grpc_auth.Auth | None = None,
    ) -> None:
        self.reg = reg
        self.on_kv_snapshot = on_kv_snapshot  # the scheduler asks for a store scan (its id)
        self.load = load
        self.interval_s = interval_s
        self.rpc_timeout_s = rpc_timeout_s
        self.address = scheduler_address
        self._token = token
        self._channel = channel(scheduler_address, token)
        self._stub = pb_grpc.SchedulerStub(self._channel)
        self.stub = _CurrentStub(self)
        # no ack for this long: the scheduler is lost (its RegisterResponse's node timeout)
        self.ack_timeout_s = 2.0
        self.lost = 0  # schedulers given up on for want of acks
        self._task: asyncio.Task | None = None
        self._stopping = asyncio.Event()
        self.registrations = 0
        self.registered = False  # the scheduler knows this node now (its heartbeats flow)
        self.refusals = 0  # registrations refused in a row (another process holds the id)
        # one per process start: the scheduler tells a restarted process from a second one
        self.incarnation = uuid.uuid4().hex[:16]
        # routed requests whose call reached this node, for the next heartbeat (`claim`)
        self._claimed: list[str] = []

    def claim(self, request_id: str) -> None:
        """A routed request's call reached this node: the next heartbeat tells the scheduler,
        which then holds it open until its Complete instead of releasing it after the route
        lease (spec.scheduler.routeLeaseSeconds)."""
        if request_id:
            self._claimed.append(request_id)
            if len(self._claimed) > MAX_CLAIMS_KEPT:  # no heartbeat flows (scheduler down)
                del self._claimed[: len(self._claimed) - MAX_CLAIMS_KEPT]

    def start(self) -> NodeAgent:
        self._task = asyncio.create_task(self._run(), name=f"node-agent-{self.reg.node_id}")
        return self

    async def _register(self) -> None:
        role = ROLE_TO_PB[self.reg.role]
        resp = await self._stub.Register(
            pb.RegisterRequest(
                node_id=self.reg.node_id,
                role=role,
                address=self.reg.address,
                transfer_address=self.reg.transfer_address,
                snic_bytes_per_s=self.reg.snic_bytes_per_s,
                prefill_tokens_per_s=self.reg.prefill_tokens_per_s,
                group=self.reg.group,
                config_hash=self.reg.config_hash,
                load=load_to_pb(self.load()),
                incarnation=self.incarnation,
            ),
            timeout=self.rpc_timeout_s,
            wait_for_ready=True,
        )
        self.registrations += 1
        self.registered = True
        self.refusals = 0
        if resp.heartbeat_interval_ms:
            self.interval_s = resp.heartbeat_interval_ms / 1000.0
        if resp.node_timeout_ms:
            self.ack_timeout_s = max(resp.node_timeout_ms / 1000.0, 3 * self.interval_s)
        log.info("registered %s with the scheduler (#%d)", self.reg.node_id, self.registrations)

    async def _beats(self):
        while not self._stopping.is_set():
            claimed, self._claimed = self._claimed, []
            yield pb.Heartbeat(
                node_id=self.reg.node_id,
                load=load_to_pb(self.load()),
                incarnation=self.incarnation,
                claimed_request_ids=claimed,
            )
            try:
                await asyncio.wait_for(self._stopping.wait(), timeout=self.interval_s)
            except TimeoutError:
                pass

    async def _acks(self):
        """The heartbeat stream's acks; TimeoutError when none came for `ack_timeout_s`."""
        call = self._stub.Heartbeats(self._beats())
        try:
            while True:
                ack = await asyncio.wait_for(call.read(), timeout=self.ack_timeout_s)
                if ack is grpc.aio.EOF:
                    raise grpc.aio.AioRpcError(
                        grpc.StatusCode.UNAVAILABLE,
                        grpc.aio.Metadata(),
                        grpc.aio.Metadata(),
                        "the scheduler ended the heartbeat stream",
                    )
                yield ack
        finally:
            call.cancel()

    async def _reconnect(self) -> None:
        """A new channel: the old connection may be to a hung process or a host gone."""
        old, self._channel = self._channel, channel(self.address, self._token)
        self._stub = pb_grpc.SchedulerStub(self._channel)
        await old.close()

    async def _run(self) -> None:
        backoff = REGISTER_BACKOFF_S
        while not self._stopping.is_set():
            try:
                await self._register()
                backoff = REGISTER_BACKOFF_S
                async for ack in self._acks():
                    if ack.kv_snapshot_id and self.on_kv_snapshot is not None:
                        self.on_kv_snapshot(ack.kv_snapshot_id)
                    if not ack.known:
                        log.warning(
                            "scheduler does not know %s: registering again", self.reg.node_id
                        )
                        self.registered = False
                        break
            except asyncio.CancelledError:
                self.registered = False
                raise
            except TimeoutError:
                self.registered = False
                if self._stopping.is_set():
                    break
                self.lost += 1
                log.warning(
                    "no heartbeat ack from the scheduler for %.1fs: lost; %s registers again "
                    "on a new connection",
                    self.ack_timeout_s,
                    self.reg.node_id,
                )
                await self._reconnect()
            except grpc.aio.AioRpcError as err:
                self.registered = False
                if self._stopping.is_set():
                    break
                if err.code() == grpc.StatusCode.ALREADY_EXISTS:
                    # logged once per streak; retried: the other process may stop or time out
                    self.refusals += 1
                    log.log(
                        logging.ERROR if self.refusals == 1 else logging.DEBUG,
                        "registration of %s refused (retrying): %s",
                        self.reg.node_id,
                        err.details(),
                    )
                else:
                    log.warning(
                        "scheduler unreachable (%s); retry in %.2fs", err.code().name, backoff
                    )
            if self._stopping.is_set():
                break
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, REGISTER_BACKOFF_MAX_S)

    async def drain(self) -> int:
        """Tell the scheduler this node drains (idempotent); returns the requests routed to it
        and not completed yet."""
        resp = await self._stub.Drain(
            pb.DrainRequest(node_id=self.reg.node_id), timeout=self.rpc_timeout_s
        )
        return resp.routed_in_flight

    async def stop(self) -> None:
        self._stopping.set()
        if self._task:
            try:
                await asyncio.wait_for(self._task, timeout=2.0)
            except (TimeoutError, asyncio.CancelledError):
                self._task.cancel()
        await self._channel.close()
