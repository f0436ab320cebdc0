"""A plan's points and what is said of them, below both `plan.py` (one plan) and `sweep.py`
(a plan per cell of a grid): a policy's figures at a split over seeds (`Point`) and their 95%
intervals, the splits not told apart from the best (`ties`), dualpath over the baseline at their
best splits (`compare`), and the hardware a plan simulates (`hardware`)."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field, replace
from typing import Any

from dualpath.sim.model import Hardware

BASELINE = "prefill-read"
# Two-sided 95% Student t quantiles by degrees of freedom (seeds - 1).
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def interval(xs: list[float]) -> tuple[float, float, float]:
    """(mean, low, high): the 95% Student t interval of the mean of `xs` (one value: no
    spread, low = high = mean)."""
    n = len(xs)
    if n == 0:
        return math.nan, math.nan, math.nan
    m = sum(xs) / n
    if n == 1:
        return m, m, m
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))
    half = _T95.get(n - 1, 1.96) * sd / math.sqrt(n)
    return m, m - half, m + half


def ratio_interval(
    num: list[float], den: list[float], widen: float = 1.0
) -> tuple[float, float, float]:
    """(ratio, low, high) of two per-seed series, paired by seed (the same seed = the same
    session order and join points): the t interval of the mean log ratio, widened by `widen`
    (the capacity searches' resolution) on both sides."""
    logs = [math.log(a / b) for a, b in zip(num, den, strict=True) if a > 0 and b > 0]
    if not logs:
        return math.nan, math.nan, math.nan
    m, lo, hi = interval(logs)
    return math.exp(m), math.exp(lo) / widen, math.exp(hi) * widen


@dataclass(slots=True)
class Point:
    """A policy at a split and a load over one or more seeds (`Planner.run`: TTFT/TPOT p90 over
    the seeds' turns pooled), or a split's goodput (`combine`: each seed at its own capacity,
    the figures their means), with the per-seed values kept for the spread."""

    policy: str
    prefill: int
    decode: int
    sessions: int
    tokens_per_s: float
    ttft_p90_s: float
    tpot_p90_s: float
    slo_attainment: float
    meets_slo: bool
    binding: str
    utilisation: dict[str, float]
    path_d_fraction: float
    refused: int
    truncated: int
    wall_s: float
    seeds: list[int] = field(default_factory=list)
    tokens_per_s_seeds: list[float] = field(default_factory=list)
    ttft_p90_seeds: list[float] = field(default_factory=list)
    # Binding resource of the lightest load that missed the SLO: what runs out first.
    overload_binding: str = ""
    # Capacity search: the lightest load found to miss the SLO (0: none found below the cap).
    sessions_missed: int = 0
    # Splits only: not simulated, its upper bound was under the best's interval.
    pruned_bound: float = 0.0
    # A split over seeds (`combine`): each seed's capacity, and the widest bracket of them.
    sessions_seeds: list[int] = field(default_factory=list)
    resolution_seeds: float = 0.0

    @property
    def spread(self) -> tuple[float, float]:
        """95% interval of the tokens/s over seeds, its top widened by the capacity
        bracket (the true capacity lies below `sessions_missed`)."""
        _, lo, hi = interval(self.tokens_per_s_seeds or [self.tokens_per_s])
        return lo, hi * self.resolution

    @property
    def resolution(self) -> float:
        """How tightly the capacity is bracketed: missed / met load (1 if not bracketed)."""
        if self.resolution_seeds:
            return self.resolution_seeds
        if self.sessions_missed and self.sessions:
            return max(1.0, self.sessions_missed / self.sessions)
        return 1.0

    def row(self) -> dict[str, Any]:
        lo, hi = self.spread
        return {
            "policy": self.policy,
            "prefill": self.prefill,
            "decode": self.decode,
            "sessions": self.sessions,
            "sessions_missed": self.sessions_missed or None,
            "sessions_seeds": self.sessions_seeds or [self.sessions],
            "tokens_per_s": round(self.tokens_per_s, 1),
            "tokens_per_s_interval": [round(lo, 1), round(hi, 1)],
            "tokens_per_s_seeds": [round(x, 1) for x in self.tokens_per_s_seeds],
            "seeds": self.seeds,
            "ttft_p90_s": _num(self.ttft_p90_s),
            "ttft_p90_s_seeds": [_num(x) for x in self.ttft_p90_seeds],
            "tpot_p90_s": _num(self.tpot_p90_s),
            "slo_attainment": self.slo_attainment,
            "meets_slo": self.meets_slo,
            "binding": self.binding,
            "utilisation": self.utilisation,
            "path_d_fraction": round(self.path_d_fraction, 4),
            "refused_turns": self.refused,
            "truncated_turns": self.truncated,
            "overload_binding": self.overload_binding,
            "pruned_bound": round(self.pruned_bound, 1) or None,
            "wall_s": round(self.wall_s, 2),
        }


def ties(best: Point, tried: dict[int, Point] | list[Point]) -> list[Point]:
    """The simulated splits whose goodput interval overlaps the best's: not told apart."""
    pts = tried.values() if isinstance(tried, dict) else tried
    lo, hi = best.spread
    return [
        pt
        for pt in pts
        if pt is not best
        and not pt.pruned_bound
        and pt.meets_slo
        and pt.spread[1] >= lo
        and pt.spread[0] <= hi
    ]


def _num(x: float) -> float | None:
    return None if math.isnan(x) else round(x, 4)


def hardware(args: argparse.Namespace, snic_gbps: float, kv_bytes: int) -> Hardware:
    return replace(
        Hardware(),
        gpus_per_node=args.gpus_per_node,
        snic_gbps=snic_gbps,
        cnic_gbps=args.cnic_gbps,
        decode_kv_capacity_bytes=kv_bytes,
    )


def compare(best: dict[str, Point]) -> dict[str, Any] | None:
    """dualpath over the baseline at their best splits, paired by seed, with its interval."""
    if "dualpath" not in best or BASELINE not in best:
        return None
    dp, base = best["dualpath"], best[BASELINE]
    if not (dp.meets_slo and base.meets_slo) or dp.seeds != base.seeds:
        return None
    r, lo, hi = ratio_interval(
        dp.tokens_per_s_seeds, base.tokens_per_s_seeds, max(dp.resolution, base.resolution)
    )
    if math.isnan(r):
        return None
    return {
        "ratio": round(r, 3),
        "interval": [round(lo, 3), round(hi, 3)],
        "seeds": dp.seeds,
        "per_seed": [
            round(a / b, 3)
            for a, b in zip(dp.tokens_per_s_seeds, base.tokens_per_s_seeds, strict=True)
            if b > 0
        ],
        "above_1": lo > 1.0,
        "above_1_2": lo > 1.2,
    }
