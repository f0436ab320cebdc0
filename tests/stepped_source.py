"""A hit-KV source whose pieces arrive only when the consumer waits for them: the
arrival order of `ThrottledSource` without its clock, so a test of early tiles does not
depend on when a throttled read lands on a loaded machine. Importable from every test
(`pythonpath = ["tests"]` in pyproject.toml)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import torch

LayerKV = tuple[torch.Tensor, torch.Tensor]


class SteppedSource:
    """Layer l's pieces (`piece_tokens` each); none has arrived until the consumer first waits
    (`wait_arrival`), and each wait lands exactly one more piece."""

    def __init__(self, kv_layers: Sequence[LayerKV], piece_tokens: int) -> None:
        self.kv_layers = list(kv_layers)
        self._pieces = [
            [
                (k[a : a + piece_tokens], v[a : a + piece_tokens])
                for a in range(0, len(k), piece_tokens)
            ]
            for k, v in self.kv_layers
        ]
        self._landed = [0] * len(self.kv_layers)

    def arrived(self, l: int) -> tuple[list[LayerKV], bool]:  # noqa: E741
        n = self._landed[l]
        return self._pieces[l][:n], n == len(self._pieces[l])

    async def wait_arrival(self, l: int, have: int) -> None:  # noqa: E741
        await asyncio.sleep(0)
        self._landed[l] = min(max(self._landed[l], have + 1), len(self._pieces[l]))

    async def layer(self, l: int) -> LayerKV:  # noqa: E741
        self._landed[l] = len(self._pieces[l])
        return self.kv_layers[l]
