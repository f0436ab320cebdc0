"""`dualpath bench local --online`: agents arrive as a Poisson process; a rate sweep per policy.

The paper's online figure: the agent arrival rate a cluster sustains under a TTFT SLA. A rate
point is `--point-s` seconds of Poisson arrivals at its rate (the same window for every point and
policy): rate x window agents, agent i running session i mod `--agents` (`--turns` turns each,
exponential think times of mean `--think-s`) under an id of its own. Sessions arrive with their
context stored, as the paper's do (98.7% hits): each session's first `--warmup-turns` turns run
once, cold, on a seeding cluster, and each policy's cluster starts from a copy of that store; a
point agent starts from its session's stored context (`bench.replay(context_of=...)`) with its
own appended tokens, so no agent hits what another wrote; every turn of a point is timed. A
fixed window, not a fixed number of agents: above capacity a point then builds the same backlog
time under either policy (a fixed count arrives 3x faster at dualpath's rates and its three
SNICs drain the backlog 3x faster: an overloaded point would still meet the SLA).

A point's figures: TTFT p50/p90/p99 and TPOT p50 over its turns, tokens/s over its wall time
(first arrival to last answer). A point meets the SLA when its TTFT p90 is within it and no turn
failed; a policy sustains the highest rate that met it. The sweep's resolution is the figure's:
each policy reports its bracket (highest met, lowest missed above it) and `rate_ratio_bounds`
says what the brackets allow for dualpath / prefill-read.

SLA: scaled to this CPU as the SNIC cap is (a ratio kept from a GPU cluster): the paper's TTFT SLA
is a few times the TTFT of an unloaded cluster, so here it is `--sla-factor` (4) x the TTFT p50
of a few sessions run one at a time on the first policy's cluster before its sweep (nothing
else in flight), unless `--sla-s` gives it. Each policy's unloaded TTFT is reported.

`--rates auto` (default) brackets each policy's own knee from a measurement: the calibrated
median turn's hit read time at the SNIC cap (`read_s`) and prefill compute (`prefill_s`) give
the turns/s a policy's readers can serve (`capacity`: prefill-read reads on the P prefill
SNICs, dualpath on all P + D, neither above the prefill nodes' compute); the sweep starts at
START_LOAD of that, steps by `STEP` up after a met point and down after a missed one until it has
a bracket, then halves the bracket (geometric midpoint) until it is within `--resolution` or
`--max-points` points ran. A list of rates sweeps those, the same for every policy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from dualpath import config
from dualpath.local import bench
from dualpath.local.budget import Capacity, capacity
from dualpath.local.interrupt import run_interruptible
from dualpath.trace import Trajectory, generate
from dualpath.units import gbps_to_bytes_per_s

log = logging.getLogger(__name__)

# --agents (the sessions whose contexts are stored, which a point's agents run in turn) and
# --turns when not given in online mode
ONLINE_SIZE = {"agents": 8, "turns": 3}
MAX_POINT_AGENTS = 2000
# --point-s auto: the window that brings this many turns at the baseline's predicted capacity
POINT_TURNS = 40


_point_s = bench.auto_or_number("seconds", positive=True)


START_LOAD = 0.75  # --rates auto: the first point, a fraction of the policy's predicted capacity
STEP = 1.5  # --rates auto: up after a met point, down after a missed one, until a bracket
UNLOADED_SESSIONS = 3  # sessions run one at a time for the unloaded TTFT


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("online mode (--online)")
    g.add_argument("--online", action="store_true", help="Poisson arrivals, a rate sweep")
    g.add_argument(
        "--rates",
        default="auto",
        help="agent arrival rates to sweep, per second (e.g. 0.1,0.2), or 'auto': per policy, "
        "bracket its knee around its capacity predicted from the calibrated read and prefill",
    )
    g.add_argument("--think-s", type=float, default=1.0, help="mean think time between turns")
    g.add_argument(
        "--point-s",
        type=_point_s,
        default="auto",
        help="each rate point's arrival window in s (rate x this many agents arrive), the same "
        f"for every point and policy; 'auto': {POINT_TURNS} turns at the first policy's "
        "predicted capacity",
    )
    g.add_argument("--sla-s", type=float, default=0.0, help="TTFT p90 SLA (0: scaled)")
    g.add_argument("--sla-factor", type=float, default=4.0, help="SLA = this x unloaded TTFT")
    g.add_argument(
        "--max-points", type=int, default=4, help="--rates auto: rate points per policy, at most"
    )
    g.add_argument(
        "--resolution",
        type=float,
        default=1.12,
        help="--rates auto: stop when a bracket's missed / met rate is within this",
    )


@dataclass
class RatePoint:
    rate_per_s: float
    agents: int
    turns: int
    failed: int
    elapsed_s: float
    tokens_per_s: float
    turns_per_s: float  # answered turns over the point's wall time
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    refused: int = 0  # failed turns the cluster refused as overloaded (HTTP 429)
    met_sla: bool | None = None
    load: float | None = None  # the rate over the policy's predicted capacity (agents/s)
    errors: dict[str, int] = field(default_factory=dict)  # failed turns by error (80 chars)


def point(rate: float, agents: int, results: list[bench.TurnResult], elapsed_s: float) -> RatePoint:
    """A sweep point's figures from its turns (pure)."""
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok]
    tpot = [(r.latency_s - r.ttft_s) / (len(r.generated) - 1) for r in ok if len(r.generated) > 1]
    tokens = sum(r.prompt_tokens + len(r.generated) for r in ok)
    return RatePoint(
        rate_per_s=rate,
        agents=agents,
        turns=len(ok),
        failed=len(results) - len(ok),
        elapsed_s=round(elapsed_s, 3),
        tokens_per_s=round(tokens / elapsed_s, 1) if elapsed_s > 0 else 0.0,
        turns_per_s=round(len(ok) / elapsed_s, 3) if elapsed_s > 0 else 0.0,
        ttft_p50_s=round(bench.pct(ttft, 0.5), 4),
        ttft_p90_s=round(bench.pct(ttft, 0.9), 4),
        ttft_p99_s=round(bench.pct(ttft, 0.99), 4),
        tpot_p50_s=round(bench.pct(tpot, 0.5), 4),
        refused=sum(1 for r in results if not r.ok and r.error.startswith("HTTP 429")),
        errors=dict(Counter(r.error[:80] for r in results if not r.ok)),
    )


def meets(p: RatePoint, sla_s: float) -> bool:
    """TTFT p90 within the SLA, no failed turn (a refused one is a miss too)."""
    return bool(p.turns) and p.failed == 0 and p.ttft_p90_s <= sla_s


def sustained_rate(points: list[RatePoint], sla_s: float) -> float:
    """The highest swept rate whose TTFT p90 meets the SLA with no failed turn (0: none)."""
    return max((p.rate_per_s for p in points if meets(p, sla_s)), default=0.0)


def bracket(points: list[RatePoint], sla_s: float) -> tuple[float | None, float | None]:
    """(highest rate met, lowest rate missed above it); None where the sweep has none (pure)."""
    met = max((p.rate_per_s for p in points if meets(p, sla_s)), default=None)
    missed = [p.rate_per_s for p in points if not meets(p, sla_s)]
    above = [r for r in missed if met is None or r > met]
    return met, min(above, default=None)


def ratio_bounds(
    base: tuple[float | None, float | None], other: tuple[float | None, float | None]
) -> tuple[float | None, float | None]:
    """What two brackets allow for other's sustained rate / base's: the true knee lies in
    [met, missed) for each, so the ratio is above other.met / base.missed and below
    other.missed / base.met (None where a bracket is open on that side) (pure)."""
    lo = other[0] / base[1] if other[0] and base[1] else None
    hi = other[1] / base[0] if other[1] and base[0] else None
    return (round(lo, 3) if lo else None, round(hi, 3) if hi else None)


def next_rate(
    tried: list[tuple[float, bool]],
    start: float,
    step: float = STEP,
    resolution: float = 1.12,
    max_points: int = 4,
) -> float | None:
    """The next rate of an auto sweep given the (rate, met) points so far, or None: done (pure).

    Start at `start`; without a bracket yet, `step` x the highest met rate, or the lowest missed
    rate / `step`; with one (highest met, lowest missed above it), its geometric midpoint until
    missed / met <= `resolution`; never more than `max_points` points.
    """
    if not tried:
        return start
    if len(tried) >= max_points:
        return None
    met = max((r for r, ok in tried if ok), default=None)
    missed = min((r for r, ok in tried if not ok and (met is None or r > met)), default=None)
    if missed is None:
        return met * step
    if met is None:
        return missed / step
    if missed / met <= resolution:
        return None
    return math.sqrt(met * missed)


def sessions(args: argparse.Namespace) -> list[Trajectory]:
    """The `--agents` sessions every rate point replays (ids a0, a1, ...; start_s 0)."""
    return generate(replace(bench.trace_spec(args), mean_think_s=args.think_s))


def arrivals(
    base: list[Trajectory], rate: float, k: int, seed: int, point_s: float
) -> list[Trajectory]:
    """Point `k`'s agents: round(rate x point_s) agents (at least 1, at most MAX_POINT_AGENTS)
    arriving as a Poisson process of `rate`, agent i running session i mod len(base) under a
    fresh id (`r{k}-{i}-a{j}`). The gaps are the first of one seeded stream of exponentials,
    normalised to mean 1/rate exactly (the last agent arrives at agents/rate: a point offers its
    nominal rate, not the draw's); every point and policy sees the same stream (pure)."""
    n = min(MAX_POINT_AGENTS, max(1, round(rate * point_s)))
    rng = random.Random(f"{seed}:arrivals")
    gaps = [rng.expovariate(1.0) for _ in range(n)]
    scale = n / (sum(gaps) * rate)
    t, out = 0.0, []
    for i, gap in enumerate(gaps):
        t += gap * scale
        tr = base[i % len(base)]
        out.append(replace(tr, agent_id=f"r{k}-{i}-{tr.agent_id}", start_s=round(t, 6)))
    return out


def _context_of(trs: list[Trajectory]) -> dict[str, str]:
    """Each point agent starts from its session's stored context (the seed agent's first
    tokens): agents of one point that run the same session read the same stored blocks, each
    read on its own (no worker caches block data), and append their own tokens."""
    return {t.agent_id: t.agent_id.rsplit("-", 1)[1] for t in trs}


async def _arrive(
    frontend: str, cfg: config.ClusterConfig, trs: list[Trajectory], args: argparse.Namespace
) -> list[bench.TurnResult]:
    """Each agent starts at its arrival time and runs its session (think times included)."""
    limits = httpx.Limits(max_connections=len(trs) + 4)
    context_of = _context_of(trs)
    async with httpx.AsyncClient(base_url=frontend, limits=limits) as client:

        async def agent(tr: Trajectory) -> list[bench.TurnResult]:
            await asyncio.sleep(tr.start_s)
            return await bench.replay(
                client,
                [tr],
                cfg.spec.model.name,
                cfg.spec.model.vocab_size,
                args.seed,
                think_scale=1.0,
                context_of=context_of,
            )

        return [r for rs in await asyncio.gather(*(agent(t) for t in trs)) for r in rs]


def _unloaded_ttft(
    frontend: str, cfg: config.ClusterConfig, base: list[Trajectory], args: argparse.Namespace
) -> float:
    """TTFT p50 of a few sessions run one at a time (nothing else in flight)."""
    results: list[bench.TurnResult] = []
    for tr in base[:UNLOADED_SESSIONS]:
        one = replace(tr, agent_id=f"u-{tr.agent_id}", start_s=0.0)
        results += run_interruptible(_arrive(frontend, cfg, [one], args))
    failed = [r for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"unloaded turns failed ({len(failed)}): {failed[0].error}")
    return round(bench.pct([r.ttft_s for r in results], 0.5), 4)


def sweep(
    cfg: config.ClusterConfig,
    policy: str,
    base: list[Trajectory],
    args: argparse.Namespace,
    sink,
    seed: Path | None,
    rates: list[float] | None,
    cap: Capacity,
    sla_s: float | None,
) -> tuple[float, float, list[RatePoint]]:
    """One policy's cluster: its unloaded TTFT, the SLA (given, or this policy's unloaded TTFT x
    --sla-factor), then the rate points (`rates`, or auto from START_LOAD x `cap`). Returns
    (unloaded TTFT p50, SLA, points in the order run)."""
    from dualpath.local.cluster import LocalCluster

    pcfg = bench.policy_config(cfg, policy, seed)
    out: list[RatePoint] = []
    with LocalCluster(
        pcfg, Path(args.out) / f"online-{policy}", sink=sink, log_level="WARNING"
    ) as cluster:
        frontend = cluster.endpoints.frontend
        unloaded = _unloaded_ttft(frontend, pcfg, base, args)
        sla = sla_s or round(args.sla_factor * unloaded, 4)
        log.info("online %s: unloaded TTFT p50 %.3fs, SLA %.3fs", policy, unloaded, sla)
        tried: list[tuple[float, bool]] = []
        while True:
            if rates is not None:
                rate = rates[len(out)] if len(out) < len(rates) else None
            else:
                start = START_LOAD * cap.agents_per_s
                rate = next_rate(tried, start, STEP, args.resolution, args.max_points)
            if rate is None:
                break
            rate = round(rate, 4)
            trs = arrivals(base, rate, len(out), args.seed, args.point_s)
            t0 = time.perf_counter()
            results = run_interruptible(_arrive(frontend, pcfg, trs, args))
            p = point(rate, len(trs), results, time.perf_counter() - t0)
            p.met_sla = meets(p, sla)
            p.load = round(rate / cap.agents_per_s, 3)
            tried.append((rate, p.met_sla))
            log.info("online %s rate %.4g/s: %s", policy, rate, p)
            if not args.json:
                print(
                    f"{policy:<13} rate {rate:7.4g}/s ({p.load:.2f}x capacity)  "
                    f"TTFT p50 {p.ttft_p50_s:7.3f}s p90 {p.ttft_p90_s:7.3f}s "
                    f"(SLA {sla:.2f}s {'met' if p.met_sla else 'MISSED'})  "
                    f"TPOT {p.tpot_p50_s:6.3f}s  {p.tokens_per_s:7.1f} tok/s  "
                    f"failed {p.failed} (refused {p.refused})  {p.elapsed_s:6.1f}s",
                    file=sys.stderr,
                )
            out.append(p)
    return unloaded, sla, out


def plot(sweeps: dict[str, list[RatePoint]], sla_s: float, path: str, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for policy, pts in sweeps.items():
        pts = sorted(pts, key=lambda p: p.rate_per_s)
        (line,) = ax.plot(
            [p.rate_per_s for p in pts], [p.ttft_p90_s for p in pts], "o-", label=policy
        )
        met = sustained_rate(pts, sla_s)
        if met:
            ax.axvline(met, color=line.get_color(), linestyle=":", alpha=0.7)
    ax.axhline(sla_s, color="gray", linestyle="--", label=f"SLA {sla_s:.2f} s")
    ax.set_xscale("log")
    ax.set_xlabel("agent arrival rate (agents/s, log)")
    ax.set_ylabel("TTFT p90 (s)")
    ax.set_title(title or "local cluster, online: TTFT p90 vs arrival rate", fontsize=10)
    ax.legend()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _parse_rates(text: str) -> list[float] | None:
    """None for 'auto'; else the sorted rates (ValueError naming the flag)."""
    if text.strip() == "auto":
        return None
    try:
        rates = sorted(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(
            f"--rates {text!r}: want 'auto' or rates per second, e.g. 0.1,0.2"
        ) from None
    if not rates or not rates[0] > 0:
        raise ValueError("--rates needs at least one rate > 0")
    return rates


def run(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    t_start, load_start = time.perf_counter(), os.getloadavg()
    try:
        rates = _parse_rates(args.rates)
        if args.max_points < 2 or not args.resolution > 1:
            raise ValueError("--max-points must be >= 2 and --resolution > 1")
        base = sessions(args)
        # every turn of a point is timed (its first turn hits the stored context): calibrate on all
        cal_args = argparse.Namespace(**{**vars(args), "warmup_turns": 0})
        cfg, calibration = bench.bench_config(cal_args, base)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if calibration is None:  # a fixed cap: still time the median turn's prefill for the capacity
        calibration = bench.calibrate_snic(bench.base_config(args), base, 0, args.read_to_compute)
    read_s = calibration.hit_bytes / gbps_to_bytes_per_s(cfg.spec.storage.snic_gbps)
    turns = sum(len(t.turns) for t in base) / len(base)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    caps = {
        p: capacity(
            p,
            cfg.spec.prefill.replicas,
            cfg.spec.decode.replicas,
            read_s,
            calibration.prefill_s,
            turns,
        )
        for p in policies
    }
    if args.point_s == "auto":  # the same window for every point and policy
        args.point_s = round(POINT_TURNS / caps[policies[0]].turns_per_s, 1)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    sweeps: dict[str, list[RatePoint]] = {}
    unloaded: dict[str, float] = {}
    sla: float | None = args.sla_s or None
    with (Path(args.out) / "online-cluster.log").open("w") as sink:
        # a session arrives with its context stored (the paper's traces hit 98.7%): its first
        # `--warmup-turns` turns run once beforehand, cold, a few sessions at a time (all at once
        # would ask the prefill node for more KV buffer than it has for their cold prefills)
        seed = (
            bench.seed_storage(
                cfg, [base[i : i + 8] for i in range(0, len(base), 8)], args, sink
            ).path
            if args.warmup_turns
            else None
        )
        for policy in policies:
            unloaded[policy], sla, sweeps[policy] = sweep(
                cfg, policy, base, args, sink, seed, rates, caps[policy], sla
            )
    assert sla is not None
    sustained = {p: sustained_rate(pts, sla) for p, pts in sweeps.items()}
    brackets = {p: bracket(pts, sla) for p, pts in sweeps.items()}
    ratio, bounds = None, (None, None)
    if "prefill-read" in sweeps and "dualpath" in sweeps:
        if sustained["prefill-read"]:
            ratio = round(sustained["dualpath"] / sustained["prefill-read"], 3)
        bounds = ratio_bounds(brackets["prefill-read"], brackets["dualpath"])
    doc: dict[str, Any] = {
        "bench": "local-online",
        "rate_ratio": ratio,
        "rate_ratio_bounds": list(bounds),
        "sla_s": sla,
        "sla": "given"
        if args.sla_s
        else f"{args.sla_factor} x unloaded TTFT p50 on {policies[0]} ({unloaded[policies[0]]} s)",
        "sustained_rate_per_s": sustained,
        "bracket": {p: {"met": b[0], "missed": b[1]} for p, b in brackets.items()},
        "unloaded_ttft_p50_s": unloaded,
        "predicted_capacity": {p: asdict(c) for p, c in caps.items()},
        "setup": {
            "prefill": cfg.spec.prefill.replicas,
            "decode": cfg.spec.decode.replicas,
            "snic_gbps": cfg.spec.storage.snic_gbps,
            "snic_calibration": asdict(calibration),
            "model": cfg.spec.model.name,
            "sessions": args.agents,
            "point_s": args.point_s,
            "turns": args.turns,
            "think_s": args.think_s,
            "rates": args.rates,
            "elapsed_s": round(time.perf_counter() - t_start, 1),
            "loadavg": {
                "start": [round(x, 2) for x in load_start],
                "end": [round(x, 2) for x in os.getloadavg()],
            },
        },
        "policies": {p: [asdict(x) for x in pts] for p, pts in sweeps.items()},
    }
    (Path(args.out) / "online.json").write_text(json.dumps(doc, indent=2))
    if args.plot:
        title = "local 1P2D, online: TTFT p90 vs arrival rate"
        if ratio is not None:
            title += f"\nrate ratio at the SLA {ratio} (bounds {bounds[0]}-{bounds[1]})"
        plot(sweeps, sla, args.plot, title)
    print(json.dumps(doc) if args.json else json.dumps(doc, indent=2))
    # a turn the cluster refused as overloaded is a missed point, not an error
    return 0 if all(p.failed == p.refused for pts in sweeps.values() for p in pts) else 1
