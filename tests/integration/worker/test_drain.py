"""Drain: a worker told to stop first tells the scheduler (which routes nothing new to it), then
finishes what is in flight (a storage read, the P->D relay of the hit, the prefill->decode
handoff, the decoding) before it stops.

A real scheduler and four real workers (two prefill, two decode) in this process, over gRPC and
NIXL. The storage NIC is capped low, so a turn's hit read takes about five seconds: the drain
starts while it is in flight.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest
import torch

pytest.importorskip("nixl_cu12")

from dualpath.config import Role  # noqa: E402
from dualpath.kv import block_ids  # noqa: E402
from dualpath.scheduler.cli import build  # noqa: E402
from dualpath.scheduler.client import SchedulerClient  # noqa: E402
from dualpath.v1 import scheduler_pb2 as spb  # noqa: E402
from dualpath.v1 import worker_pb2 as wpb  # noqa: E402
from dualpath.v1 import worker_pb2_grpc as wpb_grpc  # noqa: E402
from dualpath.worker.common import NodeOptions  # noqa: E402
from dualpath.worker.node import WorkerNode  # noqa: E402
from prometheus_client import REGISTRY  # noqa: E402
from tiny_configs import pools, tiny_cluster  # noqa: E402

pytestmark = pytest.mark.slow

BT = 16
DRAIN_S = 30


def _config(tmp: Path):
    return tiny_cluster(
        "drain",
        BT,
        **pools(2, 16 << 20),
        # ~300 hit tokens x 1 KiB (tiny model) at 50 KB/s past the 64 KiB burst: ~5 s,
        # longer than the drain's settle time and the gRPC server's stop grace together
        storage={"path": str(tmp / "kv"), "snicGbps": 0.0004},
        workers={"drainSeconds": DRAIN_S, "transferDeadlineSeconds": 30, "kvCacheTokens": 4096},
    )


def _drains(outcome: str) -> float:
    return REGISTRY.get_sample_value("dualpath_worker_drains_total", {"outcome": outcome}) or 0.0


async def _tokens(call) -> tuple[list[int], wpb.GenerateChunk]:
    chunks = [c async for c in call]
    return [t for c in chunks for t in c.tokens], chunks[0]


def _generate(cfg, rid, prompt, hit, path, prefill) -> wpb.GenerateRequest:
    return wpb.GenerateRequest(
        request_id=rid,
        prompt_tokens=prompt,
        hit_tokens=hit,
        max_new_tokens=6,
        read_path=path,
        prefill_node=prefill.node_id,
        prefill_address=prefill.address,
    )


async def test_a_draining_worker_finishes_in_flight_work_and_gets_nothing_new(tmp_path):
    cfg = _config(tmp_path)
    model = cfg.spec.model
    sched = build(cfg, None, "127.0.0.1", 0)
    await sched.start()
    addr = f"127.0.0.1:{sched.port}"
    client = SchedulerClient(addr, timeout_s=10)
    nodes: dict[str, WorkerNode] = {}
    channels = []
    try:
        for role, name in (
            (Role.PREFILL, "p0"),
            (Role.PREFILL, "p1"),
            (Role.DECODE, "d0"),
            (Role.DECODE, "d1"),
        ):
            opts = NodeOptions(role=role, node_id=name, host="127.0.0.1", scheduler=addr)
            nodes[name] = await WorkerNode(cfg, opts).start()
        p0, p1, d0, d1 = (nodes[n] for n in ("p0", "p1", "d0", "d1"))
        deadline = time.monotonic() + 20
        while not all(n.health()[0] for n in nodes.values()):  # registered: ready
            assert time.monotonic() < deadline, [n.health() for n in nodes.values()]
            await asyncio.sleep(0.05)

        def stub(node):
            ch = grpc.aio.insecure_channel(node.address)
            channels.append(ch)
            return wpb_grpc.WorkerStub(ch)

        # turn 1 on the nodes that stay: its blocks are stored
        g = torch.Generator().manual_seed(11)
        prompt = torch.randint(4, model.vocab_size, (300,), generator=g).tolist()
        gen1, _ = await _tokens(stub(d1).Generate(_generate(cfg, "t1", prompt, 0, 0, p1)))
        ctx = prompt + gen1 + torch.randint(4, model.vocab_size, (9,), generator=g).tolist()
        hit = d1.store.lookup(block_ids(ctx, model)) * BT
        assert hit >= 288
        recompute, _ = await _tokens(stub(d1).Generate(_generate(cfg, "ref", ctx, 0, 0, p1)))

        async def route():  # (the hit does not matter for where it goes)
            return await client.route(
                prompt_tokens=len(ctx),
                context_bytes=len(ctx) * model.kv_bytes_per_token,
                max_new_tokens=6,
                queue_timeout_s=1.0,
            )

        # a request routed to p0 before its drain, whose Prefill call has not arrived yet
        for _ in range(50):
            routed_early = await route()
            if routed_early.prefill_node == "p0":
                break
            await client.complete(routed_early.request_id)
        assert routed_early.prefill_node == "p0"

        # turn 2 through p0 (path P: p0 reads the hit, relays it to d0, hands its KV to d0)
        clean_before = _drains("clean")
        served = {}

        async def turn2():
            req = _generate(cfg, "t2", ctx, hit, spb.READ_PATH_PREFILL, p0)
            served["tokens"], served["head"] = await _tokens(stub(d0).Generate(req))
            served["at"] = time.monotonic()

        in_flight = asyncio.create_task(turn2())
        deadline = time.monotonic() + 10
        while not p0.read_queue.pending_bytes:  # p0's storage read is under way
            assert time.monotonic() < deadline and not in_flight.done()
            await asyncio.sleep(0.005)
        t_drain = time.monotonic()
        drains = {n.node_id: asyncio.create_task(n.drain_and_stop()) for n in (p0, d0)}
        stopped_at = {}
        for name, task in drains.items():
            task.add_done_callback(
                lambda _t, name=name: stopped_at.setdefault(name, time.monotonic())
            )

        # the scheduler hears of both drains before anything else happens, and routes elsewhere
        while True:
            view = {n.node_id: n for n in (await client.cluster_view()).nodes}
            if view["p0"].load.draining and view["d0"].load.draining:
                break
            assert time.monotonic() - t_drain < 2, "the scheduler was not told of the drain"
            await asyncio.sleep(0.01)
        for i in range(20):
            r = await route()
            assert (r.prefill_node, r.decode_node) == ("p1", "d1"), i
            await client.complete(r.request_id)
        assert not in_flight.done() and not any(t.done() for t in drains.values())

        await asyncio.wait_for(in_flight, 30)  # the turn in flight completes, with its hit
        assert served["tokens"] == recompute
        assert served["head"].hit_tokens == hit
        assert served["head"].read_path == spb.READ_PATH_PREFILL
        # p0 still waits for the request routed to it before the drain, past the settle time
        await asyncio.sleep(1.5)
        assert not drains["p0"].done()
        await client.complete(routed_early.request_id)
        t_completed = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*drains.values()), DRAIN_S)
        assert stopped_at["p0"] >= t_completed
        # ... within the drain time: p0 once its part (read, relay, handoff) was done (the turn
        # above used its hit), d0 only after the turn's last token
        assert stopped_at["d0"] >= served["at"]
        assert all(stopped_at[n] - t_drain < DRAIN_S for n in ("p0", "d0"))
        assert _drains("clean") - clean_before == 2
        assert p0.stopping and d0.stopping and not p0.live()[0]
        # the nodes that stay still serve a hit
        tokens, head = await _tokens(
            stub(d1).Generate(_generate(cfg, "t3", ctx, hit, spb.READ_PATH_DECODE, p1))
        )
        assert tokens == recompute and head.hit_tokens == hit
    finally:
        for ch in channels:
            await ch.close()
        for n in nodes.values():
            if not n.stopping:
                await n.stop()
        await client.close()
        await sched.stop(0)
