"""The agentic trace generator and its JSONL form."""

from __future__ import annotations

import pytest
from dualpath import trace
from dualpath.trace import TraceSpec, Trajectory, Turn


def test_same_seed_same_trace_other_seed_differs() -> None:
    spec = TraceSpec(agents=5, seed=3)
    assert trace.generate(spec) == trace.generate(spec)
    assert trace.generate(spec) != trace.generate(TraceSpec(agents=5, seed=4))


def test_agent_does_not_depend_on_agent_count() -> None:
    few = trace.generate(TraceSpec(agents=2, seed=1))
    many = trace.generate(TraceSpec(agents=9, seed=1))
    assert few == many[:2]


@pytest.mark.parametrize("name", sorted(trace.TRACE_PRESETS))
def test_presets_respect_cap_and_hit_rate(name: str) -> None:
    spec = trace.preset_spec(name, agents=20, seed=0)
    trs = trace.generate(spec)
    for tr in trs:
        assert tr.final_context_tokens <= spec.max_context_tokens
        assert 1 <= len(tr.turns) <= spec.max_turns
        assert tr.turns[0].think_s == 0.0
    s = trace.stats(trs)
    # Long shared prefixes: the paper reports 98.7%; the synthetic traces land in the 90s.
    assert 0.95 < s.hit_rate < 1.0
    assert abs(s.mean_append_tokens - spec.mean_append_tokens) < 0.25 * spec.mean_append_tokens


def test_poisson_arrivals_are_increasing_with_the_right_rate() -> None:
    trs = trace.generate(TraceSpec(agents=400, seed=2, max_turns=1), arrival_rate_per_s=4.0)
    starts = [t.start_s for t in trs]
    assert starts == sorted(starts) and starts[0] > 0
    assert 3.0 < len(starts) / starts[-1] < 5.0


def test_prompt_tokens_accumulate() -> None:
    tr = Trajectory("x", [Turn(10, 5), Turn(7, 3, 1.0)], first_tokens=100)
    assert tr.prompt_tokens(0) == 110
    assert tr.prompt_tokens(1) == 110 + 5 + 7
    assert tr.final_context_tokens == 125


def test_jsonl_round_trip(tmp_path) -> None:
    trs = trace.generate(TraceSpec(agents=3, seed=5), arrival_rate_per_s=1.0)
    path = tmp_path / "t.jsonl"
    assert trace.save_jsonl(path, trs) == 3
    assert trace.load_jsonl(path) == trs


def test_jsonl_errors_name_the_line_and_field(tmp_path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"turns": [{"append_tokens": 1, "gen_tokens": 1}]}\n{"turns": [{}]}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2.*turns\[0\]"):
        trace.load_jsonl(path)
    path.write_text("not json\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: not valid JSON"):
        trace.load_jsonl(path)


def test_bad_spec_names_the_field() -> None:
    with pytest.raises(ValueError, match="TraceSpec.agents"):
        TraceSpec(agents=0)
