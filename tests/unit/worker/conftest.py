"""The worker roles' fixture: a prefill and a decode node in the test's process over the
in-memory store and transfer engine (their real roles, read queues, engines and gRPC service)."""

from __future__ import annotations

import pytest
from dualpath.config import Role, from_resource
from dualpath.kv.memory import MemoryStore
from dualpath.transfer.fake import MemoryFabric, MemoryTransfer
from dualpath.worker.common import NodeOptions
from dualpath.worker.node import WorkerNode

BT = 16
DEADLINE_S = 1.0


@pytest.fixture
async def cluster(tmp_path):
    cfg = from_resource(
        {
            "apiVersion": "dualpath.io/v1alpha1",
            "kind": "DualPathCluster",
            "metadata": {"name": "roles"},
            "spec": {
                "model": {"name": "dualpath-tiny", "preset": "tiny", "blockTokens": BT},
                "prefill": {"replicas": 1, "kvBufferBytes": 8 << 20},
                "decode": {"replicas": 1, "kvBufferBytes": 8 << 20},
                "storage": {"path": str(tmp_path / "kv"), "readTimeoutMs": 500},
            },
        }
    )
    fabric = MemoryFabric()
    store = MemoryStore(cfg.spec.model)
    nodes = {}
    for role, name in ((Role.PREFILL, "prefill-0"), (Role.DECODE, "decode-0")):
        opts = NodeOptions(role=role, node_id=name, kv_cache_tokens=4096, deadline_s=DEADLINE_S)
        transfer = MemoryTransfer(name, 8 << 20, fabric, deadline_s=DEADLINE_S)
        nodes[name] = await WorkerNode(cfg, opts, store=store, transfer=transfer).start()
    try:
        yield nodes["prefill-0"], nodes["decode-0"], store, fabric
    finally:
        for node in nodes.values():
            await node.stop()
