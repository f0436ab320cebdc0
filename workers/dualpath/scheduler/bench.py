"""`dualpath bench scheduler`: decision latency in process and through gRPC on loopback, and
Route (the block index's hit lookup, then the decision) with a store of `--index-blocks`
blocks indexed."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import random
import sys
import time
import tracemalloc

from dualpath.scheduler.index import ROOT, BlockIndex, keys_view, pack_keys
from dualpath.scheduler.policy import (
    ClusterView,
    Decision,
    NodeState,
    RouteRequest,
    account,
    get_policy,
)
from dualpath.scheduler.wire import route_fields

KV_BYTES_PER_TOKEN = 70_000  # about DeepSeek-V3's MLA latent per token, all layers


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, default=144, help="total nodes, 1/3 prefill")
    parser.add_argument("--decisions", type=int, default=50_000, help="in-process decisions")
    parser.add_argument("--grpc-decisions", type=int, default=2_000)
    parser.add_argument("--policy", default="dualpath")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--index-blocks", type=int, default=1_000_000, help="blocks in the block index"
    )
    parser.add_argument("--block-tokens", type=int, default=64)
    parser.add_argument(
        "--index-holes",
        type=int,
        default=100,
        help="blocks removed from inside chains (a hit ends there; bad blocks, races)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON only")


SNIC_BYTES_PER_S = 50e9  # 400 Gbps


def draw_load(node: NodeState, rng: random.Random) -> None:
    """A random load for `node`, as a heartbeat would report it."""
    node.read_pending_bytes = rng.randrange(0, int(6 * SNIC_BYTES_PER_S))
    if node.role == "prefill":
        node.tokens_queued = rng.randrange(0, 60_000)
    else:
        node.tokens_running = rng.randrange(0, 500_000)
        node.requests_running = rng.randrange(0, 64)
        node.buffer_free_bytes = rng.randrange(1 << 30, 1 << 36)


def random_view(
    n_prefill: int, n_decode: int, rng: random.Random, config_hashes: int = 1
) -> ClusterView:
    """Random loads; with `config_hashes` > 1 the nodes alternate between that many versions
    (a rollout in progress), drawn after the loads so the loads are the same."""
    prefill = [
        NodeState(
            f"p{i}", "prefill", snic_bytes_per_s=SNIC_BYTES_PER_S, prefill_tokens_per_s=10_000.0
        )
        for i in range(n_prefill)
    ]
    decode = [
        NodeState(f"d{i}", "decode", snic_bytes_per_s=SNIC_BYTES_PER_S, group=f"g{i // 8}")
        for i in range(n_decode)
    ]
    for n in (*prefill, *decode):
        draw_load(n, rng)
    if config_hashes > 1:
        for i, n in enumerate((*prefill, *decode)):
            n.config_hash = f"v{i % config_hashes}"
    return ClusterView(prefill, decode, cnic_bytes_per_s=8 * 50e9)


class Churn:
    """The load changes between two decisions of a running scheduler, applied after each one
    (outside the timed part): the decision is charged to its nodes (`account`, as the service
    does), and one node, in turn, reports a fresh load (a heartbeat). Every node's load is
    replaced every len(nodes) decisions, so the accounting stays bounded, and each decision
    reads the changes of about three nodes: more churn than a real cluster, whose nodes
    heartbeat about once a second, gives at these rates (the policy's pools update what
    changed, so a static view would flatter them)."""

    def __init__(self, view: ClusterView, rng: random.Random) -> None:
        self.view = view
        self.nodes = [*view.prefill, *view.decode]
        self.rng = rng
        self.turn = 0

    def after(self, request: RouteRequest, decision: Decision | None) -> None:
        if decision is not None:
            account(self.view, request, decision)
        self.heartbeat()

    def heartbeat(self) -> None:
        node = self.nodes[self.turn % len(self.nodes)]
        self.turn += 1
        draw_load(node, self.rng)


def _requests(n: int, rng: random.Random) -> list[RouteRequest]:
    out = []
    for i in range(n):
        prompt = rng.randrange(4_000, 64_000)
        hit = prompt - rng.randrange(64, 700)
        out.append(RouteRequest.for_turn(f"r{i}", prompt, hit, KV_BYTES_PER_TOKEN, 180))
    return out


def _pct(sorted_ns: list[int], q: float) -> float:
    return sorted_ns[min(len(sorted_ns) - 1, int(q * len(sorted_ns)))] / 1e3


def in_process(n_nodes: int, n: int, policy_name: str, seed: int, config_hashes: int = 1) -> dict:
    rng = random.Random(seed)
    n_prefill = n_nodes // 3
    view = random_view(n_prefill, n_nodes - n_prefill, rng, config_hashes)
    reqs = _requests(1000, rng)
    policy = get_policy(policy_name)
    churn = Churn(view, rng)
    lat = []
    clock = time.perf_counter_ns
    busy = waits = 0
    for i in range(n):
        req = reqs[i % 1000]
        t0 = clock()
        decision = policy.decide(req, view)
        t1 = clock()
        lat.append(t1 - t0)
        busy += t1 - t0
        waits += decision is None
        churn.after(req, decision)
    wall_s = busy / 1e9
    lat.sort()
    return {
        "p50_us": _pct(lat, 0.5),
        "p99_us": _pct(lat, 0.99),
        "decisions_per_s": n / wall_s,
        "decisions": n,
        "waits": waits,  # decisions that found no node (None): a bench of waits would flatter
    }


def indexed_store(
    n_blocks: int, rng: random.Random, block_tokens: int, holes: int = 0
) -> tuple[BlockIndex, list[list[int]]]:
    """A block index of `n_blocks` in agent chains of 4K..64K tokens (fed as KV events), with
    `holes` blocks removed at random from inside chains, and the chains."""
    index = BlockIndex()
    index.install_snapshot(index.snapshot_wanted("bench", 0.0), [])
    chains: list[list[int]] = []
    total, seq = 0, 0
    while total < n_blocks:
        n = min(rng.randrange(4_000, 64_000) // block_tokens, n_blocks - total)
        keys = [rng.getrandbits(63) | 1 for _ in range(n)]
        seq += 1
        index.apply(
            "bench", "e", seq, [(k, keys[i - 1] if i else ROOT, i) for i, k in enumerate(keys)]
        )
        chains.append(keys)
        total += n
    seq += 1
    index.apply("bench", "e", seq, removed=[rng.choice(rng.choice(chains)) for _ in range(holes)])
    return index, chains


def index_requests(
    chains: list[list[int]], rng: random.Random, n: int, block_tokens: int
) -> list[tuple[int, bytes]]:
    """(prompt tokens, packed block keys): one chain's prefix as the cached context plus a
    turn's new blocks."""
    out = []
    for _ in range(n):
        chain = rng.choice(chains)
        cut = rng.randrange(1, len(chain) + 1)
        new = [rng.getrandbits(63) | 1 for _ in range(rng.randrange(1, 12))]
        keys = chain[:cut] + new
        out.append((len(keys) * block_tokens + rng.randrange(0, block_tokens), pack_keys(keys)))
    return out


def index_route(
    n_nodes: int,
    n: int,
    policy_name: str,
    seed: int,
    n_blocks: int,
    block_tokens: int,
    holes: int = 0,
) -> dict:
    """Route in process as the service runs it: the hit from the index, the decision and its
    accounting, with a heartbeat's load change between two routes (`Churn`)."""
    rng = random.Random(seed)
    n_prefill = n_nodes // 3
    view = random_view(n_prefill, n_nodes - n_prefill, rng)
    tracemalloc.start()
    index, chains = indexed_store(n_blocks, rng, block_tokens, holes)
    index_bytes = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    gc.collect()
    gc.freeze()  # the bench's own chains and requests are not the service's garbage
    policy = get_policy(policy_name)
    reqs = [
        (f"r{i}", p, k) for i, (p, k) in enumerate(index_requests(chains, rng, 1000, block_tokens))
    ]
    churn = Churn(view, rng)
    lat = []
    hit_blocks = 0
    clock = time.perf_counter_ns
    busy = waits = 0
    for i in range(n):
        rid, prompt, packed = reqs[i % 1000]
        t0 = clock()
        keys = keys_view(packed)
        hit = index.hit_blocks(keys, (prompt - 1) // block_tokens) * block_tokens
        req = RouteRequest.for_turn(rid, prompt, hit, KV_BYTES_PER_TOKEN, 180)
        decision = policy.decide(req, view)
        if decision is not None:
            account(view, req, decision)
        else:
            waits += 1
        t1 = clock()
        lat.append(t1 - t0)
        busy += t1 - t0
        churn.heartbeat()
        hit_blocks += hit // block_tokens
    wall_s = busy / 1e9
    gc.unfreeze()
    lat.sort()
    return {
        "p50_us": _pct(lat, 0.5),
        "p99_us": _pct(lat, 0.99),
        "routes_per_s": n / wall_s,
        "routes": n,
        "waits": waits,
        "indexed_blocks": len(index),
        "holes": index.holes,
        "index_bytes": index_bytes,
        "index_bytes_per_block": round(index_bytes / max(len(index), 1), 1),
        "mean_hit_blocks": round(hit_blocks / n, 1),
        "hole_cuts": index.counters.hole_cuts,
        "walks": index.counters.walks,
    }


async def through_grpc(
    n_nodes: int, n: int, policy_name: str, seed: int, n_blocks: int = 100_000
) -> dict:
    from dualpath import config
    from dualpath.scheduler.cli import build
    from dualpath.scheduler.client import SchedulerClient

    server = build(config.local_default(), policy_name, "127.0.0.1", 0)
    server.servicer.state.node_timeout_s = 3600.0  # no heartbeats in this bench
    logging.getLogger("dualpath.scheduler.state").setLevel(logging.WARNING)
    await server.start()
    rng = random.Random(seed)
    n_prefill = n_nodes // 3
    view = random_view(n_prefill, n_nodes - n_prefill, rng)
    for node in (*view.prefill, *view.decode):
        server.servicer.state.register(node, f"127.0.0.1:{1000}")
    bt = server.servicer.state.block_tokens
    index, chains = indexed_store(n_blocks, rng, bt)
    server.servicer.state.index = index
    client = SchedulerClient(f"127.0.0.1:{server.port}")
    reqs = index_requests(chains, rng, n, bt)
    lat = []
    try:
        t_start = time.perf_counter_ns()
        for prompt, keys in reqs:
            t0 = time.perf_counter_ns()
            turn = RouteRequest.for_turn("", prompt, 0, KV_BYTES_PER_TOKEN, 180)
            resp = await client.route(**route_fields(turn), block_keys=keys)
            lat.append(time.perf_counter_ns() - t0)
            await client.complete(resp.request_id)
        wall_s = (time.perf_counter_ns() - t_start) / 1e9
    finally:
        await client.close()
        await server.stop(0)
    lat.sort()
    return {
        "p50_us": _pct(lat, 0.5),
        "p99_us": _pct(lat, 0.99),
        "routes_per_s": n / wall_s,
        "decisions": n,
        "indexed_blocks": len(index),
    }


def run(args: argparse.Namespace) -> int:
    print(f"bench scheduler: {args.nodes} nodes, policy {args.policy}", file=sys.stderr)
    res_in = in_process(args.nodes, args.decisions, args.policy, args.seed)
    # The same view split over two config hashes: the multi-pool pair choice (no bar: transient).
    res_rollout = in_process(args.nodes, args.decisions, args.policy, args.seed, config_hashes=2)
    res_index = index_route(
        args.nodes,
        args.decisions,
        args.policy,
        args.seed,
        args.index_blocks,
        args.block_tokens,
        args.index_holes,
    )
    res_grpc = asyncio.run(through_grpc(args.nodes, args.grpc_decisions, args.policy, args.seed))
    out = {
        "bench": "scheduler",
        "nodes": args.nodes,
        "prefill_nodes": args.nodes // 3,
        "decode_nodes": args.nodes - args.nodes // 3,
        "policy": args.policy,
        "in_process": res_in,
        "in_process_rollout": res_rollout,
        "route_with_index": res_index,
        "grpc_loopback": res_grpc,
        "bars": {"p99_us_max": 50, "decisions_per_s_min": 20_000, "route_p99_us_max": 50},
        "pass": res_in["p99_us"] < 50
        and res_in["decisions_per_s"] >= 20_000
        and res_index["p99_us"] < 50,
    }
    print(json.dumps(out, indent=None if args.json else 2))
    return 0
