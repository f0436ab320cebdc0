"""Layer-wise prefill over a per-layer source of hit KV (DESIGN section 3, step 3).

`PrefillRun` computes the new tokens layer by layer on the engine's compute thread while the
asyncio loop keeps receiving hit KV: layer `l+1`'s `source.layer(l+1)` is awaited while layer
`l` computes. It yields the new tokens' K, V per layer, (new_tokens, kv_heads, head_dim), for the
caller to stream to a decode node or cut into store blocks; `logits` is set at the end.

    run = engine.prefill(new_tokens, hit_tokens, source)
    async for layer, k, v in run:
        ...
    logits = run.logits          # (1 or new_tokens, vocab) fp32
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from dualpath.engine.model import TiledAttention, Transformer

log = logging.getLogger(__name__)

LayerKV = tuple[torch.Tensor, torch.Tensor]


class LayerSource(Protocol):
    """Hit KV arriving per layer: the store's read handle, or a stream from another node.

    A source may also have `layer_pieces(l)`: an async iterator over layer l in token order, in
    pieces whose concatenation is `layer(l)`; the prefill then attends to each full tile of the
    hit while the rest of the layer is still arriving (its output is the same either way).
    """

    async def layer(self, l: int) -> LayerKV: ...  # noqa: E741


class EmptySource:
    """No hit: every layer is an empty (0, kv_heads, head_dim) pair."""

    def __init__(self, kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        self._e = torch.empty(0, kv_heads, head_dim, dtype=dtype)

    async def layer(self, l: int) -> LayerKV:  # noqa: E741
        return self._e, self._e


class MemorySource:
    """Hit KV already in memory (a list of per-layer (K, V))."""

    def __init__(self, kv_layers: Sequence[LayerKV]) -> None:
        self.kv_layers = list(kv_layers)

    async def layer(self, l: int) -> LayerKV:  # noqa: E741
        return self.kv_layers[l]


class ThrottledSource:
    """In-memory hit KV that arrives like a link of `bytes_per_s`: layer by layer, in order,
    each layer in pieces of `piece_tokens` (a store block's worth by default).

    The transfer starts at `start()` (or the first `layer()` call) and proceeds on its own, as a
    stream from storage or another node would, whether or not the consumer is waiting.
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
        self._events: list[list[asyncio.Event]] = []
        self._task: asyncio.Task | None = None
        self.started_at = 0.0
        self.finished_at = 0.0

    def _cuts(self, l: int) -> list[tuple[int, int]]:  # noqa: E741
        n = self.kv_layers[l][0].shape[0]
        return [(a, min(a + self.piece_tokens, n)) for a in range(0, n, self.piece_tokens)] or [
            (0, 0)
        ]

    def layer_seconds(self, l: int) -> float:  # noqa: E741
        k, v = self.kv_layers[l]
        return (k.numel() * k.element_size() + v.numel() * v.element_size()) / self.bytes_per_s

    def start(self) -> None:
        if self._task is None:
            layers = range(len(self.kv_layers))
            self._events = [[asyncio.Event() for _ in self._cuts(i)] for i in layers]
            self.started_at = time.perf_counter()
            self._task = asyncio.ensure_future(self._transfer())

    async def _transfer(self) -> None:
        due = self.started_at
        for l, events in enumerate(self._events):  # noqa: E741
            n = max(1, self.kv_layers[l][0].shape[0])
            for (a, b), ev in zip(self._cuts(l), events, strict=True):
                due += self.layer_seconds(l) * (b - a) / n
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
                ev.set()
        self.finished_at = time.perf_counter()

    async def layer(self, l: int) -> LayerKV:  # noqa: E741
        self.start()
        await self._events[l][-1].wait()
        return self.kv_layers[l]

    async def layer_pieces(self, l: int) -> AsyncIterator[LayerKV]:  # noqa: E741
        self.start()
        k, v = self.kv_layers[l]
        for (a, b), ev in zip(self._cuts(l), self._events[l], strict=True):
            await ev.wait()
            yield k[a:b], v[a:b]

    async def wait_all(self) -> None:
        self.start()
        assert self._task is not None
        await self._task

    def close(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()


class _LayerPieces:
    """Layer l of a source as pieces in token order: the source's `layer_pieces(l)` when it has
    one, else the whole layer as one piece, requested now (so it is fetched ahead)."""

    def __init__(self, source: LayerSource, l: int) -> None:  # noqa: E741
        pieces = getattr(source, "layer_pieces", None)
        self._iter = pieces(l).__aiter__() if pieces is not None else None
        self._whole = None if pieces is not None else asyncio.ensure_future(source.layer(l))

    async def next(self) -> LayerKV | None:
        if self._iter is not None:
            return await anext(self._iter, None)
        if self._whole is None:
            return None
        whole, self._whole = self._whole, None
        return await whole


@dataclass
class PrefillTimes:
    compute_s: float = 0.0  # sum of compute-thread time
    wait_s: float = 0.0  # time spent waiting for hit KV with the compute thread idle
    early_tiles: int = 0  # hit tiles attended to while the rest of their layer was arriving
    total_s: float = 0.0
    per_layer_wait_s: list[float] = field(default_factory=list)


class PrefillRun:
    """One request's prefill; iterate it for the new tokens' per-layer KV."""

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
        self.times = PrefillTimes()
        self._executor = executor
        self._queue: asyncio.Queue = asyncio.Queue()
        self._task: asyncio.Task | None = None

    async def _compute(self, fn, *args):
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        out = await loop.run_in_executor(self._executor, fn, *args)
        self.times.compute_s += time.perf_counter() - t0
        return out

    def _check_piece(self, l: int, k: torch.Tensor, v: torch.Tensor) -> None:  # noqa: E741
        s = self.model.spec
        want = (s.kv_heads, s.head_dim)
        if tuple(k.shape[1:]) != want or k.shape != v.shape:
            raise ValueError(
                f"layer {l} hit KV has shapes K{tuple(k.shape)} V{tuple(v.shape)}; "
                f"expected ({self.hit_tokens}, {s.kv_heads}, {s.head_dim}) "
                "(hit_tokens, kv_heads, head_dim)"
            )

    def _before_hit(
        self, layer: int, h: torch.Tensor, positions: torch.Tensor
    ) -> tuple[TiledAttention, torch.Tensor, torch.Tensor]:
        q, k, v = self.model.qkv(layer, h, positions)
        return self.model.self_attention(q, k, v), k, v

    async def _take_hit(self, l: int, pending: _LayerPieces, acc: TiledAttention) -> float:  # noqa: E741
        """Push layer l's hit pieces into `acc`; while the next piece is still on the wire,
        attend to the full tiles already here. Pieces that are already here are taken without
        a compute hop (a hop costs a thread handoff; in the compute-bound steady state every
        piece is here and the tail does all the tiles at once). Returns the seconds waited."""
        waited, early = 0.0, 0
        nxt = asyncio.ensure_future(pending.next())
        try:
            while True:
                await asyncio.sleep(0)  # a piece that is already here completes now
                if not nxt.done() and acc.ready_tiles:
                    early = acc.ready_tiles
                    await self._compute(acc.compute_ready)
                t0 = time.perf_counter()
                piece = await nxt
                waited += time.perf_counter() - t0
                if piece is None:
                    return waited
                self.times.early_tiles += early  # more of the layer came after them
                early = 0
                self._check_piece(l, *piece)
                acc.push(*piece, compute=False)
                nxt = asyncio.ensure_future(pending.next())
        finally:
            if not nxt.done():
                nxt.cancel()

    async def _run(self) -> None:
        model, n_layers = self.model, self.model.spec.layers
        t_start = time.perf_counter()
        try:
            pending = _LayerPieces(self.source, 0) if n_layers else None
            h = await self._compute(model.embed, self.tokens)
            for l in range(n_layers):  # noqa: E741
                # the projections and the new tokens' self-attention need no hit KV: they run
                # while layer l is still arriving
                positions = torch.arange(self.hit_tokens, self.hit_tokens + h.shape[0])
                acc, k, v = await self._compute(self._before_hit, l, h, positions)
                assert pending is not None
                waited = await self._take_hit(l, pending, acc)
                self.times.wait_s += waited
                self.times.per_layer_wait_s.append(waited)
                if acc.hit_tokens != self.hit_tokens:
                    raise ValueError(
                        f"layer {l} hit KV has {acc.hit_tokens} tokens; expected shape "
                        f"({self.hit_tokens}, {model.spec.kv_heads}, {model.spec.head_dim}) "
                        "(hit_tokens, kv_heads, head_dim)"
                    )
                # overlap: layer l+1 arrives while layer l finishes
                if l + 1 < n_layers:
                    pending = _LayerPieces(self.source, l + 1)
                h = await self._compute(model.attend_tail, l, h, acc)
                self._queue.put_nowait((l, k, v))
            last = h if self.all_logits else h[-1:]
            self.logits = await self._compute(model.head, last)
            self.times.total_s = time.perf_counter() - t_start
            self._queue.put_nowait(None)
        except BaseException as exc:  # handed to the iterating caller
            self._queue.put_nowait(exc)
            raise

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
