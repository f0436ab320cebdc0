"""`dualpath sim`: run a preset per policy, print JSON (per-policy results and ratios), plot.

    dualpath sim --preset offline --json
    dualpath sim --preset online --json --plot out/online.png
    dualpath sim --preset scale --json
    dualpath sim --preset bench --json        # 48P+96D, one simulated hour (speed)
    dualpath sim --preset offline-64k --trace out/cc.jsonl --xs 119 --steady --json

Every option is honoured or refused with a message naming it (exit 2): a recorded trace keeps
its think times (`--think` is refused, `--think-cap` caps them), its sessions are cycled to the
x axis (offline: sessions, online: Poisson session arrivals at x/s, scale: per prefill node),
`--seed` shuffles their order and seeds the arrivals.

Every routing decision calls `dualpath.scheduler.policy.get_policy(name).decide` unchanged.
The baseline is `prefill-read`; ratios are dual-path / baseline, next to the paper's.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from dataclasses import replace
from typing import Any

from dualpath import trace
from dualpath.config import ClusterConfig, ModelSpec, load
from dualpath.scheduler.policy import thresholds_from_spec
from dualpath.scheduler.policy.types import Thresholds
from dualpath.sim.engine import SimConfig, SimResult, Simulator, percentile, slo_attainment
from dualpath.sim.model import CostModel, Hardware
from dualpath.sim.options import add_context_arguments, context_limit_of
from dualpath.sim.presets import PRESETS, Preset

log = logging.getLogger(__name__)

BASELINE = "prefill-read"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    names = ", ".join(f"{p.name} ({p.help})" for p in PRESETS.values())
    parser.add_argument(
        "--preset",
        default="offline",
        choices=sorted(PRESETS),
        metavar="NAME",
        help=f"setup to run: {names}",
    )
    parser.add_argument(
        "--policies",
        default="dualpath,prefill-read",
        help="comma-separated policy names (get_policy); baseline prefill-read",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--plot", metavar="PNG", help="draw throughput and TTFT per policy")
    parser.add_argument("--xs", help="override the preset's x axis (agents, rates or P nodes)")
    parser.add_argument(
        "--trace",
        metavar="JSONL",
        help="replay a recorded trace (`dualpath trace import`), cycled to the x axis",
    )
    parser.add_argument(
        "--config",
        metavar="YAML",
        help="take model, pool sizes, snicGbps and cnicGbps from a cluster file",
    )
    parser.add_argument("--prefill", type=int, help="prefill nodes (override)")
    parser.add_argument("--decode", type=int, help="decode nodes (override)")
    parser.add_argument("--model", help="model preset (override), e.g. qwen2.5-32b")
    parser.add_argument("--snic-gbps", type=float, help="storage NIC per node (default 400)")
    parser.add_argument("--cnic-gbps", type=float, help="compute NICs per node (default 3200)")
    parser.add_argument("--horizon", type=float, help="simulated seconds to stop at")
    parser.add_argument("--agent-group", type=int, help="agents per simulated agent")
    parser.add_argument("--think", type=float, help="synthetic trace: mean think time (s)")
    parser.add_argument(
        "--think-cap", type=float, help="cap every think time (recorded tails run to hours)"
    )
    parser.add_argument(
        "--steady",
        action="store_true",
        help="offline: also measure the steady state: x sessions at once (joined at a random "
        "turn, starts spread over the warm-up), a finished session's slot starts the next "
        "(recycled) until the horizon (default 1800 s), warm-up excluded",
    )
    parser.add_argument("--warmup", type=float, help="seconds excluded from steady-state stats")
    add_context_arguments(parser)
    parser.add_argument(
        "--active-per-prefill",
        type=int,
        help="offline: agents running at once per prefill node (0 = all)",
    )
    parser.add_argument("--ttft-sla", type=float, help="online TTFT SLA in s (default 4)")
    parser.add_argument("--tpot-sla", type=float, help="TPOT SLA in s (SLO attainment)")
    parser.add_argument(
        "--sla-percentile",
        type=float,
        help="TTFT percentile that must meet the SLA (default p90)",
    )
    parser.add_argument(
        "--seed", type=int, help="synthetic: trace seed (default 0); recorded: shuffle, arrivals"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")


def _policy(name: str) -> Any:
    # The scheduler's policy module, unchanged: the simulator never decides itself.
    from dualpath.scheduler.policy import get_policy

    return get_policy(name)


class Refused(ValueError):
    """A command-line option that this run cannot honour; the message names it."""


def _stats(
    r: SimResult,
    online: bool,
    sla: tuple[float, float | None] | None = None,
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "tokens_per_s": round(r.steady_tokens_per_s if online else r.tokens_per_s, 2),
        "turns": r.turns_done,
        "agents_done": r.agents_done,
        "agents": r.agents,
        "sim_s": round(r.sim_s, 3),
        "wall_s": round(r.wall_s, 3),
        "events": r.events,
        "decisions": r.decisions,
        "waits": r.waits,
        "read_gbytes_per_s": round(r.read_bytes_per_s / 1e9, 3),
        "path_d_fraction": round(r.path_d_fraction, 4),
        "prefill_busy": round(r.prefill_busy, 4),
        "cnic_kv_gbytes": round(r.cnic_kv_bytes / 1e9, 3),
        "write_gbytes": round(r.write_bytes / 1e9, 3),
        "utilisation": r.utilisation,
        "binding": r.binding,
        "refused_context": r.refused_context,
        "truncated_context": r.truncated_context,
        "truncated_tokens": r.truncated_tokens,
        "refused_unfittable": r.refused_unfittable,
        "waiting_at_end": r.waiting_at_end,
    }
    if not online:
        out["jct_s"] = None if math.isnan(r.jct_s) else round(r.jct_s, 3)
        out["complete"] = not math.isnan(r.jct_s)
    else:
        out["sessions_started"] = r.sessions_started
    if sla is not None:
        out["slo_attainment"] = slo_attainment(r, sla[0], sla[1])
    for q in (50, 90, 99):
        out[f"ttft_p{q}_s"] = _num(percentile(r.ttft_s, q))
        out[f"tpot_p{q}_s"] = _num(percentile(r.tpot_s, q))
    return out


def _num(x: float) -> float | None:
    return None if math.isnan(x) else round(x, 4)


class _Setup:
    """A preset with the command line's overrides applied."""

    def __init__(self, args: argparse.Namespace) -> None:
        p: Preset = PRESETS[args.preset]
        _check_options(args, p)
        model_name = args.model or p.model
        prefill, decode = p.prefill_nodes, p.decode_nodes
        hw = Hardware()
        if args.config:
            cfg: ClusterConfig = load(args.config)
            spec = cfg.spec
            model = spec.model
            prefill, decode = spec.prefill.replicas, spec.decode.replicas
            if spec.storage.snic_gbps:
                hw = replace(hw, snic_gbps=spec.storage.snic_gbps)
            if spec.network.cnic_gbps:
                hw = replace(hw, cnic_gbps=spec.network.cnic_gbps)
            th = thresholds_from_spec(spec.scheduler)
        else:
            model = ModelSpec(preset=model_name)
            th = Thresholds()
        if args.model and args.config:
            model = ModelSpec(preset=args.model)
        if args.snic_gbps:
            hw = replace(hw, snic_gbps=args.snic_gbps)
        if args.cnic_gbps:
            hw = replace(hw, cnic_gbps=args.cnic_gbps)
        self.preset = p
        self.model = model
        self.hw = hw
        self.cost = CostModel.build(model, hw)
        self.thresholds = th
        self.prefill = args.prefill or prefill
        self.decode = args.decode or decode
        self.xs = _xs(args.xs) if args.xs else list(p.xs)
        self.horizon = args.horizon if args.horizon else p.horizon_s
        self.group = args.agent_group or p.agent_group
        self.think = p.mean_think_s if args.think is None else args.think
        self.think_cap = args.think_cap
        self.steady = args.steady
        self.steady_horizon = args.horizon or STEADY_HORIZON_S
        self.warmup = args.warmup if args.warmup is not None else None
        self.tpot_sla = args.tpot_sla
        self.max_context = context_limit_of(args, model)
        self.context_rule = args.context_rule
        self.active_per_prefill = (
            p.active_per_prefill if args.active_per_prefill is None else args.active_per_prefill
        )
        self.sla = args.ttft_sla or p.ttft_sla_s
        self.sla_q = args.sla_percentile if args.sla_percentile is not None else 90.0
        self.seed = args.seed
        self.recorded: list[trace.Trajectory] | None = None
        self.trace_name = p.trace
        if args.trace:
            try:
                meta, self.recorded = trace.load_trace(args.trace)
            except (OSError, ValueError) as err:
                raise Refused(f"--trace: {err}") from None
            if not self.recorded:
                raise Refused(f"--trace: {args.trace} holds no sessions")
            self.trace_name = str(meta.get("name") or args.trace)
        self.trace_file = args.trace
        self.progress = not args.quiet

    def trajectories(self, agents: int, rate: float = 0.0) -> list[trace.Trajectory]:
        if self.recorded is not None:
            trs = trace.replay(self.recorded, max(1, agents), rate, self.seed)
        else:
            spec = trace.preset_spec(
                self.preset.trace,
                agents=max(1, agents),
                mean_think_s=self.think,
                seed=self.seed or 0,
            )
            trs = trace.generate(spec, arrival_rate_per_s=rate)
        if self.think_cap is not None:
            trs = [trace.cap_think(t, self.think_cap) for t in trs]
        return trs

    def config(
        self,
        prefill: int,
        decode: int,
        horizon: float,
        warmup: float,
        group: int,
        trs: list[trace.Trajectory],
        active: int | None = None,
        recycle: bool = False,
    ) -> SimConfig:
        st = trace.stats(trs[:256], self.model.block_tokens)
        if active is None:
            active = (
                max(1, self.active_per_prefill * prefill // group) if self.active_per_prefill else 0
            )
        return SimConfig(
            prefill_nodes=prefill,
            decode_nodes=decode,
            hardware=self.hw,
            cost=self.cost,
            block_tokens=self.model.block_tokens,
            thresholds=self.thresholds,
            horizon_s=horizon,
            warmup_s=warmup,
            mean_context_tokens=st.mean_prompt_tokens,
            progress=self.progress,
            agent_group=group,
            max_active_agents=active,
            max_context_tokens=self.max_context,
            context_rule=self.context_rule,
            recycle=recycle,
        )


STEADY_HORIZON_S = 1800.0


def _xs(text: str) -> list[float]:
    try:
        xs = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise Refused(f"--xs: {text!r} is not a comma-separated list of numbers") from None
    if not xs or any(x <= 0 for x in xs):
        raise Refused(f"--xs: {text!r}: give positive numbers")
    return xs


def _check_options(args: argparse.Namespace, p: Preset) -> None:
    """Refuse the options this preset's mode cannot honour (instead of ignoring them)."""
    if args.trace and args.think is not None:
        raise Refused(
            "--think: sets the synthetic trace's mean think time; a recorded trace (--trace) "
            "keeps its own: use --think-cap S to cap them"
        )
    if args.steady and p.mode != "offline":
        raise Refused(f"--steady: the {p.mode} preset already measures the steady state")
    if args.sla_percentile is not None and p.mode != "online":
        raise Refused("--sla-percentile: only the online preset searches a rate under the SLA")
    offline_only = p.mode == "offline" and not args.steady
    for flag, value in (
        ("--warmup", args.warmup),
        ("--ttft-sla", args.ttft_sla),
        ("--tpot-sla", args.tpot_sla),
    ):
        if value is not None and offline_only:
            raise Refused(f"{flag}: offline completion has no warm-up or SLA; add --steady")
    for flag, value in (
        ("--horizon", args.horizon),
        ("--think-cap", args.think_cap),
        ("--warmup", args.warmup),
        ("--ttft-sla", args.ttft_sla),
        ("--tpot-sla", args.tpot_sla),
    ):
        if value is not None and value < 0:
            raise Refused(f"{flag}: must be >= 0 (got {value})")
    for flag, value in (
        ("--agent-group", args.agent_group),
        ("--prefill", args.prefill),
        ("--decode", args.decode),
    ):
        if value is not None and value < 1:
            raise Refused(f"{flag}: must be >= 1 (got {value})")
    if args.max_context is not None and args.max_context < 0:
        raise Refused(f"--max-context: must be >= 0 (got {args.max_context})")
    if p.mode == "scale" and (args.prefill or args.decode):
        raise Refused("--prefill/--decode: the scale preset sets them from --xs (P, 2P)")


def _say(setup: _Setup, msg: str) -> None:
    if setup.progress:
        sys.stderr.write(f"[sim] {msg}\n")
        sys.stderr.flush()


def _run_one(
    setup: _Setup, policy: str, cfg: SimConfig, trs: list[trace.Trajectory], label: str
) -> SimResult:
    r = Simulator(cfg, _policy(policy), trs).run()
    _say(
        setup,
        f"{label} {policy}: {r.turns_done} turns, sim {r.sim_s:.1f} s, "
        f"wall {r.wall_s:.2f} s, {r.tokens_per_s:.0f} tok/s",
    )
    return r


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b:
        return None
    return round(a / b, 3)


def run_preset(setup: _Setup, policies: list[str]) -> dict[str, Any]:
    p = setup.preset
    mode = p.mode
    points: list[dict[str, Any]] = []
    wall0 = time.perf_counter()
    sim_total = 0.0
    for x in setup.xs:
        per: dict[str, Any] = {}
        steady_cfg: SimConfig | None = None
        steady_trs: list[trace.Trajectory] = []
        if mode == "offline":
            agents = int(x)
            group = setup.group
            trs = setup.trajectories(max(1, agents // group))
            cfg = setup.config(setup.prefill, setup.decode, setup.horizon, 0.0, group, trs)
            label = f"{p.name} {setup.prefill}P+{setup.decode}D agents={agents}"
            if setup.steady:
                slots = max(1, agents // group)
                pool = len(setup.recorded) if setup.recorded is not None else slots
                h = setup.steady_horizon
                w = setup.warmup if setup.warmup is not None else h / 4
                steady_trs = setup.trajectories(max(slots, pool))
                steady_trs = trace.join_midway(
                    steady_trs, slots, setup.seed, setup.model.block_tokens
                )
                steady_trs = trace.stagger(steady_trs, slots, w)
                steady_cfg = setup.config(
                    setup.prefill, setup.decode, h, w, group, steady_trs, slots, recycle=True
                )
        elif mode == "online":
            group = setup.group
            n = int(math.ceil(x * setup.horizon)) if math.isfinite(setup.horizon) else 1000
            trs = setup.trajectories(max(1, n // group), rate=x / group)
            warm = setup.warmup if setup.warmup is not None else p.warmup_s
            cfg = setup.config(setup.prefill, setup.decode, setup.horizon, warm, group, trs)
            label = f"{p.name} {setup.prefill}P+{setup.decode}D rate={x}/s"
        else:  # scale: x prefill nodes, 2x decode nodes, agents proportional
            pn = int(x)
            group = setup.group
            agents = pn * p.agents_per_prefill
            trs = setup.trajectories(max(1, agents // group))
            warm = setup.warmup if setup.warmup is not None else p.warmup_s
            cfg = setup.config(pn, 2 * pn, setup.horizon, warm, group, trs)
            label = f"{p.name} {pn}P+{2 * pn}D agents={agents}"
        sla = (setup.sla, setup.tpot_sla) if mode != "offline" or setup.steady else None
        for pol in policies:
            r = _run_one(setup, pol, cfg, trs, label)
            sim_total += r.sim_s
            per[pol] = _stats(r, online=mode != "offline", sla=None if mode == "offline" else sla)
            if mode == "offline" and not per[pol]["complete"]:
                _say(
                    setup,
                    f"WARNING {label} {pol}: stopped at the horizon with "
                    f"{r.agents - r.agents_done} of {r.agents} agents unfinished",
                )
            if steady_cfg is not None:
                rs = _run_one(setup, pol, steady_cfg, steady_trs, f"{label} steady")
                sim_total += rs.sim_s
                per[pol]["steady"] = _stats(rs, online=True, sla=sla)
        points.append(
            {
                "x": x,
                "prefill_nodes": cfg.prefill_nodes,
                "decode_nodes": cfg.decode_nodes,
                "agent_group": cfg.agent_group,
                "policies": per,
            }
        )
    out: dict[str, Any] = {
        "preset": p.name,
        "mode": mode,
        "model": setup.model.name,
        "kv_bytes_per_token": setup.model.kv_bytes_per_token,
        "trace": setup.trace_name,
        "trace_file": setup.trace_file,
        "seed": setup.seed,
        "think_cap_s": setup.think_cap,
        "context_limit_tokens": setup.max_context,
        "context_rule": setup.context_rule,
        "x": {"offline": "agents", "online": "agent_arrivals_per_s", "scale": "prefill_nodes"}[
            mode
        ],
        "hardware": {
            "snic_gbps": setup.hw.snic_gbps,
            "cnic_gbps": setup.hw.cnic_gbps,
            "cnic_kv_share": setup.hw.cnic_kv_share,
            "gpus_per_node": setup.hw.gpus_per_node,
        },
        "baseline": BASELINE,
        "points": points,
    }
    if setup.steady:
        h = setup.steady_horizon
        out["steady"] = {
            "horizon_s": h,
            "warmup_s": setup.warmup if setup.warmup is not None else h / 4,
            "x": "sessions running at once (a finished one's slot starts the next)",
            "ttft_sla_s": setup.sla,
            "tpot_sla_s": setup.tpot_sla,
        }
    out.update(_summary(setup, policies, points))
    out["paper"] = p.paper
    out["wall_s"] = round(time.perf_counter() - wall0, 3)
    out["sim_s"] = round(sim_total, 3)
    return out


def _summary(setup: _Setup, policies: list[str], points: list[dict[str, Any]]) -> dict[str, Any]:
    mode = setup.preset.mode
    ratios: dict[str, Any] = {}
    if "dualpath" in policies and BASELINE in policies:
        per_point = [
            _ratio(
                pt["policies"]["dualpath"]["tokens_per_s"], pt["policies"][BASELINE]["tokens_per_s"]
            )
            for pt in points
        ]
        ratios["throughput_ratio_per_point"] = per_point
        key = {
            "offline": "offline_throughput_ratio",
            "online": "online_throughput_ratio",
            "scale": "throughput_ratio",
        }[mode]
        # The largest load point: where the cluster is saturated, as in the paper's headline.
        ratios[key] = per_point[-1]
        if mode == "offline" and "steady" in points[0]["policies"]["dualpath"]:
            ratios["steady_throughput_ratio_per_point"] = [
                _ratio(
                    pt["policies"]["dualpath"]["steady"]["tokens_per_s"],
                    pt["policies"][BASELINE]["steady"]["tokens_per_s"],
                )
                for pt in points
            ]
            ratios["steady_throughput_ratio"] = ratios["steady_throughput_ratio_per_point"][-1]
        if mode == "offline":
            ratios["jct_ratio_baseline_over_dualpath"] = [
                _ratio(pt["policies"][BASELINE]["jct_s"], pt["policies"]["dualpath"]["jct_s"])
                for pt in points
            ]
    out: dict[str, Any] = {"ratios": ratios}
    if mode == "online":
        q = setup.sla_q
        best: dict[str, float | None] = {}
        for pol in policies:
            ok = [
                pt["x"]
                for pt in points
                if (v := pt["policies"][pol].get(f"ttft_p{int(q)}_s")) is not None
                and v <= setup.sla
            ]
            best[pol] = max(ok) if ok else None
        out["ttft_sla_s"] = setup.sla
        out["sla_percentile"] = q
        out["max_arrival_rate_meeting_sla"] = best
        if "dualpath" in best and BASELINE in best:
            ratios["max_arrival_rate_ratio"] = _ratio(best["dualpath"], best[BASELINE])
    if mode == "scale":
        lin: dict[str, Any] = {}
        for pol in policies:
            base = points[0]["policies"][pol]["tokens_per_s"] / points[0]["prefill_nodes"]
            eff = [
                round(pt["policies"][pol]["tokens_per_s"] / pt["prefill_nodes"] / base, 4)
                if base
                else None
                for pt in points
            ]
            lin[pol] = {
                "efficiency_vs_smallest": eff,
                "within_10pct_of_linear": all(e is not None and abs(e - 1) <= 0.1 for e in eff),
            }
        out["scaling"] = lin
    return out


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    xs = [pt["x"] for pt in result["points"]]
    for pol in result["points"][0]["policies"]:
        tps = [pt["policies"][pol]["tokens_per_s"] for pt in result["points"]]
        ttft = [pt["policies"][pol]["ttft_p90_s"] for pt in result["points"]]
        ax1.plot(xs, tps, marker="o", label=pol)
        ax2.plot(xs, [t if t is not None else float("nan") for t in ttft], marker="o", label=pol)
    ax1.set_xlabel(result["x"])
    ax1.set_ylabel("generated tokens/s")
    ax2.set_xlabel(result["x"])
    ax2.set_ylabel("TTFT p90 (s)")
    if result["mode"] == "online":
        ax2.axhline(result["ttft_sla_s"], color="grey", linestyle="--", label="SLA")
    ax1.set_title(f"{result['preset']}: throughput")
    ax2.set_title(f"{result['preset']}: TTFT")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    policies = [s.strip() for s in args.policies.split(",") if s.strip()]
    if not policies:
        print(
            "--policies: give at least one policy name, e.g. dualpath,prefill-read", file=sys.stderr
        )
        return 2
    try:
        for pol in policies:
            _policy(pol)
    except (KeyError, ValueError) as err:
        print(f"--policies: {err}", file=sys.stderr)
        return 2
    try:
        setup = _Setup(args)
    except Refused as err:
        print(f"dualpath sim: {err}", file=sys.stderr)
        return 2
    result = run_preset(setup, policies)
    if args.plot:
        plot(result, args.plot)
        result["plot"] = args.plot
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        r = result["ratios"]
        print(
            f"{result['preset']} ({result['mode']}): ratios {json.dumps(r)}; "
            f"paper {json.dumps(result['paper'])}; wall {result['wall_s']} s, "
            f"simulated {result['sim_s']} s"
        )
    return 0
