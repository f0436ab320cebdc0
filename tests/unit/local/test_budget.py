"""The time budget of a bounded local benchmark (`dualpath demo`): pure planning."""

from __future__ import annotations

import pytest
from dualpath.local import budget


def test_the_whole_trace_when_it_fits() -> None:
    plan = budget.plan_turns([10] * 12, {"prefill-read": 0.5, "dualpath": 0.2}, 10, 300, 1)
    assert plan.turns == 10 and plan.fits
    assert plan.replayed_turns == plan.trace_turns == 120 and plan.left_out_turns == 0
    # 108 measured turns (the warm-up turns were served once, before) after a 10 s start
    assert plan.phase_s == pytest.approx({"prefill-read": 64.0, "dualpath": 31.6})


def test_a_slower_machine_replays_fewer_turns_per_agent_within_the_share() -> None:
    # 4x slower turns: 12 agents x (t - 1) measured turns cost 12 (t - 1) (2.0 + 0.8) + 2 x 10 s
    per_turn = {"prefill-read": 2.0, "dualpath": 0.8}
    plan = budget.plan_turns([10] * 12, per_turn, 10, 300, 1)
    assert plan.fits and 2 <= plan.turns < 10
    assert sum(plan.phase_s.values()) <= budget.PLAN_SHARE * 300
    more = budget.plan_turns([10] * 12, per_turn, 10, 300 * 2, 1)
    assert more.turns > plan.turns  # the next turn would not have fit
    over = 20 + 12 * plan.turns * 2.8  # one more turn an agent
    assert over > budget.PLAN_SHARE * 300
    assert plan.left_out_turns == 12 * (10 - plan.turns)


def test_agents_shorter_than_the_cut_keep_all_their_turns() -> None:
    plan = budget.plan_turns([2, 10, 10], {"p": 1.0}, 0, 20, 1)
    # measured turns: 1 + 7 + 7 = 15 s of the 0.8 x 20 (one more: 17 s)
    assert plan.turns == 8 and plan.replayed_turns == 2 + 8 + 8


def test_when_nothing_fits_the_smallest_run_is_planned_and_said_so() -> None:
    plan = budget.plan_turns([10] * 12, {"prefill-read": 50.0}, 10, 60, 1)
    assert plan.turns == 2 and not plan.fits  # warm-up + one measured turn an agent


def test_a_phase_deadline_is_its_predicted_share_of_what_is_left() -> None:
    phases = {"prefill-read": 90.0, "dualpath": 30.0}
    assert budget.phase_deadline_s(100, 300, phases, "prefill-read") == pytest.approx(250)
    # the last phase gets all that is left, early or late
    assert budget.phase_deadline_s(200, 300, {"dualpath": 30.0}, "dualpath") == 300
    assert budget.phase_deadline_s(310, 300, {"dualpath": 30.0}, "dualpath") == 310


def test_capacity_is_read_bound_on_the_policys_readers_and_never_above_compute() -> None:
    pr = budget.capacity("prefill-read", 1, 2, read_s=1.0, prefill_s=0.25, turns=1)
    dp = budget.capacity("dualpath", 1, 2, read_s=1.0, prefill_s=0.25, turns=1)
    assert (pr.readers, pr.turns_per_s) == (1, 1.0) and (dp.readers, dp.turns_per_s) == (3, 3.0)
    assert budget.capacity("dualpath", 1, 2, 1.0, 0.5, 1).turns_per_s == 2.0  # compute-bound
