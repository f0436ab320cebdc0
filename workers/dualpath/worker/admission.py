"""Prefill admission with the intra-node batcher (docs/design.md section 4, `workers.prefillBatchQuotaMs`).

Requests whose hit KV is on its way queue here; whenever a batch slot is free, the head of the
queue that fits the compute quota by the cost model (`engine.batcher.admit_fifo`; the request that
would overflow leads the next batch) runs as one `BatchPrefillRun`. Two batch slots: while one
batch waits for a member's hit KV, the other computes on the engine's one compute thread.

The cost model is fitted at start-up from prefills timed on this machine (`engine.calibrate`).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import torch

from dualpath.engine import BatchMember, BatchPrefillRun, Engine
from dualpath.engine.batch import check_request
from dualpath.engine.batcher import PrefillItem, admit_fifo
from dualpath.engine.cost import CostModel
from dualpath.engine.prefill import LayerSource
from dualpath.worker import metrics

log = logging.getLogger(__name__)

# shapes timed at start-up: (cached, new) tokens; a few seconds on the CPU presets
CALIBRATION_GRID = ((0, 16), (0, 128), (256, 32), (1024, 16), (1024, 128), (512, 256))


@dataclass
class _Waiter:
    item: PrefillItem
    tokens: torch.Tensor
    hit_tokens: int
    source: LayerSource | None
    admitted: asyncio.Future = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class BatchAdmission:
    """Queue of prefills waiting for compute; batches them within `quota_s`."""

    def __init__(
        self, engine: Engine, cost: CostModel, quota_s: float, max_batches: int = 2
    ) -> None:
        if not quota_s > 0:
            raise ValueError("workers.prefillBatchQuotaMs must be > 0 to batch prefills")
        self.engine = engine
        self.cost = cost
        self.quota_s = quota_s
        self._queue: list[_Waiter] = []
        self._slots = asyncio.Semaphore(max_batches)
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.batches = 0  # formed so far
        self.batched_requests = 0

    @classmethod
    async def calibrated(cls, engine: Engine, quota_s: float) -> BatchAdmission:
        from dualpath.engine.calibrate import calibrate

        cost, _ = await calibrate(engine, CALIBRATION_GRID, repeats=1)
        return cls(engine, cost, quota_s)

    def start(self) -> BatchAdmission:
        if self._task is None:
            self._task = asyncio.ensure_future(self._dispatch())
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    @property
    def queued(self) -> int:
        return len(self._queue)

    async def join(
        self,
        request_id: str,
        tokens: torch.Tensor | list[int],
        hit_tokens: int,
        source: LayerSource | None,
    ) -> BatchMember:
        """Wait for a place in a batch; iterate the member for the KV, as a PrefillRun."""
        tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        check_request(f"prefill {request_id}", tokens, hit_tokens, source)  # not the batch's
        w = _Waiter(PrefillItem(request_id, hit_tokens, tokens.numel()), tokens, hit_tokens, source)
        self._queue.append(w)
        self._wake.set()
        try:
            return await asyncio.shield(w.admitted)
        except asyncio.CancelledError:
            if w in self._queue:
                self._queue.remove(w)
            elif w.admitted.done() and not w.admitted.cancelled():
                w.admitted.result().cancel()  # admitted meanwhile: leave the batch
                w.admitted.result().batch.member_gone()
            raise

    def _finished(self, batch: BatchPrefillRun) -> None:
        self._slots.release()
        metrics.PREFILL_BATCH_COMPUTE_SECONDS.observe(batch.times.compute_s)

    async def _dispatch(self) -> None:
        while True:
            while not self._queue:
                self._wake.clear()
                await self._wake.wait()
            await self._slots.acquire()
            if not self._queue:  # every waiter left meanwhile
                self._slots.release()
                continue
            n = admit_fifo([w.item for w in self._queue], self.cost, self.quota_s)
            take, self._queue = self._queue[:n], self._queue[n:]
            try:
                batch = self.engine.prefill_batch(
                    [(w.tokens, w.hit_tokens, w.source) for w in take]
                )
            except Exception as exc:  # join() checked each request: nothing left to refuse
                self._slots.release()
                for w in take:
                    w.admitted.set_exception(exc)
                continue
            self.batches += 1
            self.batched_requests += n
            estimated_s = sum(self.cost.estimate(w.item.cached, w.item.new) for w in take)
            log.debug(
                "prefill batch %d: %d requests, %d new tokens, estimated %.3fs of %.3fs",
                self.batches,
                n,
                batch.new_tokens,
                estimated_s,
                self.quota_s,
            )
            metrics.PREFILL_BATCH_REQUESTS.observe(n)
            batch.start()
            batch.add_done_callback(self._finished)
            for w, m in zip(take, batch.members, strict=True):
                w.admitted.set_result(m)
