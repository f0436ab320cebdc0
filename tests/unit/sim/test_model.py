"""The simulator's cost model: KV bytes from the model config, GPU time shapes."""

from __future__ import annotations

import pytest
from dualpath.config import ModelSpec
from dualpath.sim.model import CostModel, Hardware


@pytest.mark.parametrize(
    ("preset", "per_token"),
    [
        ("deepseek-v3.2", (512 + 64) * 2 * 61),  # MLA latent + rope key, bf16, 61 layers
        ("dsmla-27b", (512 + 64) * 2 * 30),
        ("qwen2.5-32b", 2 * 8 * 128 * 2 * 64),  # GQA: K and V, 8 kv heads x 128, bf16
    ],
)
def test_kv_bytes_per_token_come_from_the_model(preset: str, per_token: int) -> None:
    m = ModelSpec(preset=preset)
    assert m.kv_bytes_per_token == per_token
    assert CostModel.build(m, Hardware()).kv_bytes_per_token == per_token


def test_prefill_is_linear_in_new_tokens_and_grows_with_context() -> None:
    c = CostModel.build(ModelSpec(preset="qwen2.5-32b"), Hardware())
    assert c.prefill_s(1000, 0) > 1.9 * c.prefill_s(500, 0)
    assert c.prefill_s(500, 30_000) > c.prefill_s(500, 1_000)


def test_sparse_attention_caps_the_attended_context() -> None:
    c = CostModel.build(ModelSpec(preset="deepseek-v3.2"), Hardware())
    assert c.attn_topk == 2048
    assert c.prefill_s(500, 60_000) == pytest.approx(c.prefill_s(500, 10_000))


def test_decode_step_is_memory_bound_in_batch_kv() -> None:
    c = CostModel.build(ModelSpec(preset="deepseek-v3.2"), Hardware())
    small = c.decode_step_s(8, 8 * 1e9)
    big = c.decode_step_s(64, 64 * 1e9)
    assert big > small > c.step_fixed_s


def test_hardware_refuses_bad_values() -> None:
    with pytest.raises(ValueError, match="Hardware.snic_gbps"):
        Hardware(snic_gbps=0)
    assert Hardware(snic_gbps=400).snic_bytes_per_s == 50e9
