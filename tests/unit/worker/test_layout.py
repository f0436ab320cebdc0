"""Request KV regions: sizes, layer-contiguous views, the whole context reassembled."""

from __future__ import annotations

import pytest
import torch
from dualpath.config import ModelSpec
from dualpath.kv.buffers import request_buffer_bytes
from dualpath.worker.layout import RequestLayout

SPEC = ModelSpec(preset="tiny", block_tokens=8)


def test_sizes_match_the_store_request_buffer_and_the_new_tokens():
    lo = RequestLayout.of(SPEC, hit_tokens=24, prompt_tokens=29)
    assert (lo.hit_blocks, lo.new_tokens, lo.layers) == (3, 5, SPEC.layers)
    assert lo.hit_bytes == request_buffer_bytes(lo.block, 3)
    assert lo.new_bytes == 5 * SPEC.kv_bytes_per_token
    assert lo.hit_layer_bytes * SPEC.layers == lo.hit_bytes


@pytest.mark.parametrize("hit,prompt", [(5, 20), (16, 16), (-8, 4), (24, 10)])
def test_bad_hits_are_refused(hit, prompt):
    with pytest.raises(ValueError, match="hit_tokens"):
        RequestLayout.of(SPEC, hit, prompt)


def test_context_is_hit_then_new_per_layer():
    lo = RequestLayout.of(SPEC, hit_tokens=16, prompt_tokens=21)
    hit = torch.randn(lo.hit_bytes // 4).view(torch.uint8)  # finite floats: NaN != NaN
    new = torch.zeros(lo.new_bytes, dtype=torch.uint8)
    g = torch.Generator().manual_seed(0)
    shape = (lo.new_tokens, SPEC.kv_heads, SPEC.head_dim)
    fresh = [
        (torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(lo.layers)
    ]
    for layer, (k, v) in enumerate(fresh):
        lo.put_new(new, layer, k, v)
    ctx = lo.context(hit, new)
    for layer, (k, v) in enumerate(ctx):
        hk, hv = lo.hit_views(hit, layer)
        assert k.shape == (21, SPEC.kv_heads, SPEC.head_dim)
        assert torch.equal(k[:16], hk) and torch.equal(v[:16], hv)
        assert torch.equal(k[16:], fresh[layer][0]) and torch.equal(v[16:], fresh[layer][1])
    # each layer of the new region is one contiguous range: one WRITE per layer
    k1, _ = lo.new_views(new, 1)
    assert k1.data_ptr() - new.data_ptr() == lo.new_layer_bytes
    assert lo.context(None, new)[0][0].shape[0] == lo.new_tokens
