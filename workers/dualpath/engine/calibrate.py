"""Calibration (the measured shell around the pure cost model): time prefills on this machine.

samples = asyncio.run(measure(engine, [(0, 64), (512, 128), ...]))
model = fit_cost_model(FlopsModel.from_spec(engine.spec), samples)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from dualpath.engine.cost import CostModel, FlopsModel, Sample, fit_cost_model
from dualpath.engine.engine import Engine
from dualpath.engine.prefill import MemorySource

log = logging.getLogger(__name__)

DEFAULT_GRID: tuple[tuple[int, int], ...] = tuple(
    (c, n) for c in (0, 256, 1024) for n in (16, 64, 256)
)


def random_hit(
    engine: Engine, tokens: int, seed: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    s = engine.spec
    gen = torch.Generator().manual_seed(seed)
    shape = (tokens, s.kv_heads, s.head_dim)
    return [
        (
            torch.randn(shape, generator=gen).to(engine.model.dtype),
            torch.randn(shape, generator=gen).to(engine.model.dtype),
        )
        for _ in range(s.layers)
    ]


async def measure_one(engine: Engine, cached: int, new: int, repeats: int = 3) -> float:
    """Best-of-`repeats` wall time (shared machine: the least disturbed run) of prefilling `new` tokens after `cached` in-memory hit tokens."""
    hit = random_hit(engine, cached)
    tokens = torch.randint(
        0, engine.spec.vocab_size, (new,), generator=torch.Generator().manual_seed(new)
    )
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        await engine.prefill(tokens, cached, MemorySource(hit) if cached else None).collect()
        times.append(time.perf_counter() - t0)
    return min(times)


async def measure(
    engine: Engine, shapes: Sequence[tuple[int, int]], repeats: int = 3
) -> list[Sample]:
    await measure_one(engine, 0, 16, 1)  # warm-up
    out = []
    for cached, new in shapes:
        out.append((cached, new, await measure_one(engine, cached, new, repeats)))
    return out


async def calibrate(
    engine: Engine, shapes: Sequence[tuple[int, int]] = DEFAULT_GRID, repeats: int = 3
) -> tuple[CostModel, list[Sample]]:
    samples = await measure(engine, shapes, repeats)
    model = fit_cost_model(FlopsModel.from_spec(engine.spec), samples)
    log.info("cost model calibrated on %d shapes: %s", len(samples), model.to_dict())
    return model, samples
