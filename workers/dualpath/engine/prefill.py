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

from dualpath.engine.model import Transformer

log = logging.getLogger(__name__)

LayerKV = tuple[torch.Tensor, torch.Tensor]


class LayerSource(Protocol):
    """Hit KV arriving per layer: the store's read handle, or a stream from another node."""

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
    """In-memory hit KV that arrives like a link of `bytes_per_s`: layer by layer, in order.

    The transfer starts at `start()` (or the first `layer()` call) and proceeds on its own, as a
    stream from storage or another node would, whether or not the consumer is waiting.
    """

    def __init__(self, kv_layers: Sequence[LayerKV], bytes_per_s: float) -> None:
        if bytes_per_s <= 0:
            raise ValueError("bytes_per_s must be > 0")
        self.kv_layers = list(kv_layers)
        self.bytes_per_s = bytes_per_s
        self._events: list[asyncio.Event] = []
        self._task: asyncio.Task | None = None
        self.started_at = 0.0
        self.finished_at = 0.0

    def layer_seconds(self, l: int) -> float:  # noqa: E741
        k, v = self.kv_layers[l]
        return (k.numel() * k.element_size() + v.numel() * v.element_size()) / self.bytes_per_s

    def start(self) -> None:
        if self._task is None:
            self._events = [asyncio.Event() for _ in self.kv_layers]
            self.started_at = time.perf_counter()
            self._task = asyncio.ensure_future(self._transfer())

    async def _transfer(self) -> None:
        due = self.started_at
        for l, ev in enumerate(self._events):  # noqa: E741
            due += self.layer_seconds(l)
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            ev.set()
        self.finished_at = time.perf_counter()

    async def layer(self, l: int) -> LayerKV:  # noqa: E741
        self.start()
        await self._events[l].wait()
        return self.kv_layers[l]

    async def wait_all(self) -> None:
        self.start()
        assert self._task is not None
        await self._task

    def close(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()


@dataclass
class PrefillTimes:
    compute_s: float = 0.0  # sum of compute-thread time
    wait_s: float = 0.0  # time spent waiting for hit KV with the compute thread idle
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

    def _check(self, l: int, k: torch.Tensor, v: torch.Tensor) -> None:  # noqa: E741
        s = self.model.spec
        want = (self.hit_tokens, s.kv_heads, s.head_dim)
        if tuple(k.shape) != want or tuple(v.shape) != want:
            raise ValueError(
                f"layer {l} hit KV has shapes K{tuple(k.shape)} V{tuple(v.shape)}; "
                f"expected {want} (hit_tokens, kv_heads, head_dim)"
            )

    async def _run(self) -> None:
        model, n_layers = self.model, self.model.spec.layers
        t_start = time.perf_counter()
        try:
            pending = asyncio.ensure_future(self.source.layer(0)) if n_layers else None
            h = await self._compute(model.embed, self.tokens)
            for l in range(n_layers):  # noqa: E741
                # the projections need no hit KV: they run while layer l is still arriving
                positions = torch.arange(self.hit_tokens, self.hit_tokens + h.shape[0])
                q, k, v = await self._compute(model.qkv, l, h, positions)
                t0 = time.perf_counter()
                hit_k, hit_v = await pending
                waited = time.perf_counter() - t0
                self.times.wait_s += waited
                self.times.per_layer_wait_s.append(waited)
                self._check(l, hit_k, hit_v)
                # overlap: layer l+1 arrives while layer l computes
                if l + 1 < n_layers:
                    pending = asyncio.ensure_future(self.source.layer(l + 1))
                h = await self._compute(model.attend, l, h, q, k, v, hit_k, hit_v)
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
