"""A decoder-only transformer (Llama / Qwen2 style): RMSNorm, rotary, GQA, SwiGLU.

The model is split into per-layer pieces (`embed`, `qkv`, `self_attention`, `finish`, `head`)
so the prefill can interleave layer `l`'s compute with the arrival of layer `l+1`'s hit KV, and
the decode can run one batched step over paged KV. Weights are initialised deterministically
from `ModelSpec.seed` here; checkpoint files are read and written by `engine/checkpoint.py`.

K is cached after rotary (as in HF / vLLM), so a hit prefix's K is used as is.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
from torch import nn

from dualpath.config import ModelSpec, RopeScaling

TORCH_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}


def configure_threads(threads: int | None = None) -> int:
    """Set torch's intra-op threads from `threads`, else $DUALPATH_TORCH_THREADS, else 1."""
    n = threads or int(os.environ.get("DUALPATH_TORCH_THREADS", "0") or 0) or 1
    torch.set_num_threads(n)
    return n


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Block(nn.Module):
    def __init__(self, spec: ModelSpec, qkv_bias: bool) -> None:
        super().__init__()
        hd, h, kvh = spec.head_dim, spec.heads, spec.kv_heads
        inter = spec.intermediate_size or 4 * spec.hidden_size
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.q_proj = nn.Linear(spec.hidden_size, h * hd, bias=qkv_bias)
        self.k_proj = nn.Linear(spec.hidden_size, kvh * hd, bias=qkv_bias)
        self.v_proj = nn.Linear(spec.hidden_size, kvh * hd, bias=qkv_bias)
        self.o_proj = nn.Linear(h * hd, spec.hidden_size, bias=False)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.gate_proj = nn.Linear(spec.hidden_size, inter, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, inter, bias=False)
        self.down_proj = nn.Linear(inter, spec.hidden_size, bias=False)


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """The head_dim/2 rotary frequencies (fp64), with Llama 3's scaling when given."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv
    old, low, high = (
        scaling.original_max_position_embeddings,
        scaling.low_freq_factor,
        scaling.high_freq_factor,
    )
    wavelen = 2 * math.pi / inv
    # long wavelengths (beyond old/low) are stretched by `factor`, short ones (below old/high)
    # kept, and the band between blends the two by where its wavelength falls
    smooth = ((old / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    return (1 - smooth) * inv / scaling.factor + smooth * inv


def rotary(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (n, head_dim) for integer `positions` (HF rotate-half convention)."""
    ang = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().float(), ang.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (n, heads, head_dim); cos/sin: (n, head_dim)."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    c, s = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    return x * c + rot * s


ATTENTION_TILE_TOKENS = 128


class TiledAttention:
    """Attention of the new tokens' queries over keys that arrive in pieces (online softmax).

    The new tokens' own causal attention needs no hit, so it comes first, while the layer's hit
    is still on the wire. The hit KV is then consumed in fixed tiles of `tile` tokens counted
    from the hit's first token, each as soon as it has arrived, and the result does not depend
    on how the source cut the layer into pieces (path P and path D give bit-identical outputs).
    Each tile gives a partial output and its log-sum-exp; the partials are merged in one fixed
    order (self, then hit tiles in order). The math runs in fp32 whatever the model dtype.

        acc = TiledAttention(q, kv_heads, scale)
        acc.add_self(k_new, v_new)           # causal self-attention, before any hit
        acc.push(k0, v0); acc.push(k1, v1)   # any cut; full tiles are computed as they fill
        acc.compute_ready(final=True)        # the last, partial tile
        out = acc.result()                   # (n, heads * head_dim)
    """

    def __init__(
        self, q: torch.Tensor, kv_heads: int, scale: float, tile: int = ATTENTION_TILE_TOKENS
    ) -> None:
        n, heads, hd = q.shape
        self.n, self.heads, self.kv_heads, self.hd = n, heads, kv_heads, hd
        self.groups = heads // kv_heads
        # head h reads kv head h // groups (HF repeat_kv): (kv_heads, groups, n, hd)
        self.q = q.float().permute(1, 0, 2).reshape(kv_heads, self.groups, n, hd)
        self.scale, self.tile = scale, tile
        self.out: torch.Tensor | None = None
        self.lse: torch.Tensor | None = None
        self.hit_tokens = 0  # pushed so far
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._pending_tokens = 0

    @property
    def pending_tokens(self) -> int:
        """Hit tokens pushed but not yet attended to."""
        return self._pending_tokens

    @property
    def ready_tiles(self) -> int:
        """Whole tiles pushed but not yet computed."""
        return self._pending_tokens // self.tile

    def push(self, k: torch.Tensor, v: torch.Tensor, compute: bool = True) -> None:
        """Append hit keys/values (t, kv_heads, hd) in token order; compute the full tiles."""
        if k.shape[0]:
            self._pending.append((k, v))
            self._pending_tokens += k.shape[0]
            self.hit_tokens += k.shape[0]
        if compute:
            self.compute_ready()

    def compute_ready(self, final: bool = False) -> None:
        """Attend to every full pending tile (and, if `final`, to the last partial one)."""
        if self.out is None:
            raise RuntimeError("add_self() comes before any hit tile (one fixed merge order)")
        if not self._pending_tokens or (self._pending_tokens < self.tile and not final):
            return
        ks, vs = zip(*self._pending, strict=True)
        k, v = (torch.cat(ks), torch.cat(vs)) if len(ks) > 1 else (ks[0], vs[0])
        end = k.shape[0] if final else k.shape[0] - k.shape[0] % self.tile
        for a in range(0, end, self.tile):
            self._merge(*self._partial(self.q, k[a : a + self.tile], v[a : a + self.tile]), 0)
        rest = k.shape[0] - end
        self._pending = [(k[end:], v[end:])] if rest else []
        self._pending_tokens = rest

    def add_self(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """The new tokens' own keys, causally (query i sees key <= i); first, before any hit."""
        if self.out is not None:
            raise RuntimeError("add_self() comes before any hit tile (one fixed merge order)")
        n = self.n
        for a in range(0, n, self.tile):
            b = min(a + self.tile, n)
            # only queries a.. see any key of this tile, and each sees key a at least (no NaN)
            mask = torch.arange(a, b)[None, :] <= torch.arange(a, n)[:, None]
            self._merge(*self._partial(self.q[:, :, a:], k[a:b], v[a:b], mask), a)

    def result(self) -> torch.Tensor:
        """(n, heads * hd) fp32: the merged attention output."""
        assert self.out is not None and not self._pending_tokens, "add_self, compute_ready(True)"
        return self.out.reshape(self.heads, self.n, self.hd).transpose(0, 1).reshape(self.n, -1)

    def _partial(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        kt = k.float().permute(1, 2, 0)[:, None]  # (kv_heads, 1, hd, t)
        s = torch.matmul(q, kt).mul_(self.scale)  # (kv_heads, groups, rows, t)
        if mask is not None:
            s.masked_fill_(~mask, float("-inf"))
        lse = torch.logsumexp(s, -1, keepdim=True)
        p = s.sub_(lse).exp_()
        return torch.matmul(p, v.float().permute(1, 0, 2)[:, None]), lse

    def _merge(self, out: torch.Tensor, lse: torch.Tensor, row0: int) -> None:
        if self.out is None:
            if row0:  # rows before row0 saw no key yet: out 0, lse -inf
                self.out = self.q.new_zeros(self.q.shape)
                self.lse = self.q.new_full((*self.q.shape[:3], 1), float("-inf"))
            else:
                self.out, self.lse = out, lse
                return
        assert self.lse is not None
        o0, l0 = self.out[:, :, row0:], self.lse[:, :, row0:]
        total = torch.logaddexp(l0, lse)
        self.out[:, :, row0:] = o0 * (l0 - total).exp() + out * (lse - total).exp()
        self.lse[:, :, row0:] = total


class Transformer(nn.Module):
    """Weights plus the per-layer forward pieces; holds no KV itself."""

    def __init__(self, spec: ModelSpec, qkv_bias: bool = False, tie_embeddings: bool = False):
        super().__init__()
        if spec.attention != "gqa":
            raise ValueError("the engine runs GQA models only (model.attention: gqa)")
        if spec.dtype not in TORCH_DTYPES:
            raise ValueError(
                f"model.dtype {spec.dtype!r} cannot run; use one of {list(TORCH_DTYPES)}"
            )
        self.spec = spec
        self.dtype = TORCH_DTYPES[spec.dtype]
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(Block(spec, qkv_bias) for _ in range(spec.layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.tie_embeddings = tie_embeddings
        if tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.groups = spec.heads // spec.kv_heads
        self.scale = 1.0 / math.sqrt(spec.head_dim)
        self.rope_inv_freq = rope_frequencies(spec.head_dim, spec.rope_theta, spec.rope_scaling)
        self.requires_grad_(False)
        self.eval()

    # ---- construction -----------------------------------------------------------------------

    @classmethod
    def from_seed(cls, spec: ModelSpec, seed: int | None = None) -> Transformer:
        """Deterministic weights: the same spec and seed give bit-identical weights anywhere."""
        model = cls(spec)
        gen = torch.Generator().manual_seed(spec.seed if seed is None else seed)
        with torch.no_grad():
            for name, p in sorted(model.named_parameters()):
                if name.endswith("layernorm.weight") or name == "norm.weight":
                    p.fill_(1.0)
                elif name.endswith(".bias"):
                    p.zero_()
                elif name == "embed_tokens.weight":
                    p.copy_(torch.randn(p.shape, generator=gen))
                else:  # fan-in scaled so activations and logits stay O(1) through the layers
                    p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
        return model.to(model.dtype)

    # ---- forward pieces ---------------------------------------------------------------------

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(tokens)

    def qkv(
        self,
        layer: int,
        h: torch.Tensor,
        positions: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated q (n, heads, hd), rotated k and v (n, kv_heads, hd) of layer `layer`."""
        blk, s = self.layers[layer], self.spec
        x = blk.input_layernorm(h)
        n = h.shape[0]
        q = blk.q_proj(x).view(n, s.heads, s.head_dim)
        k = blk.k_proj(x).view(n, s.kv_heads, s.head_dim)
        v = blk.v_proj(x).view(n, s.kv_heads, s.head_dim)
        cos, sin = rotary(positions, self.rope_inv_freq)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def finish(self, l: int, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:  # noqa: E741
        """Residual + output projection + SwiGLU MLP; attn is (n, heads*hd)."""
        blk = self.layers[l]
        h = h + blk.o_proj(attn)
        x = blk.post_attention_layernorm(h)
        return h + blk.down_proj(F.silu(blk.gate_proj(x)) * blk.up_proj(x))

    def prefill_layer(
        self,
        layer: int,
        h: torch.Tensor,
        hit_k: torch.Tensor,
        hit_v: torch.Tensor,
        start: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer `layer` over new tokens at positions start.. attending to hit KV + themselves."""
        positions = torch.arange(start, start + h.shape[0])
        q, k, v = self.qkv(layer, h, positions)
        return self.attend(layer, h, q, k, v, hit_k, hit_v), k, v

    def attend(
        self,
        layer: int,
        h: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        hit_k: torch.Tensor,
        hit_v: torch.Tensor,
    ) -> torch.Tensor:
        """The rest of a prefill layer with the whole hit KV at hand: causal attention + MLP."""
        acc = self.self_attention(q, k, v)
        acc.push(hit_k, hit_v)
        return self.attend_tail(layer, h, acc)

    def self_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> TiledAttention:
        """The new tokens' causal attention to themselves: what a layer can do before its hit."""
        acc = TiledAttention(q, self.spec.kv_heads, self.scale)
        acc.add_self(k, v)
        return acc

    def attend_tail(self, layer: int, h: torch.Tensor, acc: TiledAttention) -> torch.Tensor:
        """Once every hit piece is in `acc`: its last tile, the output projection and the MLP."""
        acc.compute_ready(final=True)
        return self.finish(layer, h, acc.result().to(h.dtype))

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h)).float()

    def forward_full(
        self, tokens: torch.Tensor
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Reference: logits (n, vocab) and per-layer KV of the whole sequence, no cache."""
        h = self.embed(tokens)
        empty = torch.empty(0, self.spec.kv_heads, self.spec.head_dim, dtype=self.dtype)
        kv = []
        for l in range(self.spec.layers):  # noqa: E741
            h, k, v = self.prefill_layer(l, h, empty, empty, 0)
            kv.append((k, v))
        return self.head(h), kv
