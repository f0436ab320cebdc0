"""The layer-by-layer KV stream between two workers (docs/design.md section 3), both directions.

A request's layer `l` is one contiguous range in both workers' buffers (`RequestLayout`), sent
as one NIXL WRITE whose notification names it: `<request>/hit/<l>` for the hit KV (path D:
decode -> prefill; path P: prefill -> decode), `<request>/new/<l>` for the new tokens' KV
(prefill -> decode).
"""

from __future__ import annotations

import asyncio

import torch

from dualpath.transfer.pool import Region
from dualpath.transfer.protocol import KVTransfer
from dualpath.worker.layout import RequestLayout


def hit_notif(request_id: str, layer: int) -> bytes:
    return f"{request_id}/hit/{layer}".encode()


def new_notif(request_id: str, layer: int) -> bytes:
    return f"{request_id}/new/{layer}".encode()


async def send_hit_layer(
    transfer: KVTransfer,
    source,  # noqa: ANN001 (a LayerReadHandle filling `region`)
    layout: RequestLayout,
    region: Region,
    peer: str,
    dst_address: int,
    request_id: str,
    layer: int,
) -> None:
    """Once hit layer `layer` has landed in `region` (read from storage), write it to the
    peer's region at `dst_address`."""
    await source.layer(layer)
    off = layer * layout.hit_layer_bytes
    await transfer.write(
        peer,
        region.address + off,
        layout.hit_layer_bytes,
        dst_address + off,
        notif=hit_notif(request_id, layer),
    )


def stream_hit_layers(
    transfer: KVTransfer,
    source,  # noqa: ANN001 (a LayerReadHandle filling `region`)
    layout: RequestLayout,
    region: Region,
    peer: str,
    dst_address: int,
    request_id: str,
) -> list[asyncio.Task]:
    """One task per layer: each layer goes to the peer as soon as it has been read (the
    caller awaits them and cancels what is left if the request fails)."""
    return [
        asyncio.create_task(
            send_hit_layer(transfer, source, layout, region, peer, dst_address, request_id, layer)
        )
        for layer in range(layout.layers)
    ]


class RemoteHitSource:
    """Path D on the prefill node: layer l is ready when the decode node's WRITE notifies."""

    def __init__(
        self,
        transfer: KVTransfer,
        peer: str,
        request_id: str,
        layout: RequestLayout,
        region: torch.Tensor,
        deadline_s: float,
    ) -> None:
        self.transfer, self.peer, self.request_id = transfer, peer, request_id
        self.layout, self.region, self.deadline_s = layout, region, deadline_s

    async def layer(self, l: int):  # noqa: ANN201, E741 (LayerSource contract)
        await self.transfer.wait_notif(self.peer, hit_notif(self.request_id, l), self.deadline_s)
        return self.layout.hit_views(self.region, l)
