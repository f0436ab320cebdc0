"""Agentic traces: seeded trajectories of agent turns, and their JSONL form.

An agent runs one *trajectory*: a sequence of turns on one growing context. Turn i sends the
whole context so far plus `append_tokens` new tokens (the user/tool message), the model
generates `gen_tokens`, then the agent spends `think_s` in a tool call before turn i+1.
Everything but the last turn's append is a prefix hit on turn i+1, so with ~500 tokens appended
per turn to a context of tens of thousands the hit rate is ~98-99% (the paper's 98.7%).

The simulator (`dualpath.sim`) and the local benchmark (`dualpath bench local`) both consume
`Trajectory` lists: `generate(TraceSpec(...))` or `load_jsonl(path)`.

JSONL format: one trajectory per line,
    {"agent_id": "a0", "start_s": 0.0, "first_tokens": 2048,
     "turns": [{"append_tokens": 512, "gen_tokens": 160, "think_s": 1.7}, ...]}
`first_tokens` is the initial prompt (system prompt + task) sent with turn 0's append;
`think_s` of turn i is the tool-call time *before* turn i is sent (0 for turn 0);
`start_s` is when the agent starts (offline: 0; online: its Poisson arrival time).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(slots=True, frozen=True)
class Turn:
    """One request of an agent: tokens appended, tokens generated, tool time before it."""

    append_tokens: int
    gen_tokens: int
    think_s: float = 0.0


@dataclass(slots=True)
class Trajectory:
    """One agent's whole job: turns on one context that grows by append + gen each turn."""

    agent_id: str
    turns: list[Turn]
    first_tokens: int = 0
    start_s: float = 0.0

    def prompt_tokens(self, i: int) -> int:
        """Whole context sent with turn i (everything before it plus its append)."""
        ctx = self.first_tokens
        for t in self.turns[:i]:
            ctx += t.append_tokens + t.gen_tokens
        return ctx + self.turns[i].append_tokens

    @property
    def final_context_tokens(self) -> int:
        return self.first_tokens + sum(t.append_tokens + t.gen_tokens for t in self.turns)

    @property
    def total_gen_tokens(self) -> int:
        return sum(t.gen_tokens for t in self.turns)


@dataclass(slots=True, frozen=True)
class TraceSpec:
    """Shape of a synthetic agentic trace. Lengths are per-turn means; draws are seeded.

    A trajectory ends after `max_turns` turns or when the next turn would push the context
    (prompt + generation) past `max_context_tokens`, whichever comes first.
    """

    agents: int = 64
    max_context_tokens: int = 32_768
    max_turns: int = 60
    mean_append_tokens: int = 610
    mean_gen_tokens: int = 150
    first_tokens: int = 2_048
    mean_think_s: float = 2.0
    # Spread of append/gen lengths: lognormal sigma (0 = every turn exactly the mean).
    length_sigma: float = 0.5
    seed: int = 0

    def __post_init__(self) -> None:
        checks = {
            "agents": self.agents >= 1,
            "max_context_tokens": self.max_context_tokens >= 16,
            "max_turns": self.max_turns >= 1,
            "mean_append_tokens": self.mean_append_tokens >= 1,
            "mean_gen_tokens": self.mean_gen_tokens >= 1,
            "first_tokens": 0 <= self.first_tokens < self.max_context_tokens,
            "mean_think_s": self.mean_think_s >= 0,
            "length_sigma": self.length_sigma >= 0,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"TraceSpec.{name}: out of range (got {getattr(self, name)!r})")


# The paper's three agentic traces (arXiv 2602.21548): max context, turns, append / gen means.
TRACE_PRESETS: dict[str, dict[str, int]] = {
    "32k": dict(
        max_context_tokens=32_768, max_turns=60, mean_append_tokens=610, mean_gen_tokens=150
    ),
    "48k": dict(
        max_context_tokens=49_152, max_turns=106, mean_append_tokens=520, mean_gen_tokens=165
    ),
    "64k": dict(
        max_context_tokens=65_536, max_turns=157, mean_append_tokens=430, mean_gen_tokens=180
    ),
}


def preset_spec(name: str, **overrides: object) -> TraceSpec:
    """A `TraceSpec` shaped like one of the paper's traces (`32k`, `48k`, `64k`)."""
    if name not in TRACE_PRESETS:
        raise ValueError(f"unknown trace preset {name!r}; choose one of {sorted(TRACE_PRESETS)}")
    return TraceSpec(**{**TRACE_PRESETS[name], **overrides})  # type: ignore[arg-type]


def _draw_len(rng: random.Random, mean: int, sigma: float) -> int:
    if sigma <= 0:
        return mean
    # Lognormal with the requested mean: mu = ln(mean) - sigma^2 / 2.
    return max(1, int(round(rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma))))


def generate_one(spec: TraceSpec, index: int, start_s: float = 0.0) -> Trajectory:
    """Trajectory `index` of `spec`: depends only on (spec, index), not on other agents."""
    rng = random.Random(f"{spec.seed}:{index}")
    turns: list[Turn] = []
    ctx = spec.first_tokens
    for i in range(spec.max_turns):
        append = _draw_len(rng, spec.mean_append_tokens, spec.length_sigma)
        gen = _draw_len(rng, spec.mean_gen_tokens, spec.length_sigma)
        think = rng.expovariate(1.0 / spec.mean_think_s) if i and spec.mean_think_s > 0 else 0.0
        if ctx + append + gen > spec.max_context_tokens:
            if turns:
                break
            # The first turn always fits: clip it to the cap.
            append = max(1, min(append, spec.max_context_tokens - ctx - 1))
            gen = max(1, spec.max_context_tokens - ctx - append)
        turns.append(Turn(append, gen, round(think, 6)))
        ctx += append + gen
    return Trajectory(
        agent_id=f"a{index}", turns=turns, first_tokens=spec.first_tokens, start_s=start_s
    )


def generate(spec: TraceSpec, arrival_rate_per_s: float = 0.0) -> list[Trajectory]:
    """`spec.agents` trajectories. With `arrival_rate_per_s` > 0 agents start as a Poisson
    process of that rate (online mode); otherwise all start at 0 (offline mode)."""
    arrivals = random.Random(f"{spec.seed}:arrivals")
    out: list[Trajectory] = []
    t = 0.0
    for i in range(spec.agents):
        if arrival_rate_per_s > 0:
            t += arrivals.expovariate(arrival_rate_per_s)
        out.append(generate_one(spec, i, start_s=round(t, 6)))
    return out


@dataclass(slots=True)
class TraceStats:
    agents: int
    turns: int
    mean_turns: float
    mean_append_tokens: float
    mean_gen_tokens: float
    mean_prompt_tokens: float
    max_context_tokens: int
    # Fraction of prompt tokens that are whole-block prefix hits (`block_tokens` granularity).
    hit_rate: float
    extra: dict[str, float] = field(default_factory=dict)


def stats(trajectories: list[Trajectory], block_tokens: int = 64) -> TraceStats:
    """Summary of a trace, including the block-granular prefix hit rate."""
    turns = appended = generated = prompt_sum = hits = 0
    max_ctx = 0
    for tr in trajectories:
        ctx = tr.first_tokens
        for t in tr.turns:
            prompt = ctx + t.append_tokens
            hits += (ctx // block_tokens) * block_tokens
            prompt_sum += prompt
            appended += t.append_tokens
            generated += t.gen_tokens
            turns += 1
            ctx = prompt + t.gen_tokens
        max_ctx = max(max_ctx, ctx)
    n = max(turns, 1)
    return TraceStats(
        agents=len(trajectories),
        turns=turns,
        mean_turns=turns / max(len(trajectories), 1),
        mean_append_tokens=appended / n,
        mean_gen_tokens=generated / n,
        mean_prompt_tokens=prompt_sum / n,
        max_context_tokens=max_ctx,
        hit_rate=hits / max(prompt_sum, 1),
    )


def to_dict(tr: Trajectory) -> dict[str, object]:
    return {
        "agent_id": tr.agent_id,
        "start_s": tr.start_s,
        "first_tokens": tr.first_tokens,
        "turns": [asdict(t) for t in tr.turns],
    }


def from_dict(obj: dict[str, object], where: str = "trajectory") -> Trajectory:
    """Parse one JSONL record; errors name the record and the field."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: must be a JSON object")
    turns_raw = obj.get("turns")
    if not isinstance(turns_raw, list) or not turns_raw:
        raise ValueError(f"{where}.turns: must be a non-empty list")
    turns = []
    for i, t in enumerate(turns_raw):
        if not isinstance(t, dict):
            raise ValueError(f"{where}.turns[{i}]: must be an object")
        try:
            append, gen = int(t["append_tokens"]), int(t["gen_tokens"])
            think = float(t.get("think_s", 0.0))
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(
                f"{where}.turns[{i}]: needs integer append_tokens and gen_tokens ({err})"
            ) from None
        if append < 0 or gen < 0 or think < 0 or append + gen == 0:
            raise ValueError(f"{where}.turns[{i}]: lengths and think_s must be >= 0, not all 0")
        turns.append(Turn(append, gen, think))
    return Trajectory(
        agent_id=str(obj.get("agent_id", where)),
        turns=turns,
        first_tokens=int(obj.get("first_tokens", 0)),  # type: ignore[arg-type]
        start_s=float(obj.get("start_s", 0.0)),  # type: ignore[arg-type]
    )


def save_jsonl(path: str | Path, trajectories: Iterable[Trajectory]) -> int:
    """Write one trajectory per line; returns how many were written."""
    n = 0
    with Path(path).open("w") as f:
        for tr in trajectories:
            f.write(json.dumps(to_dict(tr), separators=(",", ":")) + "\n")
            n += 1
    return n


def iter_jsonl(path: str | Path) -> Iterator[Trajectory]:
    p = Path(path)
    with p.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{p}:{lineno}: not valid JSON: {err}") from None
            yield from_dict(obj, where=f"{p}:{lineno}")


def load_jsonl(path: str | Path) -> list[Trajectory]:
    """Load a recorded trace (see the module docstring for the format)."""
    return list(iter_jsonl(path))
