"""Rows of a cluster holding against its own members and clients (issue 37): oversized
refusals that do not grow the log, channels to bad prefill addresses that do not stay, the only
prefill killed again and again without a 503, slow HTTP clients dropped, short turns beside a
long prompt."""

from __future__ import annotations

import asyncio
import random
import re
import statistics
import time
import urllib.request
from typing import Any

from dualpath.local.faults.client import Result, prompt_ids
from dualpath.local.faults.report import Row
from dualpath.local.faults.suite import Suite
from dualpath.local.faults.up import http_ok
from dualpath.local.supervisor import tcp_sockets

OVERSIZED_CHARS = 3_900_000  # under gRPC's 4 MiB message limit: the field bound must refuse it
LOG_GROWTH_BAR_BYTES = 100_000
CHANNEL_SETTLE_S = 30.0
PREFILL_KILLS = 10
SLOW_CLIENTS = 200
LONG_PROMPT_TOKENS = 10_000


def _codes(codes: list[str]) -> str:
    tally: dict[str, int] = {}
    for c in codes:
        tally[c] = tally.get(c, 0) + 1
    return ", ".join(f"{k}x{v}" for k, v in sorted(tally.items(), key=lambda kv: -kv[1]))


async def oversized_refusals_row(s: Suite) -> Row:
    """Ten Register calls with a 3.9 MB node_id under decode-0's certificate (a member's
    certificate out of its role): refused by the field bound, the log grows by a line each."""
    import grpc

    from dualpath.scheduler.client import channel
    from dualpath.v1 import scheduler_pb2 as pb
    from dualpath.v1 import scheduler_pb2_grpc as pb_grpc

    row = Row("oversized-refusals")
    auth = s.worker_auth(node="decode-0")
    before = s.cl.log_file.stat().st_size
    codes, details = [], 0
    t0 = time.monotonic()
    async with channel(s.cl.scheduler, auth) as ch:
        stub = pb_grpc.SchedulerStub(ch)
        for i in range(10):
            req = pb.RegisterRequest(
                node_id=f"decode-{i}-" + "x" * OVERSIZED_CHARS,
                role=pb.ROLE_DECODE,
                address="127.0.0.1:1",
            )
            res = Result("failed", start_s=time.monotonic())
            try:
                await stub.Register(req, timeout=10)
                codes.append("OK")
                res.kind = "ok"
            except grpc.aio.AioRpcError as err:
                codes.append(err.code().name)
                details = max(details, len(err.details() or ""))
            res.end_s = time.monotonic()
            row.add([res])
    took = time.monotonic() - t0
    await asyncio.sleep(1.0)  # the processes' log lines written
    grown = s.cl.log_file.stat().st_size - before
    row.add([await s.c.turn(i) for i in s.ref_ids[:4]])
    row.note = (
        f"10 Register with a {OVERSIZED_CHARS:,}-character node_id in {took:.1f}s: "
        f"{_codes(codes)}; longest refusal {details} characters; cluster log grew "
        f"{grown:,} bytes (bar {LOG_GROWTH_BAR_BYTES:,}); then 4 good turns"
    )
    if set(codes) != {"INVALID_ARGUMENT"}:
        row.bars.append("not_invalid_argument")
    if grown >= LOG_GROWTH_BAR_BYTES:
        row.bars.append(f"log_grew={grown}")
    return row


def _metric(url: str, name: str, labels: str = "") -> float:
    with urllib.request.urlopen(url, timeout=2) as r:  # noqa: S310 (loopback)
        text = r.read().decode()
    m = re.search(rf"^{re.escape(name)}\{{{re.escape(labels)}\}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def _connections(pid: int) -> int:
    """A process's TCP sockets other than its listening ones (its connections and connect
    attempts)."""
    return sum(state != "LISTEN" for state, _ in tcp_sockets(pid))


async def bad_prefill_addresses_row(s: Suite) -> Row:
    """100 Generate calls to decode-0 naming ports 1-100 of loopback as the prefill node: each
    answered FAILED_PRECONDITION, and decode-0's channels and sockets back to their baseline
    within 30 s (a channel kept per address reconnected forever)."""
    import grpc

    from dualpath.grpc_auth import channel
    from dualpath.local.cluster import run_dir_auth
    from dualpath.v1 import worker_pb2 as wpb
    from dualpath.v1 import worker_pb2_grpc as wpb_grpc

    row = Row("bad-prefill-addresses")
    name = "decode-0"
    pid = s.cl.pid(name)
    if pid is None:
        row.bars.append("no_decode")
        return row
    metrics = s.cl.ready_url(name).replace("/readyz", "/metrics")
    gauge = ("dualpath_grpc_channels_open", 'server_role="prefill"')
    base_sockets, base_channels = _connections(pid), _metric(metrics, *gauge)
    address = await s.node_address(name)
    codes: list[str] = []
    t0 = time.monotonic()
    async with channel(address, run_dir_auth(s.cl.run_dir), server_role="decode") as ch:
        stub = wpb_grpc.WorkerStub(ch)

        async def call(port: int) -> None:
            req = wpb.GenerateRequest(
                request_id=f"bad-prefill-{port}",
                prompt_tokens=prompt_ids(port),
                max_new_tokens=2,
                prefill_node="prefill-0",
                prefill_address=f"127.0.0.1:{port}",
            )
            res = Result("failed", start_s=time.monotonic())
            try:
                async for _ in stub.Generate(req, timeout=30):
                    pass
                codes.append("OK")
            except grpc.aio.AioRpcError as err:
                codes.append(err.code().name)
                if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL):
                    res.status, res.error = 500, f"{err.code().name}: {err.details()}"
            res.end_s = time.monotonic()
            row.add([res], bad_input=True)

        during: list[int] = []

        async def sample() -> None:
            while True:
                during.append(_connections(pid))
                await asyncio.sleep(0.2)

        sampler = asyncio.create_task(sample())
        try:
            for wave in range(1, 101, 25):
                await asyncio.gather(*(call(p) for p in range(wave, wave + 25)))
        finally:
            sampler.cancel()
    took = time.monotonic() - t0
    series: list[tuple[float, int, float]] = []
    t_calls = time.monotonic()
    settled_s = None
    while time.monotonic() - t_calls < CHANNEL_SETTLE_S:
        n, chans = _connections(pid), _metric(metrics, *gauge)
        at = time.monotonic() - t_calls
        series.append((at, n, chans))
        if settled_s is None and n <= base_sockets and chans <= base_channels:
            settled_s = at
        if settled_s is not None and at - settled_s > 5:
            break
        await asyncio.sleep(1.0)
    row.add([await s.c.turn(i) for i in s.ref_ids[:4]])
    peak = max(during, default=0)
    last = series[-1]
    shown = " ".join(f"{at:.0f}s:{n}/{c:g}" for at, n, c in series[:8])
    row.note = (
        f"100 bad addresses in {took:.1f}s: {_codes(codes)}; decode-0 sockets/channels "
        f"baseline {base_sockets}/{base_channels:g}, peak sockets during the calls {peak}, "
        f"{last[1]}/{last[2]:g} at {last[0]:.0f}s"
        + (f", back to baseline {settled_s:.0f}s after" if settled_s is not None else "")
        + f" [{shown}]; then 4 good turns"
    )
    if settled_s is None:
        row.bars.append("sockets_not_back")
    if set(codes) != {"FAILED_PRECONDITION"}:
        row.bars.append("not_failed_precondition")
    return row


async def prefill_kills_row(s: Suite) -> Row:
    """The only prefill SIGKILLed 10 times under load, each after the last restart serves:
    every turn a client sent is counted, a 503 among them included (a bar)."""
    row = Row("prefill-kills")
    restarts: list[float] = []

    async def kill_ten() -> None:
        for _ in range(PREFILL_KILLS):
            old = s.cl.kill("prefill-0")
            t_kill = time.monotonic()
            t_up = await asyncio.to_thread(s.cl.wait_restarted, "prefill-0", old)
            if t_up is None:
                return
            restarts.append(t_up - t_kill)
            url = s.cl.ready_url("prefill-0")
            while not http_ok(url) and time.monotonic() - t_up < 60:
                await asyncio.sleep(0.05)
            await asyncio.sleep(1.0)  # a second of load on the restarted prefill

    results = await s.load_during(kill_ten, n=3)
    row.add(results)
    failed = [r for r in results if r.kind == "failed"]
    row.note = (
        f"{len(restarts)}/{PREFILL_KILLS} kills of the only prefill restarted "
        f"(median {statistics.median(restarts) if restarts else 0:.1f}s); "
        f"{row.unavailable} 503 of {row.sent} turns"
        + (
            f"; failed: {_codes([str(r.status) for r in failed])}, first: {failed[0].error[:160]}"
            if failed
            else ""
        )
    )
    if len(restarts) < PREFILL_KILLS:
        row.bars.append("not_restarted")
    return row


async def slow_clients_row(s: Suite) -> Row:
    """200 HTTP connections each sending one header line a second: every one dropped within
    the header timeout (plus 2 s), while normal turns are served."""
    from urllib.parse import urlsplit

    row = Row("slow-clients")
    limit_s = s.spec["frontend"]["headerTimeoutSeconds"]
    url = urlsplit(s.cl.frontend)
    held: list[float | None] = []
    answers: list[bytes] = []

    async def slow() -> None:
        reader, writer = await asyncio.open_connection(url.hostname, url.port)
        t0 = time.monotonic()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")

        async def drip() -> None:
            try:
                while True:
                    await asyncio.sleep(1.0)
                    writer.write(b"x-slow: 1\r\n")
                    await writer.drain()
            except (ConnectionError, RuntimeError):
                pass

        dripping = asyncio.create_task(drip())
        try:
            answers.append(await asyncio.wait_for(reader.read(), 4 * limit_s + 10))
            held.append(time.monotonic() - t0)
        except (TimeoutError, ConnectionError):
            held.append(None)
        finally:
            dripping.cancel()
            writer.close()

    async def slowloris() -> None:
        await asyncio.gather(*(slow() for _ in range(SLOW_CLIENTS)))

    results = await s.load_during(slowloris, n=1)
    row.add(results)
    kept = [h for h in held if h is None or h > limit_s + 2]
    worst = max((h for h in held if h is not None), default=0.0)
    answered_408 = sum(a.startswith(b"HTTP/1.1 408") for a in answers)
    row.note = (
        f"{SLOW_CLIENTS} connections dripping a header line a second: "
        f"{len(held) - len(kept)} dropped within the {limit_s}s header timeout + 2s "
        f"(slowest {worst:.1f}s, {answered_408} answered 408); {len(results)} turns beside"
    )
    if kept:
        row.bars.append(f"held_open={len(kept)}")
    return row


async def _ttft(s: Suite, i: int) -> tuple[Result, float]:
    first: list[float] = []
    res = await s.c.turn(
        i, stream=True, on_chunk=lambda: first.append(time.monotonic()) if not first else None
    )
    return res, (first[0] - res.start_s) if first else float("nan")


def _p99(xs: list[float]) -> float:
    xs = sorted(x for x in xs if x == x)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))] if xs else float("nan")


async def long_prompt_row(s: Suite) -> Row:
    """Short turns' TTFT p99 alone, then while one 10,000-token uncached prompt prefills:
    both printed (the paper's chunked prefill is what keeps them close)."""
    import httpx

    row = Row("long-prompt")
    n = 10 if s.quick else 24
    shorts = [s.new_prompt() for _ in range(2 * n)]
    alone: list[float] = []
    for i in shorts[:n]:
        res, t = await _ttft(s, i)
        row.add([res])
        alone.append(t)
    rng = random.Random(37)
    body: dict[str, Any] = {
        "model": s.c.model,
        "prompt": [rng.randrange(3, 500) for _ in range(LONG_PROMPT_TOKENS)],
        "max_tokens": 1,
        "temperature": 0,
    }
    t0 = time.monotonic()
    long_done: list[float] = []

    async def long_turn() -> int:
        try:
            r = await s.c.http.post("/v1/completions", json=body, timeout=600)
            return r.status_code
        except httpx.HTTPError:
            return 0
        finally:
            long_done.append(time.monotonic() - t0)

    long_task = asyncio.create_task(long_turn())
    await asyncio.sleep(0.5)  # the long prompt is routed and prefilling
    beside: list[float] = []
    overlapped = 0
    for i in shorts[n:]:
        res, t = await _ttft(s, i)
        row.add([res])
        beside.append(t)
        overlapped += not long_done
    status = await long_task
    row.note = (
        f"short-turn TTFT p99 {_p99(alone) * 1000:.0f} ms alone, "
        f"{_p99(beside) * 1000:.0f} ms beside a {LONG_PROMPT_TOKENS:,}-token uncached prompt "
        f"({overlapped}/{n} short turns while it ran; it took {long_done[0]:.1f}s, HTTP {status})"
    )
    if status != 200:
        row.bars.append(f"long_prompt_status={status}")
    return row
