"""`dualpath bench transfer`: the D->P layer stream against raw NIXL WRITEs, and isolation.

Two processes (this one sends, a `PeerProcess` receives), NIXL with UCX between them:

* `raw_gbps`: the library alone: one WRITE per layer buffer, all posted at once, no
  notifications, timed at the sender until every WRITE completed;
* `stream_gbps`: the path-D stream as the workers run it: `TransferEngine.write` per layer
  with a notification each, timed from the first post to the receiver seeing the last
  notification (both clocks CLOCK_MONOTONIC, one machine);
* `stream_ratio` = stream / raw (best of `--reps` each, interleaved);
* isolation: real WRITEs through an emulated compute link of `--link-gbps` shared by the
  two traffic classes by weight (99:1): model-class throughput alone, then beside a saturating
  kv stream; `isolation` = shared / solo (bar: >= 0.95).

`--link-only`: the same isolation through the link alone (`measure_isolation`: no NIXL, no
bytes move), where NIXL is not installed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import threading
import time
from collections.abc import Mapping

from dualpath.transfer.link import DEFAULT_WEIGHTS, TRAFFIC_CLASSES, ComputeLink, LinkClosed

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    parser.add_argument("--layers", type=int, default=32, help="layers streamed per request")
    parser.add_argument(
        "--layer-mib",
        type=float,
        default=8.0,
        help="bytes of one layer of the hit KV (default 8 MiB: 2048 tokens of a "
        "Llama-3-8B-shaped fp16 model, 8 KV heads x 128)",
    )
    parser.add_argument("--reps", type=int, default=5, help="repetitions (best is reported)")
    parser.add_argument("--link-gbps", type=float, default=8.0, help="isolation: link rate")
    parser.add_argument("--seconds", type=float, default=1.5, help="isolation: per phase")
    parser.add_argument("--weights", default="99:1", help="isolation: model:kv weights")
    parser.add_argument(
        "--link-only",
        action="store_true",
        help="only the isolation, through the link alone (no NIXL, no bytes move)",
    )


async def _raw(engine, peer_name: str, src: int, dst: int, layer: int, layers: int) -> float:  # noqa: ANN001
    agent = engine.agent
    t0 = time.monotonic()
    handles = []
    for i in range(layers):
        local = agent.get_xfer_descs([(src + i * layer, layer, 0)], "DRAM")
        remote = agent.get_xfer_descs([(dst + i * layer, layer, 0)], "DRAM")
        h = agent.initialize_xfer("WRITE", local, remote, peer_name)
        handles.append([h, agent.transfer(h)])
    for x in handles:
        while x[1] == "PROC":
            await asyncio.sleep(0)
            x[1] = agent.check_xfer_state(x[0])
        if x[1] != "DONE":
            raise RuntimeError(f"raw WRITE failed: {x[1]}")
        agent.release_xfer_handle(x[0])
    return time.monotonic() - t0


async def _stream(engine, peer, peer_name: str, src: int, layer: int, layers: int, tag: str):  # noqa: ANN001, ANN202
    peer.send("wait", peer=engine.name, prefix=f"{tag}/hit/", count=layers, deadline_s=60)
    await asyncio.sleep(0.05)  # the receiver is waiting (and polling) before the clock starts
    t0 = time.monotonic()
    await asyncio.gather(
        *(
            engine.write(
                peer_name,
                src + i * layer,
                layer,
                peer.address + i * layer,
                notif=f"{tag}/hit/{i}".encode(),
            )
            for i in range(layers)
        )
    )
    t_last = (await asyncio.to_thread(peer.result))["t_last"]
    return t_last - t0


async def _isolation(engine, peer, peer_name: str, src: int, args) -> dict:  # noqa: ANN001
    high, low = (int(x) for x in args.weights.split(":"))
    chunk = 1 << 20

    async def phase(classes: tuple[str, ...]) -> dict[str, float]:
        engine.link = ComputeLink(args.link_gbps, {"model": high, "kv": low}, name="bench")
        sent = dict.fromkeys(classes, 0)
        counting = asyncio.Event()
        stop = asyncio.Event()

        async def stream(tc: str, i: int) -> None:
            off = (i % 8) * chunk
            while not stop.is_set():
                await engine.write(
                    peer_name, src + off, chunk, peer.address + off, traffic_class=tc
                )
                if counting.is_set():
                    sent[tc] += chunk

        tasks = [asyncio.create_task(stream(tc, i)) for tc in classes for i in range(4)]
        await asyncio.sleep(args.seconds * 0.2)
        counting.set()
        t0 = time.monotonic()
        await asyncio.sleep(args.seconds)
        dt = time.monotonic() - t0
        stop.set()
        await asyncio.gather(*tasks)
        engine.link.close()
        engine.link = None
        return {tc: sent[tc] * 8 / dt / 1e9 for tc in classes}

    solo = await phase(("model",))
    shared = await phase(("model", "kv"))
    kv_solo = await phase(("kv",))
    return {
        "link_gbps": args.link_gbps,
        "weights": args.weights,
        "model_solo_gbps": round(solo["model"], 3),
        "model_shared_gbps": round(shared["model"], 3),
        "kv_shared_gbps": round(shared["kv"], 3),
        "kv_solo_gbps": round(kv_solo["kv"], 3),
        "isolation": round(shared["model"] / solo["model"], 4) if solo["model"] else 0.0,
    }


def measure_isolation(
    link_gbps: float,
    seconds: float = 1.0,
    *,
    weights: Mapping[str, int] | None = None,
    chunk_bytes: int = 1 << 20,
    streams: int = 4,
    mode: str = "threads",
    repeats: int = 1,
) -> dict[str, float | str]:
    """Model-class throughput through a `ComputeLink` alone, then beside a saturating kv stream.

    Link only (no bytes move). Each class runs `streams` closed-loop streams acquiring
    `chunk_bytes` each, as threads (`mode="threads"`) or as tasks on one asyncio loop
    (`mode="asyncio"`; call it where no loop runs). Three phases (model alone, both, kv alone)
    of `seconds` each, the first 10% of each a warm-up, run `repeats` times interleaved; each
    rate is the best of its runs (CPU contention only ever slows a stream). Returns Gbps and
    `isolation` = model_shared / model_solo (high / (high + low) = 0.99 when kv takes its whole
    share).
    """
    if mode not in ("threads", "asyncio"):
        raise ValueError(f"mode must be 'threads' or 'asyncio', got {mode!r}")

    def rates(s0: dict, s1: dict, dt: float) -> dict[str, float]:
        return {
            tc: (s1[tc]["served_bytes"] - s0[tc]["served_bytes"]) * 8 / 1e9 / dt
            for tc in TRAFFIC_CLASSES
        }

    def phase_threads(classes: tuple[str, ...]) -> dict[str, float]:
        link = ComputeLink(link_gbps, weights, name="isolation-bench")

        def stream(tc: str) -> None:
            try:
                while True:
                    link.acquire_sync(tc, chunk_bytes)
            except LinkClosed:
                pass

        threads = [
            threading.Thread(target=stream, args=(tc,), daemon=True, name=f"link-{tc}-{i}")
            for tc in classes
            for i in range(streams)
        ]
        for t in threads:
            t.start()
        time.sleep(seconds * 0.1)
        t0, s0 = time.monotonic(), link.stats()
        time.sleep(seconds * 0.9)
        t1, s1 = time.monotonic(), link.stats()
        link.close()
        for t in threads:
            t.join(timeout=5)
        return rates(s0, s1, t1 - t0)

    async def phase_asyncio(classes: tuple[str, ...]) -> dict[str, float]:
        link = ComputeLink(link_gbps, weights, name="isolation-bench")

        async def stream(tc: str) -> None:
            try:
                while True:
                    await link.acquire(tc, chunk_bytes)
            except LinkClosed:
                pass

        tasks = [asyncio.create_task(stream(tc)) for tc in classes for _ in range(streams)]
        await asyncio.sleep(seconds * 0.1)
        t0, s0 = time.monotonic(), link.stats()
        await asyncio.sleep(seconds * 0.9)
        t1, s1 = time.monotonic(), link.stats()
        link.close()
        await asyncio.gather(*tasks)
        return rates(s0, s1, t1 - t0)

    def phase(classes: tuple[str, ...]) -> dict[str, float]:
        if mode == "asyncio":
            return asyncio.run(phase_asyncio(classes))
        return phase_threads(classes)

    runs: list[tuple[dict[str, float], ...]] = []
    for _ in range(max(1, repeats)):
        runs.append((phase(("model",)), phase(("model", "kv")), phase(("kv",))))
    solo = max((r[0] for r in runs), key=lambda x: x["model"])
    shared = max((r[1] for r in runs), key=lambda x: x["model"])
    kv_solo = max((r[2] for r in runs), key=lambda x: x["kv"])
    w = {**DEFAULT_WEIGHTS, **(weights or {})}
    return {
        "link_gbps": link_gbps,
        "model_weight": w["model"],
        "kv_weight": w["kv"],
        "chunk_bytes": chunk_bytes,
        "streams_per_class": streams,
        "mode": mode,
        "repeats": max(1, repeats),
        "model_solo_gbps": solo["model"],
        "model_shared_gbps": shared["model"],
        "isolation": shared["model"] / solo["model"] if solo["model"] else 0.0,
        "kv_shared_gbps": shared["kv"],
        "kv_solo_gbps": kv_solo["kv"],
        "link_utilization_shared": (shared["model"] + shared["kv"]) / link_gbps,
    }


async def measure(args: argparse.Namespace) -> dict:
    from dualpath.transfer.engine import TransferEngine
    from dualpath.transfer.peer import PeerProcess

    layer = int(args.layer_mib * (1 << 20))
    total = layer * args.layers
    pool = total + (16 << 20)
    engine = TransferEngine("bench-sender", pool, deadline_s=60).start()
    try:
        with PeerProcess("bench-receiver", pool_bytes=pool) as peer:
            peer_name = engine.add_peer(peer.metadata)
            peer.call("add_peer", metadata=engine.metadata)
            region = engine.pool.alloc(total)
            region.tensor.fill_(1)
            raw, stream = [], []
            with engine.active():
                await _raw(engine, peer_name, region.address, peer.address, layer, 2)  # connect
                for rep in range(args.reps):
                    raw.append(
                        await _raw(
                            engine, peer_name, region.address, peer.address, layer, args.layers
                        )
                    )
                    stream.append(
                        await _stream(
                            engine, peer, peer_name, region.address, layer, args.layers, f"s{rep}"
                        )
                    )
                    if not args.json:
                        print(
                            f"rep {rep}: raw {total * 8 / raw[-1] / 1e9:.1f} Gbit/s, stream "
                            f"{total * 8 / stream[-1] / 1e9:.1f} Gbit/s",
                            file=sys.stderr,
                        )
                isolation = await _isolation(engine, peer, peer_name, region.address, args)
            engine.pool.free(region)
    finally:
        await engine.aclose()
    raw_gbps = total * 8 / min(raw) / 1e9
    stream_gbps = total * 8 / min(stream) / 1e9
    return {
        "bench": "transfer",
        "backend": "nixl-ucx",
        "layers": args.layers,
        "layer_bytes": layer,
        "request_bytes": total,
        "reps": args.reps,
        "raw_gbps": round(raw_gbps, 2),
        "stream_gbps": round(stream_gbps, 2),
        "stream_ratio": round(stream_gbps / raw_gbps, 3),
        "raw_gbps_all": [round(total * 8 / t / 1e9, 2) for t in raw],
        "stream_gbps_all": [round(total * 8 / t / 1e9, 2) for t in stream],
        "isolation": isolation,
    }


def run(args: argparse.Namespace) -> int:
    if args.link_only:
        high, low = (int(x) for x in args.weights.split(":"))
        iso = measure_isolation(
            args.link_gbps, args.seconds, weights={"model": high, "kv": low}, repeats=args.reps
        )
        print(json.dumps({"bench": "transfer-link", **iso}, indent=None if args.json else 2))
        return 0
    result = asyncio.run(measure(args))
    print(json.dumps(result, indent=None if args.json else 2))
    ok = result["stream_ratio"] >= 0.8 and result["isolation"]["isolation"] >= 0.95
    if not args.json:
        print(
            f"stream_ratio {result['stream_ratio']} (bar >= 0.8), isolation "
            f"{result['isolation']['isolation']} (bar >= 0.95): {'met' if ok else 'NOT met'}",
            file=sys.stderr,
        )
    return 0
