"""Prefill cost model (pure): estimated execution time from (cached, new) tokens.

Features are the FLOPs of a prefill: `linear` (projections + MLP of the new tokens + the last
token's logits) and `attention` (new tokens x context). Time = base + a * linear + b * attention,
fitted by least squares to measured samples (`dualpath.engine.calibrate` measures them on this
machine); coefficients stay non-negative so the estimate grows with both token counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dualpath.config import ModelSpec


@dataclass(frozen=True)
class FlopsModel:
    """The dims the FLOPs count needs (plain data, from a ModelSpec)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def from_spec(cls, spec: ModelSpec) -> FlopsModel:
        return cls(
            spec.layers,
            spec.hidden_size,
            spec.heads,
            spec.kv_heads,
            spec.head_dim,
            spec.intermediate_size or 4 * spec.hidden_size,
            spec.vocab_size,
        )

    def flops(self, cached: int, new: int) -> tuple[float, float]:
        """(linear, attention) FLOPs of prefilling `new` tokens after `cached` ones."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        per_token = 2 * (self.hidden * (2 * q + 2 * kv) + 3 * self.hidden * self.intermediate)
        linear = float(self.layers * per_token * new + 2 * self.hidden * self.vocab)
        # scores + weighted sum: 4 * heads * head_dim per (query, key) pair, causal within new
        pairs = new * cached + new * (new + 1) / 2
        attention = float(self.layers * 4 * q * pairs)
        return linear, attention


@dataclass(frozen=True)
class CostModel:
    flops: FlopsModel
    base_s: float
    s_per_linear_flop: float
    s_per_attention_flop: float

    def estimate(self, cached: int, new: int) -> float:
        if new <= 0:
            return 0.0
        lin, att = self.flops.flops(cached, new)
        return self.base_s + self.s_per_linear_flop * lin + self.s_per_attention_flop * att

    def to_dict(self) -> dict[str, float]:
        return {
            "base_s": self.base_s,
            "s_per_linear_gflop": self.s_per_linear_flop * 1e9,
            "s_per_attention_gflop": self.s_per_attention_flop * 1e9,
        }


Sample = tuple[int, int, float]  # (cached, new, seconds)


def fit_cost_model(flops: FlopsModel, samples: Sequence[Sample]) -> CostModel:
    """Least-squares fit of time = base + a*linear + b*attention with a, b, base >= 0.

    Minimises relative error (rows weighted by 1/time), so short and long prefills count alike.
    """
    if len(samples) < 3:
        raise ValueError(f"need >= 3 samples to fit the cost model (got {len(samples)})")
    rows = np.array([[1.0, *flops.flops(c, n)] for c, n, _ in samples])
    y = np.array([t for _, _, t in samples])
    if np.any(y <= 0):
        raise ValueError("sample times must be > 0 seconds")
    scale = rows.max(axis=0)
    scale[scale == 0] = 1.0
    x, w = rows / scale, 1.0 / y
    active = [0, 1, 2]
    coef = np.zeros(3)
    while active:  # tiny active-set NNLS: drop a negative coefficient, refit
        sol, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        if np.all(sol >= 0):
            coef[:] = 0
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    coef = coef / scale
    return CostModel(flops, float(coef[0]), float(coef[1]), float(coef[2]))


def relative_errors(model: CostModel, samples: Sequence[Sample]) -> list[float]:
    """|estimate - measured| / measured per sample."""
    return [abs(model.estimate(c, n) - t) / t for c, n, t in samples]
