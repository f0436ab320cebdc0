"""`dualpath bench store`: KV block store read throughput vs a plain read of the same bytes.

Writes a realistic set of blocks (default: the llama3-8b preset's KV shape: 32 layers, 8 KV
heads, 128 dim, fp16, 64-token blocks = 8 MiB a block), then, interleaved over a few rounds,
reads them (a) through the read queue layer by layer, as a prefill node does (one range read
per block-layer, checksums verified) and (b) as one plain sequential read per file (raw).
(the raw read lands in a buffer of the same size as the request buffer).
Prints JSON: read_gbps, raw_read_gbps, read_ratio = read/raw, whole-request read_blocks_gbps,
the backend used, and with --snic-gbps X the capped throughput and its error |capped-X|/X.
All rates are gigabits per second (the SNIC convention). The data set lives in a temporary
directory (under --out when given) and is removed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from dualpath.config import ModelSpec, StorageSpec
from dualpath.kv.backend import BACKENDS
from dualpath.kv.buffers import random_layers
from dualpath.kv.ids import block_ids
from dualpath.kv.queue import ReadQueue
from dualpath.kv.store import KVStore
from dualpath.units import gbps_to_bytes_per_s

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="llama3-8b", help="model preset (KV shape)")
    parser.add_argument("--blocks", type=int, default=48, help="blocks in the data set")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved read rounds")
    parser.add_argument(
        "--backend",
        default=None,
        choices=BACKENDS,
        help="read backend (default: the product's, storage.useNixl: auto if true, else preadv)",
    )
    parser.add_argument("--concurrency", type=int, default=2, help="read queue workers")
    parser.add_argument(
        "--snic-gbps", type=float, default=0.0, help="also measure a queue capped at X Gbit/s"
    )
    parser.add_argument(
        "--capped-seconds", type=float, default=3.0, help="how long the capped read runs"
    )
    parser.add_argument("--out", default=None, help="directory for the data set and result")
    parser.add_argument("--json", action="store_true", help="print only the JSON result")


def default_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args([])


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes * 8 / seconds / 1e9


def _raw_read(paths: list[Path], buf: torch.Tensor) -> int:
    """The baseline: each file in one sequential read, landing in one request-sized buffer."""
    view = memoryview(buf.numpy())
    total = 0
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            total += f.readinto(view[total:])
    return total


async def _queue_read(
    queue: ReadQueue, ids: list, layers: int, out: torch.Tensor | None = None
) -> int:
    # `out`: a preallocated node buffer (as workers have); a fresh one would time page faults
    handle = queue.submit(ids, out)
    try:
        for layer in range(layers):
            k, v = await handle.layer(layer)
            assert k.shape[0] == len(ids) * queue.store.layout.block_tokens
        return handle.valid_blocks * queue.store.layout.payload_bytes
    finally:
        handle.close()


def run(args: argparse.Namespace) -> int:
    model = ModelSpec(preset=args.preset)
    if args.backend is None:
        args.backend = "auto" if StorageSpec().use_nixl else "preadv"
    if args.blocks < 1 or args.rounds < 1:
        raise SystemExit("--blocks and --rounds must be >= 1")
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="dualpath-bench-store-", dir=out))
    try:
        result = _bench(args, model, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    text = json.dumps(result, indent=None if args.json else 2)
    if out:
        (out / "bench_store.json").write_text(text + "\n")
    print(text)
    return 0


def _bench(args: argparse.Namespace, model: ModelSpec, root: Path) -> dict:
    lo_blocks = args.blocks
    store = KVStore(root, model, capacity_bytes=1 << 40, backend=args.backend)
    lo = store.layout
    tokens = [(i * 2654435761) % model.vocab_size for i in range(lo_blocks * lo.block_tokens)]
    ids = block_ids(tokens, model)
    gen = torch.Generator().manual_seed(0)
    blocks = [random_layers(lo, gen) for _ in range(min(4, lo_blocks))]
    t0 = time.perf_counter()
    for i, bid in enumerate(ids):
        store.put(bid, blocks[i % len(blocks)])
    write_s = time.perf_counter() - t0
    assert store.lookup(ids) == len(ids)
    paths = [store.path_of(b) for b in ids]
    payload = len(ids) * lo.payload_bytes
    raw_buf = torch.empty(len(ids) * lo.file_bytes, dtype=torch.uint8)
    req_buf = torch.empty(payload, dtype=torch.uint8)

    raw_s, queue_s, blocks_s = [], [], []
    with ReadQueue(store, concurrency=args.concurrency, name="bench") as queue:
        asyncio.run(
            _queue_read(queue, ids, lo.layers, req_buf)
        )  # warm: headers cached, threads started
        _raw_read(paths, raw_buf)
        for _ in range(args.rounds):
            t = time.perf_counter()
            n = _raw_read(paths, raw_buf)
            raw_s.append(time.perf_counter() - t)
            assert n == len(ids) * lo.file_bytes
            t = time.perf_counter()
            got = asyncio.run(_queue_read(queue, ids, lo.layers, req_buf))
            queue_s.append(time.perf_counter() - t)
            assert got == payload
            t = time.perf_counter()
            r = store.read_blocks(ids, req_buf)
            blocks_s.append(time.perf_counter() - t)
            assert r.valid_blocks == len(ids)

    raw_bytes = len(ids) * lo.file_bytes
    raw_gbps = _gbps(raw_bytes, statistics.median(raw_s))
    read_gbps = _gbps(payload, statistics.median(queue_s))
    result: dict = {
        "bench": "store",
        "backend": store.backend.name,
        "preset": args.preset,
        "blocks": len(ids),
        "block_bytes": lo.file_bytes,
        "payload_bytes": payload,
        "layers": lo.layers,
        "concurrency": args.concurrency,
        "rounds": args.rounds,
        "write_gbps": round(_gbps(raw_bytes, write_s), 3),
        "read_gbps": round(read_gbps, 3),
        "raw_read_gbps": round(raw_gbps, 3),
        "read_ratio": round(read_gbps / raw_gbps, 3),
        "read_blocks_gbps": round(_gbps(payload, statistics.median(blocks_s)), 3),
        "read_gbps_rounds": [round(_gbps(payload, s), 2) for s in queue_s],
        "raw_read_gbps_rounds": [round(_gbps(raw_bytes, s), 2) for s in raw_s],
    }
    if args.snic_gbps > 0:
        result.update(_capped(store, ids, args, req_buf))
    store.close()
    return result


def _capped(store: KVStore, ids: list, args: argparse.Namespace, buf: torch.Tensor) -> dict:
    lo = store.layout
    target_bytes = gbps_to_bytes_per_s(args.snic_gbps) * args.capped_seconds
    reps = max(1, round(target_bytes / (len(ids) * lo.payload_bytes)))
    n = max(1, min(len(ids), round(target_bytes / lo.payload_bytes)))
    with ReadQueue(
        store, concurrency=args.concurrency, snic_gbps=args.snic_gbps, name="bench-capped"
    ) as queue:

        async def go() -> int:
            total = 0
            for _ in range(reps if n == len(ids) else 1):
                total += await _queue_read(queue, ids[:n], lo.layers, buf)
            return total

        t = time.perf_counter()
        nbytes = asyncio.run(go())
        elapsed = time.perf_counter() - t
    capped = _gbps(nbytes, elapsed)
    return {
        "snic_gbps": args.snic_gbps,
        "capped_gbps": round(capped, 4),
        "cap_error": round(abs(capped - args.snic_gbps) / args.snic_gbps, 4),
        "capped_bytes": nbytes,
        "capped_seconds": round(elapsed, 3),
    }


if __name__ == "__main__":  # pragma: no cover
    logging.basicConfig(level=os.environ.get("LOG_LEVEL", "INFO"))
    raise SystemExit(run(default_args()))
