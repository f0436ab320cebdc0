"""The engine against Hugging Face transformers' own Llama and Qwen2: a checkpoint written by
`save_pretrained` loads and gives the same logits, and the KV of transformers' cache, used as
the hit, gives the same logits as transformers over the whole sequence."""

import json

import pytest
import torch
from dualpath.engine import (
    Engine,
    MemorySource,
    load_checkpoint,
    save_checkpoint,
    spec_from_checkpoint,
)

transformers = pytest.importorskip("transformers")

DIMS = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    rope_theta=500000.0,  # not the default: a loader that drops it is caught
    rms_norm_eps=1e-5,
)


def hf_model(kind: str, tie: bool, seed: int = 0):
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[kind]
    model = model_cls(config_cls(**DIMS, tie_word_embeddings=tie)).eval().float()
    return randomise(model, seed)


def randomise(model, seed: int):
    """Every weight random: HF zeroes biases and sets norms to one, which would hide a swap."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen) * 0.1
            p.copy_(1.0 + noise if name.endswith("norm.weight") else noise)
    return model


def save(model, path):
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("kind,tie", [("llama", False), ("llama", True), ("qwen2", False)])
def test_a_transformers_checkpoint_gives_transformers_logits(tmp_path, kind, tie):
    hf = hf_model(kind, tie)
    ours = load_checkpoint(save(hf, tmp_path / kind))
    assert ours.spec.rope_theta == DIMS["rope_theta"]
    assert (ours.layers[0].q_proj.bias is not None) == (kind == "qwen2")
    x = torch.randint(0, DIMS["vocab_size"], (37,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(x[None]).logits[0].float()
    got, _ = ours.forward_full(x)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("hit,new", [(16, 5), (29, 1), (40, 13)])
async def test_transformers_cache_as_the_hit_gives_transformers_logits(tmp_path, hit, new):
    # the hit KV layout (rotated K, per layer (tokens, kv_heads, head_dim)) is transformers'
    hf = hf_model("qwen2", tie=False, seed=2)
    path = save(hf, tmp_path / "qwen2")
    x = torch.randint(0, DIMS["vocab_size"], (hit + new,), generator=torch.Generator())
    with torch.no_grad():
        want = hf(x[None]).logits[0, hit:].float()
        cache = hf(x[None, :hit], use_cache=True).past_key_values
    layers = [(c.keys[0].transpose(0, 1), c.values[0].transpose(0, 1)) for c in cache.layers]
    with Engine(spec_from_checkpoint(path), model=load_checkpoint(path)) as engine:
        run = engine.prefill(x[hit:], hit, MemorySource(layers), all_logits=True)
        _, logits = await run.collect()
    torch.testing.assert_close(logits, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "field,value,named",
    [
        ("rope_parameters", {"rope_type": "longrope", "rope_theta": 5e5}, "longrope"),
        ("rope_scaling", {"type": "yarn", "factor": 4.0}, "yarn"),
        ("hidden_act", "gelu", "gelu"),
        ("use_sliding_window", True, "use_sliding_window"),
    ],
)
def test_a_checkpoint_asking_for_other_math_is_refused_by_name(tmp_path, field, value, named):
    path = save(hf_model("llama", tie=False), tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg[field] = value
    (path / "config.json").write_text(json.dumps(cfg))
    for load in (spec_from_checkpoint, load_checkpoint):
        with pytest.raises(ValueError, match=named):
            load(path)


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # small, so the tiny head_dim's frequencies fall in all three bands (kept, blended, scaled)
    "original_max_position_embeddings": 64,
}


def test_a_llama3_scaled_rope_checkpoint_gives_transformers_logits(tmp_path):
    config = transformers.LlamaConfig(**{**DIMS, "rope_parameters": LLAMA3_ROPE})
    hf = transformers.LlamaForCausalLM(config).eval().float()
    randomise(hf, seed=3)
    path = save(hf, tmp_path / "llama3")
    ours = load_checkpoint(path)
    assert ours.spec.rope_scaling is not None and ours.spec.rope_scaling.factor == 8.0
    x = torch.randint(0, DIMS["vocab_size"], (150,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = hf(x[None]).logits[0].float()
    got, _ = ours.forward_full(x)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    # and back: our own writer keeps the scaling, and the KV format knows it
    save_checkpoint(ours, tmp_path / "again")
    again = spec_from_checkpoint(tmp_path / "again")
    assert again.rope_scaling == ours.spec.rope_scaling
    plain = spec_from_checkpoint(save(hf_model("llama", tie=False), tmp_path / "plain"))
    assert plain.rope_scaling is None and plain.fingerprint != again.fingerprint
