"""A worker process: what a prefill or decode node holds, started and stopped in order.

`WorkerNode` owns the node's parts and stops them in order; each concern has its own module:
the parts built from the spec (`parts.py`: engine, KV store, read queue, transfer engine, the
role), the gRPC service (`service.py`), the scheduler registration with heartbeats and KV events
(`registration.py`) and the drain (`drain.py`). Those modules see the node as `common.Node` (what
a node holds), below them all with its options, so none imports this one back. /metrics, /livez
and /readyz read `live` and `health`.

Its timeouts, KV cache size and drain time come from `spec.workers` (NodeOptions may override
them for tests and local experiments).
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import TYPE_CHECKING

from dualpath.config import ClusterConfig, Role
from dualpath.scheduler.policy.types import NodeLoad
from dualpath.v1 import scheduler_pb2 as spb
from dualpath.v1 import worker_pb2_grpc as wpb_grpc
from dualpath.worker import metrics
from dualpath.worker.common import NodeOptions, advertised_address, prefill_channels
from dualpath.worker.registration import NodeRegistration, node_load
from dualpath.worker.service import WorkerServer

if TYPE_CHECKING:  # the parts import torch and NIXL: built in start() (parts.py)
    from dualpath.engine import Engine
    from dualpath.kv.events import KvEventBuffer
    from dualpath.kv.protocol import BlockStore
    from dualpath.kv.queue import ReadQueue
    from dualpath.transfer.protocol import KVTransfer
    from dualpath.worker.checks import Check
    from dualpath.worker.decode import DecodeRole
    from dualpath.worker.prefill import PrefillRole

log = logging.getLogger(__name__)


def _given_or(given: float | None, spec_value: float) -> float:
    return spec_value if given is None else given


async def live_addresses(registration: NodeRegistration) -> set[str] | None:
    """The addresses of the nodes in the scheduler's view (None: not registered yet)."""
    agent = registration.agent
    if agent is None or not agent.registered:
        return None
    view = await agent.stub.ClusterView(spb.ClusterViewRequest(), timeout=5)
    return {n.address for n in view.nodes}


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
        self.storage_path = opts.storage or cfg.spec.storage.path
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
        self.kv_events: KvEventBuffer | None = None  # the store's (with a scheduler)
        self.registration = NodeRegistration(self)
        self._prefills = prefill_channels(opts.token)
        self._server: WorkerServer | None = None
        self.port = 0

    # ---- start ----------------------------------------------------------------------------

    async def start(self) -> WorkerNode:
        from dualpath.worker import parts  # torch and NIXL
        from dualpath.worker.checks import run_checks

        spec = self.cfg.spec
        self.checks = run_checks(spec, self.role)
        self._loop = asyncio.get_running_loop()
        await parts.build(self)
        self._server = WorkerServer(self, self.opts.token)
        self.port = await self._server.start(self.opts.host, self.opts.port)
        self.registration.start()
        if self.role == Role.DECODE:
            self._prefills.start_sweeper(lambda: live_addresses(self.registration))
        self.started = True
        log.info(
            "%s worker %s serving on %s (SNIC %s Gbps, KV buffer %d MiB, storage %s)",
            self.role.value,
            self.node_id,
            self.address,
            spec.storage.snic_gbps or "uncapped",
            spec.pool(self.role).kv_buffer_bytes >> 20,
            self.storage_path,
        )
        return self

    @property
    def address(self) -> str:
        return advertised_address(self.opts, self.port)

    async def flush_kv_events(self) -> None:
        """Wait until the scheduler's block index has this store's events so far."""
        await self.registration.flush_kv_events()

    def load(self) -> NodeLoad:
        return node_load(self)

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
        registered, why = self.registration.ready
        if not registered:
            return False, why
        return True, f"{self.role.value} {self.node_id} ok"

    # ---- helpers for the roles -------------------------------------------------------------

    async def worker_stub(self, address: str) -> wpb_grpc.WorkerStub:
        """A prefill node's stub, for the decode role (`grpc_channels.Unreachable` when it
        does not connect)."""
        return wpb_grpc.WorkerStub(await self._prefills.get(address))

    # ---- stop -------------------------------------------------------------------------------

    async def drain_and_stop(self) -> None:
        """`drain.drain_and_stop`: tell the scheduler, finish what is in flight, stop."""
        from dualpath.worker.drain import drain_and_stop

        await drain_and_stop(self)

    async def stop(self) -> None:
        self.stopping = True
        self.started = False
        if self._server is not None:
            await self._server.health.enter_graceful_shutdown()
        await self.registration.stop()
        if self._server is not None:
            await self._server.server.stop(grace=1.0)
        if self.decode is not None:
            await self.decode.stop()
        if self.prefill is not None:
            await self.prefill.stop()
        await self._prefills.close()
        if self.transfer is not None:
            await self.transfer.aclose()
        if self.read_queue is not None:
            self.read_queue.close()
        if self.store is not None:
            self.store.close()
        if self.engine is not None:
            self.engine.close()
        log.info("worker %s stopped (pid %d)", self.node_id, os.getpid())
