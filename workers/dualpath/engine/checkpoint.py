"""Checkpoint I/O: Llama/Qwen2-format checkpoint directories (config.json + *.safetensors)
to and from a `Transformer` and its `ModelSpec`.

    model = load_model(spec)                 # spec.checkpoint_path, else seeded weights
    spec = spec_from_checkpoint(path)        # dims from config.json
    model = load_checkpoint(path, spec)      # weights from *.safetensors
    save_checkpoint(model, path)             # Llama-format config.json + model.safetensors

A config that asks for math the model does not do is refused with the field named.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from dualpath.config import ModelSpec, RopeScaling
from dualpath.engine.model import Transformer

log = logging.getLogger(__name__)

_HF_FIELDS = {
    "num_hidden_layers": "layers",
    "hidden_size": "hidden_size",
    "num_attention_heads": "heads",
    "num_key_value_heads": "kv_heads",
    "head_dim": "head_dim",
    "intermediate_size": "intermediate_size",
    "vocab_size": "vocab_size",
    "rope_theta": "rope_theta",
    "rms_norm_eps": "rms_norm_eps",
}
_HF_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}


def _rope_configs(cfg: dict) -> list[tuple[str, dict]]:
    """transformers 5 writes `rope_parameters`; older configs `rope_scaling` (null: plain)."""
    return [(f, cfg[f]) for f in ("rope_parameters", "rope_scaling") if cfg.get(f)]


def _rope_scaling(cfg: dict) -> RopeScaling | None:
    for _, rope in _rope_configs(cfg):
        if rope.get("rope_type", rope.get("type")) == "llama3":
            keys = RopeScaling.model_fields.keys() - {"type"}
            return RopeScaling(**{k: rope[k] for k in keys if k in rope})
    return None


def _refuse_what_the_engine_cannot_run(path: str | Path, cfg: dict) -> None:
    """A checkpoint whose config asks for math the engine does not do would load and then
    give wrong outputs without a word: name the field instead."""
    problems = []
    for field, rope in _rope_configs(cfg):
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", "llama3"):
            problems.append(f"{field} of type {kind!r} (plain RoPE or llama3 only)")
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {cfg['hidden_act']!r} (only silu, SwiGLU)")
    if cfg.get("use_sliding_window"):
        problems.append("use_sliding_window (only full attention)")
    if cfg.get("mlp_bias"):
        problems.append("mlp_bias (the MLP has no bias)")
    if problems:
        raise ValueError(
            f"model.checkpointPath {path}: config.json asks for {'; '.join(problems)}; "
            "the engine runs Llama/Qwen2-style decoders without these"
        )


def spec_from_checkpoint(path: str | Path, **overrides: object) -> ModelSpec:
    """A ModelSpec with the dims of a checkpoint's config.json (overrides win)."""
    return _spec_from_config(path, _read_config(path), **overrides)


def _read_config(path: str | Path) -> dict:
    """The checkpoint's config.json, refused if it asks for math the engine does not do."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    _refuse_what_the_engine_cannot_run(path, cfg)
    return cfg


def _spec_from_config(path: str | Path, cfg: dict, **overrides: object) -> ModelSpec:
    dims: dict[str, object] = {"preset": None, "checkpoint_path": str(path)}
    for hf, ours in _HF_FIELDS.items():
        if hf in cfg and cfg[hf] is not None:
            dims[ours] = cfg[hf]
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta")  # where transformers 5 puts it
    if theta is not None:
        dims["rope_theta"] = theta
    dims["rope_scaling"] = _rope_scaling(cfg)
    dims.setdefault("kv_heads", cfg.get("num_attention_heads"))
    if "head_dim" not in dims:
        dims["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    dtype = cfg.get("dtype") or cfg.get("torch_dtype")  # transformers 5 renamed the field
    if dtype in _HF_DTYPES:
        dims["dtype"] = _HF_DTYPES[dtype]
    dims["name"] = cfg.get("_name_or_path") or Path(path).name
    dims.update(overrides)
    return ModelSpec(**dims)


def load_model(spec: ModelSpec) -> Transformer:
    """From `spec.checkpoint_path` when set, else seeded."""
    if spec.checkpoint_path:
        return load_checkpoint(spec.checkpoint_path, spec)
    return Transformer.from_seed(spec)


def load_checkpoint(path: str | Path, spec: ModelSpec | None = None) -> Transformer:
    """Load a Llama/Qwen2-format checkpoint directory (config.json + *.safetensors)."""
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model.checkpointPath {path}: no config.json there")
    cfg = _read_config(path)
    spec = spec or _spec_from_config(path, cfg)
    qkv_bias = bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2"))
    tie = bool(cfg.get("tie_word_embeddings", False))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model.checkpointPath {path}: no *.safetensors files")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    model = Transformer(spec, qkv_bias=qkv_bias, tie_embeddings=tie)
    ours = {}
    for key, t in state.items():
        name = key.removeprefix("model.")
        name = name.replace("self_attn.", "").replace("mlp.", "")
        if name.endswith("rotary_emb.inv_freq"):
            continue
        ours[name] = t
    if tie:
        ours.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(ours, strict=False)
    missing = [m for m in missing if not (tie and m == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {path} does not match a Llama/Qwen2 model of config.json: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    log.info("loaded checkpoint %s (%d layers, %d tensors)", path, spec.layers, len(state))
    return model.to(model.dtype)


def save_checkpoint(model: Transformer, path: str | Path) -> None:
    """Write `model` as a Llama-format checkpoint (config.json + model.safetensors)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    s = model.spec
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": s.layers,
        "hidden_size": s.hidden_size,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim,
        "intermediate_size": s.intermediate_size or 4 * s.hidden_size,
        "vocab_size": s.vocab_size,
        "rope_theta": s.rope_theta,
        "rope_scaling": None
        if s.rope_scaling is None
        else {"rope_type": "llama3", **s.rope_scaling.model_dump(exclude={"type"})},
        "rms_norm_eps": s.rms_norm_eps,
        "torch_dtype": s.dtype,
        "tie_word_embeddings": model.tie_embeddings,
        "attention_bias": model.layers[0].q_proj.bias is not None,
    }
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    state = {}
    for name, t in model.state_dict().items():
        if model.tie_embeddings and name == "lm_head.weight":
            continue
        if name.startswith("layers."):
            parts = name.split(".")
            sub = (
                "self_attn."
                if parts[2] in ("q_proj", "k_proj", "v_proj", "o_proj")
                else ("mlp." if parts[2] in ("gate_proj", "up_proj", "down_proj") else "")
            )
            name = ".".join(parts[:2] + [sub + ".".join(parts[2:])])
        hf = name if name.startswith("lm_head") else f"model.{name}"
        state[hf] = t.contiguous()
    save_file(state, str(path / "model.safetensors"))
