"""`dualpath plan`: size the prefill:decode split of a DualPath cluster from a trace.

    dualpath plan --trace out/cc.jsonl --nodes 12 --ttft-slo 4 --tpot-slo 0.1 --plot out/plan.png
    dualpath plan --trace out/cc.jsonl --nodes 12 --target-tokens-per-s 40000 --json
    dualpath plan --trace out/cc.jsonl --nodes 12 --emit-spec out/cluster.yaml

For each policy (prefill-read, the baseline, and dualpath) and each P:D split of `--nodes`, the
simulator (`dualpath.sim`, the scheduler's own policies) runs the trace in steady state: S
sessions at once (joined at a random turn of theirs, as if already running, their starts
spread over the warm-up), a finished session's slot starting the next from its first turn,
warm-up excluded. S climbs a
ladder (doubling) while the SLO holds (TTFT p90 <= --ttft-slo and TPOT p90 <= --tpot-slo);
a split's goodput is the tokens/s at its highest load that meets the SLO. Splits are searched
coarse to fine (a grid of P, then the neighbours of the best) since goodput is unimodal in P.
The report per policy: best P:D, its sessions, steady tokens/s, TTFT/TPOT p90, SLO attainment,
the binding resource (highest utilisation: prefill GPUs, SNICs, CNICs or decode KV memory), and
the read-path split (fraction of hit bytes read by decode SNICs). With a target tokens/s it then
searches the node count (the best split's P share, scaled) that reaches it under the SLO.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass, replace
from typing import Any

from dualpath import trace
from dualpath.config import ModelSpec
from dualpath.scheduler.policy import get_policy
from dualpath.sim.engine import CONTEXT_RULE_EFFECT, SimConfig, Simulator, percentile
from dualpath.sim.model import CostModel, Hardware
from dualpath.sim.options import add_context_arguments, context_limit_of
from dualpath.sim.points import BASELINE, Point, compare, hardware, ties

# Fraction of a decode node's HBM left to KV (the rest: weights, activations): 400 of 8 x 80 GB.
KV_FRACTION = 0.625
# A load keeps at most this many simulated agents (larger loads group agents: see
# SimConfig.agent_group) so one run costs about a second, not minutes.
MAX_SIMULATED_AGENTS = 512
# Capacity search: a split's highest load meeting the SLO is bracketed to this ratio (3%).
TOLERANCE = 0.03
# Splits a best-split search simulates, about (for the ETA until it is known).
SPLITS_PER_SEARCH = 5


@dataclass(slots=True, frozen=True)
class Slo:
    ttft_p90_s: float
    tpot_p90_s: float


@dataclass(slots=True)
class _Run:
    """One simulation (one seed): what a Point aggregates."""

    tokens_per_s: float
    ttft_s: list[float]
    tpot_s: list[float]
    attained: int  # measured turns meeting both SLOs
    binding: str
    utilisation: dict[str, float]
    path_d_fraction: float
    refused: int
    truncated: int
    wall_s: float


def capacity_bound(pt: Point, prefill: int, decode: int) -> float:
    """An upper bound of the tokens/s of `pt`'s policy at another split, from the demand per
    generated token `pt` measured on each resource (utilisation x nodes / tokens/s) and every
    resource at most fully busy. A policy that reads through decode SNICs (path D) can put
    its reads on any SNIC, so they are one pool of P + D; its CNIC traffic depends on the
    split and is left out (that only loosens the bound)."""
    t = pt.tokens_per_s
    if t <= 0:
        return math.inf
    u = pt.utilisation
    p0, d0 = pt.prefill, pt.decode
    demand: list[tuple[float, float]] = [  # (nodes there, node-seconds per token)
        (prefill, u.get("prefill_gpu", 0.0) * p0 / t),
        (decode, u.get("decode_kv_memory", 0.0) * d0 / t),
    ]
    if pt.path_d_fraction > 0:
        snic = u.get("prefill_snic", 0.0) * p0 + u.get("decode_snic", 0.0) * d0
        demand.append((prefill + decode, snic / t))
    else:
        demand += [
            (prefill, u.get("prefill_snic", 0.0) * p0 / t),
            (decode, u.get("decode_snic", 0.0) * d0 / t),
            (prefill, u.get("prefill_cnic", 0.0) * p0 / t),
            (decode, u.get("decode_cnic", 0.0) * d0 / t),
        ]
    return min((n / x for n, x in demand if x > 0), default=math.inf)


@dataclass
class Planner:
    """Pure search over the simulator: no I/O but the optional progress callback.

    A seed fixes the sessions' order, join points and starts; the same `seeds` serve every
    policy, split and load, so comparisons are paired by seed. A split's capacity is found for
    each seed by bracketing and bisection to `tolerance`, and its goodput is their mean with
    their spread; the best split by a climb from the split the first one's resource demands
    predict, skipping splits whose upper bound (`capacity_bound`) is under the best's
    interval."""

    recorded: list[trace.Trajectory]
    model: ModelSpec
    hw: Hardware
    slo: Slo
    horizon_s: float = 900.0
    warmup_s: float = 225.0
    max_context_tokens: int = 131_072
    context_rule: str = "truncate"
    ladder: tuple[int, ...] = ()  # sessions to try instead of the search (ascending)
    seeds: tuple[int, ...] = (0, 1, 2)
    tolerance: float = TOLERANCE
    progress: Any = None  # callable(str) or None
    runs: int = 0
    wall_s: float = 0.0
    # For the progress line's ETA: split searches still to come after the current one (set by
    # the caller), and splits left in the current one (a guess until it ends).
    searches_after: int = 0
    splits_left: int = 0
    splits_done: int = 0

    def __post_init__(self) -> None:
        if not self.seeds:
            raise ValueError("Planner.seeds: give at least one seed")
        self.cost = CostModel.build(self.model, self.hw)
        self.mean_prompt = trace.stats(self.recorded[:256], self.model.block_tokens)
        self._runs: dict[tuple[str, int, int, int, int], _Run] = {}
        self._goodput: dict[tuple[str, int, int], Point] = {}
        self._t0 = time.perf_counter()
        self._runs_at_split_start = 0

    @property
    def slo_dict(self) -> dict[str, float]:
        return {"ttft_p90_s": self.slo.ttft_p90_s, "tpot_p90_s": self.slo.tpot_p90_s}

    def effective(self, sessions: int) -> int:
        """The load a run really simulates: slots x agent group (groups above 512 agents)."""
        group = max(1, math.ceil(sessions / MAX_SIMULATED_AGENTS))
        return max(1, sessions // group) * group

    def _sim(self, policy: str, prefill: int, decode: int, sessions: int, seed: int) -> _Run:
        key = (policy, prefill, decode, sessions, seed)
        if key in self._runs:
            return self._runs[key]
        group = max(1, math.ceil(sessions / MAX_SIMULATED_AGENTS))
        slots = max(1, sessions // group)
        trs = trace.replay(self.recorded, max(slots, len(self.recorded)), 0.0, seed)
        trs = trace.join_midway(trs, slots, seed, self.model.block_tokens)
        trs = trace.stagger(trs, slots, self.warmup_s)
        cfg = SimConfig(
            prefill_nodes=prefill,
            decode_nodes=decode,
            hardware=self.hw,
            cost=self.cost,
            block_tokens=self.model.block_tokens,
            horizon_s=self.horizon_s,
            warmup_s=self.warmup_s,
            mean_context_tokens=self.mean_prompt.mean_prompt_tokens,
            agent_group=group,
            max_active_agents=slots,
            max_context_tokens=self.max_context_tokens,
            context_rule=self.context_rule,
            recycle=True,
        )
        r = Simulator(cfg, get_policy(policy), trs).run()
        n = min(len(r.ttft_s), len(r.tpot_s))
        ok = sum(
            1
            for i in range(n)
            if r.ttft_s[i] <= self.slo.ttft_p90_s and r.tpot_s[i] <= self.slo.tpot_p90_s
        )
        out = _Run(
            tokens_per_s=r.steady_tokens_per_s,
            ttft_s=r.ttft_s,
            tpot_s=r.tpot_s,
            attained=ok,
            binding=r.binding,
            utilisation=r.utilisation,
            path_d_fraction=r.path_d_fraction,
            refused=r.refused_context + r.refused_unfittable,
            truncated=r.truncated_context,
            wall_s=r.wall_s,
        )
        self._runs[key] = out
        self.runs += 1
        self.wall_s += r.wall_s
        return out

    def run(
        self,
        policy: str,
        prefill: int,
        decode: int,
        sessions: int,
        seeds: tuple[int, ...] | list[int] = (),
    ) -> Point:
        """`policy` at `prefill`:`decode` and `sessions` over `seeds` (default all of the
        planner's), each simulated once (cached); TTFT/TPOT p90 over the seeds' turns pooled."""
        sessions = self.effective(sessions)
        seeds = list(seeds or self.seeds)
        before = self.runs
        runs = [self._sim(policy, prefill, decode, sessions, s) for s in seeds]
        pt = self._aggregate(policy, prefill, decode, sessions, seeds, runs)
        if self.runs > before:
            self._report(pt)
        return pt

    def _aggregate(
        self, policy: str, p: int, d: int, sessions: int, seeds: list[int], runs: list[_Run]
    ) -> Point:
        ttft = [x for r in runs for x in r.ttft_s]
        tpot = [x for r in runs for x in r.tpot_s]
        t90, p90 = percentile(ttft, 90), percentile(tpot, 90)
        meets = (
            bool(ttft)
            and t90 <= self.slo.ttft_p90_s
            and not math.isnan(p90)
            and p90 <= self.slo.tpot_p90_s
        )
        k = len(runs)
        util = {
            key: round(sum(r.utilisation.get(key, 0.0) for r in runs) / k, 4)
            for key in runs[0].utilisation
        }
        binding = max(util, key=util.__getitem__) if util and max(util.values()) > 0 else ""
        return Point(
            policy=policy,
            prefill=p,
            decode=d,
            sessions=sessions,
            tokens_per_s=sum(r.tokens_per_s for r in runs) / k,
            ttft_p90_s=t90,
            tpot_p90_s=p90,
            slo_attainment=round(sum(r.attained for r in runs) / len(ttft), 4) if ttft else 0.0,
            meets_slo=meets,
            binding=binding,
            utilisation=util,
            path_d_fraction=sum(r.path_d_fraction for r in runs) / k,
            refused=sum(r.refused for r in runs),
            truncated=sum(r.truncated for r in runs),
            wall_s=sum(r.wall_s for r in runs),
            seeds=seeds,
            tokens_per_s_seeds=[r.tokens_per_s for r in runs],
            ttft_p90_seeds=[percentile(r.ttft_s, 90) for r in runs],
        )

    def _report(self, pt: Point) -> None:
        if self.progress is None:
            return
        elapsed = time.perf_counter() - self._t0
        eta = ""
        if self.splits_done and self.runs:
            # Runs left = splits left x runs a split took so far, less this split's runs.
            per_run = elapsed / self.runs
            per_split = self._runs_at_split_start / self.splits_done
            splits = max(1, self.splits_left) + self.searches_after * SPLITS_PER_SEARCH
            left = max(0.0, splits * per_split - (self.runs - self._runs_at_split_start))
            eta = f", ETA ~{left * per_run:.0f} s"
        self.progress(
            f"[plan] run {self.runs} ({elapsed:.0f} s{eta}): {pt.policy} {pt.prefill}P+"
            f"{pt.decode}D sessions={pt.sessions} x{len(pt.seeds)} seeds: "
            f"{pt.tokens_per_s:,.0f} tok/s, TTFT p90 {pt.ttft_p90_s:.2f} s, "
            f"SLO {'ok' if pt.meets_slo else 'missed'}, binding {pt.binding or '-'}"
        )

    def goodput(self, policy: str, prefill: int, decode: int, guess: int = 0) -> Point:
        """The split's goodput over the seeds: each seed's capacity (`capacity`) is searched
        on its own, the next seed's from the previous seed's; the figures are their means,
        with their spread (the capacity's own noise, the SLO verdict near the knee, is in it)."""
        key = (policy, prefill, decode)
        if key in self._goodput:
            return self._goodput[key]
        self._runs_at_split_start = self.runs
        per_seed: list[Point] = []
        step = 1.25 if guess else 1.6
        for seed in self.seeds:
            pt = self.capacity(policy, prefill, decode, seed, guess, step)
            per_seed.append(pt)
            if pt.meets_slo:
                guess, step = pt.sessions, 1.1  # seeds differ by a few percent, not by 2x
        out = combine(per_seed)
        self._goodput[key] = out
        self.splits_done += 1
        self.splits_left = max(0, self.splits_left - 1)
        self._runs_at_split_start = self.runs
        return out

    def capacity(
        self, policy: str, prefill: int, decode: int, seed: int, guess: int = 0, step: float = 1.6
    ) -> Point:
        """One seed's capacity: the highest load meeting the SLO, bracketed from `guess`
        (default 64 sessions a node) by steps of `step` and bisected (geometrically) until the
        lightest load that misses is within `tolerance` of it. With a fixed `ladder`, the
        highest rung meeting it."""
        nodes = prefill + decode
        met: dict[int, Point] = {}
        missed: dict[int, Point] = {}

        def judge(s: int) -> bool:
            s = self.effective(s)
            pt = self.run(policy, prefill, decode, s, (seed,))
            (met if pt.meets_slo else missed)[s] = pt
            return pt.meets_slo

        if self.ladder:
            for s in self.ladder:
                if not judge(s):
                    break
        else:
            self._search(judge, met, missed, guess or 64 * nodes, step, nodes)
        if met:
            out = met[max(met)]
            above = [s for s in missed if s > out.sessions]
            if above:
                first = min(above)
                out.sessions_missed = first
                out.overload_binding = missed[first].binding
            return out
        # Nothing meets the SLO: the lightest load tried.
        out = missed[min(missed)]
        out.overload_binding = out.binding
        return out

    def _search(
        self,
        judge: Any,
        met: dict[int, Point],
        missed: dict[int, Point],
        guess: int,
        step: float,
        nodes: int,
    ) -> None:
        cap = 1024 * nodes  # beyond 1024 sessions a node nothing agentic meets an SLO
        s = self.effective(max(1, guess))
        if judge(s):
            while not missed:
                nxt = self.effective(max(s + 1, math.ceil(s * step)))
                if nxt > cap:
                    return
                prev = met[s]
                if not judge(nxt):
                    break
                if met[nxt].tokens_per_s < prev.tokens_per_s * 1.01:
                    return  # saturated: more sessions only queue, and the SLO still holds
                s = nxt
        else:
            while not met:
                nxt = self.effective(max(1, math.floor(s / step)))
                if nxt >= s:
                    return  # one session misses it: nothing does
                judge(nxt)
                s = nxt
        self._bisect(judge, met, missed)

    def _bisect(self, judge: Any, met: dict[int, Point], missed: dict[int, Point]) -> None:
        while met and missed:
            lo = max(met)
            above = [s for s in missed if s > lo]
            if not above:
                return
            hi = min(above)
            if hi <= lo * (1 + self.tolerance) or hi - lo <= 1:
                return
            mid = self.effective(round(math.sqrt(lo * hi)))
            if not lo < mid < hi:
                mid = self.effective((lo + hi) // 2)
                if not lo < mid < hi:
                    return
            judge(mid)

    def best_split(self, policy: str, nodes: int, start: int = 0) -> tuple[Point, dict[int, Point]]:
        """The split of `nodes` with the highest goodput: from `start` prefill nodes (default a
        quarter), the split the demands measured there predict, then a climb to the
        neighbours of the best until it is a local maximum (goodput is unimodal in P). A
        neighbour whose `capacity_bound` is under the best's interval is not simulated
        (returned with `pruned_bound`)."""
        if nodes < 2:
            raise ValueError("nodes: a P/D cluster needs at least 2 nodes")
        tried: dict[int, Point] = {}
        self.splits_left = SPLITS_PER_SEARCH

        def clamp(p: int) -> int:
            return max(1, min(nodes - 1, p))

        def guess_for(p: int) -> int:
            near = min(tried, key=lambda q: abs(q - p))
            pt = tried[near]
            if not pt.meets_slo or pt.tokens_per_s <= 0:
                return 0
            b0 = capacity_bound(pt, pt.prefill, pt.decode)
            b1 = capacity_bound(pt, p, nodes - p)
            scale = b1 / b0 if math.isfinite(b0) and math.isfinite(b1) and b0 > 0 else 1.0
            return max(1, round(pt.sessions * scale))

        p0 = clamp(start or round(nodes * 0.25))
        tried[p0] = self.goodput(policy, p0, nodes - p0)
        first = tried[p0]
        if first.meets_slo:
            pred = max(range(1, nodes), key=lambda p: capacity_bound(first, p, nodes - p))
            if pred not in tried:
                tried[pred] = self.goodput(policy, pred, nodes - pred, guess_for(pred))
        while True:
            b = max((p for p in tried if not tried[p].pruned_bound), key=lambda p: _rank(tried[p]))
            best = tried[b]
            new = [q for q in (b - 1, b + 1) if 1 <= q < nodes and q not in tried]
            if not new:
                break
            for q in new:
                bound = max(
                    (capacity_bound(pt, q, nodes - q) for pt in tried.values() if pt.meets_slo),
                    default=math.inf,
                )
                if best.meets_slo and bound < best.spread[0]:
                    tried[q] = replace(best, prefill=q, decode=nodes - q, pruned_bound=bound)
                    continue
                self.splits_left = max(self.splits_left, 1)
                tried[q] = self.goodput(policy, q, nodes - q, guess_for(q))
        self.searches_after = max(0, self.searches_after - 1)
        b = max((p for p in tried if not tried[p].pruned_bound), key=lambda p: _rank(tried[p]))
        return tried[b], tried

    def nodes_for(
        self, policy: str, share: float, target_tokens_per_s: float, max_nodes: int
    ) -> Point | None:
        """Fewest nodes (P = share of them) whose goodput reaches the target, or None."""
        lo, hi = 2, max_nodes
        found: Point | None = None
        while lo <= hi:
            n = (lo + hi) // 2
            p = max(1, min(n - 1, round(n * share)))
            pt = self.goodput(policy, p, n - p)
            if pt.meets_slo and pt.tokens_per_s >= target_tokens_per_s:
                found, hi = pt, n - 1
            else:
                lo = n + 1
        return found


def combine(per_seed: list[Point]) -> Point:
    """One point of a split from each seed's capacity point: means (sessions rounded), the
    per-seed values kept; it meets the SLO only if every seed found a load that does."""
    k = len(per_seed)
    first = per_seed[0]
    keys = first.utilisation.keys()
    util = {key: round(sum(p.utilisation.get(key, 0.0) for p in per_seed) / k, 4) for key in keys}
    binding = max(util, key=util.__getitem__) if util and max(util.values()) > 0 else ""
    missed = [p.sessions_missed for p in per_seed if p.sessions_missed]
    over = [p.overload_binding for p in per_seed if p.overload_binding]
    meets = all(p.meets_slo for p in per_seed)

    def mean(xs: list[float]) -> float:
        xs = [x for x in xs if not math.isnan(x)]
        return sum(xs) / len(xs) if xs else math.nan

    return Point(
        policy=first.policy,
        prefill=first.prefill,
        decode=first.decode,
        sessions=round(mean([p.sessions for p in per_seed])),
        tokens_per_s=mean([p.tokens_per_s for p in per_seed]),
        ttft_p90_s=mean([p.ttft_p90_s for p in per_seed]),
        tpot_p90_s=mean([p.tpot_p90_s for p in per_seed]),
        slo_attainment=round(mean([p.slo_attainment for p in per_seed]), 4),
        meets_slo=meets,
        binding=binding,
        utilisation=util,
        path_d_fraction=mean([p.path_d_fraction for p in per_seed]),
        refused=sum(p.refused for p in per_seed),
        truncated=sum(p.truncated for p in per_seed),
        wall_s=sum(p.wall_s for p in per_seed),
        seeds=[s for p in per_seed for s in p.seeds],
        tokens_per_s_seeds=[p.tokens_per_s for p in per_seed],
        ttft_p90_seeds=[p.ttft_p90_s for p in per_seed],
        overload_binding=max(set(over), key=over.count) if over else "",
        sessions_missed=round(mean(missed)) if len(missed) == k else 0,
        sessions_seeds=[p.sessions for p in per_seed],
        resolution_seeds=max((p.resolution for p in per_seed), default=1.0),
    )


def _rank(pt: Point) -> tuple[bool, float, float]:
    return (pt.meets_slo, pt.tokens_per_s if pt.meets_slo else pt.slo_attainment, -pt.prefill)


# -- shell ---------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", required=True, metavar="JSONL", help="dualpath trace file")
    parser.add_argument("--nodes", type=int, default=12, help="node budget to split (default 12)")
    parser.add_argument(
        "--splits", help="evaluate only these P:D splits instead, e.g. 2:4,1:4,1:8 (any sizes)"
    )
    parser.add_argument("--model", default="deepseek-v3.2", help="model preset")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--hbm-gb", type=float, default=80.0, help="HBM per GPU (GB)")
    parser.add_argument(
        "--kv-fraction",
        type=float,
        default=KV_FRACTION,
        help=f"share of a decode node's HBM that holds KV (default {KV_FRACTION})",
    )
    parser.add_argument("--snic-gbps", type=float, default=400.0, help="storage NIC per node")
    parser.add_argument("--cnic-gbps", type=float, default=3200.0, help="compute NICs per node")
    parser.add_argument("--ttft-slo", type=float, default=4.0, help="TTFT p90 SLO (s)")
    parser.add_argument("--tpot-slo", type=float, default=0.1, help="TPOT p90 SLO (s)")
    parser.add_argument("--policies", default=f"{BASELINE},dualpath")
    parser.add_argument(
        "--sessions", help="a fixed load ladder (sessions at once) instead of the search"
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=TOLERANCE,
        help=f"capacity bracketed to this ratio (default {TOLERANCE}: 3%%)",
    )
    parser.add_argument(
        "--seeds", type=int, default=3, help="seeds per load: figures are their mean (default 3)"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="first seed (seeds SEED .. SEED+SEEDS-1; default 0)"
    )
    parser.add_argument("--horizon", type=float, default=900.0, help="simulated s per run")
    parser.add_argument("--warmup", type=float, help="warm-up s excluded (default horizon/4)")
    parser.add_argument("--think-cap", type=float, help="cap the trace's think times (s)")
    add_context_arguments(parser)
    parser.add_argument(
        "--target-tokens-per-s", type=float, help="also find the node count reaching this"
    )
    parser.add_argument("--max-nodes", type=int, default=64, help="bound of that search")
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="plan every node budget x SNIC x decode KV memory of the --sweep-* lists",
    )
    parser.add_argument("--sweep-nodes", default="12,24", help="node budgets of --sweep")
    parser.add_argument(
        "--sweep-snic-gbps", default="200,400,800", help="SNIC Gbit/s per node of --sweep"
    )
    parser.add_argument(
        "--sweep-kv-gb", default="400,800", help="decode KV GB per decode node of --sweep"
    )
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument(
        "--plot", metavar="PNG", help="goodput and TTFT p90 per P, per policy (--sweep: heatmap)"
    )
    parser.add_argument("--emit-spec", metavar="YAML", help="write the recommended cluster spec")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")


def _splits(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        try:
            p, d = (int(x) for x in part.split(":"))
        except ValueError:
            raise ValueError(f"--splits: {part!r} is not P:D (e.g. 2:4)") from None
        if p < 1 or d < 1:
            raise ValueError(f"--splits: {part!r}: P and D must be >= 1")
        out.append((p, d))
    return out


def _numbers(flag: str, text: str) -> list[float]:
    try:
        xs = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag}: {text!r} is not a list of numbers") from None
    if not xs or any(x <= 0 for x in xs):
        raise ValueError(f"{flag}: give positive numbers")
    return xs


def _refuse(msg: str) -> int:
    print(f"dualpath plan: {msg}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    policies = [s.strip() for s in args.policies.split(",") if s.strip()]
    try:
        for pol in policies:
            get_policy(pol)
    except (KeyError, ValueError) as err:
        return _refuse(f"--policies: {err}")
    if not policies:
        return _refuse("--policies: give at least one policy")
    if args.nodes < 2:
        return _refuse("--nodes: a P/D cluster needs at least 2 nodes")
    checks = {
        "--gpus-per-node": args.gpus_per_node >= 1,
        "--hbm-gb": args.hbm_gb > 0,
        "--kv-fraction": 0 < args.kv_fraction <= 1,
        "--snic-gbps": args.snic_gbps > 0,
        "--cnic-gbps": args.cnic_gbps > 0,
        "--ttft-slo": args.ttft_slo > 0,
        "--tpot-slo": args.tpot_slo > 0,
        "--horizon": args.horizon > 0,
        "--warmup": args.warmup is None or 0 <= args.warmup < args.horizon,
        "--think-cap": args.think_cap is None or args.think_cap >= 0,
        "--max-context": args.max_context is None or args.max_context >= 0,
        "--max-nodes": args.max_nodes >= 2,
        "--seeds": 1 <= args.seeds <= 10,
        "--tolerance": 0.001 <= args.tolerance <= 1.0,
    }
    for flag, ok in checks.items():
        if not ok:
            return _refuse(f"{flag}: out of range")
    if args.sweep and (args.splits or args.target_tokens_per_s or args.emit_spec):
        return _refuse(
            "--sweep: plans node budgets; --splits, --target-tokens-per-s and "
            "--emit-spec apply to one plan"
        )
    try:
        model = ModelSpec(preset=args.model)
        ladder = tuple(int(s) for s in args.sessions.split(",")) if args.sessions else ()
        splits = _splits(args.splits) if args.splits else []
        if any(s < 1 for s in ladder):
            raise ValueError("--sessions: give positive session counts")
        grid = (
            (
                [int(n) for n in _numbers("--sweep-nodes", args.sweep_nodes)],
                _numbers("--sweep-snic-gbps", args.sweep_snic_gbps),
                _numbers("--sweep-kv-gb", args.sweep_kv_gb),
            )
            if args.sweep
            else None
        )
        if grid and min(grid[0]) < 2:
            raise ValueError("--sweep-nodes: a P/D cluster needs at least 2 nodes")
        meta, recorded = trace.load_trace(args.trace)
    except (OSError, ValueError) as err:
        return _refuse(str(err))
    if not recorded:
        return _refuse(f"--trace: {args.trace} holds no sessions")
    if args.think_cap is not None:
        recorded = [trace.cap_think(t, args.think_cap) for t in recorded]
    progress = None if args.quiet else _stderr
    seeds = tuple(range(args.seed, args.seed + args.seeds))

    def planner(hw: Hardware) -> Planner:
        return Planner(
            recorded,
            model,
            hw,
            Slo(args.ttft_slo, args.tpot_slo),
            horizon_s=args.horizon,
            warmup_s=args.warmup if args.warmup is not None else args.horizon / 4,
            max_context_tokens=context_limit_of(args, model),
            context_rule=args.context_rule,
            ladder=tuple(sorted(ladder)),
            seeds=seeds,
            tolerance=args.tolerance,
            progress=progress,
        )

    t0 = time.perf_counter()
    if grid is not None:
        from dualpath.sim.sweep import heatmap, sweep, sweep_table

        result = sweep(args, meta, model, policies, grid, planner)
        result["wall_s"] = round(time.perf_counter() - t0, 2)
        result["load_average"] = _loadavg()
        if args.plot:
            heatmap(result, args.plot)
            result["plot"] = args.plot
        print(json.dumps(result, indent=2) if args.json else sweep_table(result))
        return 0
    hbm_node = args.gpus_per_node * args.hbm_gb * 1e9
    hw = hardware(args, args.snic_gbps, int(hbm_node * args.kv_fraction))
    pl = planner(hw)
    best: dict[str, Point] = {}
    per_split: dict[str, list[Point]] = {}
    if splits:
        pl.splits_left = len(splits) * len(policies)
    else:
        pl.searches_after = len(policies) - 1
    for pol in policies:
        if splits:
            per_split[pol] = [pl.goodput(pol, p, d) for p, d in splits]
            best[pol] = max(per_split[pol], key=_rank)
        else:
            best[pol], tried = pl.best_split(pol, args.nodes)
            per_split[pol] = [tried[p] for p in sorted(tried)]
    result = _result(args, meta, model, hw, pl, best, per_split)
    if args.target_tokens_per_s:
        result["target"] = {"tokens_per_s": args.target_tokens_per_s}
        for pol in policies:
            share = best[pol].prefill / args.nodes
            pt = pl.nodes_for(pol, share, args.target_tokens_per_s, args.max_nodes)
            result["target"][pol] = pt.row() if pt else None
    result["wall_s"] = round(time.perf_counter() - t0, 2)
    result["load_average"] = _loadavg()
    result["runs"] = pl.runs
    if args.plot:
        plot(result, args.plot)
        result["plot"] = args.plot
    if args.emit_spec:
        pol = "dualpath" if "dualpath" in best else policies[0]
        with open(args.emit_spec, "w") as f:
            f.write(cluster_spec(args, best[pol]))
        result["spec"] = args.emit_spec
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(table(result))
    return 0


def _loadavg() -> list[float] | None:
    """The machine's 1/5/15-minute load average (timings on a shared machine need it)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _stderr(msg: str) -> None:
    sys.stderr.write(msg + "\n")
    sys.stderr.flush()


def _result(
    args: argparse.Namespace,
    meta: dict[str, Any],
    model: ModelSpec,
    hw: Hardware,
    planner: Planner,
    best: dict[str, Point],
    per_split: dict[str, list[Point]],
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "trace": meta.get("name") or args.trace,
        "sessions_in_trace": len(planner.recorded),
        "model": model.name,
        "nodes": args.nodes if not args.splits else None,
        "hardware": {
            "gpus_per_node": hw.gpus_per_node,
            "hbm_gb_per_gpu": args.hbm_gb,
            "kv_gbytes_per_decode_node": round(hw.decode_kv_capacity_bytes / 1e9, 1),
            "snic_gbps": hw.snic_gbps,
            "cnic_gbps": hw.cnic_gbps,
        },
        "slo": planner.slo_dict,
        "seeds": list(planner.seeds),
        "tolerance": planner.tolerance,
        "horizon_s": planner.horizon_s,
        "warmup_s": planner.warmup_s,
        "context_limit_tokens": planner.max_context_tokens,
        "context_rule": planner.context_rule,
        "context": context_share(planner.recorded, planner.max_context_tokens),
        "think_cap_s": args.think_cap,
        "best": {pol: pt.row() for pol, pt in best.items()},
        "ties": {
            pol: [f"{t.prefill}:{t.decode}" for t in ties(best[pol], pts)]
            for pol, pts in per_split.items()
        },
        "splits": {pol: [pt.row() for pt in pts] for pol, pts in per_split.items()},
    }
    cmp = compare(best)
    if cmp is not None:
        out["dualpath_over_baseline"] = cmp["ratio"]
        out["dualpath_over_baseline_interval"] = cmp["interval"]
        out["dualpath_over_baseline_per_seed"] = cmp["per_seed"]
    return out


def context_share(recorded: list[trace.Trajectory], limit: int) -> dict[str, Any]:
    """How many of the trace's turns (subagents included) exceed the context limit: prompt +
    output over `limit` tokens (0: no limit)."""
    turns = over = 0
    for _, _, t, prompt, _ in trace.iter_turns(recorded):
        turns += 1
        over += bool(limit) and prompt + t.gen_tokens > limit
    return {"turns": turns, "over_limit": over, "share": round(over / max(turns, 1), 4)}


def context_line(result: dict[str, Any]) -> str:
    """The plan's sentence on the turns over the context limit and what it did with them."""
    c, limit = result["context"], result["context_limit_tokens"]
    if not limit:
        return f"context: no limit (--max-context 0): all {c['turns']:,} turns served as recorded"
    rule = result["context_rule"]
    return (
        f"context: {c['over_limit']:,} of {c['turns']:,} turns in the trace "
        f"({100 * c['share']:.1f}%) exceed the {limit:,}-token limit; --context-rule {rule}: "
        f"each is {CONTEXT_RULE_EFFECT[rule]}"
    )


def _tok(r: dict[str, Any]) -> str:
    lo, hi = r["tokens_per_s_interval"]
    return f"{r['tokens_per_s']:,.0f} [{lo:,.0f}-{hi:,.0f}]"


def _ttft(r: dict[str, Any]) -> str:
    per = [x for x in r["ttft_p90_s_seeds"] if x is not None]
    span = f" ({min(per):.2f}-{max(per):.2f})" if len(per) > 1 else ""
    return _s(r["ttft_p90_s"]) + span


def table(result: dict[str, Any]) -> str:
    where = f"{result['nodes']} nodes" if result["nodes"] else "the given splits"
    k = len(result["seeds"])
    lines = [
        f"plan for {result['trace']} on {where} ({result['model']}, "
        f"SLO TTFT p90 <= {result['slo']['ttft_p90_s']} s, TPOT p90 <= "
        f"{result['slo']['tpot_p90_s']} s; {k} seeds {result['seeds'][0]}..{result['seeds'][-1]}: "
        "each seed at its own capacity; mean [95% interval], TTFT p90 mean (per-seed range))",
        f"{'policy':<13} {'P:D':>6} {'sessions':>11} {'tokens/s [interval]':>26} "
        f"{'TTFT p90 (seeds)':>18} {'TPOT p90':>8} {'SLO att':>7} {'path D':>6}  binding "
        "(at the next load: SLO missed)",
    ]
    for pol, rows in result["splits"].items():
        best = result["best"][pol]
        tied = set(result["ties"].get(pol, []))
        for r in rows:
            split = f"{r['prefill']}:{r['decode']}"
            if r.get("pruned_bound"):
                lines.append(
                    f"{pol:<13} {split:>6}  not simulated: bound {r['pruned_bound']:,.0f} "
                    "tokens/s < the best's interval"
                )
                continue
            is_best = (r["prefill"], r["decode"]) == (best["prefill"], best["decode"])
            mark = "*" if is_best else "=" if split in tied else " "
            load = f"{r['sessions']}" + (
                f"-{r['sessions_missed']}" if r.get("sessions_missed") else "+"
            )
            lines.append(
                f"{pol:<13} {split:>5}{mark} {load:>11} {_tok(r):>26} {_ttft(r):>18} "
                f"{_s(r['tpot_p90_s']):>8} {r['slo_attainment']:>7.3f} "
                f"{r['path_d_fraction']:>6.2f}  {r['binding']}"
                + (f" ({r['overload_binding']})" if r["overload_binding"] else "")
                + ("" if r["meets_slo"] else "  SLO missed at every load")
            )
    lines.append(
        "sessions: the highest load meeting the SLO - the lightest that missed it, means over "
        "seeds (+: none missed below the cap); * best, = not told apart from the best "
        "(intervals overlap)"
    )
    lines.append(context_line(result))
    lines.append("best per policy (*):")
    for pol, r in result["best"].items():
        u = r["utilisation"]
        top = ", ".join(f"{k} {v:.2f}" for k, v in sorted(u.items(), key=lambda kv: -kv[1])[:3])
        tied = result["ties"].get(pol) or []
        lines.append(
            f"  {pol}: {r['prefill']}P:{r['decode']}D, {_tok(r)} tokens/s, TTFT p90 "
            f"{_s(r['ttft_p90_s'])} s, binding {r['binding']} ({top}); "
            f"more load runs out of {r['overload_binding'] or '-'}"
            + (f"; cannot be told apart from {', '.join(tied)}" if tied else "")
        )
    if "dualpath_over_baseline" in result:
        lo, hi = result["dualpath_over_baseline_interval"]
        lines.append(
            f"  dualpath / prefill-read at their best: {result['dualpath_over_baseline']}x "
            f"[{lo}-{hi}] (per seed: {result['dualpath_over_baseline_per_seed']})"
        )
    for pol, r in (result.get("target") or {}).items():
        if pol == "tokens_per_s":
            continue
        want = result["target"]["tokens_per_s"]
        lines.append(
            f"  {pol}: {want:,.0f} tokens/s needs "
            + (
                f"{r['prefill']}P+{r['decode']}D ({r['tokens_per_s']:,.0f} tokens/s)"
                if r
                else "more nodes than --max-nodes"
            )
        )
    lines.append(
        f"({result['runs']} simulations, {result['wall_s']} s, load average "
        f"{result.get('load_average')})"
    )
    return "\n".join(lines)


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for pol, rows in result["splits"].items():
        rows = [r for r in rows if not r.get("pruned_bound")]
        xs = [r["prefill"] for r in rows]
        ys = [r["tokens_per_s"] for r in rows]
        err = [
            [y - r["tokens_per_s_interval"][0] for y, r in zip(ys, rows, strict=True)],
            [r["tokens_per_s_interval"][1] - y for y, r in zip(ys, rows, strict=True)],
        ]
        ax1.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=pol)
        ttft = [r["ttft_p90_s"] if r["ttft_p90_s"] is not None else math.nan for r in rows]
        ax2.plot(xs, ttft, marker="o", label=pol)
        b = result["best"][pol]
        ax1.annotate(f"{b['prefill']}:{b['decode']}", (b["prefill"], b["tokens_per_s"]))
    ax2.axhline(result["slo"]["ttft_p90_s"], color="grey", linestyle="--", label="SLO")
    for ax in (ax1, ax2):
        ax.set_xlabel(f"prefill nodes (of {result['nodes'] or 'P + D'})")
        ax.grid(alpha=0.3)
        ax.legend()
    ax1.set_ylabel("steady tokens/s at the highest load meeting the SLO")
    ax2.set_ylabel("TTFT p90 (s)")
    ax1.set_title(f"{result['trace']}: goodput per P:D ({len(result['seeds'])} seeds, 95%)")
    ax2.set_title("TTFT p90 at that load")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cluster_spec(args: argparse.Namespace, best: Point) -> str:
    """The DualPathCluster the plan recommends (edit image, volume and RDMA before applying)."""
    lo, hi = best.spread
    return (
        f"# Recommended by `dualpath plan` for {args.trace} on {args.nodes} nodes: "
        f"{best.prefill}P:{best.decode}D,\n"
        f"# {best.tokens_per_s:,.0f} tokens/s [{lo:,.0f}-{hi:,.0f}] at {best.sessions} sessions, "
        f"TTFT p90 {best.ttft_p90_s:.2f} s, binding {best.binding}.\n"
        "apiVersion: dualpath.io/v1alpha1\n"
        "kind: DualPathCluster\n"
        "metadata:\n"
        "  name: planned\n"
        "spec:\n"
        "  model:\n"
        f"    preset: {args.model}\n"
        "  prefill:\n"
        f"    replicas: {best.prefill}\n"
        f"    gpusPerPod: {args.gpus_per_node}\n"
        "  decode:\n"
        f"    replicas: {best.decode}\n"
        f"    gpusPerPod: {args.gpus_per_node}\n"
        "  storage:\n"
        "    path: /var/lib/dualpath/kv\n"
        f"    snicGbps: {args.snic_gbps:g}\n"
        "  network:\n"
        f"    cnicGbps: {args.cnic_gbps:g}\n"
        "  scheduler:\n"
        f"    policy: {best.policy}\n"
    )
