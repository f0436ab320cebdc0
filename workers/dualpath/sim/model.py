"""Cost model of the simulated cluster: hardware, GPU time, KV bytes. Pure functions.

- KV bytes per token come from the model config (`ModelSpec.kv_bytes_per_token`: MLA latent
  or GQA K+V, times layers, in the model dtype).
- Prefill is compute-bound: FLOPs = 2 x active params x new tokens (dense/MoE matmuls) plus
  causal attention 4 x heads x head_dim x layers x new x (cached + new/2), over the node's
  GPUs at a fixed MFU. Sparse attention (DeepSeek-V3.2's DSA) caps the attended context.
- A decode step is memory-bound: each GPU reads its share of the active weights and of the
  batch's KV from HBM, plus a fixed per-step overhead (scheduling, collectives, sampling).
- Networks: each node has one storage NIC (SNIC) and compute NICs (CNIC). The CNIC carries two
  traffic classes; with IB QoS the model class (EP all-to-all) has strict priority, so the KV
  class gets the bandwidth the model class leaves (`cnic_kv_share`).
"""

from __future__ import annotations

from dataclasses import dataclass

from dualpath.config import ModelSpec
from dualpath.units import gbps_to_bytes_per_s

# Attended context cap of sparse-attention models (DeepSeek-V3.2 DSA: top-2048 tokens).
SPARSE_ATTENTION_TOPK: dict[str, int] = {"deepseek-v3.2": 2048}

# Longest context (prompt + generation) each model preset serves; the simulator truncates or
# refuses longer turns. DeepSeek-V3.2: 128K; Qwen2.5-32B: 128K with YaRN; Llama-3-8B: 8K.
# Presets not listed (and our own dsmla-27b) get DEFAULT_CONTEXT_TOKENS.
MODEL_CONTEXT_TOKENS: dict[str, int] = {
    "deepseek-v3.2": 131_072,
    "qwen2.5-32b": 131_072,
    "llama3-8b": 8_192,
}
DEFAULT_CONTEXT_TOKENS = 131_072


def context_limit(preset: str | None) -> int:
    """The served context limit (tokens) of a model preset."""
    return MODEL_CONTEXT_TOKENS.get(preset or "", DEFAULT_CONTEXT_TOKENS)


@dataclass(slots=True, frozen=True)
class Hardware:
    """One node's hardware (H800-like defaults; each node has 8 GPUs)."""

    gpus_per_node: int = 8
    gpu_tflops: float = 1979.0  # dense FP8 peak per GPU (H800; DeepSeek serves in FP8)
    mfu: float = 0.35  # achieved fraction of peak in prefill
    hbm_gbytes_per_s: float = 3350.0  # per GPU
    snic_gbps: float = 400.0  # storage NIC per node (shared by its 8 GPUs)
    cnic_gbps: float = 3200.0  # compute NICs per node (8 x 400 Gbps)
    cnic_kv_share: float = 0.5  # CNIC fraction left to the KV class by the model class
    decode_overhead_s: float = 0.012  # fixed per decode step
    decode_kv_capacity_bytes: int = 400 << 30  # HBM for KV on a decode node
    weight_bytes_per_param: float = 1.0  # FP8 weights read per decode step

    def __post_init__(self) -> None:
        for name in (
            "gpus_per_node",
            "gpu_tflops",
            "mfu",
            "hbm_gbytes_per_s",
            "snic_gbps",
            "cnic_gbps",
            "cnic_kv_share",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"Hardware.{name}: must be > 0 (got {getattr(self, name)!r})")
        if self.mfu > 1 or self.cnic_kv_share > 1:
            raise ValueError("Hardware.mfu and Hardware.cnic_kv_share must be <= 1")

    @property
    def snic_bytes_per_s(self) -> float:
        return gbps_to_bytes_per_s(self.snic_gbps)

    @property
    def cnic_kv_bytes_per_s(self) -> float:
        return gbps_to_bytes_per_s(self.cnic_gbps) * self.cnic_kv_share

    @property
    def node_flops(self) -> float:
        return self.gpus_per_node * self.gpu_tflops * 1e12 * self.mfu


@dataclass(slots=True, frozen=True)
class CostModel:
    """Precomputed per-model constants so the event loop does a few multiplies per request."""

    kv_bytes_per_token: int
    layers: int
    linear_flops_per_token: float  # 2 x active params
    attn_flops_per_pair: float  # 4 x heads x head_dim x layers, per (new token, context token)
    attn_topk: int  # 0 = dense attention
    node_flops: float
    step_fixed_s: float  # weights read + overhead, per decode step
    kv_read_s_per_byte: float  # decode: seconds per byte of batch KV (spread over the GPUs)
    decode_flops_s_per_token: float  # compute floor of a decode step, per sequence

    @classmethod
    def build(cls, model: ModelSpec, hw: Hardware) -> CostModel:
        active = model.active_params or _dense_params(model)
        heads = model.heads or 1
        head_dim = model.head_dim or 128
        hbm_node = hw.hbm_gbytes_per_s * 1e9 * hw.gpus_per_node
        weights_s = active * hw.weight_bytes_per_param / hbm_node
        return cls(
            kv_bytes_per_token=model.kv_bytes_per_token,
            layers=model.layers,
            linear_flops_per_token=2.0 * active,
            attn_flops_per_pair=4.0 * heads * head_dim * model.layers,
            attn_topk=SPARSE_ATTENTION_TOPK.get(model.preset or "", 0),
            node_flops=hw.node_flops,
            step_fixed_s=weights_s + hw.decode_overhead_s,
            kv_read_s_per_byte=1.0 / hbm_node,
            decode_flops_s_per_token=2.0 * active / (hw.node_flops / hw.mfu),
        )

    def prefill_s(self, new_tokens: int, cached_tokens: int) -> float:
        """GPU seconds of one request's prefill on a whole prefill node."""
        ctx = cached_tokens + new_tokens / 2
        if self.attn_topk and ctx > self.attn_topk:
            ctx = self.attn_topk
        flops = new_tokens * (self.linear_flops_per_token + self.attn_flops_per_pair * ctx)
        return flops / self.node_flops

    def decode_step_s(self, batch: int, batch_kv_bytes: float) -> float:
        """One decode step of `batch` sequences holding `batch_kv_bytes` of KV in total."""
        mem = self.step_fixed_s + batch_kv_bytes * self.kv_read_s_per_byte
        return max(mem, batch * self.decode_flops_s_per_token + self.step_fixed_s)

    def prefill_tokens_per_s(self, mean_context_tokens: float) -> float:
        """Node prefill throughput at a typical context (the policy's beta is seconds of it)."""
        return 1.0 / max(self.prefill_s(1, int(mean_context_tokens)), 1e-12)


def _dense_params(model: ModelSpec) -> int:
    h, i, n = model.hidden_size, model.intermediate_size, model.layers
    return int(n * (4 * h * h + 3 * h * i) + model.vocab_size * h)
