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
import time

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


# the row counts a probe tries (below: every count; above: a few, the kernels change seldom there)
PACK_PROBE_ROWS = (*range(1, 33), 40, 48, 64)
_pack_rows: dict[tuple, int] = {}


def pack_rows_needed(weights: list[torch.Tensor]) -> int:
    """The fewest rows from which a row of `x @ w.T` computed with other rows has the bits of
    the same rows computed alone, for every weight here, on this CPU's BLAS at this thread
    count (a small-M kernel sums in another order; where it switches depends on the CPU and
    the inner dimension: 4 rows sufficed on one VM, 16 were needed on another). Measured once
    per shape: a few hundred small matmuls."""
    need = 1
    for w in weights:
        key = (tuple(w.shape), w.dtype, torch.get_num_threads())
        if key not in _pack_rows:
            top = PACK_PROBE_ROWS[-1]
            gen = torch.Generator().manual_seed(0)
            x = torch.randn(2 * top + 8, w.shape[1], generator=gen).to(w.dtype)
            packed = F.linear(x, w)
            bad = [
                r
                for r in PACK_PROBE_ROWS
                for at in (0, top + 5)
                if not torch.equal(packed[at : at + r], F.linear(x[at : at + r], w))
            ]
            _pack_rows[key] = max(bad, default=0) + 1
        need = max(need, _pack_rows[key])
    return need


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
# floats in the widest vector step of torch's CPU kernels (AVX-512: 2 x 16); an exp over rows of a
# multiple of this is computed the same way in every lane whatever the tensor's length
VECTOR_FLOATS = 32
SCORE_FLOATS = 1 << 22  # the scores of the tiles attended to in one call (16 MiB)


class TiledAttention:
    """Attention of the new tokens' queries over keys that arrive in pieces (online softmax).

    The new tokens' own causal attention needs no hit, so it comes first, while the layer's hit
    is still on the wire. The hit KV is then consumed in fixed tiles of `tile` tokens counted
    from the hit's first token, each as soon as it has arrived, and the result does not depend
    on how the source cut the layer into pieces (path P and path D give bit-identical outputs).
    Each tile gives an unnormalised partial output, its row max and its row sum of exp (as in
    FlashAttention); the partials are merged in one fixed order (self, then hit tiles in order)
    and normalised once at the end. The math runs in fp32 whatever the model dtype.

        acc = TiledAttention(q, kv_heads, scale)
        acc.add_self(k_new, v_new)           # causal self-attention, before any hit
        acc.push(k0, v0); acc.push(k1, v1)   # any cut; full tiles are computed as they fill
        acc.compute_ready(final=True)        # the last, partial tile
        out = acc.result()                   # (n, heads * head_dim)

    The full tiles that are here at once are computed together (one score matmul, one exp, one
    value matmul over all of them: far fewer, larger operations); each tile's partial has the
    same bits either way (each score and each output row is summed over head_dim or over the
    tile alone, and the exp and the merges see the same layouts), which the tests check.
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
        # the merged partials: unnormalised output, row max, row sum of exp
        self.out: torch.Tensor | None = None
        self.max: torch.Tensor | None = None
        self.sum: torch.Tensor | None = None
        self.hit_tokens = 0  # pushed so far
        self._self_kv: tuple[torch.Tensor, torch.Tensor] | None = None  # begun, not done
        self._self_at = 0  # the new tokens' key tiles attended to so far
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
        full = k.shape[0] - k.shape[0] % self.tile
        # tiles together only where every row of a tile's exp is whole vectors (same bits), and
        # only as many as keep the scores within SCORE_FLOATS
        step = self.tile
        if self.tile % VECTOR_FLOATS == 0:
            step *= max(1, SCORE_FLOATS // (self.heads * self.n * self.tile))
        for a in range(0, full, step):
            b = min(a + step, full)
            for part in self._partials(self.q, k[a:b], v[a:b], self.tile):
                self._merge(*part, 0)
        if final and full < k.shape[0]:
            (part,) = self._partials(self.q, k[full:], v[full:], k.shape[0] - full)
            self._merge(*part, 0)
            full = k.shape[0]
        rest = k.shape[0] - full
        self._pending = [(k[full:], v[full:])] if rest else []
        self._pending_tokens = rest

    def add_self(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """The new tokens' own keys, causally (query i sees key <= i); first, before any hit."""
        self.begin_self(k, v)
        self.self_step()

    def begin_self(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """`add_self` in steps (`self_step`): a long prompt's self-attention, the O(n^2) part
        of its layer, in key tiles a caller can stop between (chunked prefill)."""
        if self.out is not None or self._self_kv is not None:
            raise RuntimeError("add_self() comes before any hit tile (one fixed merge order)")
        self._self_kv, self._self_at = (k, v), 0

    def self_step(self, until: float = math.inf) -> bool:
        """Attend to the new tokens' own key tiles left, one after another, until
        `time.perf_counter()` passes `until` (at least one tile); True once all are done. The
        tiles and their merge order are those of one `add_self`: the same bits."""
        if self._self_kv is None:
            return True
        k, v = self._self_kv
        n = self.n
        while self._self_at < n:
            a = self._self_at
            b = min(a + self.tile, n)
            # only queries a.. see any key of this tile, and each sees key a at least (no NaN)
            mask = torch.arange(a, b)[None, :] <= torch.arange(a, n)[:, None]
            (part,) = self._partials(self.q[:, :, a:], k[a:b], v[a:b], b - a, mask)
            self._merge(*part, a)
            self._self_at = b
            if b < n and time.perf_counter() >= until:
                return False
        self._self_kv = None
        return True

    def result(self) -> torch.Tensor:
        """(n, heads * hd) fp32: the merged attention output."""
        assert self.out is not None and not self._pending_tokens, "add_self, compute_ready(True)"
        assert self.sum is not None
        out = self.out / self.sum
        return out.reshape(self.heads, self.n, self.hd).transpose(0, 1).reshape(self.n, -1)

    def _partials(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        tile: int,
        mask: torch.Tensor | None = None,
    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per tile of `tile` keys of k: (unnormalised output, row max, row sum of exp).

        Every tile is its own matmul of one shape, whether it is computed alone or with
        others (a batch of them in one call), with its operands in one layout, so its bits do
        not depend on how many tiles came together.
        """
        kvh, groups, rows, hd = q.shape
        tiles = k.shape[0] // tile
        # a kv head's groups share its keys: one (groups * rows, hd) x (hd, tile) matmul per kv
        # head and tile, not one per query head
        q2 = q.reshape(kvh, 1, groups * rows, hd).expand(kvh, tiles, groups * rows, hd)
        q2 = q2.reshape(kvh * tiles, groups * rows, hd)
        kt, vt = (
            x.float().view(tiles, tile, kvh, hd).permute(2, 0, 1, 3).reshape(-1, tile, hd)
            for x in (k, v)
        )
        s = torch.bmm(q2, kt.contiguous().transpose(1, 2)).mul_(self.scale)
        s5 = s.view(kvh, tiles, groups, rows, tile)
        if mask is not None:
            s5.masked_fill_(~mask, float("-inf"))
        mx = s5.amax(-1, keepdim=True)
        total = s5.sub_(mx).exp_().sum(-1, keepdim=True)
        o = torch.bmm(s, vt.contiguous()).view(kvh, tiles, groups, rows, hd)
        return [(o[:, j], mx[:, j], total[:, j]) for j in range(tiles)]

    def _merge(self, out: torch.Tensor, mx: torch.Tensor, total: torch.Tensor, row0: int) -> None:
        if self.out is None:
            if row0:  # rows before row0 saw no key yet: out 0, max -inf, sum 0
                self.out = self.q.new_zeros(self.q.shape)
                self.max = self.q.new_full((*self.q.shape[:3], 1), float("-inf"))
                self.sum = self.q.new_zeros((*self.q.shape[:3], 1))
            else:
                self.out, self.max, self.sum = out.contiguous(), mx.contiguous(), total.contiguous()
                return
        assert self.max is not None and self.sum is not None
        o0, m0, s0 = self.out[:, :, row0:], self.max[:, :, row0:], self.sum[:, :, row0:]
        m = torch.maximum(m0, mx)
        a0, a1 = (m0 - m).exp_(), (mx - m).exp_()
        o, s = o0 * a0 + out * a1, s0 * a0 + total * a1
        if row0:
            self.out[:, :, row0:], self.sum[:, :, row0:], self.max[:, :, row0:] = o, s, m
        else:  # every row: the new tensors are the state (no copy back)
            self.out, self.sum, self.max = o, s, m


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

    @property
    def min_pack_rows(self) -> int:
        """A request with fewer new tokens than this runs its matmuls alone in a batched
        prefill (`engine/batch.py`); from it on, its rows packed with others keep its bits."""
        if self.spec.layers == 0:
            return 1
        block = self.layers[0]
        return pack_rows_needed([m.weight for m in block.modules() if isinstance(m, nn.Linear)])

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

    def self_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, stepped: bool = False
    ) -> TiledAttention:
        """The new tokens' causal attention to themselves: what a layer can do before its hit
        (`stepped`: begun only, its caller runs `self_step` to the end)."""
        acc = TiledAttention(q, self.spec.kv_heads, self.scale)
        if stepped:
            acc.begin_self(k, v)
        else:
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
