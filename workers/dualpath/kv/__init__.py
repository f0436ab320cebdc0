"""The KV block store (DESIGN section 2): block ids, block format, store, per-node read queue.

from dualpath.kv import KVStore, ReadQueue, block_ids
store = KVStore(root, model, capacity_bytes=64 << 30)       # backend "auto" | "nixl" | "preadv"
ids = block_ids(tokens, model); hits = store.lookup(ids)
queue = ReadQueue(store, concurrency=8, snic_gbps=0)
handle = queue.submit(ids[:hits]); k, v = await handle.layer(0)
"""

from dualpath.kv.format import BlockFormatError, BlockLayout
from dualpath.kv.ids import BlockId, block_ids
from dualpath.kv.queue import KVLoadError, LayerReadHandle, ReadQueue, TokenBucket
from dualpath.kv.store import (
    BlockFailure,
    BlockRead,
    KVStore,
    LayerRead,
    request_buffer_bytes,
    request_layer_views,
    split_blocks,
)

__all__ = [
    "BlockFailure",
    "KVLoadError",
    "LayerReadHandle",
    "ReadQueue",
    "TokenBucket",
    "BlockFormatError",
    "BlockId",
    "BlockLayout",
    "BlockRead",
    "KVStore",
    "LayerRead",
    "block_ids",
    "request_buffer_bytes",
    "request_layer_views",
    "split_blocks",
]
