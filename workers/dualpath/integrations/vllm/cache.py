"""vLLM's paged KV cache on CPU, as the connector reads and writes it (torch, no vLLM import).

vLLM 0.32's CPU attention keeps one tensor per layer of shape
(num_blocks, kv_heads, block_size, 2 * head_dim), viewed by the kernel as
(num_blocks, kv_heads, 2 * block_size, head_dim) and split in two along dim 2: per block and
head, K is stored dim-major (head_dim rows of block_size tokens: token t of dim d at
d * block_size + t) and V token-major (block_size rows of head_dim). The store keeps both
token-major, (tokens, heads, dim), as the DualPath engine does, so blocks written by either
engine are the same bytes (same weights: same KV).

`check_layout` writes random K/V with vLLM's own kernel into a scratch cache and reads them
back with these functions: a vLLM whose layout differs (another version, the bf16 AMX kernel)
is refused at start, never silently misread.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def _halves(kv_layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """K as (blocks, heads, head_dim, block_size) and V as (blocks, heads, block_size,
    head_dim) views of one layer's cache."""
    nb, heads, bs, two_hd = kv_layer.shape
    hd = two_hd // 2
    flat = kv_layer.view(nb, heads, 2 * bs * hd)
    k = flat[:, :, : bs * hd].view(nb, heads, hd, bs)
    v = flat[:, :, bs * hd :].view(nb, heads, bs, hd)
    return k, v, bs, hd


def read_tokens(kv_layer: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V of the cache slots `slots` (int64), each (tokens, heads, head_dim), token-major."""
    k, v, bs, _ = _halves(kv_layer)
    blk, off = slots // bs, slots % bs
    # k[blk, :, :, off] -> (tokens, heads, hd); v[blk, :, off] -> (tokens, heads, hd)
    return k[blk, :, :, off].contiguous(), v[blk, :, off].contiguous()


def write_tokens(
    kv_layer: torch.Tensor, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> None:
    """Put K, V (tokens, heads, head_dim) into the cache slots `slots` (int64)."""
    k, v, bs, _ = _halves(kv_layer)
    blk, off = slots // bs, slots % bs
    k[blk, :, :, off] = key.to(k.dtype)
    v[blk, :, off] = value.to(v.dtype)


def check_layout(
    reshape_and_cache: Callable[..., None],
    heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
) -> None:
    """Write random K/V with vLLM's kernel (`reshape_and_cache(key, value, key_cache,
    value_cache, slot_mapping)`) and read them back here; raise when they differ."""
    nb = 3
    cache = torch.zeros(nb, heads, block_size, 2 * head_dim, dtype=dtype)
    key_cache, value_cache = cache.view(nb, heads, 2 * block_size, head_dim).chunk(2, dim=2)
    gen = torch.Generator().manual_seed(0)
    n = block_size + 3
    key = torch.randn(n, heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(n, heads, head_dim, generator=gen).to(dtype)
    slots = torch.arange(n, dtype=torch.int64) + (block_size - 2)  # across a block boundary
    reshape_and_cache(key, value, key_cache, value_cache, slots)
    k, v = read_tokens(cache, slots)
    if not (torch.equal(k, key) and torch.equal(v, value)):
        raise RuntimeError(
            "vLLM's CPU KV cache layout is not the one dualpath.integrations.vllm.cache reads "
            f"(heads {heads}, head_dim {head_dim}, block {block_size}, {dtype}): this vLLM "
            "version or kernel is not supported (docs/vllm.md)"
        )
    back = torch.zeros_like(cache)
    write_tokens(back, slots, key, value)
    if not torch.equal(back, cache):
        raise RuntimeError("writing K/V into vLLM's CPU KV cache layout does not round-trip")
