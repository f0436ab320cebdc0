"""`dualpath bench local`: replay one agentic trace on a local cluster under each policy.

For each policy a fresh cluster (empty store) serves the same trace: concurrency = agents,
each agent's turns sequential in its session (the client sends the full token history, so a
turn's prefix is the previous turns' blocks). Printed per policy: tokens/s, job completion
time, TTFT p50/p99, bytes read per path (prefill-node vs decode-node SNICs, from the workers'
`dualpath_kv_read_bytes_total`), pooled SNIC utilisation = bytes read by all SNICs /
(sum of SNIC caps x elapsed); and `ratio` = dualpath / prefill-read throughput.

`--budget-s S` bounds the run's wall time (`dualpath demo` sets it): the replayed turns are cut
to what the calibrated predictions fit in it, each policy's phase has a deadline, and the JSON's
`cut` says what was left out (`local/budget.py`). The KV stores are scratch data in a temporary
directory (`--kv-dir`), removed at the end unless `--keep`. SIGINT or SIGTERM stops every
cluster process and prints the figures measured so far (`local/interrupt.py`).

This module holds the pieces (the arguments, the SNIC calibration, the replay and its figures,
the seeded store, the configs, the table and plot) that the run (`bench_run.py`: each policy in
turn, the budget's cuts, the result document) and the online sweep (`online.py`) share.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import shutil
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from dualpath import config
from dualpath.local.interrupt import run_interruptible
from dualpath.local.openai_client import stream_completion
from dualpath.trace import TraceSpec, Trajectory

log = logging.getLogger(__name__)

POLICIES = ("prefill-read", "dualpath")
# The balance the emulated SNIC keeps: reading a turn's hit KV takes this many times its prefill
# compute, as with hundreds of GB of KV per second of GPU prefill behind a 400 Gbps SNIC. A fixed
# cap in Gbps would not: the CPU model's compute speed differs from one machine to the next.
READ_TO_COMPUTE = 4.0
# engine vllm: its compute is probed among a phase's others (`bench_run.probe_vllm_compute`),
# but a vLLM turn also spends time outside its prefill's forwards (the hop to the decode, the
# scheduler's round trips, the steps that poll parked requests) while its agent holds its next
# read back: at 4 the dualpath phase's busiest SNICs were busy 0.72 of it (ratio 2.29), at 8
# 0.98 (2.81), both phases storage-bound (docs/vllm.md "Measured")
VLLM_READ_TO_COMPUTE = 8.0


def default_read_to_compute(args: argparse.Namespace) -> float:
    """`--read-to-compute` when not given: the serving engine's (`--engine`, else the file's)."""
    engine = getattr(args, "engine", None) or config.load_or_default(args.file).spec.workers.engine
    return VLLM_READ_TO_COMPUTE if engine == "vllm" else READ_TO_COMPUTE


# The calibration's prefills: up to `samples`, at least MIN_SAMPLES, no new one past
# CALIBRATE_S seconds of them (on a machine at load 13 one took 1.4 s, so 7 took 10 s).
MIN_SAMPLES = 3
CALIBRATE_S = 4.0


def auto_or_number(what: str, positive: bool = False) -> Callable[[str], float | str]:
    """An argparse type: 'auto', or a number >= 0 (> 0 when `positive`) of `what` (e.g. Gbps)."""

    def parse(value: str) -> float | str:
        if value == "auto":
            return value
        try:
            x = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected 'auto' or {what}, got {value!r}") from None
        if not (x > 0 if positive else x >= 0):
            bound = "> 0" if positive else ">= 0"
            raise argparse.ArgumentTypeError(f"{what} must be {bound}, got {value!r}")
        return x

    return parse


_snic_arg = auto_or_number("Gbps")


@dataclass
class SnicCalibration:
    """How `--snic-gbps auto` chose the cap: the median measured turn and this CPU's time for it."""

    hit_tokens: int
    new_tokens: int
    hit_bytes: int
    prefill_s: float  # median of `samples` in-process prefills of that turn on this machine
    samples: int
    read_to_compute: float
    snic_gbps: float
    # the serving engine's measured compute per turn over this in-process prefill (engine
    # vllm: from the warm-up's probe, or the phase before; 1: the torch engine itself)
    compute_scale: float = 1.0

    @property
    def compute_s(self) -> float:
        """The serving engine's compute of the median turn, the cap is set against."""
        return self.prefill_s * self.compute_scale

    def scaled(self, compute_scale: float) -> SnicCalibration:
        """The same turn against a serving engine `compute_scale` times slower: its cap."""
        return replace(
            self,
            compute_scale=compute_scale,
            snic_gbps=snic_gbps_for(
                self.hit_bytes, self.prefill_s * compute_scale, self.read_to_compute
            ),
        )


def snic_gbps_for(hit_bytes: int, compute_s: float, read_to_compute: float) -> float:
    """The cap (Gbps) at which reading `hit_bytes` takes `read_to_compute` x `compute_s`."""
    if not (compute_s > 0 and read_to_compute > 0):
        raise ValueError(
            f"compute_s and read_to_compute must be > 0: {compute_s}, {read_to_compute}"
        )
    return hit_bytes * 8 / 1e9 / (read_to_compute * compute_s)


def measured_compute_scale(breakdown: dict[str, Any], turns: int, prefill_s: float) -> float:
    """How many times the in-process prefill (`prefill_s`, the calibration's) the serving
    engine's prefill instance computed per measured turn in a phase (`phase_breakdown`'s
    compute over its turns; engine vllm: vLLM's compute is not the torch engine's, and the
    load differs inside a phase). 1.0 when nothing was measured."""
    compute_s = breakdown.get("prefill_compute_s", 0.0) if breakdown else 0.0
    if turns <= 0 or prefill_s <= 0 or compute_s <= 0:
        return 1.0
    return compute_s / turns / prefill_s


# a phase is storage-bound when its busiest SNICs were busy at least this share of it (and no
# less than its prefill computed); below it the turns spent most of their time elsewhere
STORAGE_BOUND_BUSY = 0.8


def phase_bound(snic_busy: float, compute_busy: float) -> str:
    """What bound a phase: compute when its prefill computed more of it than its busiest SNICs
    were busy; storage when those SNICs were busy at least `STORAGE_BOUND_BUSY` of it; else
    `other`: neither (the turns spent their time in the hops, the decode, or too few of them
    were in flight to keep the SNICs busy; a vLLM phase of 6 agents: SNICs busy 0.53)."""
    if compute_busy > snic_busy:
        return "compute"
    return "storage" if snic_busy >= STORAGE_BOUND_BUSY else "other"


def phase_verdict(
    res: PolicyResult, calibration: SnicCalibration | None, nodes: dict[str, int]
) -> dict[str, Any]:
    """Was a phase storage-bound, judged against the compute it got: engine vllm, the prefill
    vLLM's measured compute (`res.breakdown`); else the phase's own calibrated prefill times
    its turns (the torch engine the calibration runs). Empty when nothing was measured."""
    if not res.elapsed_s or not res.turns:
        return {}
    if res.breakdown:
        snic_busy = res.breakdown["busiest_snic_busy"]
        compute_busy, source = res.breakdown["prefill_compute_busy"], "measured"
    elif calibration is not None:
        per_snic = res.snic_caps_bytes_per_s / max(1, sum(nodes.values()))
        storage_s = max(
            res.bytes_read.get(role, 0) / (per_snic * n) for role, n in nodes.items() if n
        )
        snic_busy = storage_s / res.elapsed_s
        # the prefill nodes share the turns
        compute_s = calibration.compute_s * res.turns / max(1, nodes.get("prefill", 1))
        compute_busy, source = compute_s / res.elapsed_s, "calibrated"
    else:
        return {}
    return {
        "bound": phase_bound(snic_busy, compute_busy),
        "busiest_snic_busy": round(snic_busy, 3),
        "prefill_compute_busy": round(compute_busy, 3),
        "compute_from": source,
    }


def median_turn(
    trajectories: list[Trajectory], warmup_turns: int, block_tokens: int
) -> tuple[int, int]:
    """(hit tokens, new tokens) of the median measured turn: its context before the turn in
    whole blocks (what storage holds), and the rest."""
    shapes = []
    for tr in trajectories:
        for i in range(warmup_turns, len(tr.turns)):
            prompt = tr.prompt_tokens(i)
            hit = (prompt - tr.turns[i].append_tokens) // block_tokens * block_tokens
            shapes.append((hit, prompt - hit))
    if not shapes:
        raise ValueError("the trace has no measured turns (all of them are warm-up)")
    shapes.sort()
    return shapes[len(shapes) // 2]


def calibrate_snic(
    cfg: config.ClusterConfig,
    trajectories: list[Trajectory],
    warmup_turns: int,
    read_to_compute: float = READ_TO_COMPUTE,
    samples: int = 7,
    compute_scale: float = 1.0,
) -> SnicCalibration:
    """Time the median turn's prefill in process (the engine the prefill worker runs, its hit
    KV in memory) and derive the SNIC cap that makes its hit read `read_to_compute` times as long
    as that prefill times `compute_scale` (`measured_compute_scale`: how much slower the
    serving engine computed a turn in the phase before)."""
    import statistics

    from dualpath.engine.calibrate import measure_one
    from dualpath.engine.engine import Engine
    from dualpath.kv.format import BlockLayout

    if not read_to_compute > 0:
        raise ValueError(f"read_to_compute must be > 0, got {read_to_compute}")
    spec = cfg.spec.model
    layout = BlockLayout.from_model(spec)
    hit, new = median_turn(trajectories, warmup_turns, layout.block_tokens)
    hit_bytes = hit // layout.block_tokens * layout.payload_bytes

    async def timed() -> list[float]:
        await measure_one(engine, hit, new, 1)  # warm-up
        times: list[float] = []
        spent = 0.0  # a busy machine makes each sample slow: stop at a few seconds' worth
        while len(times) < samples and (len(times) < MIN_SAMPLES or spent < CALIBRATE_S):
            times.append(await measure_one(engine, hit, new, 1))
            spent += times[-1]
        return times

    with Engine(spec, kv_capacity_tokens=hit + new + layout.block_tokens) as engine:
        times = run_interruptible(timed())
    prefill_s = statistics.median(times)
    gbps = snic_gbps_for(hit_bytes, prefill_s * compute_scale, read_to_compute)
    cal = SnicCalibration(
        hit, new, hit_bytes, prefill_s, len(times), read_to_compute, gbps, compute_scale
    )
    log.info(
        "SNIC cap %.3f Gbps: the median turn (%d hit + %d new tokens) prefills in %.3f s here, "
        "its %.1f MB hit reads in %.1fx that",
        gbps,
        hit,
        new,
        prefill_s,
        hit_bytes / 1e6,
        read_to_compute,
    )
    return cal


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-f", "--file", help="DualPathCluster YAML (default: embedded local)")
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    parser.add_argument(
        "--plot",
        nargs="?",
        const="out/bench/local.png",
        default=None,
        help="write a PNG (default path out/bench/local.png)",
    )
    parser.add_argument("--out", default="out/bench/local", help="run directory")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--prefill", type=int, default=1, help="prefill workers (P)")
    parser.add_argument("--decode", type=int, default=2, help="decode workers (D)")
    parser.add_argument(
        "--snic-gbps",
        type=_snic_arg,
        default="auto",
        help="emulated SNIC cap per node in Gbps; 'auto' (default) measures this CPU's prefill "
        "of the trace's median turn and sets the cap so reading that turn's hit KV takes "
        "--read-to-compute times as long (the storage-bound balance of a GPU cluster on 400 "
        "Gbps SNICs, whatever the CPU's speed); 0 keeps spec.storage.snicGbps",
    )
    parser.add_argument(
        "--read-to-compute",
        type=float,
        default=None,
        help="with --snic-gbps auto: a turn's hit read time over its prefill compute time "
        f"(default {READ_TO_COMPUTE:g}; engine vllm {VLLM_READ_TO_COMPUTE:g}, its compute "
        "probed among a phase's others)",
    )
    parser.add_argument(
        "--recalibrate",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="with --snic-gbps auto: time the prefill again just before each policy's phase "
        "(at the load then) and set that phase's cap from it; engine vllm also scales it by "
        "how much slower vLLM computed a turn in the phase before (measured). The phases' caps "
        "then differ and `ratio_per_snic_cap` compares them. Default: one cap for every phase "
        "(engine vllm: against vLLM's compute of the median turn, probed on the warm-up's "
        "cluster). Either way each phase says whether it was storage-bound against the "
        "compute it got",
    )
    parser.add_argument(
        "--agents", type=int, default=None, help="agents (default 12; --online: sessions stored, 8)"
    )
    parser.add_argument(
        "--turns", type=int, default=None, help="max turns per agent (default 10; --online: 3)"
    )
    parser.add_argument(
        "--engine",
        choices=["dualpath", "vllm"],
        default=None,
        help="override spec.workers.engine: vllm runs every worker on vLLM with the DualPath "
        "connector (docs/vllm.md)",
    )
    parser.add_argument("--first-tokens", type=int, default=1536)
    parser.add_argument("--append-tokens", type=int, default=32)
    parser.add_argument("--gen-tokens", type=int, default=4)
    parser.add_argument("--context", type=int, default=8192, help="max context tokens")
    parser.add_argument(
        "--think-scale",
        type=float,
        default=0.0,
        help="multiply the trace's think times (0: offline, back to back)",
    )
    parser.add_argument(
        "--warmup-turns",
        type=int,
        default=1,
        help="first turns of each agent run before the clock starts (cold context)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--trace",
        help="replay an imported trace (`dualpath trace import`): its first --agents sessions' "
        "first --turns turns, lengths scaled by one factor to fit --context",
    )
    parser.add_argument("--log-file", default=None, help="cluster logs (default: OUT/cluster.log)")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="bound the run to about this many seconds: replay only the first turns of each "
        "agent that the calibrated predictions fit, with a deadline per phase (the JSON's "
        "`cut` says what was left out; default: the whole trace, however long it takes)",
    )
    parser.add_argument(
        "--kv-dir",
        default=None,
        help="scratch directory of the KV stores (default: a new temporary directory); "
        "removed at the end unless --keep",
    )
    parser.add_argument("--keep", action="store_true", help="keep the KV stores (--kv-dir)")


@dataclass(slots=True)
class TurnResult:
    agent: str
    turn: int
    prompt_tokens: int
    generated: list[int]
    cached_tokens: int
    read_path: str
    ttft_s: float
    latency_s: float
    ok: bool = True
    error: str = ""
    warmup: bool = False
    end_s: float = 0.0  # time.perf_counter() when it ended


@dataclass
class PolicyResult:
    policy: str
    elapsed_s: float
    turns: int
    failed: int
    tokens_per_s: float
    generated_tokens_per_s: float
    jct_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    hit_rate: float
    bytes_read: dict[str, int]
    snic_caps_bytes_per_s: float
    pooled_snic_util: float
    turns_by_path: dict[str, int] = field(default_factory=dict)
    # engine vllm: where the phase's time went (`phase_breakdown`)
    breakdown: dict[str, Any] = field(default_factory=dict)
    # this phase's SNIC cap per node and how it was re-calibrated just before the phase
    snic_gbps: float = 0.0
    calibration: dict[str, Any] = field(default_factory=dict)
    # storage- or compute-bound, against the compute the phase got (`phase_verdict`)
    verdict: dict[str, Any] = field(default_factory=dict)
    loadavg: list[float] = field(default_factory=list)  # 1-min load at its start and end
    # "": ran every planned turn; "deadline": cut at its phase's deadline (--budget-s);
    # "interrupted": SIGINT/SIGTERM, the figures of the turns done so far
    cut: str = ""


class Progress:
    """A one-line progress bar on stderr (`\\r`-redrawn), silent when disabled: the phase
    (`phase` of the run's phases), turns done, elapsed seconds and an ETA from the pace so far
    (never past `deadline_s`, a time.monotonic() the phase stops at)."""

    def __init__(
        self,
        total: int,
        label: str,
        enabled: bool = True,
        phase: str = "",
        deadline_s: float | None = None,
    ) -> None:
        self.total, self.label, self.done, self.enabled = total, label, 0, enabled
        self.phase, self.deadline_s = phase, deadline_s
        self.t0 = time.perf_counter()

    def eta_s(self) -> float | None:
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / self.done * (self.total - self.done) if self.done else None
        if self.deadline_s is not None:
            left = max(0.0, self.deadline_s - time.monotonic())
            eta = left if eta is None else min(eta, left)
        return eta

    def step(self, n: int = 1) -> None:
        self.done += n
        if not self.enabled:
            return
        frac = self.done / max(1, self.total)
        bar = "#" * int(30 * frac)
        eta = self.eta_s()
        phase = f"[{self.phase}] " if self.phase else ""
        sys.stderr.write(
            f"\r{phase}{self.label:<13} [{bar:<30}] {self.done}/{self.total} turns "
            f"{time.perf_counter() - self.t0:6.1f}s, ETA {'?' if eta is None else f'{eta:.0f}s'}  "
        )
        if self.done >= self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    def close(self) -> None:
        """End the line of a phase that stopped short of its total (a deadline, a signal)."""
        if self.enabled and 0 < self.done < self.total:
            sys.stderr.write("\n")
            sys.stderr.flush()


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(4, min(vocab, 260)) for _ in range(n)]


async def replay(
    client: httpx.AsyncClient,
    trajectories: list[Trajectory],
    model: str,
    vocab: int,
    seed: int = 0,
    think_scale: float = 0.0,
    progress: Progress | None = None,
    timeout_s: float = 600.0,
    warmup_turns: int = 0,
    on_warm: Callable[[], None] | None = None,
    context_of: dict[str, str] | None = None,
    results: list[TurnResult] | None = None,
    deadline_s: float | None = None,
    answered: dict[tuple[str, int], list[int]] | None = None,
    cache_salt: str = "",
) -> list[TurnResult]:
    """Replay every agent concurrently; each agent's turns run one after another.

    The first `warmup_turns` turns of every agent are marked `warmup` (their context is not in
    storage yet: a cold start, not the steady state of an agentic workload); once every agent
    finished them, `on_warm()` is called (start timers, snapshot counters) and the rest run.
    `context_of` maps an agent to another agent id whose first tokens it starts from (a context
    stored beforehand; online mode); its appended tokens stay its own.
    Turns are appended to `results` as they end (pass a list to keep what ended when the replay
    is cancelled or interrupted). At `deadline_s` (time.monotonic()) no turn starts any more and
    the turns in flight are cancelled (not counted). A turn in `answered` ((agent, turn) ->
    its greedy answer, e.g. from the warm-up's cluster) is not sent: its answer extends the
    history as if it had been (the same tokens: greedy answers do not depend on the cluster).
    `cache_salt`: the requests' (their KV never shares blocks with unsalted requests').
    """
    results = [] if results is None else results
    answered = answered or {}
    warm_left = len(trajectories) if warmup_turns else 0
    warm = asyncio.Event()
    if not warm_left:
        warm.set()
        if on_warm:
            on_warm()

    def warmed() -> None:
        nonlocal warm_left
        warm_left -= 1
        if warm_left == 0:
            if on_warm:
                on_warm()
            warm.set()

    async def agent(tr: Trajectory) -> None:
        rng = random.Random(f"{seed}:{tr.agent_id}")
        ctx = (context_of or {}).get(tr.agent_id)
        history = _tokens(random.Random(f"{seed}:{ctx}") if ctx else rng, tr.first_tokens, vocab)
        sid = f"bench-{seed}-{tr.agent_id}"
        for i, turn in enumerate(tr.turns):
            if deadline_s is not None and time.monotonic() >= deadline_s:
                if warmup_turns and i <= warmup_turns:
                    warmed()  # never block the others' barrier
                return
            if warmup_turns and i == warmup_turns:
                warmed()
                await warm.wait()
            if turn.prompt_tokens >= 0:  # recorded (--trace): keep its hit, fill to its prompt
                keep = min(len(history), turn.hit(len(history), turn.prompt_tokens))
                history = history[:keep] + _tokens(rng, turn.prompt_tokens - keep, vocab)
            else:
                history += _tokens(rng, turn.append_tokens, vocab)
            if (tr.agent_id, i) in answered:  # served before (the warm-up): its answer, no turn
                history += answered[(tr.agent_id, i)]
                continue
            if i and think_scale > 0 and turn.think_s > 0:
                await asyncio.sleep(turn.think_s * think_scale)
            body = {
                "model": model,
                "prompt": history,
                "max_tokens": turn.gen_tokens,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
                "session_id": sid,
            }
            if cache_salt:
                body["cache_salt"] = cache_salt
            t0 = time.perf_counter()
            ttft, final, usage, err = None, None, None, ""
            try:
                st = await stream_completion(client, body, timeout_s=timeout_s)
                ttft, final, usage, err = st.ttft_s, st.final, st.usage, st.error
                if st.response is not None:
                    err = f"HTTP {st.status}: {st.response.content[:200]!r}"
            except httpx.HTTPError as e:
                err = f"{type(e).__name__}: {e}"
            lat = time.perf_counter() - t0
            if final is None or usage is None:
                results.append(
                    TurnResult(
                        tr.agent_id,
                        i,
                        len(history),
                        [],
                        0,
                        "none",
                        ttft or lat,
                        lat,
                        False,
                        err or "no final or usage chunk",
                        warmup=i < warmup_turns,
                        end_s=time.perf_counter(),
                    )
                )
                if progress:
                    progress.step()
                if warmup_turns and i < warmup_turns:
                    warmed()  # never block the others' barrier
                return  # the session's history is unknown now: stop this agent
            gen = list(final["dualpath"]["token_ids"])
            results.append(
                TurnResult(
                    tr.agent_id,
                    i,
                    len(history),
                    gen,
                    usage["prompt_tokens_details"]["cached_tokens"],
                    final["dualpath"]["read_path"],
                    ttft if ttft is not None else lat,
                    lat,
                    warmup=i < warmup_turns,
                    end_s=time.perf_counter(),
                )
            )
            history += gen
            if progress:
                progress.step()
        if warmup_turns and len(tr.turns) <= warmup_turns:
            warmed()

    every = asyncio.gather(*(agent(tr) for tr in trajectories))
    # a stop signal cancels the agents under it: their outcome is known, not worth a log line
    every.add_done_callback(lambda f: f.cancelled() or f.exception())
    if deadline_s is None:
        await every
    else:
        try:
            await asyncio.wait_for(every, max(0.0, deadline_s - time.monotonic()))
        except TimeoutError:
            pass  # the turns in flight were cancelled; the ended ones are in `results`
    return results


def summarize(
    policy: str,
    results: list[TurnResult],
    elapsed_s: float,
    bytes_read: dict[str, int],
    snic_caps_bytes_per_s: float,
) -> PolicyResult:
    results = [r for r in results if not r.warmup]
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    gen = sum(len(r.generated) for r in ok)
    total_read = sum(bytes_read.values())
    by_path: dict[str, int] = {}
    for r in ok:
        by_path[r.read_path] = by_path.get(r.read_path, 0) + 1
    return PolicyResult(
        policy=policy,
        elapsed_s=round(elapsed_s, 3),
        turns=len(ok),
        failed=len(results) - len(ok),
        tokens_per_s=round((prompt + gen) / elapsed_s, 1) if elapsed_s else 0.0,
        generated_tokens_per_s=round(gen / elapsed_s, 2) if elapsed_s else 0.0,
        jct_s=round(elapsed_s, 3),
        ttft_p50_s=round(pct([r.ttft_s for r in ok], 0.5), 4),
        ttft_p99_s=round(pct([r.ttft_s for r in ok], 0.99), 4),
        hit_rate=round(sum(r.cached_tokens for r in ok) / prompt, 4) if prompt else 0.0,
        bytes_read=bytes_read,
        snic_caps_bytes_per_s=snic_caps_bytes_per_s,
        pooled_snic_util=round(total_read / (snic_caps_bytes_per_s * elapsed_s), 4)
        if snic_caps_bytes_per_s and elapsed_s
        else 0.0,
        turns_by_path=by_path,
    )


def scrape_counters(metrics_url: str, names: set[str]) -> dict[str, float]:
    """The totals of the counter families `names` on one /metrics page (every label summed;
    a histogram's total is its `_sum`)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(metrics_url, timeout=5) as r:  # noqa: S310 (local URL)
        text = r.read().decode()
    out = dict.fromkeys(names, 0.0)
    for fam in text_string_to_metric_families(text):
        if fam.name in names:
            out[fam.name] += sum(
                s.value for s in fam.samples if s.name.endswith(("_total", "_sum"))
            )
    return out


# the connector's time counters a vLLM worker's /metrics carries (its vLLM process's)
VLLM_SECONDS = {
    "dualpath_vllm_forward_seconds": "forward_s",
    "dualpath_vllm_load_wait_seconds": "load_wait_s",
    "dualpath_vllm_save_wait_seconds": "save_wait_s",
    "dualpath_vllm_hit_read_seconds": "hit_read_s",
}


def phase_breakdown(
    seconds: dict[str, dict[str, float]],
    elapsed_s: float,
    bytes_read: dict[str, int],
    snic_bytes_per_s: float,
    nodes: dict[str, int],
) -> dict[str, Any]:
    """Where a vLLM phase's time went, from the connector's counters over the measured
    window (`seconds[role][VLLM_SECONDS value]`, summed over the role's instances): the
    prefill instance's forwards, of them the time blocked on hit KV (layerwise loads) and on
    sends and saves, the rest its compute; the store reads off the forward thread, summed
    over reads that overlap (the prefill's parked loads; the decode instances' path D). The storage alone
    would take `storage_s`: the busiest side's bytes through its SNICs (each of
    `snic_bytes_per_s`). `bound` is storage when the busiest SNICs were busy at least as
    much of the time as the prefill instance computed, else compute."""
    pre, dec = seconds.get("prefill", {}), seconds.get("decode", {})
    compute_s = (
        pre.get("forward_s", 0.0) - pre.get("load_wait_s", 0.0) - pre.get("save_wait_s", 0.0)
    )
    storage_s = max(
        bytes_read.get(role, 0) / (snic_bytes_per_s * n) for role, n in nodes.items() if n
    )
    snic_busy = storage_s / elapsed_s if elapsed_s else 0.0
    compute_busy = compute_s / elapsed_s if elapsed_s else 0.0
    return {
        "prefill_forward_s": round(pre.get("forward_s", 0.0), 2),
        "prefill_load_wait_s": round(pre.get("load_wait_s", 0.0), 2),
        "prefill_save_wait_s": round(pre.get("save_wait_s", 0.0), 2),
        "prefill_compute_s": round(compute_s, 2),
        "prefill_hit_read_s": round(pre.get("hit_read_s", 0.0), 2),
        "decode_forward_s": round(dec.get("forward_s", 0.0), 2),
        "decode_hit_read_s": round(dec.get("hit_read_s", 0.0), 2),
        "storage_s": round(storage_s, 2),
        "busiest_snic_busy": round(snic_busy, 3),
        "prefill_compute_busy": round(compute_busy, 3),
        "bound": phase_bound(snic_busy, compute_busy),
    }


def verdict_line(r: PolicyResult) -> str | None:
    """A phase's verdict: storage-bound or not, against the compute it got (`phase_verdict`)."""
    v = r.verdict
    if not v:
        return None
    what = {
        "storage": "storage-bound",
        "compute": "NOT storage-bound (compute-bound: the SNIC cap is not what limits this phase)",
    }.get(
        v["bound"],
        "NOT storage-bound (neither its SNICs nor its prefill were busy most of it: its turns "
        "spent their time elsewhere)",
    )
    cap = f"SNIC cap {r.snic_gbps:.3f} Gbps" if r.snic_gbps else "SNIC cap"
    if r.calibration:
        cal = r.calibration
        scale = cal.get("compute_scale", 1.0)
        cap += f" (against the median turn's compute, {cal['prefill_s'] * scale:.2f} s"
        if scale != 1.0:
            cap += f": {cal['prefill_s']:.2f} s in process x {scale:.2f} measured on vLLM"
        cap += ")"
    load = f", load {r.loadavg[0]:.0f}-{r.loadavg[-1]:.0f}" if r.loadavg else ""
    return (
        f"{r.policy}: {what}; busiest SNICs busy {v['busiest_snic_busy']:.2f} of the phase, "
        f"prefill computing {v['prefill_compute_busy']:.2f} ({v['compute_from']}); {cap}{load}"
    )


def breakdown_lines(results: list[PolicyResult]) -> list[str]:
    """One line a phase: what bound it and (engine vllm) where its time went."""
    lines = []
    for r in results:
        verdict = verdict_line(r)
        if verdict:
            lines.append(verdict)
        b = r.breakdown
        if not b:
            continue
        lines.append(
            f"  {r.policy} time: of {r.elapsed_s:.0f} s, prefill vLLM forwards "
            f"{b['prefill_forward_s']:.0f} s (compute {b['prefill_compute_s']:.0f}, "
            f"waiting for hit KV {b['prefill_load_wait_s']:.0f}, sends+saves "
            f"{b['prefill_save_wait_s']:.0f}), prefill store reads off its forwards "
            f"{b.get('prefill_hit_read_s', 0):.0f} s; decode forwards "
            f"{b['decode_forward_s']:.0f} s, decode store reads {b['decode_hit_read_s']:.0f} s; "
            "storage alone "
            f"{b['storage_s']:.0f} s"
        )
    return lines


def ratio_per_cap(results: list[PolicyResult]) -> float | None:
    """dualpath / prefill-read throughput per unit of SNIC cap: what the tokens/s ratio would
    be at one cap, where both phases were storage-bound (their throughput scales with the cap)
    and re-calibration gave them different caps. None when the caps are equal or unknown."""
    by = {r.policy: r for r in results}
    pr, dp = by.get("prefill-read"), by.get("dualpath")
    if not (pr and dp and pr.snic_gbps and dp.snic_gbps and pr.tokens_per_s):
        return None
    if pr.snic_gbps == dp.snic_gbps:
        return None
    return round((dp.tokens_per_s / dp.snic_gbps) / (pr.tokens_per_s / pr.snic_gbps), 3)


def storage_only_ratio(results: list[PolicyResult]) -> float | None:
    """dualpath / prefill-read throughput were the storage all that bound them: the ratio of
    their storage-alone times (`phase_breakdown`), for the same turns."""
    by = {r.policy: r for r in results}
    pr, dp = by.get("prefill-read"), by.get("dualpath")
    if not (pr and dp and pr.breakdown and dp.breakdown and dp.breakdown["storage_s"]):
        return None
    return round(pr.breakdown["storage_s"] / dp.breakdown["storage_s"], 3)


def replay_on(
    frontend: str,
    cfg: config.ClusterConfig,
    trajectories: list[Trajectory],
    args: argparse.Namespace,
    progress: Progress,
    warmup_turns: int | None = None,
    on_warm: Callable[[], None] | None = None,
    results: list[TurnResult] | None = None,
    deadline_s: float | None = None,
    answered: dict[tuple[str, int], list[int]] | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    cache_salt: str = "",
) -> list[TurnResult]:
    """`replay` against a running cluster's frontend, one connection per agent, or through
    `transport` (a peer's router, `bench local --peers`)."""

    async def go() -> list[TurnResult]:
        limits = httpx.Limits(max_connections=len(trajectories) + 4)
        async with httpx.AsyncClient(
            base_url=frontend, limits=limits, transport=transport
        ) as client:
            return await replay(
                client,
                trajectories,
                cfg.spec.model.name,
                cfg.spec.model.vocab_size,
                args.seed,
                args.think_scale,
                progress,
                warmup_turns=args.warmup_turns if warmup_turns is None else warmup_turns,
                on_warm=on_warm,
                results=results,
                deadline_s=deadline_s,
                answered=answered,
                cache_salt=cache_salt,
            )

    try:
        return run_interruptible(go())
    finally:
        progress.close()


@dataclass
class Seed:
    """The warm-up's stored contexts: every policy's run starts from a copy of `path`."""

    path: Path
    warmed: set[str]  # agents whose warm-up turns all ended (the others are left out)
    start_s: float  # how long its cluster took to start (a policy's cluster takes about as long)
    # the warm-up turns' greedy answers: the policies' runs extend their histories with them
    # instead of sending those turns again
    answers: dict[tuple[str, int], list[int]] = field(default_factory=dict)
    # what `seed_storage`'s `probe` measured on the warm-up's cluster (None: no probe)
    probed: Any = None


def kv_root(args: argparse.Namespace) -> Path:
    """Where the KV stores live (`--kv-dir`: absolute, as spec.storage.path must be)."""
    return Path(args.kv_dir or Path(args.out) / "kv-scratch").resolve()


def seed_storage(
    cfg: config.ClusterConfig,
    groups: list[list[Trajectory]],
    args: argparse.Namespace,
    sink,
    phase: str = "",
    deadline_s: float | None = None,
    probe: Callable[[Any], Any] | None = None,
) -> Seed:
    """Run every agent's warm-up turns once (cold: their context is computed, then stored) and
    return that storage directory; each policy's run starts from a copy of it. The groups warm
    up one after another (online mode: one rate point's agents at a time; all of them at once
    would ask the prefill node for more KV buffer than it has for their cold prefills). At
    `deadline_s` the warm-up stops: the agents it did not finish are left out (`Seed.warmed`).
    `probe(cluster)`, when given, runs on the same cluster after the warm-up (`Seed.probed`)."""
    from dualpath.local.cluster import LocalCluster, with_overrides

    seed = kv_root(args) / "seed-kv"
    scfg = with_overrides(cfg, **{"storage.path": str(seed)})
    t0 = time.monotonic()
    warmed: set[str] = set()
    answers: dict[tuple[str, int], list[int]] = {}
    with LocalCluster(
        scfg, Path(args.out) / "seed", sink=sink, fresh_storage=True, log_level="WARNING"
    ) as cluster:
        start_s = time.monotonic() - t0
        for trajectories in groups:
            head = [
                Trajectory(t.agent_id, t.turns[: args.warmup_turns], t.first_tokens)
                for t in trajectories
            ]
            prog = Progress(
                sum(len(t.turns) for t in head), "warm-up", phase=phase, deadline_s=deadline_s
            )
            results = replay_on(
                cluster.endpoints.frontend,
                scfg,
                head,
                args,
                prog,
                warmup_turns=0,
                deadline_s=deadline_s,
            )
            failed = [r for r in results if not r.ok]
            if failed:
                raise RuntimeError(f"warm-up failed for {len(failed)} turns: {failed[0].error}")
            done = Counter(r.agent for r in results)
            warmed |= {t.agent_id for t in head if done[t.agent_id] == len(t.turns)}
            answers.update({(r.agent, r.turn): r.generated for r in results})
        probed = probe(cluster) if probe is not None else None
    return Seed(seed, warmed, start_s, answers, probed)


def policy_config(
    cfg: config.ClusterConfig, policy: str, seed: Path | None
) -> config.ClusterConfig:
    """`cfg` under `policy`, its storage emptied, or a copy of the warm-up's seed: every policy
    starts from the same stored contexts."""
    from dualpath.local.cluster import with_overrides

    pcfg = with_overrides(cfg, **{"scheduler.policy": policy})
    storage = Path(pcfg.spec.storage.path)
    if storage.exists():
        shutil.rmtree(storage)
    if seed is not None:
        shutil.copytree(seed, storage)
    return pcfg


def table(results: list[PolicyResult], ratio: float | None) -> str:
    head = (
        f"{'policy':<13}{'tok/s':>9}{'JCT s':>8}{'TTFT p50':>10}{'TTFT p99':>10}"
        f"{'read P MB':>11}{'read D MB':>11}{'SNIC util':>11}{'hit':>7}{'fail':>6}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        name = r.policy + ("*" if r.cut else "")  # cut short: footnote below
        lines.append(
            f"{name:<13}{r.tokens_per_s:>9.0f}{r.jct_s:>8.1f}{r.ttft_p50_s:>10.3f}"
            f"{r.ttft_p99_s:>10.3f}{r.bytes_read.get('prefill', 0) / 1e6:>11.1f}"
            f"{r.bytes_read.get('decode', 0) / 1e6:>11.1f}{r.pooled_snic_util:>11.2f}"
            f"{r.hit_rate:>7.2f}{r.failed:>6d}"
        )
    if ratio is not None:
        lines.append(f"ratio (dualpath / prefill-read tokens/s) = {ratio:.2f}")
    per_cap = ratio_per_cap(results)
    if per_cap is not None:
        lines.append(
            f"ratio per unit of SNIC cap (the phases' caps differ: re-calibrated) = {per_cap:.2f}"
            + (
                ""
                if all(r.verdict.get("bound") == "storage" for r in results if r.verdict)
                else " (a phase was not storage-bound: read it with its verdict)"
            )
        )
    lines.extend(breakdown_lines(results))
    storage_ratio = storage_only_ratio(results)
    if storage_ratio is not None:
        lines.append(
            f"ratio were storage all that bound them (storage-alone times) = {storage_ratio:.2f}"
        )
    for r in results:
        if r.cut:
            why = "its deadline" if r.cut == "deadline" else "a stop signal"
            lines.append(f"* {r.policy}: cut short by {why}; the figures of its {r.turns} turns")
    return "\n".join(lines)


def plot(results: list[PolicyResult], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    names = [r.policy for r in results]
    axes[0].bar(names, [r.tokens_per_s for r in results], color="tab:blue")
    axes[0].set_title("throughput (tokens/s)")
    axes[1].bar(names, [r.pooled_snic_util for r in results], color="tab:green")
    axes[1].set_ylim(0, 1.05)
    axes[1].set_title("pooled SNIC utilisation")
    p = [r.bytes_read.get("prefill", 0) / 1e6 for r in results]
    d = [r.bytes_read.get("decode", 0) / 1e6 for r in results]
    axes[2].bar(names, p, label="prefill-node SNIC")
    axes[2].bar(names, d, bottom=p, label="decode-node SNIC")
    axes[2].set_title("bytes read (MB)")
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def base_config(args: argparse.Namespace, snic_gbps: float | None = None) -> config.ClusterConfig:
    """The cluster the bench runs: the file (or the local default) with the bench's replicas,
    run directory and SNIC cap (`snic_gbps`, else a numeric --snic-gbps; 0 keeps the spec's)."""
    from dualpath.local.cluster import with_overrides

    cfg = config.load_or_default(args.file)
    over: dict[str, Any] = {
        "prefill.replicas": args.prefill,
        "decode.replicas": args.decode,
        "storage.path": str(kv_root(args) / "kv"),
    }
    if getattr(args, "engine", None):
        over["workers.engine"] = args.engine
    if snic_gbps is None and isinstance(args.snic_gbps, float):
        snic_gbps = args.snic_gbps
    if snic_gbps:
        over["storage.snicGbps"] = snic_gbps
    cfg = with_overrides(cfg, **over)
    if cfg.spec.workers.engine == "vllm" and not cfg.spec.model.checkpoint_path:
        from dualpath.local.cluster import with_vllm_checkpoint

        # one checkpoint for the seed and every policy: its path is part of the KV fingerprint
        cfg = with_vllm_checkpoint(cfg, Path(args.out).resolve() / "model")
    return cfg


def bench_config(
    args: argparse.Namespace, trajectories: list[Trajectory]
) -> tuple[config.ClusterConfig, SnicCalibration | None]:
    """The cluster a bench run uses and, with `--snic-gbps auto`, how its SNIC cap was
    calibrated on this CPU for `trajectories` (offline and online modes alike)."""
    calibration = None
    if args.snic_gbps == "auto":
        calibration = calibrate_snic(
            base_config(args), trajectories, args.warmup_turns, args.read_to_compute
        )
    cfg = base_config(args, calibration.snic_gbps if calibration else None)
    if cfg.spec.storage.snic_gbps <= 0:
        raise ValueError(
            "storage.snicGbps must be > 0 for the local benchmark (the emulated SNIC cap); "
            "pass --snic-gbps"
        )
    return cfg, calibration


def trace_spec(args: argparse.Namespace) -> TraceSpec:
    """The synthetic trace of the trace arguments (offline; online adds its think time)."""
    return TraceSpec(
        agents=args.agents,
        max_context_tokens=args.context,
        max_turns=args.turns,
        mean_append_tokens=args.append_tokens,
        mean_gen_tokens=args.gen_tokens,
        first_tokens=args.first_tokens,
        seed=args.seed,
        length_sigma=0.3,
    )


# --agents and --turns when not given: offline (one replay); --online has its own (ONLINE_SIZE)
OFFLINE_SIZE = {"agents": 12, "turns": 10}


def signal_name(signum: int) -> str:
    import signal

    return signal.Signals(signum).name


def remove_scratch(kv_dir: Path, made: bool, keep: bool) -> None:
    """Remove the KV stores (the whole directory when the bench made it) unless `keep`."""
    if keep:
        print(f"KV stores kept in {kv_dir}", file=sys.stderr)
        return
    for d in [kv_dir] if made else [kv_dir / "seed-kv", kv_dir / "kv"]:
        shutil.rmtree(d, ignore_errors=True)
    if kv_dir.is_dir() and not any(kv_dir.iterdir()):
        kv_dir.rmdir()
