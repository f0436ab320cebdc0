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
from dualpath.kv.ids import BlockId

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
