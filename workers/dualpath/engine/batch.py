"""The layer-wise prefill forward, over one request (`PrefillRun`) or several
(`BatchPrefillRun`, docs/design.md section 4, intra-node batching): a request alone is a batch of one,
so both run this one forward and its one per-request layer step (`BatchPrefillRun._pull`).

The forward runs on the engine's compute thread as one job for as long as the hit KV is there
(`_advance`): every piece already arrived is taken in the same job, and the job comes back to
the loop only to wait for more (then for a whole tile's worth or the end of the layer). A trip
through the loop costs a thread handoff (about half a millisecond on a VM), so in the
compute-bound steady state a whole prefill is one job. While a run waits, the compute thread is
free for other runs.

The requests of a batch have their own hit and new lengths and their own hit KV source (a
store read handle, a remote stream); their new tokens are packed into one matrix, so every
projection and MLP of a layer is one matmul over all of them, while each request attends to its
own KV (its own `TiledAttention`, tiles consumed as its source delivers them). A layer's MLP runs once every request's hit of that layer is in, so the batch
moves in lockstep and the compute thread waits for the member whose KV is late.

Each request's KV and logits are bit-identical to running it alone (`PrefillRun`, the same
forward over a batch of one):
- row-wise steps (embedding, RMSNorm, rotary at the request's own positions) do not see the
  other rows;
- attention is per request, in one fixed merge order (self, then hit tiles in order);
- a matmul row of the packed matrix equals the same row computed alone as long as the request has
  at least `model.min_pack_rows` rows: with fewer, BLAS takes a small-M kernel (gemv for one
  row) that sums in another order. Requests that short run their matmuls on their own (a pack of
  one); the rest share one pack. The count depends on the CPU and the model's shapes, so it is
  measured per process (`pack_rows_needed`); the engine's tests check the outputs with
  torch.equal, and `dualpath bench engine` compares every output.
The logits of each request come from its own rows, as alone.

    batch = engine.prefill_batch([(tokens_a, hit_a, source_a), (tokens_b, hit_b, source_b)])
    async def consume(member):
        async for layer, k, v in member: ...       # as a PrefillRun
        member.logits
    await asyncio.gather(*(consume(m) for m in batch.members))

A member whose source fails (or whose hit has the wrong shape) gets the error when it iterates
and leaves the batch; the others go on. A member whose caller stops iterating leaves too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import torch

from dualpath.engine.model import TiledAttention, Transformer
from dualpath.engine.prefill import (
    ArrivingSource,
    EmptySource,
    LayerKV,
    LayerSource,
    PrefillTimes,
    PumpedSource,
)

log = logging.getLogger(__name__)

BatchRequest = tuple[Sequence[int] | torch.Tensor, int, LayerSource | None]
# A run's compute-thread time before it hands the thread back (between two key tiles of its
# self-attention, or two layers), so a long prompt does not hold the queue of short ones for
# its whole prefill: chunked prefill (a handoff costs about half a millisecond)
COMPUTE_QUANTUM_S = 0.05


def check_request(
    name: str, tokens: torch.Tensor, hit_tokens: int, source: LayerSource | None
) -> None:
    """Refuse a request no forward can run, naming it (before it joins a batch)."""
    if tokens.numel() == 0:
        raise ValueError(f"{name} has no new tokens (tokens is empty)")
    if hit_tokens < 0:
        raise ValueError(f"{name}: hit_tokens must be >= 0")
    if hit_tokens and source is None:
        raise ValueError(f"{name}: hit_tokens={hit_tokens} needs a source")


@dataclass
class BatchTimes:
    compute_s: float = 0.0  # compute-thread time of the whole batch
    wait_s: float = 0.0  # time the batch's compute waited for some member's hit KV
    total_s: float = 0.0
    yields: int = 0  # times it handed the compute thread back (its quantum spent)


class BatchMember:
    """One request of a batch: iterate it for its new tokens' per-layer KV, as a PrefillRun.

    `times.compute_s` is the batch's compute time (shared); `times.wait_s` the time the batch
    waited for this member's hit KV.
    """

    def __init__(
        self,
        batch: BatchPrefillRun,
        index: int,
        tokens: torch.Tensor,
        hit_tokens: int,
        source: LayerSource,
    ) -> None:
        self.batch = batch
        self.index = index
        self.tokens = tokens
        self.hit_tokens = hit_tokens
        self.source = source
        self.logits: torch.Tensor | None = None
        self.times = PrefillTimes(per_layer_wait_s=[0.0] * batch.model.spec.layers)
        self.error: BaseException | None = None
        self.left = False  # failed or cancelled: no longer computed
        self._queue: asyncio.Queue = asyncio.Queue()
        self._cancelled = False
        # this layer's state (compute thread; the loop reads it only between jobs)
        self.acc: TiledAttention | None = None
        self.new_kv: LayerKV | None = None
        self.taken = 0
        self.short = 0
        self.complete = False

    @property
    def new_tokens(self) -> int:
        return self.tokens.numel()

    def cancel(self) -> None:
        """Leave the batch at the next layer: the caller stopped reading."""
        self._cancelled = True

    async def __aiter__(self) -> AsyncIterator[tuple[int, torch.Tensor, torch.Tensor]]:
        self.batch.start()
        finished = False
        try:
            while True:
                item = await self._queue.get()
                if item is None:
                    finished = True
                    return
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
        finally:
            if not finished:
                self.cancel()
                self.batch.member_gone()

    async def collect(self) -> tuple[list[LayerKV], torch.Tensor]:
        kv = [(k, v) async for _, k, v in self]
        assert self.logits is not None
        return kv, self.logits


class BatchPrefillRun:
    """Several requests' layer-wise prefills as one forward (see the module docstring)."""

    def __init__(
        self,
        model: Transformer,
        executor: cf.Executor,
        requests: Sequence[BatchRequest],
        all_logits: bool = False,
    ) -> None:
        if not requests:
            raise ValueError("a prefill batch needs at least one request")
        spec = model.spec
        self.model = model
        self.all_logits = all_logits
        self.members: list[BatchMember] = []
        for i, (tokens, hit, source) in enumerate(requests):
            tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
            check_request(f"request {i} of the batch", tokens, hit, source)
            src = source or EmptySource(spec.kv_heads, spec.head_dim, model.dtype)
            self.members.append(BatchMember(self, i, tokens, hit, src))
        rows = model.min_pack_rows
        big = [m for m in self.members if m.new_tokens >= rows]
        self.packs: list[list[BatchMember]] = ([big] if big else []) + [
            [m] for m in self.members if m.new_tokens < rows
        ]
        self.times = BatchTimes()
        self._executor = executor
        self._task: asyncio.Task | None = None
        self._layer = -1
        self._h: list[torch.Tensor] = []  # per pack: its members' hidden rows, packed
        self._projected = False  # this layer's projections and self-attention are done
        self._waiting: BatchMember | None = None
        self.quantum_s = COMPUTE_QUANTUM_S

    @property
    def new_tokens(self) -> int:
        return sum(m.new_tokens for m in self.members)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())

    def add_done_callback(self, fn: Callable[[BatchPrefillRun], object]) -> None:
        """Call `fn(self)` once the forward has ended (done, failed or cancelled)."""
        assert self._task is not None, "start() first"

        def done(task: asyncio.Task) -> None:
            if not task.cancelled():
                task.exception()  # retrieved: each member got it already
            fn(self)

        self._task.add_done_callback(done)

    def member_gone(self) -> None:
        """A caller stopped reading: stop the forward once nobody reads."""
        if self._task is not None and all(m._cancelled or m.left for m in self.members):
            if not self._task.done():
                self._task.cancel()

    # ---- the forward, on the compute thread -------------------------------------------------

    def _rows(self, pack: list[BatchMember]) -> list[int]:
        return [m.new_tokens for m in pack]

    def _drop(self, m: BatchMember, exc: BaseException | None) -> None:
        """Take a member out of the forward (its rows out of its pack)."""
        for p, pack in enumerate(self.packs):
            if m in pack:
                if self._h:
                    parts = self._h[p].split(self._rows(pack))
                    keep = [x for x, o in zip(parts, pack, strict=True) if o is not m]
                    self._h[p] = torch.cat(keep) if keep else parts[0][:0]
                pack.remove(m)
        m.left, m.error = True, exc
        m.acc = m.new_kv = None

    def _live(self) -> list[BatchMember]:
        return [m for pack in self.packs for m in pack]

    def _pull(self, m: BatchMember, feed: ArrivingSource) -> bool:
        """Push what arrived of this layer into m's attention; True when all of it is in."""
        l = self._layer  # noqa: E741
        acc = m.acc
        assert acc is not None
        while True:
            got, complete = feed.arrived(l)
            while m.taken < len(got):
                k, v = got[m.taken]
                self._check_piece(m, k, v)
                acc.push(k, v, compute=False)
                m.taken += 1
            if complete:
                if acc.hit_tokens != m.hit_tokens:
                    s = self.model.spec
                    raise ValueError(
                        f"layer {l} hit KV has {acc.hit_tokens} tokens; expected shape "
                        f"({m.hit_tokens}, {s.kv_heads}, {s.head_dim}) "
                        "(hit_tokens, kv_heads, head_dim)"
                    )
                return True
            if acc.ready_tiles:  # attend to what is here while the rest arrives
                m.times.early_tiles += acc.ready_tiles
                acc.compute_ready()
            got2, complete2 = feed.arrived(l)
            if m.taken == len(got2) and not complete2:
                m.short = acc.tile - acc.pending_tokens
                return False

    def _check_piece(self, m: BatchMember, k: torch.Tensor, v: torch.Tensor) -> None:
        s = self.model.spec
        if tuple(k.shape[1:]) != (s.kv_heads, s.head_dim) or k.shape != v.shape:
            raise ValueError(
                f"layer {self._layer} hit KV has shapes K{tuple(k.shape)} V{tuple(v.shape)}; "
                f"expected ({m.hit_tokens}, {s.kv_heads}, {s.head_dim}) "
                "(hit_tokens, kv_heads, head_dim)"
            )

    def _advance(
        self, feeds: dict[int, ArrivingSource], emit: Callable[[BatchMember, object], None]
    ) -> bool:
        """Run the forward as far as every member's arrived hit KV allows. True when done."""
        model, n_layers = self.model, self.model.spec.layers
        t0 = time.perf_counter()
        try:
            if self._layer < 0:
                self._h = [model.embed(torch.cat([m.tokens for m in p])) for p in self.packs]
                self._layer = 0
            while self._layer < n_layers:
                l = self._layer  # noqa: E741
                for m in self._live():
                    if m._cancelled:
                        self._drop(m, None)
                if not self._live():
                    return True
                if not self._projected:
                    for p, pack in enumerate(self.packs):
                        if not pack:
                            continue
                        positions = torch.cat(
                            [torch.arange(m.hit_tokens, m.hit_tokens + m.new_tokens) for m in pack]
                        )
                        q, k, v = model.qkv(l, self._h[p], positions)
                        rows = self._rows(pack)
                        for m, qm, km, vm in zip(
                            pack, q.split(rows), k.split(rows), v.split(rows), strict=True
                        ):
                            acc = model.self_attention(qm, km, vm, stepped=True)
                            m.acc, m.new_kv = acc, (km, vm)
                            m.taken, m.complete = 0, False
                    self._projected = True
                # the self-attention in key tiles: past its quantum the run hands the compute
                # thread back between two of them (chunked prefill: a long prompt's layer does
                # not hold the short prompts queued behind it)
                for m in self._live():
                    assert m.acc is not None
                    if not m.acc.self_step(t0 + self.quantum_s):
                        return self._yield()
                for m in self._live():
                    if m.complete:
                        continue
                    try:
                        m.complete = self._pull(m, feeds[m.index])
                    except Exception as exc:  # this member's hit is bad: it leaves, not all
                        self._drop(m, exc)
                        emit(m, exc)
                        continue
                    if not m.complete:
                        self._waiting = m
                        return False
                for p, pack in enumerate(self.packs):
                    if not pack:
                        continue
                    attn = []
                    for m in pack:
                        assert m.acc is not None
                        m.acc.compute_ready(final=True)
                        attn.append(m.acc.result().to(self._h[p].dtype))
                    self._h[p] = model.finish(l, self._h[p], torch.cat(attn))
                for m in self._live():
                    assert m.new_kv is not None
                    emit(m, (l, *m.new_kv))
                    m.acc = m.new_kv = None
                self._projected = False
                self._layer += 1
                if self._layer < n_layers and time.perf_counter() - t0 >= self.quantum_s:
                    # and between layers: the jobs queued behind it run before its next one
                    return self._yield()
            for p, pack in enumerate(self.packs):
                if not pack:
                    continue
                for m, h in zip(pack, self._h[p].split(self._rows(pack)), strict=True):
                    m.logits = model.head(h if self.all_logits else h[-1:])
            return True
        finally:
            self.times.compute_s += time.perf_counter() - t0

    def _yield(self) -> bool:
        """Hand the compute thread back (its quantum is spent): `_run` queues the next job."""
        self._waiting = None
        self.times.yields += 1
        return False

    # ---- the loop side ----------------------------------------------------------------------

    async def _wait_for_tile(self, m: BatchMember, feed: ArrivingSource) -> None:
        """Until m's layer is complete or has a new full tile's worth of hit tokens."""
        l, have = self._layer, m.taken  # noqa: E741
        while True:
            await feed.wait_arrival(l, have)
            got, complete = feed.arrived(l)
            if complete or sum(k.shape[0] for k, _ in got[m.taken :]) >= m.short:
                return
            have = len(got)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        t_start = time.perf_counter()
        layers = self.model.spec.layers
        pumped = {
            m.index: PumpedSource(m.source, layers)
            for m in self.members
            if not hasattr(m.source, "arrived")
        }
        feeds: dict[int, ArrivingSource] = {
            m.index: pumped.get(m.index, m.source)  # type: ignore[misc]
            for m in self.members
        }

        def emit(m: BatchMember, item: object) -> None:
            if m._cancelled:
                return
            try:
                loop.call_soon_threadsafe(m._queue.put_nowait, item)
            except RuntimeError:  # the loop closed under a cancelled batch: nobody reads
                pass

        try:
            while not await loop.run_in_executor(self._executor, self._advance, feeds, emit):
                m = self._waiting
                if m is None:  # it yielded its quantum: back in the compute queue at once
                    continue
                t0 = time.perf_counter()
                try:
                    await self._wait_for_tile(m, feeds[m.index])
                except BaseException as exc:  # its source failed: it leaves, the batch goes on
                    task = self._task
                    if isinstance(exc, asyncio.CancelledError) and task and task.cancelling():
                        raise  # the batch itself is cancelled, not m's read
                    self._drop(m, exc)
                    m._queue.put_nowait(exc)
                waited = time.perf_counter() - t0
                self.times.wait_s += waited
                m.times.wait_s += waited
                m.times.per_layer_wait_s[self._layer] += waited
            self.times.total_s = time.perf_counter() - t_start
            for m in self.members:
                m.times.compute_s = self.times.compute_s
                m.times.total_s = self.times.total_s
                if not m.left:
                    m._queue.put_nowait(None)  # after the layers: emit's callbacks came first
        except BaseException as exc:
            for m in self.members:
                if not m.left:
                    m._cancelled = True  # a job still on the thread drops it at the next layer
                    m._queue.put_nowait(exc)
            raise
        finally:
            for p in pumped.values():
                p.close()


class PrefillRun:
    """One request's prefill; iterate it for the new tokens' per-layer KV.

    A batch of one: the same forward as a batch's, so a request's bits do not depend on
    whether it ran alone or batched. `times` are this request's.
    """

    def __init__(
        self,
        model: Transformer,
        executor: cf.Executor,
        tokens: Sequence[int] | torch.Tensor,
        hit_tokens: int,
        source: LayerSource | None,
        all_logits: bool = False,
    ) -> None:
        tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        check_request("the prefill", tokens, hit_tokens, source)
        self.batch = BatchPrefillRun(model, executor, [(tokens, hit_tokens, source)], all_logits)
        self.member = self.batch.members[0]

    @property
    def logits(self) -> torch.Tensor | None:
        """(1 or new_tokens, vocab) fp32, once the run has ended."""
        return self.member.logits

    @property
    def times(self) -> PrefillTimes:
        return self.member.times

    def __aiter__(self) -> AsyncIterator[tuple[int, torch.Tensor, torch.Tensor]]:
        return self.member.__aiter__()

    async def collect(self) -> tuple[list[LayerKV], torch.Tensor]:
        """Run to the end: the new tokens' per-layer KV and the logits."""
        return await self.member.collect()
