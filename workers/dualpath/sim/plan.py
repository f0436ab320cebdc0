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
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any

from dualpath import trace
from dualpath.config import ModelSpec
from dualpath.scheduler.policy import get_policy
from dualpath.sim.engine import SimConfig, SimResult, Simulator, percentile, slo_attainment
from dualpath.sim.model import CostModel, Hardware
from dualpath.sim.options import add_context_arguments, context_limit_of

BASELINE = "prefill-read"
# Fraction of a decode node's HBM left to KV (the rest: weights, activations): 400 of 8 x 80 GB.
KV_FRACTION = 0.625
# The ladder keeps at most this many simulated agents (larger loads group agents: see
# SimConfig.agent_group) so one point costs seconds, not minutes.
MAX_SIMULATED_AGENTS = 512


@dataclass(slots=True, frozen=True)
class Slo:
    ttft_p90_s: float
    tpot_p90_s: float


@dataclass(slots=True)
class Point:
    """One steady-state run: a policy at a split and a load."""

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
    # Binding resource of the lightest load that missed the SLO: what runs out first.
    overload_binding: str = ""

    def row(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "prefill": self.prefill,
            "decode": self.decode,
            "sessions": self.sessions,
            "tokens_per_s": round(self.tokens_per_s, 1),
            "ttft_p90_s": _num(self.ttft_p90_s),
            "tpot_p90_s": _num(self.tpot_p90_s),
            "slo_attainment": self.slo_attainment,
            "meets_slo": self.meets_slo,
            "binding": self.binding,
            "utilisation": self.utilisation,
            "path_d_fraction": round(self.path_d_fraction, 4),
            "refused_turns": self.refused,
            "truncated_turns": self.truncated,
            "overload_binding": self.overload_binding,
            "wall_s": round(self.wall_s, 2),
        }


@dataclass
class Planner:
    """Pure search over the simulator: no I/O but the optional progress callback."""

    recorded: list[trace.Trajectory]
    model: ModelSpec
    hw: Hardware
    slo: Slo
    horizon_s: float = 900.0
    warmup_s: float = 225.0
    max_context_tokens: int = 131_072
    context_rule: str = "truncate"
    ladder: tuple[int, ...] = ()  # sessions; () = auto from the node count
    refine: int = 2  # bisection steps between the last rung meeting the SLO and the first not
    seed: int | None = None
    progress: Any = None  # callable(str) or None
    runs: int = 0
    wall_s: float = 0.0
    points: list[Point] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.cost = CostModel.build(self.model, self.hw)
        self.mean_prompt = trace.stats(self.recorded[:256], self.model.block_tokens)
        self._cache: dict[tuple[str, int, int, int], Point] = {}

    def loads(self, nodes: int) -> tuple[int, ...]:
        if self.ladder:
            return self.ladder
        # Doubling from 16 sessions a node: the first rung is light for any agentic trace.
        return tuple(16 * nodes * 2**k for k in range(6))

    def run(self, policy: str, prefill: int, decode: int, sessions: int) -> Point:
        key = (policy, prefill, decode, sessions)
        if key in self._cache:
            return self._cache[key]
        group = max(1, math.ceil(sessions / MAX_SIMULATED_AGENTS))
        slots = max(1, sessions // group)
        trs = trace.replay(self.recorded, max(slots, len(self.recorded)), 0.0, self.seed)
        trs = trace.join_midway(trs, slots, self.seed, self.model.block_tokens)
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
        pt = self._point(policy, prefill, decode, slots * group, r)
        self._cache[key] = pt
        self.points.append(pt)
        self.runs += 1
        self.wall_s += r.wall_s
        if self.progress is not None:
            self.progress(
                f"[plan] run {self.runs}: {policy} {prefill}P+{decode}D sessions={pt.sessions}: "
                f"{pt.tokens_per_s:,.0f} tok/s, TTFT p90 {pt.ttft_p90_s:.2f} s, "
                f"SLO {'ok' if pt.meets_slo else 'missed'}, binding {pt.binding or '-'}"
            )
        return pt

    def _point(self, policy: str, p: int, d: int, sessions: int, r: SimResult) -> Point:
        ttft = percentile(r.ttft_s, 90)
        tpot = percentile(r.tpot_s, 90)
        meets = (
            bool(r.ttft_s)
            and ttft <= self.slo.ttft_p90_s
            and not math.isnan(tpot)
            and tpot <= self.slo.tpot_p90_s
        )
        return Point(
            policy=policy,
            prefill=p,
            decode=d,
            sessions=sessions,
            tokens_per_s=r.steady_tokens_per_s,
            ttft_p90_s=ttft,
            tpot_p90_s=tpot,
            slo_attainment=slo_attainment(r, self.slo.ttft_p90_s, self.slo.tpot_p90_s) or 0.0,
            meets_slo=meets,
            binding=r.binding,
            utilisation=r.utilisation,
            path_d_fraction=r.path_d_fraction,
            refused=r.refused_context + r.refused_unfittable,
            truncated=r.truncated_context,
            wall_s=r.wall_s,
        )

    def goodput(self, policy: str, prefill: int, decode: int) -> Point:
        """The highest load meeting the SLO: up the ladder until it fails, then `refine`
        bisection steps between the last rung that met it and the first that did not (or the
        lightest rung, if none does)."""
        best: Point | None = None
        first: Point | None = None
        fail: int | None = None
        missed: Point | None = None
        for s in self.loads(prefill + decode):
            pt = self.run(policy, prefill, decode, s)
            first = first or pt
            if not pt.meets_slo:
                fail, missed = s, pt
                break
            if best is not None and pt.tokens_per_s < best.tokens_per_s * 1.01:
                best = pt if pt.tokens_per_s > best.tokens_per_s else best
                break  # saturated: more sessions only queue
            best = pt
        if best is not None and fail is not None:
            lo, hi = best.sessions, fail
            for _ in range(self.refine):
                mid = (lo + hi) // 2
                if mid <= lo:
                    break
                pt = self.run(policy, prefill, decode, mid)
                if pt.meets_slo:
                    lo = mid
                    if pt.tokens_per_s > best.tokens_per_s:
                        best = pt
                else:
                    hi, missed = mid, pt
        out = best or first
        if out is not None and missed is not None:
            out.overload_binding = missed.binding
        return out  # type: ignore[return-value]

    def best_split(self, policy: str, nodes: int) -> tuple[Point, dict[int, Point]]:
        """Coarse-to-fine search of P in 1..nodes-1 for the highest goodput."""
        if nodes < 2:
            raise ValueError("nodes: a P/D cluster needs at least 2 nodes")
        tried: dict[int, Point] = {}

        def at(p: int) -> Point:
            if p not in tried:
                tried[p] = self.goodput(policy, p, nodes - p)
            return tried[p]

        grid = sorted({max(1, min(nodes - 1, round(nodes * f))) for f in (0.1, 0.25, 0.4, 0.6)})
        for p in grid:
            at(p)
        while True:
            b = max(tried, key=lambda p: _rank(tried[p]))
            new = [q for q in (b - 1, b + 1) if 1 <= q < nodes and q not in tried]
            if not new:
                break
            for q in new:
                at(q)
        b = max(tried, key=lambda p: _rank(tried[p]))
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


def _rank(pt: Point) -> tuple[bool, float, float]:
    return (pt.meets_slo, pt.tokens_per_s if pt.meets_slo else pt.slo_attainment, -pt.prefill)


def _num(x: float) -> float | None:
    return None if math.isnan(x) else round(x, 4)


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
    parser.add_argument("--sessions", help="load ladder: sessions at once (default 16/node x2^k)")
    parser.add_argument(
        "--refine", type=int, default=2, help="bisection steps of the load at the SLO (default 2)"
    )
    parser.add_argument("--horizon", type=float, default=900.0, help="simulated s per run")
    parser.add_argument("--warmup", type=float, help="warm-up s excluded (default horizon/4)")
    parser.add_argument("--think-cap", type=float, help="cap the trace's think times (s)")
    add_context_arguments(parser)
    parser.add_argument("--seed", type=int, help="shuffle the sessions' order")
    parser.add_argument(
        "--target-tokens-per-s", type=float, help="also find the node count reaching this"
    )
    parser.add_argument("--max-nodes", type=int, default=64, help="bound of that search")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--plot", metavar="PNG", help="goodput and TTFT p90 per P, per policy")
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
        "--refine": 0 <= args.refine <= 8,
    }
    for flag, ok in checks.items():
        if not ok:
            return _refuse(f"{flag}: out of range")
    try:
        model = ModelSpec(preset=args.model)
        ladder = tuple(int(s) for s in args.sessions.split(",")) if args.sessions else ()
        splits = _splits(args.splits) if args.splits else []
        if any(s < 1 for s in ladder):
            raise ValueError("--sessions: give positive session counts")
        meta, recorded = trace.load_trace(args.trace)
    except (OSError, ValueError) as err:
        return _refuse(str(err))
    if not recorded:
        return _refuse(f"--trace: {args.trace} holds no sessions")
    if args.think_cap is not None:
        recorded = [trace.cap_think(t, args.think_cap) for t in recorded]
    hbm_node = args.gpus_per_node * args.hbm_gb * 1e9
    hw = replace(
        Hardware(),
        gpus_per_node=args.gpus_per_node,
        snic_gbps=args.snic_gbps,
        cnic_gbps=args.cnic_gbps,
        decode_kv_capacity_bytes=int(hbm_node * args.kv_fraction),
    )
    progress = None if args.quiet else _stderr
    planner = Planner(
        recorded,
        model,
        hw,
        Slo(args.ttft_slo, args.tpot_slo),
        horizon_s=args.horizon,
        warmup_s=args.warmup if args.warmup is not None else args.horizon / 4,
        max_context_tokens=context_limit_of(args, model),
        context_rule=args.context_rule,
        ladder=tuple(sorted(ladder)),
        refine=args.refine,
        seed=args.seed,
        progress=progress,
    )
    t0 = time.perf_counter()
    best: dict[str, Point] = {}
    per_split: dict[str, list[Point]] = {}
    for pol in policies:
        if splits:
            per_split[pol] = [planner.goodput(pol, p, d) for p, d in splits]
            best[pol] = max(per_split[pol], key=_rank)
        else:
            best[pol], tried = planner.best_split(pol, args.nodes)
            per_split[pol] = [tried[p] for p in sorted(tried)]
    result = _result(args, meta, model, hw, planner, best, per_split)
    if args.target_tokens_per_s:
        result["target"] = {"tokens_per_s": args.target_tokens_per_s}
        for pol in policies:
            share = best[pol].prefill / args.nodes
            pt = planner.nodes_for(pol, share, args.target_tokens_per_s, args.max_nodes)
            result["target"][pol] = pt.row() if pt else None
    result["wall_s"] = round(time.perf_counter() - t0, 2)
    result["runs"] = planner.runs
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
        "slo": {"ttft_p90_s": planner.slo.ttft_p90_s, "tpot_p90_s": planner.slo.tpot_p90_s},
        "horizon_s": planner.horizon_s,
        "warmup_s": planner.warmup_s,
        "context_limit_tokens": planner.max_context_tokens,
        "context_rule": planner.context_rule,
        "think_cap_s": args.think_cap,
        "best": {pol: pt.row() for pol, pt in best.items()},
        "splits": {pol: [pt.row() for pt in pts] for pol, pts in per_split.items()},
    }
    if "dualpath" in best and BASELINE in best and best[BASELINE].tokens_per_s:
        out["dualpath_over_baseline"] = round(
            best["dualpath"].tokens_per_s / best[BASELINE].tokens_per_s, 3
        )
    return out


def table(result: dict[str, Any]) -> str:
    where = f"{result['nodes']} nodes" if result["nodes"] else "the given splits"
    lines = [
        f"plan for {result['trace']} on {where} ({result['model']}, "
        f"SLO TTFT p90 <= {result['slo']['ttft_p90_s']} s, TPOT p90 <= "
        f"{result['slo']['tpot_p90_s']} s)",
        f"{'policy':<13} {'P:D':>6} {'sessions':>8} {'tokens/s':>10} {'TTFT p90':>9} "
        f"{'TPOT p90':>9} {'SLO att':>8} {'path D':>7}  binding (at the next load: SLO missed)",
    ]
    for pol, rows in result["splits"].items():
        best = result["best"][pol]
        for r in rows:
            mark = "*" if (r["prefill"], r["decode"]) == (best["prefill"], best["decode"]) else " "
            lines.append(
                f"{pol:<13} {r['prefill']:>2}:{r['decode']:<3}{mark} {r['sessions']:>7} "
                f"{r['tokens_per_s']:>10,.0f} {_s(r['ttft_p90_s']):>9} {_s(r['tpot_p90_s']):>9} "
                f"{r['slo_attainment']:>8.3f} {r['path_d_fraction']:>7.2f}  {r['binding']}"
                + (f" ({r['overload_binding']})" if r["overload_binding"] else "")
                + ("" if r["meets_slo"] else "  SLO missed at every load")
            )
    lines.append("best per policy (*):")
    for pol, r in result["best"].items():
        u = r["utilisation"]
        top = ", ".join(f"{k} {v:.2f}" for k, v in sorted(u.items(), key=lambda kv: -kv[1])[:3])
        lines.append(
            f"  {pol}: {r['prefill']}P:{r['decode']}D, {r['tokens_per_s']:,.0f} tokens/s, TTFT p90 "
            f"{_s(r['ttft_p90_s'])} s, binding {r['binding']} ({top}); "
            f"more load runs out of {r['overload_binding'] or '-'}"
        )
    if "dualpath_over_baseline" in result:
        lines.append(
            f"  dualpath / prefill-read at their best: {result['dualpath_over_baseline']}x"
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
    lines.append(f"({result['runs']} simulations, {result['wall_s']} s)")
    return "\n".join(lines)


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for pol, rows in result["splits"].items():
        xs = [r["prefill"] for r in rows]
        ax1.plot(xs, [r["tokens_per_s"] for r in rows], marker="o", label=pol)
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
    ax1.set_title(f"{result['trace']}: goodput per P:D")
    ax2.set_title("TTFT p90 at that load")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cluster_spec(args: argparse.Namespace, best: Point) -> str:
    """The DualPathCluster the plan recommends (edit image, volume and RDMA before applying)."""
    return (
        f"# Recommended by `dualpath plan` for {args.trace} on {args.nodes} nodes: "
        f"{best.prefill}P:{best.decode}D,\n"
        f"# {best.tokens_per_s:,.0f} tokens/s at {best.sessions} sessions, TTFT p90 "
        f"{best.ttft_p90_s:.2f} s, binding {best.binding}.\n"
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
