"""Cost model fit and the intra-node batchers (pure: plain data in, plain data out)."""

import random

import pytest
from dualpath.config import ModelSpec
from dualpath.engine.batcher import (
    PrefillItem,
    admit_fifo,
    chunk_to_fit,
    fifo_batches,
    mean_spread_s,
    similar_time_batches,
)
from dualpath.engine.cost import CostModel, FlopsModel, fit_cost_model, relative_errors
from hypothesis import given, settings
from hypothesis import strategies as st

FLOPS = FlopsModel.from_spec(ModelSpec(preset="small"))
# a plausible machine: 20 GFLOP/s linear, 10 GFLOP/s attention, 2 ms fixed
TRUE = CostModel(FLOPS, 2e-3, 1 / 20e9, 1 / 10e9)


def mixed_queue(n=60, seed=0):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if rng.random() < 0.5:
            out.append(
                PrefillItem(f"r{i}", cached=rng.randrange(0, 512, 64), new=rng.randint(8, 48))
            )
        else:
            out.append(
                PrefillItem(f"r{i}", cached=rng.randrange(0, 4096, 64), new=rng.randint(200, 600))
            )
    return out


def test_fit_recovers_known_coefficients():
    shapes = [(c, n) for c in (0, 512, 2048, 8192) for n in (16, 128, 512)]
    samples = [(c, n, TRUE.estimate(c, n)) for c, n in shapes]
    fit = fit_cost_model(FLOPS, samples)
    assert max(relative_errors(fit, samples)) < 1e-6
    held_out = [(c, n, TRUE.estimate(c, n)) for c, n in [(1000, 300), (300, 40), (6000, 100)]]
    assert max(relative_errors(fit, held_out)) < 1e-6


def test_fit_keeps_coefficients_non_negative():
    # times that do not grow with attention: the attention coefficient is clamped to 0, not < 0
    samples = [(c, n, 1e-3 + n * 1e-5) for c in (0, 1024, 4096) for n in (16, 64, 256)]
    fit = fit_cost_model(FLOPS, samples)
    assert fit.base_s >= 0 and fit.s_per_linear_flop >= 0 and fit.s_per_attention_flop >= 0
    assert fit.estimate(0, 64) < fit.estimate(0, 256)


def test_fit_needs_samples():
    with pytest.raises(ValueError, match=">= 3 samples"):
        fit_cost_model(FLOPS, [(0, 1, 0.1)])


@given(cached=st.integers(0, 10_000), new=st.integers(1, 5000), budget=st.floats(0.001, 1.0))
@settings(max_examples=200, deadline=None)
def test_chunk_to_fit_is_the_largest_fitting_chunk(cached, new, budget):
    item = PrefillItem("x", cached, new)
    n = chunk_to_fit(TRUE, item, budget)
    assert 0 <= n <= new
    if n:
        assert TRUE.estimate(cached, n) <= budget
    if n < new:
        assert TRUE.estimate(cached, n + 1) > budget


def _covered(batches):
    got = {}
    for b in batches:
        for it in b.items:
            got[it.request_id] = got.get(it.request_id, 0) + it.new
    return got


@pytest.mark.parametrize("batcher", [fifo_batches, similar_time_batches])
def test_batches_cover_every_token_within_quota(batcher):
    queue = mixed_queue() + [PrefillItem("huge", 0, 8000)]
    quota = 0.3
    batches = batcher(queue, TRUE, quota)
    assert _covered(batches) == {it.request_id: it.new for it in queue}
    assert all(b.total_s <= quota + 1e-12 for b in batches)
    # chunks of one request are contiguous: each chunk's cached = previous cached + new
    chunks = [it for b in batches for it in b.items if it.request_id == "huge"]
    assert len(chunks) > 1
    for a, b in zip(chunks, chunks[1:], strict=False):
        assert b.cached == a.cached + a.new


def test_fifo_packs_in_arrival_order():
    queue = mixed_queue(20)
    order = [it.request_id for b in fifo_batches(queue, TRUE, 0.3) for it in b.items]
    dedup = list(dict.fromkeys(order))
    assert dedup == [it.request_id for it in queue]


def test_similar_time_batches_have_smaller_spread_than_fifo():
    for seed in range(5):
        queue = mixed_queue(80, seed)
        fifo = fifo_batches(queue, TRUE, 0.3)
        similar = similar_time_batches(queue, TRUE, 0.3)
        assert mean_spread_s(similar) < mean_spread_s(fifo)
        assert max(b.spread_s for b in similar) <= max(b.spread_s for b in fifo)


def test_similar_time_batches_anchor_the_oldest_request():
    queue = mixed_queue(30, seed=1)
    left = {it.request_id: it.new for it in queue}
    for b in similar_time_batches(queue, TRUE, 0.3):
        # the batch's first item is the oldest request with tokens still to prefill
        oldest = next(it.request_id for it in queue if left[it.request_id])
        assert b.items[0].request_id == oldest
        for it in b.items:
            left[it.request_id] -= it.new
    assert not any(left.values())


def test_quota_must_be_positive():
    with pytest.raises(ValueError, match="quota_s"):
        fifo_batches(mixed_queue(3), TRUE, 0)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 40), st.floats(0.005, 2.0), st.integers(0, 10_000))
def test_admit_fifo_takes_the_longest_prefix_within_the_quota(n, quota, seed):
    queue = mixed_queue(n, seed)
    k = admit_fifo(queue, TRUE, quota)
    times = [TRUE.estimate(it.cached, it.new) for it in queue]
    if not queue:
        assert k == 0
        return
    assert k >= 1  # a request alone above the quota still runs (alone)
    assert k == 1 or sum(times[:k]) <= quota  # within the quota, unless alone
    assert k == n or sum(times[: k + 1]) > quota  # the next one would overflow: it waits
