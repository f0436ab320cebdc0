"""Paged KV cache and continuous-batching decode (DESIGN section 3, step 5).

The cache is a pool of pages per layer, K and V each (pages, page_tokens, kv_heads, head_dim);
a sequence owns a block table (list of page indices). `DecodeBatch.step()` runs one token for
every running sequence in one batched forward, gathering each sequence's pages by its table.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from dualpath.engine.model import Transformer
from dualpath.sampling import SamplingParams

LayerKV = tuple[torch.Tensor, torch.Tensor]


class CacheFullError(RuntimeError):
    """The paged KV cache has no free pages; free sequences or raise kv capacity."""


@dataclass(frozen=True)
class StepOutput:
    seq_id: str
    token: int
    finished: bool
    reason: str | None = None  # "stop" | "length"


@dataclass
class Sequence_:
    seq_id: str
    params: SamplingParams
    length: int  # tokens whose KV is cached
    pages: list[int]
    last_token: int  # sampled, KV not cached yet
    generated: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    finished: bool = False


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    gen: torch.Generator | None,
    generated: int = 0,
) -> int:
    """Greedy (argmax, lowest id on ties) or temperature sampling with top-k then top-p
    filtering from one logits row; `generated`: tokens the sequence has produced so far (stop
    tokens are masked while it is below `min_tokens`)."""
    logits = logits.reshape(-1).float()
    if generated < params.min_tokens and params.stop_tokens:
        logits = logits.clone()
        logits[[t for t in params.stop_tokens if 0 <= t < logits.numel()]] = -math.inf
    if params.temperature == 0:
        return int(torch.argmax(logits))
    logits = logits / params.temperature
    if 0 < params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, -math.inf)
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1:
        sorted_p, order = torch.sort(probs, descending=True)
        # keep an id while the mass before it is below top_p (the first id always stays)
        drop = (torch.cumsum(sorted_p, 0) - sorted_p) >= params.top_p
        probs = probs.scatter(0, order[drop], 0.0)
    return int(torch.multinomial(probs, 1, generator=gen))


class PagedKVCache:
    """Fixed pool of KV pages for all layers plus a free list."""

    def __init__(self, model: Transformer, capacity_tokens: int, page_tokens: int) -> None:
        s = model.spec
        self.page_tokens = page_tokens
        self.pages = max(1, math.ceil(capacity_tokens / page_tokens))
        shape = (s.layers, self.pages, page_tokens, s.kv_heads, s.head_dim)
        self.k = torch.zeros(shape, dtype=model.dtype)
        self.v = torch.zeros(shape, dtype=model.dtype)
        self._free = list(range(self.pages - 1, -1, -1))

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def pages_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.page_tokens)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise CacheFullError(
                f"KV cache needs {n} pages, {len(self._free)} free of {self.pages}; "
                "free finished sequences or raise the engine's kv_capacity_tokens"
            )
        return [self._free.pop() for _ in range(n)]

    def release(self, pages: Sequence[int]) -> None:
        self._free.extend(reversed(pages))

    def write(self, pages: Sequence[int], start: int, kv_layers: Sequence[LayerKV]) -> None:
        """Write per-layer KV of tokens start.. into a sequence's pages."""
        n = kv_layers[0][0].shape[0]
        pt = self.page_tokens
        pos = torch.arange(start, start + n)
        page_idx = torch.tensor(pages, dtype=torch.long)[pos // pt]
        slot = pos % pt
        for l, (k, v) in enumerate(kv_layers):  # noqa: E741
            self.k[l, page_idx, slot] = k.to(self.k.dtype)
            self.v[l, page_idx, slot] = v.to(self.v.dtype)

    def read(self, pages: Sequence[int], length: int, start: int = 0) -> list[LayerKV]:
        """Tokens start..length of a sequence, per layer (copies: the pages are reused)."""
        first = start // self.page_tokens
        idx = torch.tensor(pages[first : -(-length // self.page_tokens)], dtype=torch.long)
        lo, hi = start - first * self.page_tokens, length - first * self.page_tokens
        out = []
        for l in range(self.k.shape[0]):  # noqa: E741
            k = self.k[l, idx].reshape(-1, *self.k.shape[3:])[lo:hi]
            v = self.v[l, idx].reshape(-1, *self.v.shape[3:])[lo:hi]
            out.append((k, v))
        return out


def decode_forward(
    model: Transformer, cache: PagedKVCache, seqs: Sequence[Sequence_]
) -> torch.Tensor:
    """One batched decode step: feed each sequence's last token, return logits (B, vocab).

    Writes the fed tokens' KV into the cache (callers advance `length`).
    """
    s, pt = model.spec, cache.page_tokens
    b = len(seqs)
    tokens = torch.tensor([q.last_token for q in seqs], dtype=torch.long)
    positions = torch.tensor([q.length for q in seqs], dtype=torch.long)
    page_idx = torch.tensor([q.pages[q.length // pt] for q in seqs], dtype=torch.long)
    slots = positions % pt
    max_pages = max(len(q.pages) for q in seqs)
    tables = torch.zeros(b, max_pages, dtype=torch.long)
    for i, q in enumerate(seqs):
        tables[i, : len(q.pages)] = torch.tensor(q.pages)
    total = max_pages * pt
    mask = (torch.arange(total)[None, :] <= positions[:, None])[:, None, None, :]
    h = model.embed(tokens)
    for l in range(s.layers):  # noqa: E741
        q, k, v = model.qkv(l, h, positions)
        cache.k[l, page_idx, slots] = k
        cache.v[l, page_idx, slots] = v
        flat = tables.reshape(-1)
        keys = cache.k[l].index_select(0, flat).view(b, total, s.kv_heads, s.head_dim)
        vals = cache.v[l].index_select(0, flat).view(b, total, s.kv_heads, s.head_dim)
        out = F.scaled_dot_product_attention(
            q[:, :, None, :],
            keys.transpose(1, 2),
            vals.transpose(1, 2),
            attn_mask=mask,
            scale=model.scale,
            enable_gqa=True,
        )
        h = model.finish(l, h, out.reshape(b, -1))
    return model.head(h)
