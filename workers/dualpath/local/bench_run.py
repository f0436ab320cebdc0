"""The offline replay's run (`dualpath bench local` without `--online`): each policy's fresh
cluster replays the same trace (`run_policy`), every policy in turn within the budget (`run`),
and the result document all of it writes (`result_doc`). `bench.py` keeps the pieces it is made
of (the arguments, the SNIC calibration, the replay, the seed, the configs, the table)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from dualpath import config
from dualpath.local import budget, peers
from dualpath.local.bench import (
    OFFLINE_SIZE,
    STORAGE_BOUND_BUSY,
    VLLM_SECONDS,
    PolicyResult,
    Progress,
    SnicCalibration,
    TurnResult,
    base_config,
    bench_config,
    calibrate_snic,
    measured_compute_scale,
    phase_breakdown,
    phase_verdict,
    plot,
    policy_config,
    ratio_per_cap,
    replay_on,
    scrape_counters,
    seed_storage,
    signal_name,
    storage_only_ratio,
    summarize,
    table,
    trace_spec,
)
from dualpath.local.interrupt import Interrupted
from dualpath.trace import TraceSpec, Trajectory, generate
from dualpath.units import gbps_to_bytes_per_s

READ_BYTES = "dualpath_kv_read_bytes"


def _counters_by_role(workers: dict[str, str]) -> dict[str, dict[str, float]]:
    """The read bytes and the vLLM connector's seconds, summed per role (prefill, decode)."""
    out: dict[str, dict[str, float]] = {}
    for name, health in workers.items():
        role = name.split("-", 1)[0]
        got = scrape_counters(health.rsplit("/", 1)[0] + "/metrics", {READ_BYTES, *VLLM_SECONDS})
        mine = out.setdefault(role, dict.fromkeys(got, 0.0))
        for k, v in got.items():
            mine[k] += v
    for role in ("prefill", "decode"):
        out.setdefault(role, dict.fromkeys((READ_BYTES, *VLLM_SECONDS), 0.0))
    return out


# engine vllm, `--snic-gbps auto`: the probe that measures vLLM's compute per turn on the
# warm-up's cluster (`probe_vllm_compute`): every agent at once, as the phases run them, its
# warm-up turns and this many turns after them, under a salt of their own so none of their
# blocks is the trace's. A turn alone computes several times faster than one among the
# phase's others (the decode instances, the reads, the frontend share the cores), and the
# cap must be set against the compute the phase will see
PROBE_TURNS = 2
PROBE_SALT = "dualpath-bench-probe"


def probe_trajectories(trajectories: list[Trajectory], warmup_turns: int) -> list[Trajectory]:
    """The agents' warm-up turns and the `PROBE_TURNS` after them (the trace's own shapes)."""
    return [
        Trajectory(f"probe-{t.agent_id}", t.turns[: warmup_turns + PROBE_TURNS], t.first_tokens)
        for t in trajectories
        if len(t.turns) > warmup_turns
    ]


def probe_vllm_compute(
    cluster,
    cfg: config.ClusterConfig,
    args: argparse.Namespace,
    trajectories: list[Trajectory],
    label: str,
) -> float | None:
    """The prefill vLLM's compute per turn among the others (its forwards less their waits for
    KV, saves and sends, from the connector's counters over the probe's measured turns) at
    the load now; None when nothing was measured."""
    trs = probe_trajectories(trajectories, args.warmup_turns)
    mark: dict[str, Any] = {}

    def on_warm() -> None:
        mark["before"] = _counters_by_role(cluster.endpoints.workers)["prefill"]

    prog = Progress(sum(len(t.turns) for t in trs), "probe", phase=label)
    results = replay_on(
        cluster.endpoints.frontend,
        cfg,
        trs,
        args,
        prog,
        on_warm=on_warm,
        cache_salt=PROBE_SALT,
    )
    turns = sum(1 for r in results if r.ok and not r.warmup)
    if "before" not in mark or not turns:
        return None
    after = _counters_by_role(cluster.endpoints.workers)["prefill"]
    d = {VLLM_SECONDS[k]: after[k] - mark["before"][k] for k in VLLM_SECONDS}
    compute_s = d["forward_s"] - d["load_wait_s"] - d["save_wait_s"]
    return compute_s / turns if compute_s > 0 else None


class PolicyInterrupted(Interrupted):
    """A stop signal during a policy's run, with the figures of the turns done so far."""

    def __init__(self, signum: int, partial: PolicyResult | None, turns: list[TurnResult]):
        super().__init__(signum)
        self.partial, self.turns = partial, turns


def run_policy(
    cfg: config.ClusterConfig,
    policy: str,
    trajectories: list[Trajectory],
    args: argparse.Namespace,
    sink,
    seed: Path | None = None,
    phase: str = "",
    deadline_s: float | None = None,
    answered: dict[tuple[str, int], list[int]] | None = None,
    calibration: SnicCalibration | None = None,
    turns_s: float = 0.0,
) -> tuple[PolicyResult, list[TurnResult]]:
    """One policy's cluster replays `trajectories`: the figures from its first measured turn
    (after every agent's warm-up) to its last ended one. At `deadline_s` (time.monotonic()) no
    turn starts any more (`PolicyResult.cut`); on SIGINT/SIGTERM raises `PolicyInterrupted`
    with the figures so far. The warm-up turns in `answered` are not sent again.
    `calibration`: how this phase's cap was set (its verdict's compute, engine dualpath).
    `turns_s`: its turns' predicted seconds, which `deadline_s` leaves them at least once the
    cluster is up (a busy machine starts a cluster slower than the plan's start allowed: the
    start must not eat the turns, or a phase ends with none and the policies replay nothing)."""
    from dualpath.local.cluster import LocalCluster

    pcfg = policy_config(cfg, policy, seed)
    run_dir = Path(args.out) / policy
    by_role = {"prefill": pcfg.spec.prefill.replicas, "decode": pcfg.spec.decode.replicas}
    nodes = pcfg.spec.prefill.replicas + pcfg.spec.decode.replicas
    load_start = round(os.getloadavg()[0], 2)
    caps = nodes * gbps_to_bytes_per_s(pcfg.spec.storage.snic_gbps)
    results: list[TurnResult] = []
    answered = answered or {}
    total = sum(
        1 for t in trajectories for i in range(len(t.turns)) if (t.agent_id, i) not in answered
    )
    with LocalCluster(pcfg, run_dir, sink=sink, log_level="WARNING") as cluster:
        if deadline_s is not None and turns_s > 0:
            deadline_s = max(deadline_s, time.monotonic() + turns_s)
        prog = Progress(total, policy, phase=phase, deadline_s=deadline_s)
        mark: dict[str, Any] = {}

        def on_warm() -> None:  # the steady state starts: counters and clock from here
            mark["before"] = _counters_by_role(cluster.endpoints.workers)
            mark["t0"] = time.perf_counter()

        def figures(cut: str) -> PolicyResult | None:
            if "t0" not in mark:
                return None  # still warming up: nothing measured
            ends = [r.end_s for r in results if r.ok and not r.warmup]
            elapsed = (max(ends) if ends else time.perf_counter()) - mark["t0"]
            after = _counters_by_role(cluster.endpoints.workers)
            delta = {
                role: {k: v - mark["before"][role][k] for k, v in after[role].items()}
                for role in after
            }
            read = {role: int(d[READ_BYTES]) for role, d in delta.items()}
            res = summarize(policy, results, elapsed, read, caps)
            res.cut = cut
            res.snic_gbps = pcfg.spec.storage.snic_gbps
            res.calibration = asdict(calibration) if calibration else {}
            res.loadavg = [load_start, round(os.getloadavg()[0], 2)]
            if pcfg.spec.workers.engine == "vllm":
                seconds = {
                    role: {VLLM_SECONDS[k]: d[k] for k in VLLM_SECONDS} for role, d in delta.items()
                }
                res.breakdown = phase_breakdown(
                    seconds,
                    elapsed,
                    read,
                    gbps_to_bytes_per_s(pcfg.spec.storage.snic_gbps),
                    by_role,
                )
            res.verdict = phase_verdict(res, calibration, by_role)
            return res

        try:
            replay_on(
                cluster.endpoints.frontend,
                pcfg,
                trajectories,
                args,
                prog,
                on_warm=on_warm,
                results=results,
                deadline_s=deadline_s,
                answered=answered,
            )
        except Interrupted as stop:
            try:
                partial = figures("interrupted")
            except OSError:  # a worker already gone: no byte counts
                partial = None
            raise PolicyInterrupted(stop.signum, partial, list(results)) from None
        late = deadline_s is not None and time.monotonic() >= deadline_s
        res = figures("deadline" if late and len(results) < total else "")
        if res is None:  # the deadline fell in the warm-up: nothing was measured
            res = summarize(policy, [], 0.0, {"prefill": 0, "decode": 0}, caps)
            res.cut = "deadline"
    return res, results


PHASES = ("calibrate", "warm-up")  # then one phase per policy


def run(args: argparse.Namespace) -> int:
    """The offline replay (`bench_cli.run` picks it or the online sweep, makes the KV scratch
    directory and stops on signals)."""
    for name, value in OFFLINE_SIZE.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request is noise here

    t_start = time.monotonic()
    end_s = None if args.budget_s is None else t_start + args.budget_s
    spec = trace_spec(args)
    trajectories = generate(spec)
    if args.trace:
        from dualpath.trace import load_jsonl, scale_to_context

        trajectories = scale_to_context(
            load_jsonl(args.trace), args.context, args.agents, args.turns
        )
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    peer_list = getattr(args, "peers", None) or []
    phases = [*PHASES, *policies, *(f"peer {p}" for p in peer_list)]

    def phase(name: str) -> str:
        return f"{phases.index(name) + 1}/{len(phases)} {name}"

    trace_turns = sum(len(t.turns) for t in trajectories)
    bound = f"at most about {args.budget_s:.0f} s" if end_s else "unbounded (no --budget-s)"
    print(
        f"bench local: {len(trajectories)} agents, {trace_turns} turns; phases: "
        f"{', '.join(phases)}; {bound}; KV stores in {args.kv_dir} "
        f"({'kept' if args.keep else 'removed at the end; --keep keeps them'})",
        file=sys.stderr,
        flush=True,
    )
    try:
        print(f"[{phase('calibrate')}] timing a turn's prefill here ...", file=sys.stderr)
        cfg, calibration = bench_config(args, trajectories)
        if calibration is None and end_s is not None:  # a fixed cap: time the prefill to plan
            calibration = calibrate_snic(
                base_config(args), trajectories, args.warmup_turns, args.read_to_compute
            )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    Path(args.out).mkdir(parents=True, exist_ok=True)
    log_path = Path(args.log_file or Path(args.out) / "cluster.log")
    out: list[PolicyResult] = []
    answers: dict[str, dict[tuple[str, int], list[int]]] = {}
    cut: dict[str, Any] = {"budget_s": args.budget_s, "trace_turns": trace_turns}
    interrupted: PolicyInterrupted | Interrupted | None = None
    rows: list[peers.PeerRow] = []
    if peer_list and cfg.spec.workers.engine != "vllm":
        print("error: --peers compares vLLM deployments: pass --engine vllm", file=sys.stderr)
        return 2

    def doc_now() -> dict[str, Any]:
        doc = result_doc(args, cfg, calibration, spec, out, answers, cut, t_start, interrupted)
        if peer_list:
            doc["peers"] = [asdict(r) for r in rows]
        return doc

    try:
        with log_path.open("w") as sink:
            seed, answered = None, None
            start_s = budget.DEFAULT_START_S  # a cluster's start, until one is timed
            if args.warmup_turns:
                warm_end = None
                if end_s is not None:  # past half the budget, the policies' turns come first
                    warm_end = t_start + budget.WARMUP_SHARE * args.budget_s
                probe = None
                if cfg.spec.workers.engine == "vllm" and calibration is not None:

                    def probe(cluster):  # noqa: ANN001, ANN202
                        return probe_vllm_compute(
                            cluster, cfg, args, trajectories, phase("warm-up")
                        )

                seed_run = seed_storage(
                    cfg,
                    [trajectories],
                    args,
                    sink,
                    phase("warm-up"),
                    deadline_s=warm_end,
                    probe=probe,
                )
                seed, answered = seed_run.path, seed_run.answers
                if seed_run.probed and args.snic_gbps == "auto":
                    # the cap against vLLM's compute, not the in-process engine's
                    scale = seed_run.probed / calibration.prefill_s
                    calibration = calibration.scaled(scale)
                    cfg = at_cap(cfg, calibration)
                    print(
                        f"[{phase('warm-up')}] vLLM computes a turn in {seed_run.probed:.2f} s "
                        f"among the others ({scale:.2f}x the in-process prefill, load "
                        f"{os.getloadavg()[0]:.1f}): SNIC cap {calibration.snic_gbps:.3f} Gbps",
                        file=sys.stderr,
                        flush=True,
                    )
                left = [t for t in trajectories if t.agent_id not in seed_run.warmed]
                if left:
                    cut["agents_not_warmed"] = [t.agent_id for t in left]
                    trajectories = [t for t in trajectories if t.agent_id in seed_run.warmed]
                if not trajectories:  # nothing to compare: an error, never an empty success
                    print(
                        f"error: no agent's warm-up ended within the warm-up's share of the "
                        f"budget ({budget.WARMUP_SHARE:.0%} of --budget-s {args.budget_s:g}); "
                        "raise --budget-s",
                        file=sys.stderr,
                    )
                    return 1
                start_s = seed_run.start_s
            if end_s is not None and calibration is not None:
                trajectories = fit_budget(
                    args, cfg, calibration, trajectories, policies, start_s, end_s, cut
                )
            for attempt in (1, 2):
                predicted = cut.get("predicted_phase_s", {})
                floor_s = 0.0  # after a cut phase: the next ones get at least half its time
                # engine vllm: vLLM's compute per turn over the calibration's (the probe's, then
                # the phase before's)
                scale = calibration.compute_scale if calibration is not None else 1.0
                for i, policy in enumerate(policies):
                    phase_cfg, phase_cal = cfg, calibration
                    if args.snic_gbps == "auto" and args.recalibrate:
                        phase_cfg, phase_cal = recalibrate(
                            args, cfg, trajectories, scale, phase(policy)
                        )
                    deadline = None
                    t_phase = time.monotonic()
                    if end_s is not None and predicted:
                        rest = {p: predicted[p] for p in policies[i:]}
                        deadline = budget.phase_deadline_s(t_phase, end_s, rest, policy)
                        # never less than its own prediction (a plan over the budget still runs
                        # its smallest replay) nor than the floor a cut left it
                        deadline = max(deadline, t_phase + predicted[policy], t_phase + floor_s)
                    res, turns = run_policy(
                        phase_cfg,
                        policy,
                        trajectories,
                        args,
                        sink,
                        seed,
                        phase(policy),
                        deadline,
                        answered,
                        phase_cal,
                        turns_s=predicted.get(policy, 0.0) - start_s,
                    )
                    out.append(res)
                    if phase_cal is not None and res.breakdown:
                        scale = measured_compute_scale(
                            res.breakdown, res.turns, phase_cal.prefill_s
                        )
                    answers[policy] = {(t.agent, t.turn): t.generated for t in turns if t.ok}
                    if res.cut:  # the next policies replay what this one did, no more
                        cut.setdefault("deadline", {})[policy] = len(turns)
                        trajectories = completed_only(trajectories, turns)
                        # the same turns, in (a fraction of) the time this one had: a fair chance
                        floor_s = budget.CUT_FLOOR_SHARE * (time.monotonic() - t_phase)
                lower = storage_bound_retry(out, calibration, args, end_s is not None)
                if attempt == 2 or lower is None:
                    break
                # a phase was compute-bound: every phase again, once, at one lower cap
                cut["first_attempt"] = first = first_attempt(out)
                calibration = calibration.scaled(calibration.compute_scale * lower)
                cfg = at_cap(cfg, calibration)
                print(
                    f"not storage-bound ({', '.join(first['not_storage_bound'])}): "
                    f"every phase again at a SNIC cap {lower:.2f}x lower, "
                    f"{calibration.snic_gbps:.3f} Gbps",
                    file=sys.stderr,
                    flush=True,
                )
                out.clear()
                answers.clear()
            if peer_list:
                run_peers(args, cfg, trajectories, out, answers, answered or {}, phase, rows)
    except PolicyInterrupted as stop:
        interrupted = stop
        if stop.partial is not None:
            out.append(stop.partial)
            answers[stop.partial.policy] = {(t.agent, t.turn): t.generated for t in stop.turns}
    except Interrupted as stop:
        interrupted = stop
    doc = doc_now()
    (Path(args.out) / "result.json").write_text(json.dumps(doc, indent=2))
    if args.plot and out:
        plot(out, args.plot)
    if args.json:
        print(json.dumps(doc))
    else:  # for a person: the table, and where the details went
        if interrupted is not None:
            print(
                f"interrupted ({signal_name(interrupted.signum)}) after "
                f"{time.monotonic() - t_start:.0f} s: the figures measured so far"
                + ("" if out else " (none: no policy had started its measured turns)")
            )
        if out:
            print(table(out, doc["ratio"]))
        if rows:
            print(peers.peers_table(rows))
        print(
            f"same greedy answers across policies: {doc['same_greedy_answers']} "
            f"({doc['compared_turns']} turns compared; the {doc['warmup_turns']} warm-up turns, "
            f"{args.warmup_turns} an agent, are served once before both policies)"
        )
        if cut.get("first_attempt"):
            fa = cut["first_attempt"]
            print(
                f"run twice: at the first cap ({fa['snic_gbps']:.3f} Gbps) "
                f"{', '.join(fa['not_storage_bound'])} was not storage-bound (ratio {fa['ratio']}); "
                "the figures above are the second attempt's, at a lower cap"
            )
        if cut.get("left_out_turns") or cut.get("deadline") or cut.get("agents_not_warmed"):
            print(f"cut to fit --budget-s {args.budget_s:.0f}: {describe_cut(cut)}")
        print(
            f"JSON: {Path(args.out) / 'result.json'}"
            + (f", plot: {args.plot}" if args.plot and out else "")
            + f"; {time.monotonic() - t_start:.0f} s in all"
        )
    if interrupted is not None:
        interrupted.reported = True
        raise interrupted  # the caller stops with 128 + the signal
    return 0 if all(r.failed == 0 for r in out) else 1


# a run whose phase was not storage-bound runs every phase again, once, at a cap lowered by
# how far that phase was from it (its prefill's compute over its busiest SNICs' busy time)
# times this margin: the compute a phase gets changes with the machine's load
RETRY_MARGIN = 1.5


def storage_bound_retry(
    results: list[PolicyResult],
    calibration: SnicCalibration | None,
    args: argparse.Namespace,
    budgeted: bool,
) -> float | None:
    """How many times lower the next attempt's cap must be for every phase to be
    storage-bound; None when each was, or when the cap is not the bench's to lower (a fixed
    `--snic-gbps`, `--recalibrate`'s cap per phase, a `--budget-s` with no time for it)."""
    if calibration is None or args.snic_gbps != "auto" or args.recalibrate or budgeted:
        return None
    # each SNIC-busy share must grow past the prefill's compute and STORAGE_BOUND_BUSY
    off = [
        max(r.verdict["prefill_compute_busy"], STORAGE_BOUND_BUSY)
        / max(r.verdict["busiest_snic_busy"], 0.01)
        for r in results
        if r.verdict.get("bound") not in (None, "storage")
    ]
    return max(off) * RETRY_MARGIN if off else None


def first_attempt(results: list[PolicyResult]) -> dict[str, Any]:
    """What a run that is done again says of its first attempt (the JSON's `cut`)."""
    return {
        "not_storage_bound": [
            r.policy for r in results if r.verdict.get("bound") not in (None, "storage")
        ],
        "snic_gbps": results[0].snic_gbps if results else None,
        "ratio": ratio_of(results),
        "verdicts": {r.policy: r.verdict for r in results},
    }


def recalibrate(
    args: argparse.Namespace,
    cfg: config.ClusterConfig,
    trajectories: list[Trajectory],
    compute_scale: float,
    label: str,
) -> tuple[config.ClusterConfig, SnicCalibration]:
    """A phase's cap, timed at the load just before it: the machine's load (other work, the
    clusters before) changes the compute a turn gets, and the cap must stay above it."""

    print(
        f"[{label}] re-timing a turn's prefill here (load {os.getloadavg()[0]:.1f}) ...",
        file=sys.stderr,
        flush=True,
    )
    cal = calibrate_snic(
        cfg, trajectories, args.warmup_turns, args.read_to_compute, compute_scale=compute_scale
    )
    return at_cap(cfg, cal), cal


def at_cap(cfg: config.ClusterConfig, cal: SnicCalibration) -> config.ClusterConfig:
    """`cfg` with every node's SNIC cap the calibration's."""
    from dualpath.local.cluster import with_overrides

    return with_overrides(cfg, **{"storage.snicGbps": cal.snic_gbps})


def run_peers(
    args: argparse.Namespace,
    cfg: config.ClusterConfig,
    trajectories: list[Trajectory],
    out: list[PolicyResult],
    answers: dict[str, dict[tuple[str, int], list[int]]],
    warmup_answers: dict[tuple[str, int], list[int]],
    phase,
    rows: list[peers.PeerRow],
) -> None:
    """`--peers`: each peer replays the trajectories the policies replayed, on as many vLLM
    instances; its answers are compared with the dualpath phase's (and its warm-up's).
    Appends to `rows` as each peer ends (an interrupt keeps the rows done)."""
    ref_policy = "dualpath" if "dualpath" in answers else next(iter(answers), None)
    reference = {**warmup_answers, **answers.get(ref_policy, {})} if ref_policy else {}
    by = {r.policy: r for r in out}
    # the storage-reading peers' cap: the dualpath phase's (re-calibrated per phase), else the
    # run's
    snic = by[ref_policy].snic_gbps if ref_policy in by else cfg.spec.storage.snic_gbps
    if ref_policy in by:
        n = len(answers[ref_policy])
        rows.append(peers.dualpath_row(by[ref_policy], (n, n)))
    for name in args.peers:
        rows.append(
            peers.run_peer(
                peers.PEERS[name],
                cfg,
                trajectories,
                args,
                reference,
                phase(f"peer {name}"),
                snic_gbps=snic,
            )
        )


def fit_budget(
    args: argparse.Namespace,
    cfg: config.ClusterConfig,
    calibration: SnicCalibration,
    trajectories: list[Trajectory],
    policies: list[str],
    start_s: float,
    end_s: float,
    cut: dict[str, Any],
) -> list[Trajectory]:
    """The agents' first turns that every policy's predicted phase fits in the time left."""
    read_s = calibration.hit_bytes / gbps_to_bytes_per_s(cfg.spec.storage.snic_gbps)
    per_turn = {
        p: 1
        / budget.capacity(
            p,
            cfg.spec.prefill.replicas,
            cfg.spec.decode.replicas,
            read_s,
            calibration.compute_s,
            1,
        ).turns_per_s
        for p in policies
    }
    plan = budget.plan_turns(
        [len(t.turns) for t in trajectories],
        per_turn,
        start_s,
        end_s - time.monotonic(),
        args.warmup_turns,
    )
    cut.update(
        turns_per_agent=plan.turns,
        replayed_turns=plan.replayed_turns,
        left_out_turns=cut["trace_turns"] - plan.replayed_turns,
        predicted_phase_s={p: round(s, 1) for p, s in plan.phase_s.items()},
        plan_fits=plan.fits,
    )
    print(
        f"plan: {len(trajectories)} agents x {plan.turns} turns ({plan.replayed_turns} of "
        f"{cut['trace_turns']} turns) per policy, about "
        + ", ".join(f"{p} {s:.0f} s" for p, s in plan.phase_s.items())
        + ("" if plan.fits else " (over the budget even so: deadlines will cut)"),
        file=sys.stderr,
        flush=True,
    )
    return [Trajectory(t.agent_id, t.turns[: plan.turns], t.first_tokens) for t in trajectories]


def completed_only(trajectories: list[Trajectory], turns: list[TurnResult]) -> list[Trajectory]:
    """Each agent's turns up to the last one that ended (what a policy cut at its deadline ran)."""
    last: dict[str, int] = {}
    for r in turns:
        last[r.agent] = max(last.get(r.agent, -1), r.turn)
    return [
        Trajectory(t.agent_id, t.turns[: last[t.agent_id] + 1], t.first_tokens)
        for t in trajectories
        if t.agent_id in last
    ]


def describe_cut(cut: dict[str, Any]) -> str:
    parts = []
    if cut.get("left_out_turns"):
        parts.append(
            f"{cut['replayed_turns']} of {cut['trace_turns']} turns replayed "
            f"({cut['turns_per_agent']} per agent)"
        )
    if cut.get("agents_not_warmed"):
        parts.append(f"{len(cut['agents_not_warmed'])} agents not warmed up in time, left out")
    for policy, n in cut.get("deadline", {}).items():
        parts.append(f"{policy} reached its deadline after {n} turns (the rest replay those)")
    return "; ".join(parts)


def ratio_of(results: list[PolicyResult]) -> float | None:
    """dualpath / prefill-read tokens/s (None without both)."""
    by = {r.policy: r for r in results}
    if "dualpath" in by and "prefill-read" in by and by["prefill-read"].tokens_per_s:
        return round(by["dualpath"].tokens_per_s / by["prefill-read"].tokens_per_s, 3)
    return None


def result_doc(
    args: argparse.Namespace,
    cfg: config.ClusterConfig,
    calibration: SnicCalibration | None,
    spec: TraceSpec,
    out: list[PolicyResult],
    answers: dict[str, dict[tuple[str, int], list[int]]],
    cut: dict[str, Any],
    t_start: float,
    interrupted: Interrupted | None,
) -> dict[str, Any]:
    ratio = ratio_of(out)
    keys = set.intersection(*(set(a) for a in answers.values())) if answers else set()
    same = all(len({tuple(a[k]) for a in answers.values()}) == 1 for k in keys)
    return {
        "bench": "local",
        "ratio": ratio,
        # engine vllm: the ratio were storage all that bound both (`phase_breakdown`)
        "storage_only_ratio": storage_only_ratio(out),
        # the phases' caps differ (re-calibrated): the ratio at one cap, where storage-bound
        "ratio_per_snic_cap": ratio_per_cap(out),
        # per phase: storage- or compute-bound against the compute it got
        "bound": {r.policy: r.verdict.get("bound") for r in out},
        "same_greedy_answers": same,
        "compared_turns": len(keys),
        # each agent's first turns, served once before the policies: no second answer to compare
        "warmup_turns": args.warmup_turns * len({agent for agent, _ in keys}),
        "interrupted": None if interrupted is None else signal_name(interrupted.signum),
        "cut": cut,
        "elapsed_s": round(time.monotonic() - t_start, 1),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "setup": {
            "prefill": cfg.spec.prefill.replicas,
            "decode": cfg.spec.decode.replicas,
            "snic_gbps": cfg.spec.storage.snic_gbps,
            "snic_calibration": asdict(calibration) if calibration else None,
            "model": cfg.spec.model.name,
            "trace": asdict(spec)
            if not args.trace
            else {"file": args.trace, "scaled_to": args.context},
        },
        "policies": {r.policy: asdict(r) for r in out},
    }
