"""`spec.model`: the served model's dimensions (a preset and/or explicit ones), its image, its
checkpoint and the volume it lives on; its KV bytes per token and its KV fingerprint."""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any, Literal

from pydantic import Field, WithJsonSchema, field_validator, model_validator
from pydantic.alias_generators import to_camel

from dualpath import default_image
from dualpath.config.common import _Model, _volume_schema, check_volume_source

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float8": 1}


class RopeScaling(_Model):
    """Llama 3's RoPE frequency scaling (`rope_type: llama3` in a checkpoint's config.json):
    long wavelengths are divided by `factor`, short ones kept, the band between blended."""

    type: Literal["llama3"] = "llama3"
    """Scaling scheme; only llama3 is implemented."""
    factor: float = Field(gt=0)
    """Divisor of the long wavelengths (Llama 3.1: 8)."""
    low_freq_factor: float = Field(default=1.0, gt=0)
    """Wavelengths above originalMaxPositionEmbeddings / lowFreqFactor are fully scaled."""
    high_freq_factor: float = Field(default=4.0, gt=0)
    """Wavelengths below originalMaxPositionEmbeddings / highFreqFactor are kept."""
    original_max_position_embeddings: int = Field(default=8192, gt=0)
    """Context length the model was pre-trained with."""

    @model_validator(mode="after")
    def _check_band(self) -> RopeScaling:
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError("ropeScaling.highFreqFactor must be > lowFreqFactor")
        return self


MODEL_VOLUME_MESSAGE = "model.volume needs model.checkpointPath: the volume is mounted there"


class ModelSpec(_Model):
    """Model dimensions. `preset` fills every dimension not given explicitly."""

    name: str = Field(default="dualpath-tiny", min_length=1)
    """Served model name (the OpenAI `model` field); part of the KV fingerprint. Default: the
    preset's."""
    preset: str | None = "tiny"
    """Named shape filling every dimension not given: tiny, tiny64, small, llama3-8b, qwen2.5-32b,
    deepseek-v3.2, dsmla-27b; null to give all dimensions explicitly."""
    image: str = Field(default=default_image(), min_length=1)
    """Container image of every DualPath process (vLLM workers: workers.vllm.image)."""
    checkpoint_path: str | None = None
    """Local dir with config.json + *.safetensors (Llama/Qwen2); unset: random weights."""
    volume: Annotated[dict[str, Any] | None, WithJsonSchema(_volume_schema())] = None
    """Kubernetes volume source holding the checkpoint, mounted read-only at checkpointPath in
    the worker and frontend pods (the frontend reads its tokenizer): exactly one of
    persistentVolumeClaim, nfs, hostPath, csi, cephfs, glusterfs, azureFile, ephemeral,
    emptyDir; unset: the checkpoint is in the image (or there is none)."""
    attention: Literal["gqa", "mla"] = "gqa"
    """gqa (grouped-query, K and V cached) or mla (DeepSeek latent cached). Default: the
    preset's."""
    layers: int = Field(default=0, ge=0, le=512)
    """Transformer layers (0 or unset: the preset's)."""
    hidden_size: int = Field(default=0, ge=0)
    """Model width (0 or unset: the preset's)."""
    heads: int = Field(default=0, ge=0)
    """Attention heads (0 or unset: the preset's)."""
    kv_heads: int = Field(default=0, ge=0)
    """K/V heads of grouped-query attention; divides heads (0 or unset: the preset's)."""
    head_dim: int = Field(default=0, ge=0)
    """Dimension of one head (0 or unset: the preset's)."""
    intermediate_size: int = Field(default=0, ge=0)
    """MLP width (0 or unset: the preset's)."""
    vocab_size: int = Field(default=0, ge=0)
    """Vocabulary size (0 or unset: the preset's)."""
    kv_lora_rank: int = Field(default=0, ge=0)
    """MLA: latent rank; the cached latent per token per layer is kvLoraRank + ropeHeadDim."""
    rope_head_dim: int = Field(default=0, ge=0)
    """MLA: rotary part of the cached latent."""
    active_params: int = Field(default=0, ge=0)
    """Active parameters per token, for the simulator's FLOPs model (0: derived from dims)."""
    dtype: Literal["float16", "bfloat16", "float32", "float8"] = "float32"
    """Weights and KV cache element type. Default: the preset's."""
    block_tokens: int = Field(default=64, ge=1, le=4096)
    """Tokens per KV block: the unit of storage, lookup and transfer."""
    seed: int = 0
    """Seed of random weights (no checkpoint); part of the KV fingerprint."""
    rope_theta: float = Field(default=10000.0, gt=0)
    """RoPE base frequency (Llama 3: 500000)."""
    rope_scaling: RopeScaling | None = None
    """Llama 3 RoPE scaling; unset: none."""
    rms_norm_eps: float = Field(default=1e-6, gt=0)
    """Epsilon of RMSNorm."""

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        preset = data.get("preset", "tiny" if "preset" not in data else None)
        if preset is None:
            return data
        if preset not in MODEL_PRESETS:
            raise ValueError(
                f"unknown model preset {preset!r}; choose one of {sorted(MODEL_PRESETS)} "
                "or set preset: null and give the dimensions"
            )
        # Normalise camelCase keys so explicit values override the preset's snake_case ones.
        by_alias = {to_camel(f): f for f in cls.model_fields}
        merged = dict(MODEL_PRESETS[preset])
        for key, value in data.items():
            field = by_alias.get(key, key)
            if value is None or (value == 0 and field in PRESET_FIELDS):
                continue  # unset (or a 0 dimension): the preset's
            merged[field] = value
        merged["preset"] = preset
        return merged

    @field_validator("volume")
    @classmethod
    def _one_source(cls, volume: dict[str, Any] | None) -> dict[str, Any] | None:
        return check_volume_source(volume, "model.volume")

    @model_validator(mode="after")
    def _volume_needs_a_path(self) -> ModelSpec:
        if self.volume is not None and not self.checkpoint_path:
            raise ValueError(MODEL_VOLUME_MESSAGE)
        return self

    @model_validator(mode="after")
    def _check_dims(self) -> ModelSpec:
        if self.attention == "gqa":
            for field in ("layers", "hidden_size", "heads", "kv_heads", "head_dim", "vocab_size"):
                if getattr(self, field) <= 0:
                    raise ValueError(f"{to_camel(field)} must be > 0 (or use a preset)")
            if self.heads % self.kv_heads:
                raise ValueError(
                    f"heads ({self.heads}) must be a multiple of kvHeads ({self.kv_heads})"
                )
        else:
            if self.layers <= 0 or self.kv_lora_rank <= 0:
                raise ValueError("an MLA model needs layers > 0 and kvLoraRank > 0")
        return self

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def kv_bytes_per_token_layer(self) -> int:
        """Bytes of cached K and V (or MLA latent) for one token in one layer."""
        if self.attention == "mla":
            return (self.kv_lora_rank + self.rope_head_dim) * self.dtype_bytes
        return 2 * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv_bytes_per_token_layer * self.layers

    @property
    def block_bytes(self) -> int:
        """Payload bytes of one full block (all layers, K and V), header excluded."""
        return self.kv_bytes_per_token * self.block_tokens

    @property
    def fingerprint(self) -> str:
        """Identifies the model's KV format: blocks of another fingerprint are misses."""
        dims = self.model_dump(
            include={
                "name",
                "attention",
                "layers",
                "hidden_size",
                "heads",
                "kv_heads",
                "head_dim",
                "kv_lora_rank",
                "rope_head_dim",
                "dtype",
                "block_tokens",
                "seed",
                "checkpoint_path",
                "vocab_size",
                "intermediate_size",
                # K is cached after rotary: another RoPE is another KV
                "rope_theta",
                "rope_scaling",
            }
        )
        return hashlib.sha256(json.dumps(dims, sort_keys=True).encode()).hexdigest()[:16]


# Presets: dims only. `tiny` is for tests (fast on CPU), `small` for benchmarks, the rest are
# shapes of real models (KV sizes drive the simulator and the store benchmark).
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        name="dualpath-tiny",
        layers=4,
        hidden_size=64,
        heads=4,
        kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=512,
        dtype="float32",
    ),
    # tiny's size with a head dim vLLM's CPU attention supports (32, 64, 80, ...): the model of
    # the vLLM integration's tests, served by both engines from one checkpoint (docs/vllm.md)
    "tiny64": dict(
        name="dualpath-tiny64",
        layers=4,
        hidden_size=256,
        heads=4,
        kv_heads=2,
        head_dim=64,
        intermediate_size=512,
        vocab_size=512,
        dtype="float32",
    ),
    "small": dict(
        name="dualpath-small",
        layers=8,
        hidden_size=512,
        heads=8,
        kv_heads=4,
        head_dim=64,
        intermediate_size=1408,
        vocab_size=4096,
        dtype="float32",
    ),
    # The store benchmark's default KV shape (Llama-3-8B-like): 32 layers, 8 KV heads, 128 dim, fp16.
    "llama3-8b": dict(
        name="llama3-8b",
        layers=32,
        hidden_size=4096,
        heads=32,
        kv_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=128256,
        dtype="float16",
        active_params=8_000_000_000,
    ),
    "qwen2.5-32b": dict(
        name="qwen2.5-32b",
        layers=64,
        hidden_size=5120,
        heads=40,
        kv_heads=8,
        head_dim=128,
        intermediate_size=27648,
        vocab_size=152064,
        dtype="bfloat16",
        active_params=32_500_000_000,
    ),
    # DeepSeek-V3.2-like MLA (671B total, ~37B active): the cached latent per token per layer is
    # kv_lora_rank + rope_head_dim = 576 values (bf16 here: 1152 B; x61 layers = 70 KB/token).
    "deepseek-v3.2": dict(
        name="deepseek-v3.2",
        attention="mla",
        layers=61,
        hidden_size=7168,
        heads=128,
        kv_heads=1,
        head_dim=128,
        kv_lora_rank=512,
        rope_head_dim=64,
        intermediate_size=18432,
        vocab_size=129280,
        dtype="bfloat16",
        active_params=37_000_000_000,
    ),
    # A smaller DeepSeek-style MLA MoE, ~27B total / ~4B active (the paper's 27B; dims are ours:
    # 30 layers, hidden 3072, same 512+64 latent -> 34.5 KB/token in bf16).
    "dsmla-27b": dict(
        name="dsmla-27b",
        attention="mla",
        layers=30,
        hidden_size=3072,
        heads=24,
        kv_heads=1,
        head_dim=128,
        kv_lora_rank=512,
        rope_head_dim=64,
        intermediate_size=8192,
        vocab_size=129280,
        dtype="bfloat16",
        active_params=4_000_000_000,
    ),
}

# Fields a preset fills: they get no schema default in the CRD (an API-server default would look
# explicit and beat the preset); unset, they come from the preset (or the model's own default).
PRESET_FIELDS = frozenset(k for preset in MODEL_PRESETS.values() for k in preset)
