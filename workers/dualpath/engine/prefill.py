"""Layer-wise prefill over a per-layer source of hit KV (DESIGN section 3, step 3).

`PrefillRun` computes the new tokens layer by layer on the engine's compute thread while the
asyncio loop keeps receiving hit KV: layer `l+1` arrives while layer `l` computes, and the
tiles of a layer's hit are attended to as they land. It yields the new tokens' K, V per layer,
(new_tokens, kv_heads, head_dim), for the caller to stream to a decode node or cut into store
blocks; `logits` is set at the end.

    run = engine.prefill(new_tokens, hit_tokens, source)
    async for layer, k, v in run:
        ...
    logits = run.logits          # (1 or new_tokens, vocab) fp32
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures as cf
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from dualpath.engine.model import TiledAttention, Transformer

log = logging.getLogger(__name__)

LayerKV = tuple[torch.Tensor, torch.Tensor]
NewLayerKV = tuple[int, torch.Tensor, torch.Tensor]  # (layer, K, V) of the new tokens


class LayerSource(Protocol):
    """Hit KV arriving per layer: the store's read handle, or a stream from another node.

    A source may also have `layer_pieces(l)`: an async iterator over layer l in token order, in
    pieces whose concatenation is `layer(l)`; the prefill then attends to each full tile of the
    hit while the rest of the layer is still arriving (its output is the same either way).
    """

    async def layer(self, l: int) -> LayerKV: ...  # noqa: E741


class ArrivingSource(Protocol):
    """What the prefill reads a source through: a source that has these two is read directly,
    any other is pumped into them by a loop task.

    `arrived(l)` is called on the compute thread and never blocks: layer l's pieces that have
    landed so far, in token order, and whether that is all of them. `wait_arrival(l, have)`
    runs on the loop: it returns once layer l has more than `have` pieces or is complete, and
    raises the source's error if the layer cannot come.
    """

    def arrived(self, l: int) -> tuple[Sequence[LayerKV], bool]: ...  # noqa: E741

    async def wait_arrival(self, l: int, have: int) -> None: ...  # noqa: E741


class EmptySource:
    """No hit: every layer is an empty (0, kv_heads, head_dim) pair."""

    def __init__(self, kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        self._e = torch.empty(0, kv_heads, head_dim, dtype=dtype)

    async def layer(self, l: int) -> LayerKV:  # noqa: E741
        return self._e, self._e

    def arrived(self, l: int) -> tuple[list[LayerKV], bool]:  # noqa: E741
        return [(self._e, self._e)], True

    async def wait_arrival(self, l: int, have: int) -> None:  # noqa: E741
        return None


class MemorySource:
    """Hit KV already in memory (a list of per-layer (K, V))."""

    def __init__(self, kv_layers: Sequence[LayerKV]) -> None:
        self.kv_layers = list(kv_layers)

    async def layer(self, l: int) -> LayerKV:  # noqa: E741
        return self.kv_layers[l]

    def arrived(self, l: int) -> tuple[list[LayerKV], bool]:  # noqa: E741
        return [self.kv_layers[l]], True

    async def wait_arrival(self, l: int, have: int) -> None:  # noqa: E741
        return None


class ThrottledSource:
    """In-memory hit KV that arrives like a link of `bytes_per_s`: layer by layer, in order,
    each layer in pieces of `piece_tokens` (a store block's worth by default).

    The transfer starts at `start()` (or the first call that asks for a layer) and proceeds on
    its own, as a stream from storage or another node would, whether or not the consumer is
    waiting. Arrival is a function of the clock, so the link costs the consuming host no CPU,
    as an RDMA WRITE into its buffer would not: `arrived(l)` reads the clock, and only a
    consumer that has run out of pieces sleeps.
    """

    def __init__(
        self, kv_layers: Sequence[LayerKV], bytes_per_s: float, piece_tokens: int = 64
    ) -> None:
        if bytes_per_s <= 0:
            raise ValueError("bytes_per_s must be > 0")
        if piece_tokens <= 0:
            raise ValueError("piece_tokens must be > 0")
        self.kv_layers = list(kv_layers)
        self.bytes_per_s = bytes_per_s
        self.piece_tokens = piece_tokens
        self.started_at = 0.0
        # per layer: its pieces, and when each has landed (seconds after start)
        self._pieces: list[list[LayerKV]] = []
        self._due: list[list[float]] = []
        sent = 0.0
        for k, v in self.kv_layers:
            step = range(0, k.shape[0], piece_tokens)
            pieces = [(k[a : a + piece_tokens], v[a : a + piece_tokens]) for a in step] or [(k, v)]
            due = []
            for pk, pv in pieces:
                sent += pk.numel() * pk.element_size() + pv.numel() * pv.element_size()
                due.append(sent / bytes_per_s)
            self._pieces.append(pieces)
            self._due.append(due)

    def start(self) -> None:
        if not self.started_at:
            self.started_at = time.perf_counter()

    async def _until(self, l: int, i: int) -> None:  # noqa: E741
        """Until piece i of layer l has landed."""
        self.start()
        await asyncio.sleep(max(0.0, self.started_at + self._due[l][i] - time.perf_counter()))

    def arrived(self, l: int) -> tuple[list[LayerKV], bool]:  # noqa: E741
        self.start()
        n = bisect.bisect_right(self._due[l], time.perf_counter() - self.started_at)
        return self._pieces[l][:n], n == len(self._pieces[l])

    async def wait_arrival(self, l: int, have: int) -> None:  # noqa: E741
        await self._until(l, min(have, len(self._due[l]) - 1))

    async def layer(self, l: int) -> LayerKV:  # noqa: E741
        await self._until(l, -1)
        return self.kv_layers[l]

    async def layer_pieces(self, l: int) -> AsyncIterator[LayerKV]:  # noqa: E741
        for i, piece in enumerate(self._pieces[l]):
            await self._until(l, i)
            yield piece

    async def wait_all(self) -> None:
        """Until the last byte has landed."""
        if self.kv_layers:
            await self._until(len(self.kv_layers) - 1, -1)


@dataclass
class PrefillTimes:
    compute_s: float = 0.0  # sum of compute-thread time
    wait_s: float = 0.0  # time spent waiting for hit KV with the compute thread idle
    early_tiles: int = 0  # hit tiles attended to while the rest of their layer was arriving
    total_s: float = 0.0
    per_layer_wait_s: list[float] = field(default_factory=list)


class _PumpedSource:
    """`arrived` / `wait_arrival` for a source that has only `layer` (or `layer_pieces`): a
    loop task moves its pieces, in layer and token order, into per-layer lists the compute
    thread can read (appends and reads of a list are atomic under the GIL)."""

    def __init__(self, source: LayerSource, layers: int) -> None:
        self._got: list[list[LayerKV]] = [[] for _ in range(layers)]
        self._complete = [False] * layers
        self._error: BaseException | None = None
        self._source = source
        self._landed = asyncio.Event()
        self._closed = False
        self._task = asyncio.ensure_future(self._pump())

    async def _pump(self) -> None:
        pieces = getattr(self._source, "layer_pieces", None)
        try:
            for l, got in enumerate(self._got):  # noqa: E741
                if pieces is None:
                    got.append(await self._source.layer(l))
                else:
                    async for piece in pieces(l):
                        got.append(piece)
                        self._landed.set()
                self._complete[l] = True
                self._landed.set()
        except BaseException as exc:  # raised to the prefill when it needs the missing piece
            if self._closed:  # close() cancelled the pump: nobody waits any more
                raise
            # a source's own CancelledError (its read was cancelled) too: the prefill must
            # not wait for a layer that will never come
            self._error = exc
            self._landed.set()

    def arrived(self, l: int) -> tuple[list[LayerKV], bool]:  # noqa: E741
        complete = self._complete[l]  # read first: once complete, every piece is in the list
        return self._got[l], complete

    async def wait_arrival(self, l: int, have: int) -> None:  # noqa: E741
        while len(self._got[l]) <= have and not self._complete[l]:
            if self._error is not None:
                raise self._error
            self._landed.clear()
            await self._landed.wait()

    def close(self) -> None:
        self._closed = True
        if not self._task.done():
            self._task.cancel()


class PrefillRun:
    """One request's prefill; iterate it for the new tokens' per-layer KV.

    The forward runs on the engine's compute thread as one job for as long as the hit KV is
    there (`_advance`): every piece already arrived is taken in the same job, and the job comes
    back to the loop only to wait for more. A trip through the loop costs a thread handoff
    (about half a millisecond on a VM), so in the compute-bound steady state a whole prefill is
    one job. While this run waits, the compute thread is free for other runs.
    """

    def __init__(
        self,
        model: Transformer,
        executor: cf.Executor,
        tokens: torch.Tensor,
        hit_tokens: int,
        source: LayerSource | None,
        all_logits: bool = False,
    ) -> None:
        spec = model.spec
        tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        if tokens.numel() == 0:
            raise ValueError("prefill needs at least one new token (tokens is empty)")
        if hit_tokens < 0:
            raise ValueError("hit_tokens must be >= 0")
        if hit_tokens and source is None:
            raise ValueError(f"hit_tokens={hit_tokens} needs a per-layer KV source")
        self.model = model
        self.tokens = tokens
        self.hit_tokens = hit_tokens
        self.source = source or EmptySource(spec.kv_heads, spec.head_dim, model.dtype)
        self.all_logits = all_logits
        self.logits: torch.Tensor | None = None
        self.times = PrefillTimes(per_layer_wait_s=[0.0] * spec.layers)
        self._executor = executor
        self._queue: asyncio.Queue = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self._cancelled = False
        # the forward's state between jobs: written on the compute thread, read by the loop
        # only while no job of this run is on the thread
        self._layer = -1  # -1: not embedded yet
        self._h: torch.Tensor | None = None
        self._acc: TiledAttention | None = None
        self._new_kv: LayerKV | None = None
        self._taken = 0  # pieces of this layer pushed into _acc
        self._short = 0  # hit tokens this layer's next tile still lacks

    def _check_piece(self, l: int, k: torch.Tensor, v: torch.Tensor) -> None:  # noqa: E741
        s = self.model.spec
        want = (s.kv_heads, s.head_dim)
        if tuple(k.shape[1:]) != want or k.shape != v.shape:
            raise ValueError(
                f"layer {l} hit KV has shapes K{tuple(k.shape)} V{tuple(v.shape)}; "
                f"expected ({self.hit_tokens}, {s.kv_heads}, {s.head_dim}) "
                "(hit_tokens, kv_heads, head_dim)"
            )

    def _advance(self, feed: ArrivingSource, emit: Callable[[NewLayerKV], None]) -> bool:
        """On the compute thread: run the forward as far as the arrived hit KV allows. True
        when the logits are done; False when layer `_layer` needs a piece that is not here."""
        model, n_layers = self.model, self.model.spec.layers
        t0 = time.perf_counter()
        try:
            if self._layer < 0:
                self._h, self._layer = model.embed(self.tokens), 0
            while self._layer < n_layers and not self._cancelled:
                l, h = self._layer, self._h  # noqa: E741
                assert h is not None
                if self._acc is None:
                    # the projections and the new tokens' self-attention need no hit KV
                    positions = torch.arange(self.hit_tokens, self.hit_tokens + h.shape[0])
                    q, k, v = model.qkv(l, h, positions)
                    self._acc, self._new_kv, self._taken = model.self_attention(q, k, v), (k, v), 0
                acc = self._acc
                got, complete = feed.arrived(l)
                while self._taken < len(got):
                    k_hit, v_hit = got[self._taken]
                    self._check_piece(l, k_hit, v_hit)
                    acc.push(k_hit, v_hit, compute=False)
                    self._taken += 1
                if not complete:
                    if acc.ready_tiles:  # attend to what is here while the rest arrives
                        self.times.early_tiles += acc.ready_tiles
                        acc.compute_ready()
                    got, complete = feed.arrived(l)
                    if self._taken == len(got) and not complete:
                        self._short = acc.tile - acc.pending_tokens
                        return False
                    continue  # more came meanwhile
                if acc.hit_tokens != self.hit_tokens:
                    raise ValueError(
                        f"layer {l} hit KV has {acc.hit_tokens} tokens; expected shape "
                        f"({self.hit_tokens}, {model.spec.kv_heads}, {model.spec.head_dim}) "
                        "(hit_tokens, kv_heads, head_dim)"
                    )
                self._h = model.attend_tail(l, h, acc)
                emit((l, *self._new_kv))
                self._acc = self._new_kv = None
                self._layer += 1
            if not self._cancelled:
                last = self._h if self.all_logits else self._h[-1:]
                self.logits = model.head(last)
            return True
        finally:
            self.times.compute_s += time.perf_counter() - t0

    async def _wait_for_tile(self, feed: ArrivingSource) -> None:
        """On the loop, until layer `_layer` is complete or has a new full tile's worth of
        hit tokens: waking the compute thread for less would only cost a handoff."""
        l, have = self._layer, self._taken  # noqa: E741
        while True:
            await feed.wait_arrival(l, have)
            got, complete = feed.arrived(l)
            if complete or sum(k.shape[0] for k, _ in got[self._taken :]) >= self._short:
                return
            have = len(got)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        t_start = time.perf_counter()
        source = self.source
        pumped = None
        if not hasattr(source, "arrived"):
            pumped = _PumpedSource(source, self.model.spec.layers)
        feed: ArrivingSource = pumped or source  # type: ignore[assignment]

        def emit(item: NewLayerKV) -> None:
            if self._cancelled:
                return
            try:
                loop.call_soon_threadsafe(self._queue.put_nowait, item)
            except RuntimeError:  # the loop has closed under a cancelled run: nobody reads
                pass

        try:
            while not await loop.run_in_executor(self._executor, self._advance, feed, emit):
                t0 = time.perf_counter()
                await self._wait_for_tile(feed)
                waited = time.perf_counter() - t0
                self.times.wait_s += waited
                self.times.per_layer_wait_s[self._layer] += waited
            self.times.total_s = time.perf_counter() - t_start
            self._queue.put_nowait(None)  # after the layers: emit's callbacks came first
        except BaseException as exc:  # handed to the iterating caller
            self._cancelled = True  # a job still on the thread stops at its next layer
            self._queue.put_nowait(exc)
            raise
        finally:
            if pumped is not None:
                pumped.close()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())

    async def __aiter__(self) -> AsyncIterator[tuple[int, torch.Tensor, torch.Tensor]]:
        self.start()
        try:
            while True:
                item = await self._queue.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            if self._task is not None and not self._task.done():
                self._task.cancel()
            elif self._task is not None and not self._task.cancelled():
                self._task.exception()  # retrieved: no "never retrieved" warning

    async def collect(self) -> tuple[list[LayerKV], torch.Tensor]:
        """Run to the end: the new tokens' per-layer KV and the logits."""
        kv = [(k, v) async for _, k, v in self]
        assert self.logits is not None
        return kv, self.logits
