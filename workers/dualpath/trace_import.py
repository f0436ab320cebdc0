"""Importers of real request traces into the `dualpath.trace` model. Pure over parsed records.

Two public formats (see `../shared/traces/README.md`):
- Claude Code sessions (callanjfox/kv-cache-tester): one gzip'd JSON per session, requests with
  `in`/`out` tokens, `think_time`, and `hash_ids` (one id per 64-token block; equal ids at equal
  positions = the same prefix); `type: "subagent"` entries hold a subagent's own requests.
- Mooncake FAST'25 (kvcache-ai/Mooncake): JSONL, one request a line (`timestamp` ms,
  `input_length`, `output_length`, `hash_ids` per 512-token block, global across requests),
  no session ids: sessions are recovered by prefix chaining.

What a trace does not say is inferred by explicit rules, and each import returns an `Inferred`
tally so `dualpath trace stats` can say what it had to guess:
- hit: the longest prefix of a request's blocks that an earlier request (any session of the file
  for global ids, this session for local ones) sent, in whole blocks. When a request extends the
  previous one of its session completely, the previous request's *output* is assumed stored and
  re-sent verbatim too (the decode node writes it; the trace has no ids for it): the hit is then
  the full blocks of previous prompt + output, as in the growth model;
- shared prefix (Claude Code, option): turn 0 of every session hits the full blocks of its
  `system_tokens + tool_tokens`, assumed stored by an earlier session of the same client;
- subagent start: after the last parent request that started before it, delayed by the recorded
  gap from that request's end (`t + api_time`) to the subagent's `t`;
- Mooncake sessions: a request continues the open session whose last request's full blocks are
  the longest prefix of its own (its last id, a partial block, is dropped); think time = gap between the two timestamps (it includes the
  previous request's service time, which the format does not record).
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dualpath.trace import Trajectory, Turn, turn_counts

FORMATS = ("claude-code", "mooncake")


def traces_dir(repo_root: Path) -> Path | None:
    """The shared real traces: $DUALPATH_TRACES, else `../shared/traces` next to the repository
    (the main checkout), else `shared/traces` inside it; None if none exists."""
    env = os.environ.get("DUALPATH_TRACES")
    candidates = [Path(env)] if env else []
    candidates += [repo_root.parent / "shared" / "traces", repo_root / "shared" / "traces"]
    return next((c for c in candidates if (c / "claude-code").is_dir()), None)


@dataclass(slots=True)
class Inferred:
    """Counts of what an import had to infer (see the module docstring)."""

    turns: int = 0
    output_assumed_stored: int = 0  # turns whose hit includes the previous output's blocks
    # Turns whose blocks do not extend the previous request's completely (compaction, a
    # re-send): their hit is only what the ids say, no output assumed stored. Not the
    # partial-hit count (`meta["counts"]`, `trace.turn_counts`): such a turn may still hit all.
    not_extending: int = 0
    shared_prefix_turns: int = 0  # first turns given a shared system/tool prefix hit
    subagents: int = 0
    subagent_start_inferred: int = 0
    sessions_chained: int = 0  # Mooncake: sessions of 2+ requests recovered by prefix chaining
    think_from_timestamps: int = 0  # Mooncake: think times taken from timestamp gaps
    skipped_requests: int = 0  # records without usable lengths

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def add(self, other: Inferred) -> None:
        for k, v in asdict(other).items():
            setattr(self, k, getattr(self, k) + v)


class _Store:
    """Blocks sent so far, as (position, id): equal ids at equal positions are equal prefixes,
    and whole prefixes are stored, so "block k is stored" implies blocks 0..k-1 are."""

    __slots__ = ("seen",)

    def __init__(self) -> None:
        self.seen: set[tuple[int, int]] = set()

    def hit_blocks(self, ids: list[int]) -> int:
        # Binary search on the prefix-closed set: the largest k with block k-1 stored.
        seen = self.seen
        lo, hi = 0, len(ids)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if (mid - 1, ids[mid - 1]) in seen:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def add(self, ids: list[int], known: int = 0) -> None:
        """Store `ids`, of which the first `known` blocks are stored already."""
        self.seen.update(zip(range(known, len(ids)), ids[known:], strict=True))


def _hit_tokens(
    store: _Store,
    ids: list[int],
    prompt: int,
    prev: tuple[list[int], int, int] | None,
    block: int,
    inf: Inferred,
) -> int:
    """Hit of a request with block `ids` and `prompt` tokens (then stores its blocks); `prev` =
    (ids, prompt, out) of the session's previous request."""
    k = store.hit_blocks(ids)
    store.add(ids, k)
    hit = k * block
    if prev is not None:
        pids, pprompt, pout = prev
        if k >= len(pids) and ids[: len(pids)] == pids:
            # Extends the previous prompt completely: its output was stored by the decode node.
            grown = ((pprompt + pout) // block) * block
            if grown > hit:
                hit = grown
                inf.output_assumed_stored += 1
        else:
            inf.not_extending += 1
    return max(0, min(hit, prompt - 1))


def _int(rec: dict[str, Any], key: str) -> int | None:
    v = rec.get(key)
    return int(v) if isinstance(v, (int, float)) and v >= 0 else None


# -- Claude Code -------------------------------------------------------------------------------


def claude_code_session(
    obj: dict[str, Any], name: str, shared_prefix: bool = True
) -> tuple[Trajectory, Inferred]:
    """One Claude Code session file (parsed JSON) -> a trajectory with its subagents."""
    if not isinstance(obj, dict) or not isinstance(obj.get("requests"), list):
        raise ValueError(f"{name}: not a Claude Code session (needs a 'requests' list)")
    block = int(obj.get("block_size") or 64)
    inf = Inferred()
    store = _Store()  # hash_id_scope "local": ids are unique within the file
    tr = _cc_agent(obj, name, block, store, inf, shared_prefix, parent_t=None)
    return tr, inf


def _cc_agent(
    obj: dict[str, Any],
    agent_id: str,
    block: int,
    store: _Store,
    inf: Inferred,
    shared_prefix: bool,
    parent_t: list[tuple[float, float]] | None,
) -> Trajectory:
    turns: list[Turn] = []
    subs: list[tuple[float, dict[str, Any]]] = []
    ends: list[tuple[float, float]] = []  # (t, t + api_time) of this agent's requests
    prev: tuple[list[int], int, int] | None = None
    ctx = 0
    shared = int(obj.get("system_tokens") or 0) + int(obj.get("tool_tokens") or 0)
    for rec in obj["requests"]:
        if not isinstance(rec, dict):
            inf.skipped_requests += 1
            continue
        if rec.get("type") == "subagent":
            subs.append((float(rec.get("t") or 0.0), rec))
            continue
        prompt, out = _int(rec, "in"), _int(rec, "out")
        ids = rec.get("hash_ids")
        if not prompt or out is None or not isinstance(ids, list):
            inf.skipped_requests += 1
            continue
        hit = _hit_tokens(store, ids, prompt, prev, block, inf)
        if not turns and shared_prefix and shared:
            s = min((shared // block) * block, prompt - 1)
            if s > hit:
                hit = s
                inf.shared_prefix_turns += 1
        think = float(rec.get("think_time") or 0.0) if turns else 0.0
        turns.append(
            Turn(
                append_tokens=prompt - ctx,
                gen_tokens=max(out, 1),
                think_s=max(0.0, think),
                prompt_tokens=prompt,
                hit_tokens=hit,
            )
        )
        inf.turns += 1
        ctx = prompt + max(out, 1)
        prev = (ids, prompt, max(out, 1))
        t = float(rec.get("t") or 0.0)
        ends.append((t, t + float(rec.get("api_time") or 0.0)))
    tr = Trajectory(agent_id=agent_id, turns=turns)
    for j, (t, rec) in enumerate(subs):
        sub_id = f"{agent_id}/{rec.get('agent_id') or j}"
        child = _cc_agent(rec, sub_id, block, store, inf, shared_prefix, ends)
        if not child.turns:
            continue
        # Started after the last parent request that began before it, delayed by the gap.
        after = sum(1 for s, _ in ends if s <= t)
        delay = t - ends[after - 1][1] if after else t
        child.after_turn = after
        child.start_s = round(max(0.0, delay), 6)
        inf.subagents += 1
        inf.subagent_start_inferred += 1
        tr.subagents.append(child)
    return tr


def claude_code_files(paths: Iterable[Path]) -> Iterator[Path]:
    """The session files under `paths` (files or directories), sorted."""
    for p in paths:
        if p.is_dir():
            yield from sorted(q for q in p.iterdir() if q.name.endswith((".json", ".json.gz")))
        else:
            yield p


def _read_json(path: Path) -> Any:
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rt") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: cannot read JSON: {err}") from None


def import_claude_code(
    paths: Iterable[Path], shared_prefix: bool = True, limit: int = 0
) -> tuple[list[Trajectory], Inferred]:
    """Every session under `paths` (at most `limit` if > 0), offline: all start at 0."""
    out: list[Trajectory] = []
    inf = Inferred()
    for path in claude_code_files(paths):
        if limit and len(out) >= limit:
            break
        name = path.name.split(".")[0]
        tr, i = claude_code_session(_read_json(path), name, shared_prefix)
        if tr.turns:
            out.append(tr)
        inf.add(i)
    return out, inf


# -- Mooncake ----------------------------------------------------------------------------------


def mooncake_records(path: Path) -> Iterator[dict[str, Any]]:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not valid JSON: {err}") from None


def import_mooncake(
    records: Iterable[dict[str, Any]], block: int = 512, name: str = "mc", limit: int = 0
) -> tuple[list[Trajectory], Inferred]:
    """Requests (timestamp order) -> sessions by prefix chaining; `start_s` = first timestamp.
    `limit` > 0 stops after that many requests."""
    inf = Inferred()
    store = _Store()  # ids are global: shared prefixes across sessions hit
    sessions: list[dict[str, Any]] = []
    # Open session ends: (blocks, last id) of a session's last request -> session index.
    ends: dict[tuple[int, int], int] = {}
    n = 0
    for rec in records:
        if limit and n >= limit:
            break
        n += 1
        prompt, out = _int(rec, "input_length"), _int(rec, "output_length")
        ids = rec.get("hash_ids")
        ts = rec.get("timestamp")
        if not prompt or out is None or not isinstance(ids, list) or ts is None:
            inf.skipped_requests += 1
            continue
        t = float(ts) / 1000.0
        # The last id of a prompt that is not a whole number of blocks hashes a partial block:
        # never stored as such, and never equal to the next request's block at that position.
        ids = ids[: prompt // block]
        si = None
        for k in range(len(ids), 0, -1):
            si = ends.get((k, ids[k - 1]))
            if si is not None:
                break
        if si is None:
            sess = {"start": t, "turns": [], "prev": None, "last_t": t, "key": None}
            sessions.append(sess)
            si = len(sessions) - 1
        else:
            sess = sessions[si]
            del ends[sess["key"]]
        hit = _hit_tokens(store, ids, prompt, sess["prev"], block, inf)
        out = max(out, 1)
        ctx = sess["prev"][1] + sess["prev"][2] if sess["prev"] else 0
        think = t - sess["last_t"] if sess["turns"] else 0.0
        if sess["turns"]:
            inf.think_from_timestamps += 1
        sess["turns"].append(Turn(prompt - ctx, out, round(max(0.0, think), 6), prompt, hit))
        inf.turns += 1
        sess["prev"] = (ids, prompt, out)
        sess["last_t"] = t
        if ids:
            sess["key"] = (len(ids), ids[-1])
            ends[sess["key"]] = si
    trs = []
    for i, s in enumerate(sessions):
        if len(s["turns"]) > 1:
            inf.sessions_chained += 1
        trs.append(Trajectory(f"{name}{i}", s["turns"], start_s=round(s["start"], 6)))
    return trs, inf


def import_paths(
    fmt: str, paths: list[Path], shared_prefix: bool = True, limit: int = 0
) -> tuple[list[Trajectory], dict[str, Any]]:
    """(trajectories, meta) of `paths` in format `fmt` (one of FORMATS)."""
    if fmt == "claude-code":
        trs, inf = import_claude_code(paths, shared_prefix, limit)
        block = 64
    elif fmt == "mooncake":
        trs, inf = [], Inferred()
        for p in paths:
            files = sorted(p.glob("*.jsonl*")) if p.is_dir() else [p]
            for f in files:
                t, i = import_mooncake(
                    mooncake_records(f), name=f"{f.name.split('.')[0]}:", limit=limit
                )
                trs.extend(t)
                inf.add(i)
        block = 512
    else:
        raise ValueError(f"format {fmt!r}: choose one of {', '.join(FORMATS)}")
    meta = {
        "name": f"{fmt}:{'+'.join(p.name for p in paths)}",
        "format": fmt,
        "sources": [str(p) for p in paths],
        "source_block_tokens": block,
        "sessions": len(trs),
        "shared_prefix": shared_prefix if fmt == "claude-code" else "global ids",
        "inferred": inf.as_dict(),
        # The same counts as `dualpath trace stats` of the written file (one definition).
        "counts": turn_counts(trs, block),
    }
    return trs, meta
