"""A worker's standing with the scheduler: its registration and heartbeats (`NodeAgent`, each
carrying `node_load`), its store's KV events (`KvEventPublisher`) and the `Drain` call."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc

from dualpath.scheduler.client import NodeAgent, Registration
from dualpath.scheduler.kv_events import KvEventPublisher
from dualpath.scheduler.policy.types import NodeLoad
from dualpath.units import gbps_to_bytes_per_s
from dualpath.worker import metrics

if TYPE_CHECKING:
    from dualpath.config import ClusterConfig, Role
    from dualpath.worker.common import Node, NodeOptions

log = logging.getLogger(__name__)


def node_load(node: Node) -> NodeLoad:
    """What the node's heartbeats report (and its load gauges show)."""
    role = node.prefill.load if node.prefill is not None else node.decode
    q, r, n = role.tokens_queued, role.tokens_running, role.requests_running
    free = node.transfer.pool.free_bytes
    if node.decode is not None:  # a decoding context lives in the paged cache afterwards
        cache = node.engine.cache
        cache_free = cache.free_pages * cache.page_tokens * node.cfg.spec.model.kv_bytes_per_token
        free = min(free, cache_free)
    load = NodeLoad(
        read_pending_bytes=node.read_queue.pending_bytes,
        tokens_queued=q,
        tokens_running=r,
        requests_running=n,
        buffer_free_bytes=free,
        draining=node.draining,
    )
    metrics.LOAD.labels("read_pending_bytes").set(load.read_pending_bytes)
    metrics.LOAD.labels("tokens_queued").set(q)
    metrics.LOAD.labels("tokens_running").set(r)
    metrics.LOAD.labels("buffer_free_bytes").set(load.buffer_free_bytes)
    return load


def node_registration(
    cfg: ClusterConfig, role: Role, node_id: str, address: str, transfer_address: str = ""
) -> Registration:
    """What a worker registers with (either engine): its address, its SNIC share of the store
    and its pool's prefill rate, under the config's hash."""
    spec = cfg.spec
    snic = gbps_to_bytes_per_s(spec.storage.snic_gbps) if spec.storage.snic_gbps else 0.0
    return Registration(
        node_id=node_id,
        role=role.value,
        address=address,
        transfer_address=transfer_address,
        snic_bytes_per_s=snic,
        prefill_tokens_per_s=float(spec.pool(role).prefill_tokens_per_s),
        config_hash=cfg.config_hash,
    )


def node_agent(
    cfg: ClusterConfig, opts: NodeOptions, reg: Registration, load: Callable[[], NodeLoad]
) -> NodeAgent:
    """The agent that registers `reg` with `opts.scheduler` and heartbeats `load()`."""
    return NodeAgent(
        opts.scheduler,
        reg,
        load,
        interval_s=cfg.spec.scheduler.heartbeat_interval_ms / 1000.0,
        token=opts.token,
    )


class NodeRegistration:
    """Registers the node (again after a scheduler restart), heartbeats its load and publishes
    its store's KV events; without a scheduler address it does nothing (tests)."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.agent: NodeAgent | None = None
        self.publisher: KvEventPublisher | None = None

    def start(self) -> None:
        node = self.node
        if not node.opts.scheduler:
            return
        reg = node_registration(
            node.cfg, node.role, node.node_id, node.address, transfer_address=node.transfer.name
        )
        self.agent = node_agent(node.cfg, node.opts, reg, lambda: node_load(node))
        if node.kv_events is not None:  # a store given to the node announces nothing
            self.publisher = KvEventPublisher(
                self.agent.stub, node.node_id, node.kv_events, node.store.scan_keys
            ).start()
            self.agent.on_kv_snapshot = self.publisher.request_snapshot
        self.agent.start()

    @property
    def ready(self) -> tuple[bool, str]:
        """Registered (or no scheduler), else why not."""
        if self.agent is None or self.agent.registered:
            return True, "registered"
        return False, "not registered with the scheduler " + (
            "(registering again)" if self.agent.registrations else "yet"
        )

    def claim(self, request_id: str) -> None:
        """A routed request's call reached this node: the scheduler stops its route lease."""
        if self.agent is not None:
            self.agent.claim(request_id)

    async def flush_kv_events(self) -> None:
        """Wait until the scheduler's block index has this store's events so far."""
        if self.publisher is not None:
            await self.publisher.flush()

    async def drain(self) -> int:
        """`Scheduler.Drain` (idempotent): the requests routed here and still open (0 when the
        scheduler cannot say: then only the node's own calls are waited for)."""
        if self.agent is None:
            return 0
        try:
            return await self.agent.drain()
        except grpc.aio.AioRpcError as err:
            log.warning("could not tell the scheduler we drain: %s", err.code().name)
            return 0

    async def stop(self) -> None:
        if self.publisher is not None:
            await self.publisher.stop()
        if self.agent is not None:
            await self.agent.stop()
