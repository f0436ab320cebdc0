"""Where a request's KV sits in a worker's registered buffer (pure: sizes and views).

Two regions per request, both layer-major so one layer is one contiguous range and one
NIXL WRITE (the layer-by-layer stream of docs/design.md section 3):

* hit region: the store's request-buffer layout for `blocks` hit blocks
  (layer l = K of all blocks' tokens, then V), filled by a storage read or by the peer;
* new region: the prefill's new tokens, layer l = K of the new tokens, then V.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dualpath.config import ModelSpec
from dualpath.kv.buffers import TORCH_DTYPES, LayerKV, request_layer_views
from dualpath.kv.format import BlockLayout


@dataclass(frozen=True)
class RequestLayout:
    """The KV regions of one request: `hit_blocks` from storage, `new_tokens` computed."""

    block: BlockLayout
    hit_blocks: int
    new_tokens: int

    @classmethod
    def of(cls, model: ModelSpec, hit_tokens: int, prompt_tokens: int) -> RequestLayout:
        if hit_tokens % model.block_tokens:
            raise ValueError(
                f"hit_tokens ({hit_tokens}) must be whole blocks of {model.block_tokens}"
            )
        if not 0 <= hit_tokens < prompt_tokens:
            raise ValueError(
                f"hit_tokens ({hit_tokens}) must leave at least one of the {prompt_tokens} "
                "prompt tokens to prefill"
            )
        return cls(
            BlockLayout.from_model(model),
            hit_tokens // model.block_tokens,
            prompt_tokens - hit_tokens,
        )

    @property
    def layers(self) -> int:
        return self.block.layers

    @property
    def hit_tokens(self) -> int:
        return self.hit_blocks * self.block.block_tokens

    @property
    def hit_layer_bytes(self) -> int:
        return self.hit_blocks * self.block.layer_bytes

    @property
    def hit_bytes(self) -> int:
        return self.hit_layer_bytes * self.layers

    @property
    def new_k_bytes(self) -> int:
        return self.new_tokens * self.block.k_token_bytes

    @property
    def new_layer_bytes(self) -> int:
        return self.new_tokens * (self.block.k_token_bytes + self.block.v_token_bytes)

    @property
    def new_bytes(self) -> int:
        return self.new_layer_bytes * self.layers

    def hit_views(self, region: torch.Tensor, layer: int) -> LayerKV:
        return request_layer_views(region, self.block, self.hit_blocks, layer)

    def new_views(self, region: torch.Tensor, layer: int) -> LayerKV:
        lo, n = self.block, self.new_tokens
        dtype = TORCH_DTYPES[lo.dtype]
        base = layer * self.new_layer_bytes
        k = region[base : base + self.new_k_bytes].view(dtype).view(n, lo.k_heads, lo.k_dim)
        v = region[base + self.new_k_bytes : base + self.new_layer_bytes]
        return k, v.view(dtype).view(n, lo.v_heads, lo.v_dim)

    def put_new(self, region: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Copy the new tokens' K, V of `layer` into the new region."""
        dk, dv = self.new_views(region, layer)
        dk.copy_(k)
        dv.copy_(v)

    def context(self, hit_region: torch.Tensor | None, new_region: torch.Tensor) -> list[LayerKV]:
        """The whole prompt's KV per layer (hit then new), as fresh tensors."""
        out = []
        for layer in range(self.layers):
            nk, nv = self.new_views(new_region, layer)
            if self.hit_blocks and hit_region is not None:
                hk, hv = self.hit_views(hit_region, layer)
                out.append((torch.cat([hk, nk]), torch.cat([hv, nv])))
            else:
                out.append((nk.clone(), nv.clone()))
        return out
