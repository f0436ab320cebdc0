"""What a time-bounded local benchmark replays (`dualpath demo`, `dualpath bench local
--budget-s`), from what it measured on this machine. Pure.

The benchmark stays storage-bound on any CPU because its SNIC cap is calibrated from the
measured prefill (`bench.calibrate_snic`): a slower or busier machine gets a slower cap, so every
turn takes longer. A fixed trace would then take as long as the CPU makes it (40+ minutes on a
2-core machine at load 13-27); a budget bounds the *work* instead: after the warm-up (when a
cluster's start has been timed too) it keeps the first turns of every agent that the predicted
per-turn times of all policies fit into the seconds left, and each policy's phase gets a share
of what is left in proportion to its prediction, as a deadline. Both policies replay the same
agents and turns: a policy cut at its deadline leaves the rest of the run to replay what it
completed, and the JSON reports every cut.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Capacity:
    """The turns/s a policy's cluster can serve, predicted from the calibrated median turn."""

    policy: str
    readers: int  # SNICs that read hits under the policy
    read_s: float  # the median turn's hit read at one SNIC's cap
    prefill_s: float  # its prefill compute
    turns_per_s: float
    agents_per_s: float  # turns_per_s / turns per session


def capacity(
    policy: str, prefill: int, decode: int, read_s: float, prefill_s: float, turns: float
) -> Capacity:
    """Read-bound: prefill-read reads on the P prefill SNICs, decode-read on the D decode ones,
    dualpath (and round-robin) on all P + D; never above the P prefill nodes' compute."""
    readers = {"prefill-read": prefill, "decode-read": decode}.get(policy, prefill + decode)
    tps = min(readers / read_s, prefill / prefill_s)
    return Capacity(policy, readers, read_s, prefill_s, round(tps, 4), round(tps / turns, 4))


# Plan for this share of the seconds left: the prediction is the read-bound ideal (measured
# within 5% of it on an idle machine), the rest pays for stops and a busier minute.
PLAN_SHARE = 0.8
# A local cluster's start (imports, model, readiness) when none was timed (no warm-up run).
DEFAULT_START_S = 20.0
# The warm-up (a cluster start and every agent's cold first turn) stops at this share of the
# budget: the agents it has not warmed by then are left out.
WARMUP_SHARE = 0.5
# A phase after one cut at its deadline replays that phase's turns; it gets at least this share
# of the time that phase took, even past the budget (the baseline is the slower policy: a
# faster one needs less), so a cut never leaves the comparison one-sided.
CUT_FLOOR_SHARE = 0.5


@dataclass(frozen=True)
class Plan:
    turns: int  # per agent, warm-up turns included (served once, by the warm-up)
    replayed_turns: int  # over all agents, warm-up turns included
    trace_turns: int  # what the full trace has
    phase_s: dict[str, float]  # predicted seconds of each policy's phase: start + its turns
    fits: bool  # False: even the smallest run (one measured turn an agent) is predicted over

    @property
    def left_out_turns(self) -> int:
        return self.trace_turns - self.replayed_turns


def plan_turns(
    agent_turns: list[int],
    seconds_per_turn: dict[str, float],
    start_s: float,
    left_s: float,
    warmup_turns: int,
) -> Plan:
    """The most turns per agent (each agent's first ones, at least its warm-up plus one) such
    that every policy's phase (a cluster start of `start_s`, then the agents' measured turns at
    `seconds_per_turn[policy]` each; the warm-up turns were served once, before) fits in
    PLAN_SHARE of `left_s` seconds."""
    longest = max(agent_turns, default=0)
    trace = sum(agent_turns)
    least = min(longest, warmup_turns + 1)
    best: Plan | None = None
    for turns in range(least, longest + 1):
        replayed = sum(min(n, turns) for n in agent_turns)
        measured = sum(max(0, min(n, turns) - warmup_turns) for n in agent_turns)
        phases = {p: start_s + measured * s for p, s in seconds_per_turn.items()}
        fits = sum(phases.values()) <= PLAN_SHARE * left_s
        if best is None or fits:
            best = Plan(turns, replayed, trace, phases, fits)
        if not fits:
            break
    return best or Plan(0, 0, 0, {p: start_s for p in seconds_per_turn}, True)


def phase_deadline_s(now_s: float, end_s: float, phase_s: dict[str, float], policy: str) -> float:
    """When `policy`'s phase must stop sending turns: its share of the seconds left to `end_s`
    in proportion to its predicted seconds among the phases still to run (`phase_s`, this one
    included), so a phase that ended early leaves its spare time to the next ones."""
    total = sum(phase_s.values())
    share = phase_s[policy] / total if total > 0 else 1.0
    return now_s + max(0.0, end_s - now_s) * share
