"""Intra-node prefill batching (pure): pack requests into batches within a compute quota.

`fifo_batches` is the paper's packing: FIFO by (cached, new) tokens up to the quota (e.g. 300 ms
as estimated by the cost model); the request that would overflow is chunked by binary search so
its head fills the batch and its tail (cached += head) leads the next one.
`admit_fifo` is what the prefill worker's admission takes from its queue for the next batch: the
paper's FIFO packing without the chunking, so that every request's output stays bit-identical to
its prefill alone (a chunk attends to its head's KV as hit tiles, which rounds differently).
`similar_time_batches` also groups by similar estimated time, so the requests (and the GPUs)
of one batch finish together instead of waiting on a straggler: the oldest request anchors each
batch (no starvation) and is joined by the queued requests whose estimates are closest to its
own, within `max_ratio`, as long as the quota allows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol


class Estimator(Protocol):
    def estimate(self, cached: int, new: int) -> float: ...


@dataclass(frozen=True)
class PrefillItem:
    request_id: str
    cached: int  # tokens already in KV (hit, or earlier chunks)
    new: int  # tokens to prefill
    chunk: int = 0  # 0 = whole request or first chunk, k = k-th chunk


@dataclass(frozen=True)
class Batch:
    items: tuple[PrefillItem, ...]
    estimated_s: tuple[float, ...]

    @property
    def total_s(self) -> float:
        return sum(self.estimated_s)

    @property
    def spread_s(self) -> float:
        """Max - min estimated time of the batch's requests (0 for one request)."""
        return max(self.estimated_s) - min(self.estimated_s)


def chunk_to_fit(est: Estimator, item: PrefillItem, budget_s: float) -> int:
    """Largest n <= item.new with est(cached, n) <= budget_s (0 if none), by binary search."""
    lo, hi = 0, item.new
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if est.estimate(item.cached, mid) <= budget_s:
            lo = mid
        else:
            hi = mid - 1
    return lo


def split(item: PrefillItem, head: int) -> tuple[PrefillItem, PrefillItem]:
    return (
        replace(item, new=head),
        replace(item, cached=item.cached + head, new=item.new - head, chunk=item.chunk + 1),
    )


def _check(quota_s: float) -> None:
    if not quota_s > 0:
        raise ValueError("quota_s must be > 0 (the per-batch compute quota, e.g. 0.3)")


def fifo_batches(
    queue: Sequence[PrefillItem], est: Estimator, quota_s: float, min_chunk: int = 1
) -> list[Batch]:
    """The paper's FIFO packing up to `quota_s`; the overflowing request is chunked."""
    _check(quota_s)
    pending = list(queue)
    batches: list[Batch] = []
    items: list[PrefillItem] = []
    times: list[float] = []

    def close() -> None:
        if items:
            batches.append(Batch(tuple(items), tuple(times)))
            items.clear()
            times.clear()

    i = 0
    while i < len(pending):
        item = pending[i]
        t = est.estimate(item.cached, item.new)
        room = quota_s - sum(times)
        if t <= room:
            items.append(item)
            times.append(t)
            i += 1
            continue
        head = chunk_to_fit(est, item, room)
        if head >= min_chunk or (not items and head < item.new):
            head = max(head, 1)  # an empty batch always makes progress
            first, rest = split(item, head)
            items.append(first)
            times.append(est.estimate(first.cached, first.new))
            pending[i] = rest
        close()
    close()
    return batches


def admit_fifo(queue: Sequence[PrefillItem], est: Estimator, quota_s: float) -> int:
    """How many requests from the head of `queue` the next batch takes: FIFO while their
    estimates fit `quota_s`. The request that would overflow waits for the next batch (it leads
    it); a request alone above the quota runs alone. 0 only for an empty queue."""
    _check(quota_s)
    total = 0.0
    for n, item in enumerate(queue):
        total += est.estimate(item.cached, item.new)
        if total > quota_s:
            return max(n, 1)
    return len(queue)


def similar_time_batches(
    queue: Sequence[PrefillItem],
    est: Estimator,
    quota_s: float,
    max_ratio: float = 2.0,
    window: int = 64,
) -> list[Batch]:
    """Batches of similar estimated time within `quota_s`, anchored on the oldest request.

    Candidates are the first `window` queued requests; one joins the anchor's batch when its
    estimate is within `max_ratio` of the anchor's and the batch stays within the quota. An
    anchor alone above the quota is chunked to fit it.
    """
    _check(quota_s)
    if max_ratio < 1:
        raise ValueError("max_ratio must be >= 1")
    pending = list(queue)
    batches: list[Batch] = []
    while pending:
        anchor = pending[0]
        t0 = est.estimate(anchor.cached, anchor.new)
        if t0 > quota_s:
            head = max(1, chunk_to_fit(est, anchor, quota_s))
            first, rest = split(anchor, head)
            batches.append(Batch((first,), (est.estimate(first.cached, first.new),)))
            pending[0] = rest
            continue
        scored = []
        for j in range(1, min(window, len(pending))):
            c = pending[j]
            t = est.estimate(c.cached, c.new)
            ratio = max(t, t0) / max(min(t, t0), 1e-12)
            if ratio <= max_ratio:
                scored.append((abs(math.log(max(t, 1e-12) / max(t0, 1e-12))), j, t))
        scored.sort()
        chosen, times, total = [0], [t0], t0
        for _, j, t in scored:
            if total + t <= quota_s:
                chosen.append(j)
                times.append(t)
                total += t
        order = sorted(range(len(chosen)), key=lambda k: chosen[k])  # keep FIFO order inside
        batches.append(
            Batch(tuple(pending[chosen[k]] for k in order), tuple(times[k] for k in order))
        )
        taken = set(chosen)
        pending = [p for j, p in enumerate(pending) if j not in taken]
    return batches


def mean_spread_s(batches: Sequence[Batch]) -> float:
    return sum(b.spread_s for b in batches) / len(batches) if batches else 0.0
