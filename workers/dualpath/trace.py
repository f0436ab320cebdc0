"""Agentic traces: seeded trajectories of agent turns, and their JSONL form.

An agent runs one *trajectory*: a sequence of turns on one growing context. Turn i sends the
whole context so far plus `append_tokens` new tokens (the user/tool message), the model
generates `gen_tokens`, then the agent spends `think_s` in a tool call before turn i+1.
Everything but the last turn's append is a prefix hit on turn i+1, so with ~500 tokens appended
per turn to a context of tens of thousands the hit rate is ~98-99% (the paper's 98.7%).

The simulator (`dualpath.sim`) and the local benchmark (`dualpath bench local`) both consume
`Trajectory` lists: `generate(TraceSpec(...))` or `load_jsonl(path)`.

JSONL format: one trajectory (a session) per line,
    {"agent_id": "a0", "start_s": 0.0, "first_tokens": 2048,
     "turns": [{"append_tokens": 512, "gen_tokens": 160, "think_s": 1.7}, ...]}
`first_tokens` is the initial prompt (system prompt + task) sent with turn 0's append;
`think_s` of turn i is the tool-call time *before* turn i is sent (0 for turn 0);
`start_s` is when the agent starts (offline: 0; online: its Poisson arrival time).

Real traffic (`dualpath trace import`) needs three more things, all optional per turn so the
synthetic generator's files (and every file written before them) load unchanged:
- `prompt_tokens`: the whole prompt of the turn, when it is not "context so far + append" (the
  client compacted or re-sent the history differently; `append_tokens` is then informative and
  may be negative);
- `hit_tokens`: how many leading prompt tokens were already in storage when the turn was sent
  (a partial hit after a compaction, or a shared system/tool prefix on turn 0 that another
  session stored). Absent: every full block of the context so far, the growth model above;
- `subagents`: trajectories the session spawns, each with `after_turn` (how many of the
  parent's turns had finished when it started) and `start_s` (its delay after that point).
A first line `{"meta": {...}}` carries what produced the file (source, block size, what the
importer had to infer); `load_trace` returns it, `load_jsonl` skips it.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

# `Turn.prompt_tokens` / `Turn.hit_tokens` unset: derived by the growth model.
DERIVED = -1


@dataclass(slots=True, frozen=True)
class Turn:
    """One request of an agent: tokens appended, tokens generated, tool time before it.

    `prompt_tokens` and `hit_tokens` are DERIVED (-1) for a pure growth turn; a recorded turn
    sets them (see the module docstring).
    """

    append_tokens: int
    gen_tokens: int
    think_s: float = 0.0
    prompt_tokens: int = DERIVED
    hit_tokens: int = DERIVED

    def prompt(self, context_tokens: int) -> int:
        """The whole prompt of this turn, sent on a context of `context_tokens`."""
        return (
            self.prompt_tokens if self.prompt_tokens >= 0 else context_tokens + self.append_tokens
        )

    def hit(self, stored_tokens: int, prompt_tokens: int) -> int:
        """Leading prompt tokens already in storage (`stored_tokens`: the growth model's)."""
        h = self.hit_tokens if self.hit_tokens >= 0 else stored_tokens
        return max(0, min(h, prompt_tokens - 1))


@dataclass(slots=True)
class Trajectory:
    """One agent's whole job: turns on one context that grows by append + gen each turn
    (or as the turns' recorded prompts say), and the subagents it spawns."""

    agent_id: str
    turns: list[Turn]
    first_tokens: int = 0
    start_s: float = 0.0  # root: when it starts; subagent: delay after its `after_turn`
    subagents: list[Trajectory] = field(default_factory=list)
    after_turn: int = 0  # subagent: parent turns finished when it starts

    def prompt_tokens(self, i: int) -> int:
        """Whole context sent with turn i (everything before it plus its append)."""
        ctx = self.first_tokens
        for t in self.turns[:i]:
            ctx = t.prompt(ctx) + t.gen_tokens
        return self.turns[i].prompt(ctx)

    @property
    def final_context_tokens(self) -> int:
        ctx = self.first_tokens
        for t in self.turns:
            ctx = t.prompt(ctx) + t.gen_tokens
        return ctx

    @property
    def total_gen_tokens(self) -> int:
        """Generated tokens of this trajectory alone (not its subagents)."""
        return sum(t.gen_tokens for t in self.turns)

    def walk(self) -> Iterator[Trajectory]:
        """This trajectory and all its subagents, depth first."""
        yield self
        for s in self.subagents:
            yield from s.walk()


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
    # Leading tokens of the first prompt that every agent shares (system prompt, tool
    # definitions) and another agent already stored: turn 0 hits them (0 = turn 0 all misses).
    shared_prefix_tokens: int = 0

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
            "shared_prefix_tokens": 0 <= self.shared_prefix_tokens <= self.first_tokens,
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
        if i == 0 and spec.shared_prefix_tokens:
            turns.append(Turn(append, gen, 0.0, hit_tokens=spec.shared_prefix_tokens))
        else:
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
    # Fraction of prompt tokens that are prefix hits (whole blocks of `block_tokens`, or the
    # recorded hit of a turn that has one).
    hit_rate: float
    extra: dict[str, float] = field(default_factory=dict)


def iter_turns(
    trajectories: Iterable[Trajectory], block_tokens: int = 64
) -> Iterator[tuple[Trajectory, int, Turn, int, int]]:
    """(trajectory, index, turn, prompt tokens, hit tokens) of every turn, subagents included."""
    for root in trajectories:
        for tr in root.walk():
            ctx = tr.first_tokens
            for i, t in enumerate(tr.turns):
                prompt = t.prompt(ctx)
                # Nothing of an agent is stored before its first turn has run.
                stored = (ctx // block_tokens) * block_tokens if i else 0
                yield tr, i, t, prompt, t.hit(stored, prompt)
                ctx = prompt + t.gen_tokens


def stats(trajectories: list[Trajectory], block_tokens: int = 64) -> TraceStats:
    """Summary of a trace, including the block-granular prefix hit rate."""
    turns = appended = generated = prompt_sum = hits = 0
    max_ctx = 0
    agents = 0
    for _, i, t, prompt, hit in iter_turns(trajectories, block_tokens):
        agents += i == 0
        hits += hit
        prompt_sum += prompt
        appended += t.append_tokens
        generated += t.gen_tokens
        turns += 1
        max_ctx = max(max_ctx, prompt + t.gen_tokens)
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
        extra={"trajectories_incl_subagents": float(agents)},
    )


def _turn_dict(t: Turn) -> dict[str, object]:
    d = asdict(t)
    for k in ("prompt_tokens", "hit_tokens"):
        if d[k] == DERIVED:
            del d[k]
    return d


def to_dict(tr: Trajectory) -> dict[str, object]:
    out: dict[str, object] = {
        "agent_id": tr.agent_id,
        "start_s": tr.start_s,
        "first_tokens": tr.first_tokens,
        "turns": [_turn_dict(t) for t in tr.turns],
    }
    if tr.after_turn:
        out["after_turn"] = tr.after_turn
    if tr.subagents:
        out["subagents"] = [to_dict(s) for s in tr.subagents]
    return out


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
            prompt = int(t.get("prompt_tokens", DERIVED))
            hit = int(t.get("hit_tokens", DERIVED))
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(
                f"{where}.turns[{i}]: needs integer append_tokens and gen_tokens ({err})"
            ) from None
        # A recorded prompt may be shorter than the context before it (compaction).
        if prompt < 0 and (append < 0 or append + gen == 0) or gen < 0 or think < 0:
            raise ValueError(f"{where}.turns[{i}]: lengths and think_s must be >= 0, not all 0")
        if prompt == 0 or prompt < DERIVED or hit < DERIVED or (prompt > 0 and hit > prompt):
            raise ValueError(
                f"{where}.turns[{i}]: prompt_tokens must be >= 1 and hit_tokens in 0..prompt_tokens"
            )
        turns.append(Turn(append, gen, think, prompt, hit))
    subs_raw = obj.get("subagents", [])
    if not isinstance(subs_raw, list):
        raise ValueError(f"{where}.subagents: must be a list")
    try:
        first = int(obj.get("first_tokens", 0))  # type: ignore[arg-type]
        start = float(obj.get("start_s", 0.0))  # type: ignore[arg-type]
        after = int(obj.get("after_turn", 0))  # type: ignore[arg-type]
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"{where}: first_tokens, start_s, after_turn must be numbers ({err})"
        ) from None
    if first < 0 or start < 0 or after < 0:
        raise ValueError(f"{where}: first_tokens, start_s and after_turn must be >= 0")
    return Trajectory(
        agent_id=str(obj.get("agent_id", where)),
        turns=turns,
        first_tokens=first,
        start_s=start,
        subagents=[from_dict(sub, f"{where}.subagents[{j}]") for j, sub in enumerate(subs_raw)],
        after_turn=after,
    )


def save_jsonl(
    path: str | Path, trajectories: Iterable[Trajectory], meta: dict[str, object] | None = None
) -> int:
    """Write one trajectory per line (after a `{"meta": ...}` line if given); returns how many
    trajectories were written."""
    n = 0
    with Path(path).open("w") as f:
        if meta:
            f.write(json.dumps({"meta": meta}, separators=(",", ":")) + "\n")
        for tr in trajectories:
            f.write(json.dumps(to_dict(tr), separators=(",", ":")) + "\n")
            n += 1
    return n


def _iter_records(path: str | Path) -> Iterator[tuple[str, dict[str, object]]]:
    p = Path(path)
    with p.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{p}:{lineno}: not valid JSON: {err}") from None
            yield f"{p}:{lineno}", obj


def iter_jsonl(path: str | Path) -> Iterator[Trajectory]:
    for where, obj in _iter_records(path):
        if isinstance(obj, dict) and "meta" in obj and "turns" not in obj:
            continue
        yield from_dict(obj, where=where)


def load_jsonl(path: str | Path) -> list[Trajectory]:
    """Load a recorded trace (see the module docstring for the format)."""
    return list(iter_jsonl(path))


def load_trace(path: str | Path) -> tuple[dict[str, object], list[Trajectory]]:
    """(meta, trajectories) of a trace file; meta is {} for a file without a meta line."""
    meta: dict[str, object] = {}
    trs = []
    for where, obj in _iter_records(path):
        if isinstance(obj, dict) and "meta" in obj and "turns" not in obj:
            if not isinstance(obj["meta"], dict):
                raise ValueError(f"{where}.meta: must be an object")
            meta = obj["meta"]
            continue
        trs.append(from_dict(obj, where=where))
    return meta, trs


def _quantiles(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"n": 0}
    s = sorted(xs)

    def q(p: float) -> float:
        return s[min(len(s) - 1, max(0, math.ceil(p * len(s)) - 1))]

    return {
        "n": len(s),
        "mean": round(sum(s) / len(s), 3),
        "p50": q(0.5),
        "p90": q(0.9),
        "p99": q(0.99),
        "max": s[-1],
    }


def turn_counts(trajectories: list[Trajectory], block_tokens: int = 64) -> dict[str, int]:
    """What kind of turn each turn is, counted: one definition for `dualpath trace stats` and
    the importers' meta line (`trace_import`), over sessions and subagents alike.

    - first turns (turn 0 of a session or subagent): `first_turns_prefix_hit` (some leading
      blocks already stored: a shared system/tool prefix, or a parent's blocks) or
      `first_turns_full_miss`;
    - `partial_hit_turns`: a later turn that hits less than it would if everything before it
      (previous prompt + output, in whole blocks) were stored and re-sent verbatim;
    - `negative_append_turns`: a later turn whose prompt is shorter than the context before it
      (previous prompt + output). Two kinds: `compacted_turns`, shorter than the previous
      prompt itself (the client compacted or restarted the history), and
      `output_trimmed_turns`, at least the previous prompt but not all of its output (the
      client re-sent the previous answer shortened, e.g. without its thinking blocks)."""
    c = dict.fromkeys(
        (
            "turns",
            "first_turns",
            "first_turns_prefix_hit",
            "first_turns_full_miss",
            "partial_hit_turns",
            "negative_append_turns",
            "compacted_turns",
            "output_trimmed_turns",
        ),
        0,
    )
    for root in trajectories:
        for tr in root.walk():
            ctx = tr.first_tokens
            prev_prompt = 0
            for i, t in enumerate(tr.turns):
                prompt = t.prompt(ctx)
                stored = (ctx // block_tokens) * block_tokens if i else 0
                hit = t.hit(stored, prompt)
                c["turns"] += 1
                if i == 0:
                    c["first_turns"] += 1
                    c["first_turns_prefix_hit" if hit > 0 else "first_turns_full_miss"] += 1
                else:
                    c["partial_hit_turns"] += hit < min(stored, prompt - 1)
                    if prompt < ctx:
                        c["negative_append_turns"] += 1
                        c[
                            "compacted_turns" if prompt < prev_prompt else "output_trimmed_turns"
                        ] += 1
                prev_prompt = prompt
                ctx = prompt + t.gen_tokens
    return c


def describe(trajectories: list[Trajectory], block_tokens: int = 64) -> dict[str, object]:
    """Distributions of a trace (what `dualpath trace stats` prints): per-turn prompt, appended,
    generated and hit tokens, think times, turns per session, subagents."""
    prompts: list[float] = []
    appends: list[float] = []
    gens: list[float] = []
    thinks: list[float] = []
    hit_frac: list[float] = []
    hits = prompt_sum = over = 0
    per_session: list[float] = []
    subagents = 0
    for root in trajectories:
        n = 0
        for tr in root.walk():
            subagents += tr is not root
            ctx = tr.first_tokens
            for i, t in enumerate(tr.turns):
                prompt = t.prompt(ctx)
                stored = (ctx // block_tokens) * block_tokens if i else 0
                hit = t.hit(stored, prompt)
                prompts.append(prompt)
                appends.append(prompt - ctx)
                gens.append(t.gen_tokens)
                if i:
                    thinks.append(t.think_s)
                hit_frac.append(hit / prompt)
                hits += hit
                prompt_sum += prompt
                over += prompt > 131_072
                ctx = prompt + t.gen_tokens
                n += 1
        per_session.append(n)
    counts = turn_counts(trajectories, block_tokens)
    return {
        "sessions": len(trajectories),
        "subagents": subagents,
        "turns": len(prompts),
        "turns_per_session": _quantiles(per_session),
        "prompt_tokens": _quantiles(prompts),
        "append_tokens": _quantiles(appends),
        "output_tokens": _quantiles(gens),
        "think_s": _quantiles(thinks),
        "hit_ratio_tokens": round(hits / max(prompt_sum, 1), 4),
        "hit_ratio_per_turn": _quantiles(hit_frac),
        **{k: v for k, v in counts.items() if k != "turns"},
        "turns_over_128k": over,
        "total_prompt_tokens": prompt_sum,
        "total_output_tokens": int(sum(gens)),
    }


def cap_think(tr: Trajectory, cap_s: float, root: bool = True) -> Trajectory:
    """`tr` with every think time, and its subagents' start delays, at most `cap_s`."""
    return replace(
        tr,
        turns=[t if t.think_s <= cap_s else replace(t, think_s=cap_s) for t in tr.turns],
        start_s=tr.start_s if root else min(tr.start_s, cap_s),
        subagents=[cap_think(s, cap_s, root=False) for s in tr.subagents],
    )


def replay(
    recorded: list[Trajectory],
    count: int,
    arrival_rate_per_s: float = 0.0,
    seed: int | None = None,
) -> list[Trajectory]:
    """`count` sessions drawn from a recorded trace, cycling it (in order, or shuffled by
    `seed`); all start at 0 (offline), or as a Poisson process of `arrival_rate_per_s`
    (online, seeded by `seed` or 0). A session's recorded start time is not kept: the mode
    decides when sessions start."""
    if not recorded:
        raise ValueError("replay: the recorded trace has no sessions")
    order = list(range(len(recorded)))
    if seed is not None:
        random.Random(f"{seed}:order").shuffle(order)
    arrivals = random.Random(f"{seed or 0}:arrivals")
    out: list[Trajectory] = []
    t = 0.0
    n = len(recorded)
    for i in range(count):
        if arrival_rate_per_s > 0:
            t += arrivals.expovariate(arrival_rate_per_s)
        src = recorded[order[i % n]]
        aid = src.agent_id if i < n else f"{src.agent_id}#{i // n}"
        out.append(replace(src, agent_id=aid, start_s=round(t, 6)))
    return out


def scale_to_context(
    recorded: list[Trajectory], context_tokens: int, sessions: int, turns: int
) -> list[Trajectory]:
    """The first `sessions` sessions' first `turns` turns (subagents dropped), every length
    multiplied by one factor so the longest prompt + output fits `context_tokens`: prompts,
    hits and outputs keep their proportions (partial hits stay partial), think times are
    kept. For replaying a real trace on a small model (`dualpath bench local --trace`)."""
    if context_tokens < 16 or sessions < 1 or turns < 1:
        raise ValueError("scale_to_context: context_tokens >= 16, sessions >= 1, turns >= 1")
    picked = [replace(t, turns=t.turns[:turns], subagents=[]) for t in recorded[:sessions]]
    longest = max(
        (p + t.gen_tokens for _, _, t, p, _ in iter_turns(picked)), default=context_tokens
    )
    f = min(1.0, (context_tokens - 1) / longest)
    out = []
    for tr in picked:
        ctx = 0
        new_turns = []
        for i, (_, _, t, prompt, hit) in enumerate(iter_turns([tr])):
            p = max(2, int(prompt * f))
            g = max(1, int(t.gen_tokens * f))
            h = min(int(hit * f), p - 1)
            new_turns.append(Turn(p - ctx, g, t.think_s if i else 0.0, p, h))
            ctx = p + g
        out.append(Trajectory(tr.agent_id, new_turns, 0, tr.start_s))
    return out


def stagger(trajectories: list[Trajectory], first: int, spread_s: float) -> list[Trajectory]:
    """The first `first` trajectories starting evenly over [0, spread_s) instead of all at 0
    (a steady-state run ramps up over its warm-up instead of sending every session's first,
    most expensive, prompt at once); the rest unchanged."""
    if first <= 0 or spread_s <= 0:
        return trajectories
    return [
        replace(t, start_s=round(spread_s * i / first, 6)) if i < first else t
        for i, t in enumerate(trajectories)
    ]


def join_midway(
    trajectories: list[Trajectory], first: int, seed: int | None = None, block_tokens: int = 64
) -> list[Trajectory]:
    """The first `first` trajectories joined at a random turn (seeded), as if they had been
    running before the clock started: the turn keeps its prompt and its hit (recorded, or the
    full blocks of the context before it), earlier turns and the subagents they spawned are
    dropped. A steady-state run then sees every phase of a session from the start, not only
    the first (most expensive) prompts; the rest are unchanged (they start from turn 0)."""
    rng = random.Random(f"{seed or 0}:midway")
    out = []
    for i, tr in enumerate(trajectories):
        if i >= first or len(tr.turns) < 2:
            out.append(tr)
            continue
        k = rng.randrange(len(tr.turns))
        if k == 0:
            out.append(tr)
            continue
        _, _, t, prompt, hit = list(iter_turns([replace(tr, subagents=[])], block_tokens))[k]
        head = Turn(prompt, t.gen_tokens, 0.0, prompt, hit)
        subs = [replace(s, after_turn=s.after_turn - k) for s in tr.subagents if s.after_turn >= k]
        out.append(replace(tr, turns=[head, *tr.turns[k + 1 :]], first_tokens=0, subagents=subs))
    return out
