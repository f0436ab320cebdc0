"""The block index over real gRPC: a worker's store writes and evictions reach Route's hit as
KV events; a store left from an earlier run and a restarted scheduler are rebuilt from a store
scan before Route answers with hits."""

import asyncio
import time

import torch
from dualpath.kv import KVStore, block_ids
from dualpath.kv.buffers import TORCH_DTYPES
from dualpath.kv.events import KvEventBuffer
from dualpath.kv.ids import block_keys
from dualpath.scheduler.cli import build
from dualpath.scheduler.client import NodeAgent, Registration, SchedulerClient
from dualpath.scheduler.index import pack_keys
from dualpath.scheduler.kv_events import KvEventPublisher
from dualpath.scheduler.policy import NodeLoad
from prometheus_client import REGISTRY
from schedtools import free_port
from tiny_configs import tiny_cluster

BT = 16


def cluster_config(tmp_path):
    return tiny_cluster("index", BT, storage={"path": str(tmp_path / "kv")})


def kv_for(store, n_tokens):
    lo = store.layout
    dtype = TORCH_DTYPES[lo.dtype]
    return [
        (
            torch.randn((n_tokens, *lo.k_shape[1:])).to(dtype),
            torch.randn((n_tokens, *lo.v_shape[1:])).to(dtype),
        )
        for _ in range(lo.layers)
    ]


class Worker:
    """What a worker process runs for the index: its store, a NodeAgent, a publisher."""

    def __init__(self, address, node_id, role, store_root, model):
        self.events = KvEventBuffer()
        self.store = KVStore(store_root, model, 1 << 30, backend="preadv", events=self.events)
        reg = Registration(node_id, role, f"127.0.0.1:{free_port()}", snic_bytes_per_s=1e9)
        load = lambda: NodeLoad(buffer_free_bytes=1 << 40)  # noqa: E731
        self.agent = NodeAgent(address, reg, load, interval_s=0.02)
        self.publisher = KvEventPublisher(
            self.agent.stub, node_id, self.events, self.store.scan_keys
        ).start()
        self.agent.on_kv_snapshot = self.publisher.request_snapshot
        self.agent.start()

    async def stop(self):
        await self.publisher.stop()
        await self.agent.stop()
        self.store.close()


async def route_hit(client, model, tokens):
    keys = block_keys(block_ids(tokens, model))
    r = await client.route(
        prompt_tokens=len(tokens),
        block_keys=pack_keys(keys),
        context_bytes=len(tokens) * model.kv_bytes_per_token,
        max_new_tokens=4,
    )
    await client.complete(r.request_id)
    assert r.hit_bytes == r.hit_tokens * model.kv_bytes_per_token
    return r.hit_tokens


async def eventually_hit(client, model, tokens, want, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    got = None
    while time.monotonic() < deadline:
        got = await route_hit(client, model, tokens)
        if got == want:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"hit {got}, wanted {want}")


def metric(name, **labels):
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_events_reach_route_and_a_restart_rebuilds_before_hits(tmp_path):
    cfg = cluster_config(tmp_path)
    model = cfg.spec.model
    root = tmp_path / "kv"
    tokens = list(range(1, 5 * BT + 4))  # 5 full blocks + 3 tokens
    # a store left from an earlier run: the chain's first 3 blocks
    old = KVStore(root, model, 1 << 30, backend="preadv")
    old.put_tokens(tokens[: 3 * BT], kv_for(old, 3 * BT))
    old.close()

    port = free_port()
    addr = f"127.0.0.1:{port}"
    server = build(cfg, None, "127.0.0.1", port)
    await server.start()
    rebuilds0 = metric("dualpath_scheduler_index_snapshot_rebuilds_total")
    decode = Worker(addr, "d0", "decode", root, model)
    prefill = Worker(addr, "p0", "prefill", root, model)
    client = SchedulerClient(addr, timeout_s=5)
    try:
        # found by the start-up scan (asked of the first worker that heartbeats)
        await eventually_hit(client, model, tokens, 3 * BT)
        assert metric("dualpath_scheduler_index_snapshot_rebuilds_total") == rebuilds0 + 1

        # the decode worker writes the turn's blocks: stored events, flushed, then a hit
        decode.store.put_tokens(tokens, kv_for(decode.store, len(tokens)))
        assert await decode.publisher.flush(timeout_s=5)
        assert await route_hit(client, model, tokens) == 5 * BT
        # capped: at least one prompt token is left to prefill
        assert await route_hit(client, model, tokens[: 5 * BT]) == 4 * BT

        # eviction (by the other process) reaches the index and ends the hit there
        ids = block_ids(tokens, model)
        prefill.store.evict(ids[2])
        assert await prefill.publisher.flush(timeout_s=5)
        assert await route_hit(client, model, tokens) == 2 * BT
        assert server.servicer.state.index.holes == 1

        # the scheduler restarts: an empty index answers 0 (recompute) until a worker's scan
        # is installed, then the hits are back. Scanned keys carry no chain links, so the hole
        # at block 2 may be offered until an event links the chain (the reader would end the
        # hit there); the next write of the chain links it.
        await server.stop(0)
        server = build(cfg, None, "127.0.0.1", port)
        assert not server.servicer.state.index.ready
        await server.start()
        hits = []
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            hits.append(await route_hit(client, model, tokens))
            if hits[-1]:
                break
            await asyncio.sleep(0.02)
        assert hits[-1] in (2 * BT, 5 * BT), hits
        assert server.servicer.state.index.counters.rebuilds == 1
        assert all(h == 0 for h in hits[:-1])
        prefill.store.put_tokens(tokens, kv_for(prefill.store, len(tokens)))
        assert await prefill.publisher.flush(timeout_s=5)
        assert await route_hit(client, model, tokens) == 5 * BT  # block 2 written again
        prefill.store.evict(ids[1])
        assert await prefill.publisher.flush(timeout_s=5)
        assert await route_hit(client, model, tokens) == 1 * BT
    finally:
        await client.close()
        await decode.stop()
        await prefill.stop()
        await server.stop(0)


async def test_a_lost_batch_is_a_gap_and_the_index_is_rebuilt(tmp_path):
    cfg = cluster_config(tmp_path)
    model = cfg.spec.model
    root = tmp_path / "kv"
    port = free_port()
    addr = f"127.0.0.1:{port}"
    server = build(cfg, None, "127.0.0.1", port)
    await server.start()
    decode = Worker(addr, "d0", "decode", root, model)
    prefill = Worker(addr, "p0", "prefill", root, model)
    client = SchedulerClient(addr, timeout_s=5)
    tokens = list(range(7, 7 + 3 * BT + 1))
    try:
        await eventually_hit(client, model, tokens, 0)
        idx = server.servicer.state.index
        deadline = time.monotonic() + 10
        while not idx.ready and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert idx.ready
        other = list(range(900, 900 + BT + 1))
        decode.store.put_tokens(other, kv_for(decode.store, len(other)))  # batch 1 arrives
        assert await decode.publisher.flush(timeout_s=5)
        assert await route_hit(client, model, other) == BT
        gaps0 = metric("dualpath_scheduler_index_gaps_total")
        decode.events.max_keys = 1  # the buffer overflows: its events are dropped
        decode.store.put_tokens(tokens, kv_for(decode.store, len(tokens)))
        decode.events.max_keys = 1 << 20
        await decode.publisher.flush(timeout_s=5)
        assert metric("dualpath_scheduler_index_gaps_total") == gaps0 + 1
        # the rebuild finds the blocks the lost batch announced
        await eventually_hit(client, model, tokens, 3 * BT)
        assert idx.counters.rebuilds == 2
    finally:
        await client.close()
        await decode.stop()
        await prefill.stop()
        await server.stop(0)
