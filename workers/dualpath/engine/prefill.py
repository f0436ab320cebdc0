"""What a layer-wise prefill reads (docs/design.md section 3, step 3): per-layer sources of hit KV.

The forward itself is `engine/batch.py` (`PrefillRun` is a batch of one). It runs on the
engine's compute thread while the asyncio loop keeps receiving hit KV: layer `l+1` arrives
while layer `l` computes, and the tiles of a layer's hit are attended to as they land. The
compute thread reads a source through `ArrivingSource` (`arrived(l)`, never blocking) and the
loop waits through `wait_arrival(l, have)`; a source with only `layer(l)` or `layer_pieces(l)`
is pumped into that form by `PumpedSource`.

    run = engine.prefill(new_tokens, hit_tokens, MemorySource(hit_kv))
    async for layer, k, v in run:
        ...
    logits = run.logits          # (1 or new_tokens, vocab) fp32
"""

from __future__ import annotations

import asyncio
import bisect
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

LayerKV = tuple[torch.Tensor, torch.Tensor]


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


class PumpedSource:
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
