"""The local benchmark's replay client and summary, against the in-memory FakeBackend."""

from __future__ import annotations

from asgi_client import serving
from dualpath.config import local_default
from dualpath.frontend.app import create_app
from dualpath.frontend.backend import FakeBackend
from dualpath.local.bench import Progress, plot, replay, summarize, table
from dualpath.trace import TraceSpec, generate

CFG = local_default()


async def _replay(fake: FakeBackend, trs, seed: int, **kw):
    """`replay` against the real app over the in-memory fake cluster."""
    async with serving(create_app(CFG, fake)) as c:
        return await replay(c, trs, CFG.spec.model.name, CFG.spec.model.vocab_size, seed=seed, **kw)


async def _replay_policy(policy: str):
    trs = generate(
        TraceSpec(
            agents=3,
            max_turns=3,
            first_tokens=200,
            mean_append_tokens=70,
            mean_gen_tokens=3,
            max_context_tokens=2048,
            seed=1,
        )
    )
    progress = Progress(sum(len(t.turns) for t in trs), policy, False)
    return trs, await _replay(FakeBackend(CFG.spec.model, policy=policy), trs, 1, progress=progress)


async def test_replay_sessions_hit_and_answers_match_across_policies(tmp_path) -> None:
    trs, a = await _replay_policy("prefill-read")
    _, b = await _replay_policy("dualpath")
    assert len(a) == sum(len(t.turns) for t in trs) and all(r.ok for r in a)
    later = [r for r in a if r.turn > 0]
    assert later and all(r.cached_tokens > 0 for r in later)
    assert {(r.agent, r.turn): r.generated for r in a} == {
        (r.agent, r.turn): r.generated for r in b
    }
    assert {r.read_path for r in b if r.turn > 0} == {"prefill", "decode"}
    s = summarize("dualpath", b, 2.0, {"prefill": 1000, "decode": 3000}, 4000.0)
    assert s.pooled_snic_util == 0.5 and s.failed == 0 and 0 < s.hit_rate < 1
    assert "ratio" in table([s], 2.0)
    plot([s], str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 0


async def test_warmup_turns_are_replayed_first_and_left_out_of_the_summary() -> None:
    fake = FakeBackend(CFG.spec.model, policy="dualpath")
    trs = generate(
        TraceSpec(
            agents=3,
            max_turns=3,
            first_tokens=130,
            mean_append_tokens=20,
            mean_gen_tokens=2,
            max_context_tokens=2048,
            seed=2,
        )
    )
    warm_calls: list[int] = []
    res = await _replay(
        fake, trs, 2, warmup_turns=1, on_warm=lambda: warm_calls.append(len(fake.turns))
    )
    # the clock starts once, after every agent's first turn and before any second one
    assert warm_calls == [len(trs)]
    assert {r.turn for r in res if r.warmup} == {0}
    assert all(r.cached_tokens > 0 for r in res if not r.warmup)
    s = summarize("dualpath", res, 1.0, {"prefill": 0, "decode": 0}, 1.0)
    assert s.turns == sum(len(t.turns) - 1 for t in trs)
