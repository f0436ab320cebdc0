"""`dualpath bench engine`: prefill / decode tokens/s and the layer-wise load overlap.

    dualpath bench engine --json                 # small preset
    dualpath bench engine --preset tiny --quick --json

overlap_ratio = time(layer-wise load + compute) / max(load alone, compute alone), where the load
is a per-layer source throttled to a bandwidth chosen so the load takes `--load-to-compute` x the
compute time (or `--gbps`); all three are measured in this run. 1.0 = perfect overlap, 2.0 =
fully serial. Also: the cost model calibrated here and its error on held-out shapes, and the
spread of estimated time in FIFO vs similar-time batches on one mixed queue.

batched_prefill: one queue of agentic turns (short appended prompts over long hits), prefilled
one request per forward and then in batches (`admit_fifo` within the quota, one forward per
batch), in interleaved rounds; prefill tokens/s and the spread of per-job compute time of
each, and whether every request's logits and KV are identical in both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from typing import Any

import torch

from dualpath.config import ModelSpec
from dualpath.engine.batcher import (
    PrefillItem,
    admit_fifo,
    fifo_batches,
    mean_spread_s,
    similar_time_batches,
)
from dualpath.engine.calibrate import DEFAULT_GRID, calibrate, measure, random_hit
from dualpath.engine.cost import CostModel, relative_errors
from dualpath.engine.decode import SamplingParams
from dualpath.engine.engine import Engine
from dualpath.engine.prefill import MemorySource, ThrottledSource
from dualpath.units import gbps_to_bytes_per_s


def _range(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(","))
    if not 0 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"{text!r}: want LO,HI with 0 <= LO <= HI")
    return lo, hi


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="small", help="ModelSpec preset (small, tiny)")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default $DUALPATH_TORCH_THREADS or 1)",
    )
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--decode-batch", type=int, default=16)
    parser.add_argument("--decode-context", type=int, default=256)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--hit-tokens", type=int, default=1024, help="overlap: hit tokens")
    parser.add_argument("--new-tokens", type=int, default=256, help="overlap: new tokens")
    parser.add_argument(
        "--gbps",
        type=float,
        default=0.0,
        help="load bandwidth in Gbit/s (0 = derive from --load-to-compute)",
    )
    parser.add_argument(
        "--load-to-compute",
        type=float,
        default=0.9,
        help="target load-alone / compute-alone time when --gbps is 0",
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--overlap-repeats",
        type=int,
        default=21,
        help="overlap: rounds of load alone, both, compute alone (the median round is reported)",
    )
    parser.add_argument("--quota-ms", type=float, default=300.0, help="batcher compute quota")
    parser.add_argument("--batch-requests", type=int, default=32, help="batched: queued turns")
    parser.add_argument("--batch-rounds", type=int, default=3, help="batched: interleaved rounds")
    parser.add_argument(
        "--batch-hit",
        type=_range,
        default=(512, 2048),
        help="batched: hit tokens of a turn, uniform in LO,HI",
    )
    parser.add_argument(
        "--batch-new",
        type=_range,
        default=(8, 32),
        help="batched: appended tokens of a turn, uniform in LO,HI (the paper's turns append "
        "~1.3%% of their context: 430-610 tokens over 32-64K)",
    )
    parser.add_argument(
        "--batch-quota-ms",
        type=float,
        default=0.0,
        help="batched: compute quota per batch; 0 = QUOTA_TURNS x the queue's mean estimated "
        "turn (the paper's 300 ms holds about that many turns on a GPU)",
    )
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke run)")
    parser.add_argument("--json", action="store_true", help="print only the JSON result")


def _tokens(n: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


async def _prefill_tps(engine: Engine, n: int, repeats: int) -> float:
    x = _tokens(n, engine.spec.vocab_size, 1)
    await engine.prefill(x[:16]).collect()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        await engine.prefill(x).collect()
        times.append(time.perf_counter() - t0)
    return n / statistics.median(times)


async def _decode_tps(engine: Engine, batch: int, context: int, steps: int) -> float:
    kv = random_hit(engine, context, seed=2)
    logits = torch.zeros(engine.spec.vocab_size)
    for i in range(batch):
        engine.add_sequence(f"b{i}", kv, logits, SamplingParams(max_tokens=steps + 1))
    await engine.astep()  # warm-up
    t0 = time.perf_counter()
    done = 0
    for _ in range(steps - 1):
        done += len(await engine.astep())
    dt = time.perf_counter() - t0
    for i in range(batch):
        engine.free(f"b{i}")
    return done / dt


async def _overlap(
    engine: Engine, args: argparse.Namespace, load_to_compute: float
) -> dict[str, Any]:
    """Compute alone, load alone, both layer-wise, in `overlap_repeats` interleaved rounds."""
    hit = random_hit(engine, args.hit_tokens, seed=3)
    x = _tokens(args.new_tokens, engine.spec.vocab_size, 4)
    total_bytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in hit)

    warm = x[: min(64, len(x))]

    async def compute_alone() -> float:
        await engine.prefill(warm).collect()  # untimed: see the loop below
        t0 = time.perf_counter()
        await engine.prefill(x, args.hit_tokens, MemorySource(hit)).collect()
        return time.perf_counter() - t0

    await compute_alone()  # warm-up
    # the median, not the best: the load is sized against a typical compute, not a lucky one
    calibration = statistics.median([await compute_alone() for _ in range(args.repeats)])
    bps = gbps_to_bytes_per_s(args.gbps) or total_bytes / (calibration * load_to_compute)
    # interleaved, and the same number of samples of each: a best-of over more samples of one
    # side than of the other would bias the ratio
    compute, load, both, waits = [], [], [], []
    for _ in range(args.overlap_repeats):
        src = ThrottledSource(hit, bps)
        t0 = time.perf_counter()
        await src.wait_all()
        load.append(time.perf_counter() - t0)
        # The load alone is an idle wait; a compute right after idling runs slower on this VM
        # (vCPU descheduled, caches cold), so each timed compute starts after the same short
        # untimed prefill, whichever measurement came before it.
        await engine.prefill(warm).collect()
        src = ThrottledSource(hit, bps)
        t0 = time.perf_counter()
        src.start()
        run = engine.prefill(x, args.hit_tokens, src)
        await run.collect()
        both.append(time.perf_counter() - t0)
        waits.append(run.times.wait_s)
        compute.append(await compute_alone())
    # Each round's three times are taken within about a second of each other, so their ratio
    # is free of this VM's slow phases (a compute alone varies by +-20% from minute to
    # minute); the headline is the median round. The best-of-each ratio is also given.
    rounds = sorted(b / max(ld, c) for c, ld, b in zip(compute, load, both, strict=True))
    c, ld, b = min(compute), min(load), min(both)
    med = statistics.median
    return {
        "overlap_ratio": round(med(rounds), 4),
        "overlap_ratio_rounds_p10_p90": [
            round(rounds[len(rounds) // 10], 4),
            round(rounds[-1 - len(rounds) // 10], 4),
        ],
        "overlap_ratio_best_of_each": round(b / max(ld, c), 4),
        "compute_alone_s": round(med(compute), 4),
        "load_alone_s": round(med(load), 4),
        "load_and_compute_s": round(med(both), 4),
        "compute_idle_waiting_s": round(med(waits), 4),
        "serial_ratio": round((c + ld) / max(ld, c), 4),  # from the best of each
        # what a pipeline of whole layers could do at best (layer 0's load is not overlapped);
        # attending to each tile of the hit as it lands gets below it
        "ideal_whole_layer_ratio": round(
            (min(c, ld) / engine.spec.layers + max(c, ld)) / max(c, ld), 4
        ),
        "load_gbps": round(bps * 8 / 1e9, 3),
        "hit_tokens": args.hit_tokens,
        "new_tokens": args.new_tokens,
        "hit_bytes": total_bytes,
    }


async def _cost(engine: Engine, args: argparse.Namespace) -> dict[str, Any]:
    grid = DEFAULT_GRID if not args.quick else ((0, 16), (0, 64), (128, 16), (128, 64))
    model, samples = await calibrate(engine, grid, repeats=args.repeats)
    rng = random.Random(5)
    cap_c, cap_n = max(c for c, _ in grid), max(n for _, n in grid)
    held_shapes = [(rng.randrange(0, cap_c + 1, 64), rng.randint(8, cap_n)) for _ in range(6)]
    held = await measure(engine, held_shapes, repeats=args.repeats)
    errs = relative_errors(model, held)
    quota = args.quota_ms / 1000
    q = []
    for i in range(60):
        if rng.random() < 0.5:
            q.append(PrefillItem(f"r{i}", rng.randrange(0, 512, 64), rng.randint(8, 48)))
        else:
            q.append(PrefillItem(f"r{i}", rng.randrange(0, 2048, 64), rng.randint(128, 512)))
    fifo = fifo_batches(q, model, quota)
    similar = similar_time_batches(q, model, quota)
    return {
        "_model": model,
        "cost_model": {k: float(f"{v:.4g}") for k, v in model.to_dict().items()},
        "calibration_shapes": len(samples),
        "fit_mean_rel_error": round(statistics.mean(relative_errors(model, samples)), 4),
        "heldout_mean_rel_error": round(statistics.mean(errs), 4),
        "heldout_max_rel_error": round(max(errs), 4),
        "heldout": [
            {
                "cached": c,
                "new": n,
                "measured_s": round(t, 4),
                "estimated_s": round(model.estimate(c, n), 4),
            }
            for c, n, t in held
        ],
        "batcher": {
            "quota_ms": args.quota_ms,
            "fifo_batches": len(fifo),
            "similar_batches": len(similar),
            "fifo_mean_spread_ms": round(mean_spread_s(fifo) * 1000, 3),
            "similar_mean_spread_ms": round(mean_spread_s(similar) * 1000, 3),
        },
    }


# The paper's 300 ms quota holds about 8 agent turns of ~500 appended tokens on a prefill GPU
# (~13K tokens/s); a CPU quota holds as many of this machine's turns.
QUOTA_TURNS = 8


def _spread(times: list[float]) -> dict[str, float]:
    t = sorted(times)
    pick = lambda q: t[min(len(t) - 1, int(q * len(t)))]  # noqa: E731
    return {
        "jobs": len(t),
        "p10_ms": round(pick(0.1) * 1000, 2),
        "p50_ms": round(pick(0.5) * 1000, 2),
        "p90_ms": round(pick(0.9) * 1000, 2),
        "max_ms": round(t[-1] * 1000, 2),
        "cv": round(statistics.pstdev(t) / statistics.mean(t), 3),
    }


async def _batching(engine: Engine, args: argparse.Namespace, cost: CostModel) -> dict[str, Any]:
    """The same queue of turns, one per forward and in quota batches, in interleaved rounds."""
    rng = random.Random(11)
    s, hits = engine.spec, {}
    queue = []
    for i in range(args.batch_requests):
        hit = rng.randrange(args.batch_hit[0], args.batch_hit[1] + 1, s.block_tokens)
        new = rng.randint(*args.batch_new)
        if hit not in hits:
            hits[hit] = random_hit(engine, hit, seed=hit)
        queue.append((_tokens(new, s.vocab_size, 100 + i), hit))
    items = [PrefillItem(f"r{i}", hit, x.numel()) for i, (x, hit) in enumerate(queue)]
    mean_s = statistics.mean(cost.estimate(it.cached, it.new) for it in items)
    quota = args.batch_quota_ms / 1000 or QUOTA_TURNS * mean_s
    plan, rest = [], list(range(len(items)))
    while rest:
        n = admit_fifo([items[i] for i in rest], cost, quota)
        plan.append(rest[:n])
        rest = rest[n:]

    def req(i: int) -> tuple[torch.Tensor, int, MemorySource]:
        x, hit = queue[i]
        return x, hit, MemorySource(hits[hit])

    async def one_at_a_time() -> tuple[float, list[float], list]:
        t0, jobs, outs = time.perf_counter(), [], []
        for i in range(len(queue)):
            run = engine.prefill(*req(i))
            outs.append(await run.collect())
            jobs.append(run.times.compute_s)
        return time.perf_counter() - t0, jobs, outs

    async def batched() -> tuple[float, list[float], list]:
        t0, jobs, outs = time.perf_counter(), [], [None] * len(queue)
        for ids in plan:
            b = engine.prefill_batch([req(i) for i in ids])
            got_all = await asyncio.gather(*(m.collect() for m in b.members))
            for i, got in zip(ids, got_all, strict=True):
                outs[i] = got
            jobs.append(b.times.compute_s)
        return time.perf_counter() - t0, jobs, outs

    await engine.prefill(*req(0)).collect()  # warm-up
    tokens = sum(x.numel() for x, _ in queue)
    ratios, alone_tps, batch_tps = [], [], []
    identical = True
    for r in range(args.batch_rounds):
        order = (one_at_a_time, batched) if r % 2 == 0 else (batched, one_at_a_time)
        res = {f.__name__: await f() for f in order}
        (t_a, jobs_a, out_a), (t_b, jobs_b, out_b) = res["one_at_a_time"], res["batched"]
        alone_tps.append(tokens / t_a)
        batch_tps.append(tokens / t_b)
        ratios.append(t_a / t_b)
        for (kv_a, l_a), (kv_b, l_b) in zip(out_a, out_b, strict=True):
            identical &= torch.equal(l_a, l_b) and all(
                torch.equal(a, b)
                for pa, pb in zip(kv_a, kv_b, strict=True)
                for a, b in zip(pa, pb, strict=True)
            )
    med = statistics.median
    return {
        "batched_prefill_ratio": round(med(ratios), 3),
        "batched_prefill_ratio_rounds": [round(x, 3) for x in ratios],
        "one_at_a_time_tokens_per_s": round(med(alone_tps), 1),
        "batched_tokens_per_s": round(med(batch_tps), 1),
        "identical_outputs": identical,
        "requests": len(queue),
        "new_tokens": tokens,
        "hit_tokens_mean": round(statistics.mean(h for _, h in queue)),
        "quota_ms": round(quota * 1000, 2),
        "batches": len(plan),
        "requests_per_batch": [len(p) for p in plan],
        "one_at_a_time_compute": _spread(jobs_a),
        "batched_compute": _spread(jobs_b),
        "estimated_batch_ms": _spread(
            [sum(cost.estimate(items[i].cached, items[i].new) for i in p) for p in plan]
        ),
    }


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    if args.quick:
        args.prefill_tokens, args.decode_batch, args.decode_context = 128, 4, 64
        args.decode_steps, args.hit_tokens, args.new_tokens = 8, 256, 64
        args.repeats = min(args.repeats, 3)
        args.overlap_repeats = min(args.overlap_repeats, 3)
        args.batch_requests, args.batch_rounds = min(args.batch_requests, 10), 1
        args.batch_hit, args.batch_new = (64, 256), (4, 24)
    spec = ModelSpec(preset=args.preset)
    cap = args.decode_batch * (args.decode_context + args.decode_steps + spec.block_tokens * 2)
    with Engine(spec, kv_capacity_tokens=cap, threads=args.threads) as engine:
        out: dict[str, Any] = {
            "preset": args.preset,
            "torch_threads": engine.threads,
            "prefill_tokens_per_s": round(
                await _prefill_tps(engine, args.prefill_tokens, args.repeats), 1
            ),
            "decode_tokens_per_s": round(
                await _decode_tps(
                    engine, args.decode_batch, args.decode_context, args.decode_steps
                ),
                1,
            ),
            "prefill_tokens": args.prefill_tokens,
            "decode_batch": args.decode_batch,
            "decode_context": args.decode_context,
        }
        out.update(await _overlap(engine, args, args.load_to_compute))
        if args.gbps <= 0 and args.load_to_compute != 1.0:
            equal = await _overlap(engine, args, 1.0)
            out["overlap_ratio_at_equal_load"] = equal["overlap_ratio"]
            out["overlap_ratio_rounds_p10_p90_at_equal_load"] = equal[
                "overlap_ratio_rounds_p10_p90"
            ]
        cost = await _cost(engine, args)
        out.update(cost)
        out["batched_prefill"] = await _batching(engine, args, cost.pop("_model"))
        del out["_model"]
    return out


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    out = asyncio.run(_main(args))
    out["bench_wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out, indent=None if args.json else 2))
    ok = out["overlap_ratio"] > 0 and out["batched_prefill"]["identical_outputs"]
    return 0 if ok else 1


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    add_arguments(p)
    sys.exit(run(p.parse_args()))
