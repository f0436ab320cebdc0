"""Importers of real traces (claude-code, mooncake) and `dualpath trace import|stats`.

Hand-made records pin the inference rules; a few files of `../shared/traces` (the real public
traces, never copied into the repository) check the importers on real data when present.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from dualpath import trace
from dualpath.cli import main
from dualpath.trace import Trajectory, Turn
from dualpath.trace_import import (
    claude_code_session,
    import_claude_code,
    import_mooncake,
    traces_dir,
)

REPO = Path(__file__).resolve().parents[3]
TRACES = traces_dir(REPO)
needs_traces = pytest.mark.skipif(
    TRACES is None, reason="real traces absent: no ../shared/traces next to the repository"
)


def _req(t: float, prompt: int, out: int, ids: list[int], think: float = 0.0) -> dict:
    return {
        "t": t,
        "type": "n",
        "in": prompt,
        "out": out,
        "hash_ids": ids,
        "think_time": think,
        "api_time": 1.0,
    }


def test_claude_code_hits_partial_hits_shared_prefix_and_subagents() -> None:
    session = {
        "block_size": 64,
        "system_tokens": 100,
        "tool_tokens": 60,
        "requests": [
            _req(0, 300, 100, [1, 2, 3, 4]),
            # Extends the first prompt: hit = full blocks of 300 + 100 (output assumed stored).
            _req(5, 400, 20, [1, 2, 3, 4, 5, 6]),
            {
                "t": 7.5,
                "type": "subagent",
                "agent_id": "x",
                "system_tokens": 0,
                "tool_tokens": 0,
                "requests": [_req(0, 200, 5, [90, 91, 92]), _req(2, 260, 5, [90, 91, 92, 93], 1.5)],
            },
            # Compaction: only the first two blocks are the same prefix.
            _req(9, 200, 30, [1, 2, 7], think=3.0),
        ],
    }
    tr, inf = claude_code_session(session, "s1")
    assert [t.prompt_tokens for t in tr.turns] == [300, 400, 200]
    # Turn 0: the system + tool prefix (160 tokens -> 128 in whole blocks) is shared.
    assert [t.hit_tokens for t in tr.turns] == [128, 384, 128]
    assert [t.append_tokens for t in tr.turns] == [300, 0, 200 - 420]
    assert tr.turns[2].think_s == 3.0 and tr.turns[0].think_s == 0.0
    (sub,) = tr.subagents
    assert sub.after_turn == 2 and sub.start_s == pytest.approx(7.5 - 6.0)
    assert [t.hit_tokens for t in sub.turns] == [0, 192]
    assert inf.not_extending == 1 and inf.output_assumed_stored == 1
    assert inf.shared_prefix_turns == 1 and inf.subagents == 1 and inf.turns == 5
    # The model replays it: prompts and hits come back from the file unchanged.
    assert tr.prompt_tokens(2) == 200 and tr.final_context_tokens == 230
    st = trace.stats([tr])
    assert st.turns == 5 and st.extra["trajectories_incl_subagents"] == 2


def test_turn_counts_name_partial_hits_first_turns_and_negative_appends() -> None:
    session = {
        "block_size": 64,
        "system_tokens": 100,
        "tool_tokens": 60,
        "requests": [
            _req(0, 300, 100, [1, 2, 3, 4, 5]),
            # Re-sends the first prompt and only part of its output: 350 < 300 + 100.
            _req(5, 350, 20, [1, 2, 3, 4, 8, 9]),
            {
                "t": 7.5,
                "type": "subagent",
                "agent_id": "x",
                "requests": [_req(0, 200, 5, [90, 91, 92])],
            },
            # Compaction: shorter than the previous prompt, only two blocks the same prefix.
            _req(9, 200, 30, [1, 2, 7], think=3.0),
        ],
    }
    tr, _ = claude_code_session(session, "s1")
    c = trace.turn_counts([tr])
    assert c["first_turns"] == 2 and c["first_turns_prefix_hit"] == 1  # the root's shared prefix
    assert c["first_turns_full_miss"] == 1  # the subagent's first turn
    assert c["negative_append_turns"] == 2
    assert c["output_trimmed_turns"] == 1 and c["compacted_turns"] == 1
    # Turn 1 hits the 4 blocks it re-sent (256 of 384 stored by the growth model); turn 2, 128.
    assert c["partial_hit_turns"] == 2
    assert trace.describe([tr])["partial_hit_turns"] == 2


def test_import_meta_and_stats_count_the_same(tmp_path, capsys) -> None:
    src = tmp_path / "cc"
    src.mkdir()
    (src / "s1.json").write_text(
        json.dumps(
            {
                "block_size": 64,
                "system_tokens": 64,
                "requests": [
                    _req(0, 300, 100, [1, 2, 3, 4, 5]),
                    _req(5, 350, 20, [1, 2, 3, 4, 8, 9]),
                    _req(9, 200, 30, [1, 2, 7], think=3.0),
                ],
            }
        )
    )
    out = tmp_path / "cc.jsonl"
    assert main(["trace", "import", "claude-code", str(src), "-o", str(out)]) == 0
    meta = json.loads(capsys.readouterr().out)
    assert main(["trace", "stats", str(out), "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    for key, n in meta["counts"].items():
        assert st[key] == n, key
    assert meta["counts"]["partial_hit_turns"] == 2
    assert meta["counts"]["first_turns_prefix_hit"] == 1


@needs_traces
def test_real_import_meta_and_stats_agree_on_partial_hits_and_first_turns(tmp_path, capsys) -> None:
    src = tmp_path / "cc"
    src.mkdir()
    # Sessions with subagents among them: their first turns hit their parent's blocks.
    for f in sorted((TRACES / "claude-code").glob("*.json.gz"))[:25]:
        (src / f.name).symlink_to(f)
    out = tmp_path / "cc.jsonl"
    assert main(["trace", "import", "claude-code", str(src), "-o", str(out)]) == 0
    meta = json.loads(capsys.readouterr().out)
    assert main(["trace", "stats", str(out), "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    for key in ("partial_hit_turns", "first_turns_prefix_hit", "negative_append_turns"):
        assert st[key] == meta["counts"][key], key
    assert st["partial_hit_turns"] > 0
    neg = st["negative_append_turns"]
    assert neg == st["compacted_turns"] + st["output_trimmed_turns"] > 0


def test_without_shared_prefix_turn_zero_misses() -> None:
    tr, _ = claude_code_session({"requests": [_req(0, 300, 10, [1, 2, 3, 4])]}, "s", False)
    assert tr.turns[0].hit_tokens == 0


def test_mooncake_chains_sessions_and_shares_prefixes_across_them() -> None:
    recs = [
        {"timestamp": 0, "input_length": 1100, "output_length": 50, "hash_ids": [0, 1, 2]},
        {"timestamp": 500, "input_length": 700, "output_length": 20, "hash_ids": [0, 9]},
        # Continues the first (its two full blocks are this prompt's prefix).
        {"timestamp": 4000, "input_length": 1700, "output_length": 30, "hash_ids": [0, 1, 3, 4]},
    ]
    trs, inf = import_mooncake(recs, block=512)
    assert [len(t.turns) for t in trs] == [2, 1]
    a, b = trs
    assert b.turns[0].hit_tokens == 512 and b.start_s == 0.5  # shared block 0, other session
    assert a.turns[1].think_s == 4.0
    # 1100 + 50 tokens -> 2 full blocks of 512 stored, all re-sent.
    assert a.turns[1].hit_tokens == 1024
    assert inf.sessions_chained == 1 and inf.think_from_timestamps == 1


def test_new_fields_round_trip_and_old_files_still_load(tmp_path) -> None:
    tr, _ = claude_code_session(
        {"requests": [_req(0, 300, 10, [1, 2, 3, 4]), _req(1, 100, 5, [1, 8])]}, "s"
    )
    tr.subagents.append(trace.Trajectory("s/x", [trace.Turn(10, 5)], start_s=2.0, after_turn=1))
    path = tmp_path / "t.jsonl"
    trace.save_jsonl(path, [tr], meta={"name": "hand"})
    meta, back = trace.load_trace(path)
    assert meta == {"name": "hand"} and back == [tr]
    assert trace.load_jsonl(path) == [tr]
    old = tmp_path / "old.jsonl"
    old.write_text('{"agent_id":"a","turns":[{"append_tokens":5,"gen_tokens":2,"think_s":0}]}\n')
    (o,) = trace.load_jsonl(old)
    assert o.turns[0].prompt_tokens == trace.DERIVED and o.prompt_tokens(0) == 5


def test_recorded_hit_over_the_prompt_is_refused(tmp_path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"turns":[{"append_tokens":5,"gen_tokens":2,"prompt_tokens":5,"hit_tokens":9}]}\n'
    )
    with pytest.raises(ValueError, match=r"turns\[0\].*hit_tokens"):
        trace.load_jsonl(path)


def test_synthetic_shared_prefix_hits_turn_zero() -> None:
    spec = trace.TraceSpec(agents=2, max_turns=3, first_tokens=1024, shared_prefix_tokens=512)
    trs = trace.generate(spec)
    assert trs[0].turns[0].hit_tokens == 512 and trs[0].turns[1].hit_tokens == trace.DERIVED
    plain = trace.generate(trace.TraceSpec(agents=2, max_turns=3, first_tokens=1024))
    assert trace.stats(trs).hit_rate > trace.stats(plain).hit_rate


@needs_traces
def test_real_claude_code_sessions_import(tmp_path) -> None:
    files = sorted((TRACES / "claude-code").glob("*.json.gz"))[:4]
    trs, inf = import_claude_code(files)
    assert len(trs) == 4 and inf.turns == sum(len(list(trace.iter_turns([t]))) for t in trs)
    for tr in trs:
        raw = json.load(gzip.open(TRACES / "claude-code" / f"{tr.agent_id}.json.gz"))
        mains = [r for r in raw["requests"] if r.get("type") != "subagent"]
        assert [t.prompt_tokens for t in tr.turns] == [r["in"] for r in mains]
        for t in tr.turns:
            assert 0 <= t.hit_tokens < t.prompt_tokens
    d = trace.describe(trs)
    # Agentic coding: long shared contexts, almost all of each prompt a prefix hit.
    assert d["hit_ratio_tokens"] > 0.9 and d["prompt_tokens"]["p50"] > 20_000


@needs_traces
def test_trace_import_and_stats_cli(tmp_path, capsys) -> None:
    src = tmp_path / "cc"
    src.mkdir()
    for f in sorted((TRACES / "claude-code").glob("*.json.gz"))[:3]:
        (src / f.name).symlink_to(f)
    out = tmp_path / "cc.jsonl"
    assert main(["trace", "import", "claude-code", str(src), "-o", str(out)]) == 0
    meta = json.loads(capsys.readouterr().out)
    assert meta["sessions"] == 3 and meta["inferred"]["turns"] > 3
    assert main(["trace", "stats", str(out), "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["sessions"] == 3 and st["meta"]["inferred"] == meta["inferred"]
    assert main(["trace", "stats", str(out)]) == 0
    text = capsys.readouterr().out
    assert "hit ratio" in text and "inferred" in text and "output_assumed_stored" in text
    mc = TRACES / "mooncake" / "conversation_trace.jsonl.gz"
    assert (
        main(["trace", "stats", "--format", "mooncake", "--limit", "500", str(mc), "--json"]) == 0
    )
    st = json.loads(capsys.readouterr().out)
    assert st["turns"] == 500 and st["meta"]["inferred"]["sessions_chained"] > 0


def test_stats_refuses_a_missing_path(capsys) -> None:
    assert main(["trace", "stats", "/nonexistent/x.jsonl"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_scale_to_context_keeps_proportions_and_partial_hits() -> None:
    tr, _ = claude_code_session(
        {
            "requests": [
                _req(0, 64_000, 640, list(range(1000))),
                _req(1, 128_000, 1280, list(range(2000)), think=5.0),
                _req(2, 32_000, 320, [0, 1, 2, 3] + [9000 + i for i in range(496)], think=7.0),
            ]
        },
        "big",
    )
    (small,) = trace.scale_to_context([tr, tr], 8192, sessions=1, turns=3)
    prompts = [t.prompt_tokens for t in small.turns]
    assert max(p + t.gen_tokens for p, t in zip(prompts, small.turns, strict=True)) <= 8192
    assert prompts[1] == pytest.approx(2 * prompts[0], rel=0.01)
    assert small.turns[2].hit_tokens < small.turns[2].prompt_tokens // 4  # still partial
    assert [t.think_s for t in small.turns] == [0.0, 5.0, 7.0]
    assert small.prompt_tokens(2) == prompts[2]


def test_join_midway_keeps_the_turns_prompt_and_hit_and_drops_what_came_before() -> None:
    grown = trace.generate(trace.TraceSpec(agents=6, max_turns=10, seed=4))
    joined = trace.join_midway(grown, 4, seed=1)
    assert joined[4:] == grown[4:]
    moved = [(g, j) for g, j in zip(grown[:4], joined[:4], strict=True) if j != g]
    assert moved
    for g, j in moved:
        k = len(g.turns) - len(j.turns)
        head = j.turns[0]
        assert head.prompt_tokens == g.prompt_tokens(k)
        ctx = g.prompt_tokens(k - 1) + g.turns[k - 1].gen_tokens
        assert head.hit_tokens == (ctx // 64) * 64 and j.turns[1:] == g.turns[k + 1 :]
        assert j.final_context_tokens == g.final_context_tokens
    child = Trajectory("c", [Turn(10, 1)], after_turn=3)
    rec = Trajectory(
        "r", [Turn(1000, 5, 0.0, 1000, 64 * i) for i in range(1, 7)], subagents=[child]
    )
    for seed in range(20):
        (j,) = trace.join_midway([rec], 1, seed=seed)
        k = 6 - len(j.turns)
        assert j.turns[0].hit_tokens == 64 * (k + 1)
        assert [s.after_turn for s in j.subagents] == ([3 - k] if k <= 3 else [])


@needs_traces
def test_real_sessions_replay_in_the_simulator(tmp_path, capsys) -> None:
    files = sorted((TRACES / "claude-code").glob("*.json.gz"))[:3]
    trs, _ = import_claude_code(files)
    path = tmp_path / "cc3.jsonl"
    trace.save_jsonl(path, trs, meta={"name": "cc3"})
    argv = ["sim", "--preset", "offline-64k", "--trace", str(path), "--xs", "3", "--json"]
    assert main([*argv, "--quiet", "--think-cap", "30"]) == 0
    out = json.loads(capsys.readouterr().out)
    turns = sum(1 for _ in trace.iter_turns(trs))
    over = sum(1 for _, _, t, p, _ in trace.iter_turns(trs) if p + t.gen_tokens > 131_072)
    assert out["trace"] == "cc3"
    for st in out["points"][0]["policies"].values():
        assert st["complete"] and st["turns"] == turns and st["truncated_context"] == over
