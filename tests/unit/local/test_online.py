"""`dualpath bench local --online`: the pure parts of the auto sweep and of its report."""

from __future__ import annotations

import argparse

import pytest
from dualpath.local import bench, bench_cli, online


def _pt(rate: float, p90: float, failed: int = 0) -> online.RatePoint:
    return online.RatePoint(rate, 10, 30 - failed, failed, 1.0, 1.0, 30.0, p90 / 2, p90, p90, 0.1)


def _sweep(knee: float, start: float, **kw) -> list[float]:
    """The rates an auto sweep runs against a cluster that meets the SLA up to `knee`."""
    tried: list[tuple[float, bool]] = []
    while (r := online.next_rate(tried, start, **kw)) is not None:
        tried.append((r, r <= knee))
    return [r for r, _ in tried]


def test_capacity_is_read_bound_on_the_policys_snics_and_never_above_compute() -> None:
    pr = online.capacity("prefill-read", 1, 2, read_s=1.5, prefill_s=0.3, turns=3)
    dp = online.capacity("dualpath", 1, 2, read_s=1.5, prefill_s=0.3, turns=3)
    assert (pr.readers, dp.readers) == (1, 3)
    assert pr.turns_per_s == pytest.approx(1 / 1.5, abs=1e-4)
    assert dp.turns_per_s == pytest.approx(3 * pr.turns_per_s, abs=1e-3)
    assert dp.agents_per_s == pytest.approx(dp.turns_per_s / 3, abs=1e-4)
    # compute-bound: the prefill node cannot prefill faster than 1 / prefill_s
    assert online.capacity("dualpath", 1, 2, 1.5, 1.0, 1).turns_per_s == pytest.approx(1.0)
    assert online.capacity("decode-read", 1, 2, 1.0, 0.1, 1).readers == 2


@pytest.mark.parametrize("knee", [0.3, 0.7, 0.95, 1.0, 1.6, 4.0])
def test_auto_sweep_brackets_the_knee_within_its_resolution(knee: float) -> None:
    rates = _sweep(knee, start=1.0, step=1.25, resolution=1.12, max_points=12)
    met = max(r for r in rates if r <= knee) if any(r <= knee for r in rates) else None
    missed = min(r for r in rates if r > knee)
    assert rates[0] == 1.0
    assert met is not None and met <= knee < missed
    assert missed / met <= 1.12


def test_auto_sweep_stops_at_max_points_and_steps_away_from_the_start() -> None:
    assert _sweep(10.0, 1.0, step=2.0, resolution=1.1, max_points=4) == [1, 2, 4, 8]
    assert _sweep(0.1, 1.0, step=2.0, resolution=1.1, max_points=3) == [1, 0.5, 0.25]
    # met at 1, missed at 1.25: the midpoint, then done within the resolution
    rates = _sweep(1.1, 1.0, step=1.25, resolution=1.12, max_points=9)
    assert rates == [1.0, 1.25, pytest.approx(1.25**0.5)]


def test_next_rate_ignores_a_miss_below_the_highest_met_rate() -> None:
    # a noisy miss at 0.8 under a met 1.0: the bracket is (1.0, 1.25)
    tried = [(1.0, True), (0.8, False), (1.25, False)]
    assert online.next_rate(tried, 1.0, 1.25, 1.05, 9) == pytest.approx(1.25**0.5)


def test_bracket_and_sustained_rate_judge_p90_and_failures() -> None:
    pts = [_pt(1.0, 2.0), _pt(2.0, 3.0), _pt(3.0, 9.0), _pt(4.0, 20.0)]
    assert online.bracket(pts, sla_s=4.0) == (2.0, 3.0)
    assert online.sustained_rate(pts, 4.0) == 2.0
    assert online.bracket(pts, sla_s=100.0) == (4.0, None)  # never missed: open above
    assert online.bracket(pts, sla_s=1.0) == (None, 1.0)  # never met
    refused = [_pt(1.0, 2.0), _pt(2.0, 2.5, failed=1)]
    assert online.bracket(refused, 4.0) == (1.0, 2.0)  # a failed turn is a miss


def test_ratio_bounds_come_from_both_brackets() -> None:
    lo, hi = online.ratio_bounds((1.0, 1.2), (3.0, 3.5))
    assert (lo, hi) == (pytest.approx(2.5), pytest.approx(3.5))
    assert online.ratio_bounds((1.0, None), (3.0, 3.5)) == (None, 3.5)
    assert online.ratio_bounds((None, 1.0), (3.0, None)) == (3.0, None)


def test_arrivals_fill_the_point_window_at_the_rate_cycling_through_the_sessions() -> None:
    args = argparse.Namespace(
        agents=8,
        context=4096,
        turns=3,
        append_tokens=8,
        gen_tokens=2,
        first_tokens=64,
        seed=0,
        think_s=1.5,
    )
    base = online.sessions(args)
    a = online.arrivals(base, 4.0, 0, seed=0, point_s=50.0)
    b = online.arrivals(base, 8.0, 1, seed=0, point_s=50.0)
    assert (len(a), len(b)) == (200, 400)  # rate x window
    starts = [t.start_s for t in a]
    assert starts == sorted(starts) and starts[0] > 0
    assert starts[-1] == pytest.approx(200 / 4.0)  # the nominal rate, exactly
    gaps = [y - x for x, y in zip([0.0, *starts], starts, strict=False)]
    assert sum(g > 2 / 4.0 for g in gaps) / 200 == pytest.approx(0.135, abs=0.06)  # exponential
    # agent i runs session i mod 8, from its stored context, under an id of its own
    assert [t.turns for t in a[:16]] == [t.turns for t in base] * 2
    ctx = online._context_of(a)
    assert [ctx[t.agent_id] for t in a[:9]] == [t.agent_id for t in base] + ["a0"]
    assert len({t.agent_id for t in a + b}) == 600
    assert online.arrivals(base, 0.001, 2, seed=0, point_s=50.0)[0].start_s == 1000.0  # >= 1
    thinks = [turn.think_s for t in base for turn in t.turns[1:]]
    assert all(x > 0 for x in thinks)


def test_rates_flag_takes_auto_or_a_list_and_sizes_default_per_mode() -> None:
    assert online._parse_rates("auto") is None
    assert online._parse_rates("0.4, 0.1") == [0.1, 0.4]
    for bad in ("fast", "0,1", ""):
        with pytest.raises(ValueError, match="--rates"):
            online._parse_rates(bad)
    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    args = parser.parse_args(["--online"])
    assert (args.rates, args.agents, args.turns, args.point_s) == ("auto", None, None, "auto")
    assert parser.parse_args(["--point-s", "30"]).point_s == 30.0
    for bad in ("0", "-1", "long"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--point-s", bad])


def test_replay_starts_an_agent_from_another_agents_context() -> None:
    import asyncio

    import httpx

    prompts: dict[str, list[int]] = {}

    def handler(request: httpx.Request) -> httpx.Response:
        import json

        body = json.loads(request.content)
        prompts[body["session_id"]] = body["prompt"]
        final = {"choices": [{"finish_reason": "length"}], "dualpath": {"token_ids": [7]}}
        final["dualpath"]["read_path"] = "prefill"
        usage = {"choices": [], "usage": {"prompt_tokens_details": {"cached_tokens": 0}}}
        text = f"data: {json.dumps(final)}\n\ndata: {json.dumps(usage)}\n\ndata: [DONE]\n\n"
        return httpx.Response(200, text=text)

    from dualpath.trace import Trajectory, Turn

    trs = [Trajectory(i, [Turn(4, 1)], first_tokens=32) for i in ("a0", "r0-a0", "r1-a0")]

    async def go() -> None:
        transport = httpx.MockTransport(handler)
        async with httpx.AsyncClient(base_url="http://x", transport=transport) as client:
            ctx = {"r0-a0": "a0", "r1-a0": "a0"}
            await bench.replay(client, trs, "m", 300, seed=1, context_of=ctx)

    asyncio.run(go())
    a, r0, r1 = (prompts[f"bench-1-{i}"] for i in ("a0", "r0-a0", "r1-a0"))
    assert a[:32] == r0[:32] == r1[:32]  # the stored context
    assert r0[32:] != r1[32:]  # each its own appended tokens
