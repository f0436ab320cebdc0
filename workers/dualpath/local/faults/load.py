"""Rows of client behaviour: streams cut by their clients, an overload burst."""

from __future__ import annotations

import asyncio

from dualpath.local.faults.client import Result
from dualpath.local.faults.report import Row
from dualpath.local.faults.suite import Suite


async def disconnect_row(s: Suite) -> Row:
    row = Row("disconnects")
    n = 30 if s.quick else 100
    cut: list[Result] = []
    for wave in range(0, n, 20):  # 20 at a time: under the in-flight cap, none refused
        cut += await asyncio.gather(
            *(
                s.c.turn(s.new_prompt(), max_tokens=200, stream=True, cut_after_first=True)
                for _ in range(wave, min(n, wave + 20))
            )
        )
    after = await asyncio.gather(*(s.c.turn(i) for i in s.ref_ids * 2))
    row.add(after)
    row.add([r for r in cut if r.kind != "cancelled"])  # a cut stream is neither
    row.sent += sum(r.kind == "cancelled" for r in cut)
    codes = [r.status for r in after if r.kind != "ok"]
    inflight = await s.scheduler_in_flight_settles()
    row.note = (
        f"{sum(r.kind == 'cancelled' for r in cut)} streams cut by their client, then "
        f"{len(after)} turns ({codes.count(503)} 503s); scheduler in-flight {inflight}"
    )
    if codes.count(503):
        row.bars.append("503_burst")
    return row


async def overload_row(s: Suite) -> Row:
    row = Row("overload")
    n = 100 if s.quick else 300
    results = await asyncio.gather(*(s.c.turn(s.new_prompt(), max_tokens=32) for _ in range(n)))
    row.add(results)
    refused = [r for r in results if r.kind == "failed"]
    without = [r for r in refused if r.status not in (429, 503) or not r.retry_after]
    if without:
        row.bars.append(f"refused_without_retry_after={len(without)}")
    slowest = max(r.end_s - r.start_s for r in results)
    row.note = (
        f"{n} at once; {sum(r.status == 429 for r in refused)} 429, "
        f"{sum(r.status == 503 for r in refused)} 503, all with Retry-After: {not without}; "
        f"slowest answer {slowest:.1f}s"
    )
    return row
