"""Request buffers and what a read returns (torch, no I/O): the layer-major host buffer a
request's hit KV lands in, K/V views of one of its layers, and the read results with their
failures as data (`BlockFailure`: a block id and its miss reason).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from dualpath.kv.format import BlockLayout
from dualpath.kv.ids import BlockId, is_block_id

TORCH_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float8": torch.float8_e4m3fn,
}

LayerKV = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class BlockFailure:
    block_id: BlockId
    reason: str  # metric label: one of kv/errors.py READ_REASONS


@dataclass
class LayerRead:
    """One layer of a run of blocks: K, V of the valid prefix's tokens."""

    k: torch.Tensor
    v: torch.Tensor
    valid_blocks: int
    failed: list[BlockFailure] = field(default_factory=list)


@dataclass
class BlockRead:
    """A whole-request read: every layer of the valid prefix, in a layer-major host buffer."""

    buffer: torch.Tensor  # uint8, RequestBuffer layout for the requested block count
    layout: BlockLayout
    requested_blocks: int
    valid_blocks: int
    failed: list[BlockFailure] = field(default_factory=list)

    def layer(self, layer: int) -> LayerKV:
        return request_layer_views(
            self.buffer, self.layout, self.requested_blocks, layer, self.valid_blocks
        )


def request_buffer_bytes(layout: BlockLayout, blocks: int) -> int:
    """Bytes of a request buffer: per layer, K of all blocks' tokens then V of all."""
    return layout.payload_bytes * blocks


def request_layer_bytes(
    buffer: torch.Tensor, layout: BlockLayout, blocks: int, layer: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat uint8 K and V ranges of `layer` in a request buffer sized for `blocks` blocks:
    layer-major, K of every block back to back, then V of every block."""
    base = layer * blocks * layout.layer_bytes
    v0 = base + blocks * layout.k_bytes
    return buffer[base:v0], buffer[v0 : v0 + blocks * layout.v_bytes]


def request_layer_views(
    buffer: torch.Tensor, layout: BlockLayout, blocks: int, layer: int, valid: int | None = None
) -> LayerKV:
    """K, V views of `layer` in a request buffer sized for `blocks` blocks (first `valid`)."""
    valid = blocks if valid is None else valid
    dtype = TORCH_DTYPES[layout.dtype]
    k8, v8 = request_layer_bytes(buffer, layout, blocks, layer)
    tokens = valid * layout.block_tokens
    k = k8[: valid * layout.k_bytes].view(dtype).view(tokens, layout.k_heads, layout.k_dim)
    v = v8[: valid * layout.v_bytes].view(dtype).view(tokens, layout.v_heads, layout.v_dim)
    return k, v


def split_blocks(kv_layers: Sequence[LayerKV], block_tokens: int) -> list[list[LayerKV]]:
    """Split a context's per-layer (K, V), each (tokens, heads, dim), into full blocks."""
    if not kv_layers:
        return []
    tokens = kv_layers[0][0].shape[0]
    out = []
    for i in range(tokens // block_tokens):
        s = slice(i * block_tokens, (i + 1) * block_tokens)
        out.append([(k[s], v[s]) for k, v in kv_layers])
    return out


def covered_blocks(
    blocks: int, kv_layers: Sequence[LayerKV], kv_start_token: int, block_tokens: int
) -> tuple[int, list[tuple[int, list[LayerKV]]]]:
    """Which of a context's first `blocks` full blocks `kv_layers` covers, when it holds the
    KV of the context's tokens from `kv_start_token` on: (end, [(block index, per layer
    (K, V) of its tokens)]). `end` is one past the last block that is covered or lies before
    `kv_start_token` (the chain a store then holds); blocks before it are not listed."""
    end = 0
    out = []
    for i in range(blocks):
        start = i * block_tokens - kv_start_token
        if start < 0:
            end = i + 1
            continue
        if start + block_tokens > kv_layers[0][0].shape[0]:
            break
        s = slice(start, start + block_tokens)
        out.append((i, [(k[s], v[s]) for k, v in kv_layers]))
        end = i + 1
    return end, out


def check_block(lo: BlockLayout, block_id: BlockId, layers: Sequence[LayerKV]) -> None:
    """Refuse a block whose id or K, V do not fit the layout, naming what is off."""
    if not is_block_id(block_id):
        raise ValueError(f"block id {block_id!r} is not 32 hex digits (use block_ids())")
    if len(layers) != lo.layers:
        raise ValueError(f"block needs {lo.layers} layers of (K, V), got {len(layers)}")
    dtype = TORCH_DTYPES[lo.dtype]
    for i, (k, v) in enumerate(layers):
        for name, t, shape in (("K", k, lo.k_shape), ("V", v, lo.v_shape)):
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise ValueError(
                    f"layer {i} {name}: expected {shape} {dtype}, got {tuple(t.shape)} {t.dtype}"
                )


def check_layers_read(
    lo: BlockLayout,
    valid_blocks: int,
    l0: int,
    l1: int,
    a: int,
    b: int,
    dests: Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> None:
    """Refuse a read of layers [l0, l1) of blocks [a, b) of a run that cannot be done."""
    lo.layer_offset(l0)
    if not l0 < l1 <= lo.layers or len(dests) != l1 - l0:
        raise ValueError(f"layers [{l0}, {l1}) with {len(dests)} destinations")
    if not 0 <= a <= b <= valid_blocks:
        raise ValueError(f"blocks [{a}, {b}) outside the run's {valid_blocks}")
    if any(k.numel() < (b - a) * lo.k_bytes or v.numel() < (b - a) * lo.v_bytes for k, v in dests):
        raise ValueError(f"a K/V destination is too small for {b - a} blocks")


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def dest_bytes(t: torch.Tensor, name: str) -> torch.Tensor:
    if not t.is_contiguous():  # reshape would copy, and the read would land in the copy
        raise ValueError(f"{name} must be contiguous")
    return as_bytes(t)


def random_layers(layout: BlockLayout, gen: torch.Generator | None = None) -> list[LayerKV]:
    """Random K, V for one block (tests and the benchmark); bit patterns, not just values."""
    dtype = TORCH_DTYPES[layout.dtype]
    out = []
    for _ in range(layout.layers):
        kv = []
        for shape in (layout.k_shape, layout.v_shape):
            n = int(np.prod(shape)) * layout.dtype_bytes
            raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
            kv.append(raw.view(dtype).view(shape))
        out.append((kv[0], kv[1]))
    return out
