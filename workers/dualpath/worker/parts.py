"""A worker's start-up wiring: the parts a node of its role holds, built from the cluster spec.

The torch engine (one compute thread; the model loads on a thread so the loop stays responsive),
the KV store and its read queue (the node's storage NIC, optionally capped at
`storage.snicGbps`), the NIXL transfer engine with its registered KV buffer (and the emulated
compute link, `network.cnicGbps`) and the role. This module imports torch and NIXL: `WorkerNode`
loads it in `start()`, off the CLI's path.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from dualpath.config import Role
from dualpath.engine import Engine
from dualpath.kv import KVStore, ReadQueue
from dualpath.kv.events import KvEventBuffer
from dualpath.transfer.engine import TransferEngine
from dualpath.transfer.link import ComputeLink
from dualpath.worker.decode import DecodeRole
from dualpath.worker.prefill import PrefillRole

if TYPE_CHECKING:
    from dualpath.worker.common import Node


async def build(node: Node) -> None:
    """Set the node's engine, store (unless given), read queue, transfer (unless given) and
    role; each exists on the node as soon as it is built, so a failed start stops what was."""
    spec, role = node.cfg.spec, node.role
    pool = spec.pool(role)
    loop = asyncio.get_running_loop()
    # /livez and /readyz answer 503 "starting" meanwhile (startupProbe: workers.startupSeconds)
    cache_tokens = node.kv_cache_tokens if role is Role.DECODE else spec.model.block_tokens
    node.engine = await loop.run_in_executor(
        None, lambda: Engine(spec.model, kv_capacity_tokens=cache_tokens)
    )
    if node.store is None:
        if node.opts.scheduler:
            node.kv_events = KvEventBuffer()
        node.store = KVStore(
            node.storage_path,
            spec.model,
            spec.storage.capacity_bytes,
            backend=node.opts.store_backend if spec.storage.use_nixl else "preadv",
            events=node.kv_events,
        )
    node.read_queue = ReadQueue(
        node.store,
        spec.storage.read_concurrency,
        spec.storage.snic_gbps,
        name=node.node_id,
        read_timeout_s=spec.storage.read_timeout_ms / 1000,
    )
    if node.transfer is None:
        node.transfer = TransferEngine(
            node.node_id,
            pool.kv_buffer_bytes,
            link=ComputeLink.from_spec(spec.network, name=node.node_id),
            deadline_s=node.deadline_s,
        )
    node.transfer.start()
    if role is Role.PREFILL:
        node.prefill = await PrefillRole(
            model=spec.model,
            engine=node.engine,
            transfer=node.transfer,
            read_queue=node.read_queue,
            deadline_s=node.deadline_s,
            batch_quota_ms=spec.workers.prefill_batch_quota_ms,
        ).start()
    else:
        node.decode = DecodeRole(
            node_id=node.node_id,
            model=spec.model,
            engine=node.engine,
            store=node.store,
            transfer=node.transfer,
            read_queue=node.read_queue,
            deadline_s=node.deadline_s,
            request_timeout_s=node.request_timeout_s,
            worker_stub=node.worker_stub,
            flush_kv_events=node.registration.flush_kv_events,
        )
        node.decode.start()
