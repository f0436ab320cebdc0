"""`sample`: greedy stays argmax; top-k, top-p, min_tokens and seeds shape only sampling."""

from __future__ import annotations

import pytest
import torch
from dualpath.engine.decode import SamplingParams, sample

VOCAB = 64


def logits_row(seed: int = 0) -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def draws(params: SamplingParams, row: torch.Tensor, n: int = 200, generated: int = 0) -> list:
    gen = torch.Generator().manual_seed(params.seed)
    return [sample(row, params, gen, generated) for _ in range(n)]


def test_greedy_is_argmax_whatever_top_k_and_top_p_say() -> None:
    row = logits_row()
    best = int(torch.argmax(row))
    for params in (
        SamplingParams(),
        SamplingParams(top_k=5, top_p=0.5, seed=7),
        SamplingParams(min_tokens=3),  # no stop tokens: nothing to mask
    ):
        assert sample(row, params, None) == best


def test_top_k_keeps_only_the_k_most_likely_ids() -> None:
    row = logits_row(1)
    top3 = set(torch.topk(row, 3).indices.tolist())
    got = set(draws(SamplingParams(temperature=2.0, top_k=3, seed=1), row))
    assert got <= top3 and len(got) > 1
    assert set(draws(SamplingParams(temperature=2.0, top_k=1, seed=1), row)) == {
        int(torch.argmax(row))
    }


def test_top_p_keeps_the_smallest_set_holding_that_mass() -> None:
    row = logits_row(2) / 3  # flat enough that the nucleus holds several ids
    probs = torch.softmax(row, -1)
    order = torch.argsort(probs, descending=True)
    cum = torch.cumsum(probs[order], 0)
    nucleus = set(order[: int((cum < 0.6).sum()) + 1].tolist())
    got = set(draws(SamplingParams(temperature=1.0, top_p=0.6, seed=2), row, n=400))
    assert got <= nucleus
    assert len(nucleus) > 1 and len(got) > 1
    tiny = draws(SamplingParams(temperature=1.0, top_p=1e-6, seed=2), row)
    assert set(tiny) == {int(order[0])}


def test_min_tokens_masks_stop_ids_until_reached() -> None:
    row = logits_row(3)
    best = int(torch.argmax(row))
    params = SamplingParams(stop_tokens=(best,), min_tokens=2, max_tokens=4)
    assert sample(row, params, None, generated=0) != best
    assert sample(row, params, None, generated=1) != best
    assert sample(row, params, None, generated=2) == best


def test_same_seed_same_draws_other_seed_other_draws() -> None:
    row = logits_row(4)
    a = draws(SamplingParams(temperature=1.0, seed=11), row, n=50)
    assert a == draws(SamplingParams(temperature=1.0, seed=11), row, n=50)
    assert a != draws(SamplingParams(temperature=1.0, seed=12), row, n=50)


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("top_p", {"top_p": 0.0}),
        ("top_p", {"top_p": 1.5}),
        ("top_k", {"top_k": -1}),
        ("min_tokens", {"min_tokens": 5, "max_tokens": 4}),
    ],
)
def test_bad_params_are_refused_naming_the_field(field: str, kwargs: dict) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)
