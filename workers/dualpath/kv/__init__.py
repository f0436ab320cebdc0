"""The KV block store (docs/design.md section 2): block ids, block format, store, per-node read queue.

from dualpath.kv import KVStore, ReadQueue, block_ids
store = KVStore(root, model, capacity_bytes=64 << 30)       # backend "auto" | "nixl" | "preadv"
ids = block_ids(tokens, model); hits = store.lookup(ids)
queue = ReadQueue(store, concurrency=8, snic_gbps=0)
handle = queue.submit(ids[:hits]); k, v = await handle.layer(0)

Exports load lazily (PEP 562): `dualpath.kv.ids` and `dualpath.kv.format` are pure and import
without torch, so the frontend and the scheduler can hash block ids without the store's deps.
"""

from __future__ import annotations

from dualpath import lazy

_EXPORTS = {
    "BlockFormatError": "dualpath.kv.format",
    "BlockLayout": "dualpath.kv.format",
    "BlockId": "dualpath.kv.ids",
    "block_ids": "dualpath.kv.ids",
    "KVLoadError": "dualpath.kv.queue",
    "LayerReadHandle": "dualpath.kv.queue",
    "ReadQueue": "dualpath.kv.queue",
    "TokenBucket": "dualpath.kv.queue",
    "BlockFailure": "dualpath.kv.buffers",
    "BlockRead": "dualpath.kv.buffers",
    "KVStore": "dualpath.kv.store",
    "LayerRead": "dualpath.kv.buffers",
    "request_buffer_bytes": "dualpath.kv.buffers",
    "request_layer_views": "dualpath.kv.buffers",
    "split_blocks": "dualpath.kv.buffers",
}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy.exports(__name__, _EXPORTS)
