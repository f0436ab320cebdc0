"""Where a request's KV sits in a worker's registered buffer (pure: sizes and views).

Two regions per request, both layer-major so one layer is one contiguous range and one
NIXL WRITE (the layer-by-layer stream of DESIGN section 3):

* hit region: the store's request-buffer layout for `blocks` hit blocks
  (layer l = K of all blocks' tokens, then V), filled by a storage read or by the peer;
* new region: the prefill's new tokens, layer l = K of the new tokens, then V.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dualpath.kv.buffers import TORCH_DTYPES, LayerKV, request_layer_views
from dualpath.worker.sizes import RequestSizes


@dataclass(frozen=True)
class RequestLayout(RequestSizes):
    """The KV regions of one request (sizes: `RequestSizes`), viewed as tensors."""

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
