"""Rows that kill a process (decode, prefill, scheduler) or stop the whole cluster (SIGINT)."""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Any

from dualpath.local.faults.client import Result
from dualpath.local.faults.report import Row
from dualpath.local.faults.suite import Suite
from dualpath.local.faults.up import alive, http_ok


async def restart_row(s: Suite, fault: str, name: str) -> Row:
    row = Row(fault)
    info: dict[str, Any] = {}
    probes: list[Result] = []

    async def inject() -> None:
        if name.startswith("decode"):  # streams decoding on both nodes when it dies
            started: set[int] = set()
            streams = [
                asyncio.create_task(
                    s.c.turn(i, max_tokens=160, stream=True, on_chunk=lambda i=i: started.add(i))
                )
                for i in s.ref_ids[:6]
            ]
            info["streams"] = streams
            t0 = time.monotonic()
            while len(started) < len(streams) and time.monotonic() - t0 < 20:
                await asyncio.sleep(0.01)
        elif name.startswith("prefill"):  # hits being read and relayed when it dies
            info["inflight"] = [asyncio.create_task(s.c.turn(i)) for i in s.ref_ids[:6]]
            await asyncio.sleep(0.05)
        old = s.cl.kill(name)
        t_kill = time.monotonic()
        t_up = await asyncio.to_thread(s.cl.wait_restarted, name, old)
        info["t_kill"], info["t_up"] = t_kill, t_up
        if t_up is None:
            return
        if name.startswith("decode"):
            url = s.cl.ready_url(name)
            while not http_ok(url) and time.monotonic() - t_up < 60:
                await asyncio.sleep(0.05)
            info["ready_s"] = time.monotonic() - t_up
            info["recover"] = await s.serving_again(t_up, lambda r: r.decode_node == name, probes)
        else:
            info["recover"] = await s.serving_again(t_up, lambda r: True, probes)
        if name == "scheduler":
            info["hit_s"] = await s.serving_again(t_up, lambda r: r.cached > 0, probes)
        await asyncio.sleep(1.0)  # a second of load after recovery

    results = await s.load_during(inject)
    extra: list[Result] = []
    for key in ("streams", "inflight"):
        if key in info:
            extra += await asyncio.gather(*info[key])
    row.add(results + extra + probes)
    t_up = info.get("t_up")
    row.recover_s = info.get("recover")
    notes = [f"restarted {t_up - info['t_kill']:.1f}s after the kill" if t_up else "not restarted"]
    if "ready_s" in info:
        notes.append(f"ready {info['ready_s']:.1f}s after restart")
    if info.get("hit_s") is not None:
        notes.append(f"first hit {info['hit_s']:.1f}s after restart")
    if name.startswith("decode"):
        failed = [r for r in extra + results if r.kind == "failed"]
        elsewhere = [r for r in failed if name not in r.error]
        streams = info.get("streams", [])
        cut = sum(1 for st in streams if st.result().kind == "failed")
        # the streams on the killed node resume on another one (the frontend's continuation)
        notes.append(f"{cut}/{len(streams)} streams cut")
        if cut:
            row.bars.append(f"streams_cut={cut}")
        if elsewhere:
            row.bars.append(f"failed_elsewhere={len(elsewhere)}")
            notes.append(f"{len(elsewhere)} failures not on {name}: {elsewhere[0].error[:80]}")
    row.note = "; ".join(notes)
    return row


async def sigint_row(s: Suite) -> Row:
    row = Row("sigint")
    pids = s.cl.descendants()
    streams = [asyncio.create_task(s.c.turn(i, max_tokens=300, stream=True)) for i in s.ref_ids[:6]]
    await asyncio.sleep(0.5)
    took = await asyncio.to_thread(s.cl.stop, signal.SIGINT)
    results = await asyncio.gather(*streams)
    row.add(results)
    left = [p for p in pids if alive(p)]
    row.note = (
        f"dualpath up stopped in {took:.1f}s (exit {s.cl.proc.returncode if s.cl.proc else '?'}); "
        f"{len(left)} processes left"
    )
    if left:
        row.bars.append(f"processes_left={len(left)}")
    if row.failed_clean:
        row.bars.append("in_flight_cut")
    return row
