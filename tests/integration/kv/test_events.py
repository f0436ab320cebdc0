"""The store's KV events (what the scheduler's block index is fed) and its scan."""

import torch
from dualpath.kv import KVStore, block_ids
from dualpath.kv.buffers import TORCH_DTYPES, random_layers
from dualpath.kv.events import KvEventBuffer
from dualpath.kv.ids import block_key, block_keys
from dualpath.scheduler.index import ROOT, UNLINKED


def kv_for(store, n_tokens):
    lo = store.layout
    dtype = TORCH_DTYPES[lo.dtype]
    return [
        (
            torch.zeros((n_tokens, *lo.k_shape[1:]), dtype=dtype),
            torch.ones((n_tokens, *lo.v_shape[1:]), dtype=dtype),
        )
        for _ in range(lo.layers)
    ]


def test_writes_announce_the_chain_and_drops_are_removals(tmp_path, tiny):
    events = KvEventBuffer()
    store = KVStore(tmp_path / "kv", tiny, 1 << 30, backend="preadv", events=events)
    bt = store.layout.block_tokens
    tokens = list(range(3 * bt + 5))
    keys = block_keys(block_ids(tokens, tiny))
    store.put_tokens(tokens[: 2 * bt], kv_for(store, 2 * bt))
    stored, removed, lost = events.take()
    assert stored == [(keys[0], ROOT, 0), (keys[1], keys[0], 1)] and not removed and not lost
    # the next turn writes block 2 only, and announces the prefix it holds with it
    store.put_tokens(tokens, kv_for(store, len(tokens) - 2 * bt), kv_start_token=2 * bt)
    stored, _, _ = events.take()
    assert stored == [(keys[0], ROOT, 0), (keys[1], keys[0], 1), (keys[2], keys[1], 2)]

    ids = block_ids(tokens, tiny)
    store.evict(ids[1])
    store.put(ids[1], random_layers(store.layout))  # written again before the batch left
    store.evict(ids[2])
    stored, removed, _ = events.take()
    assert stored == [(keys[1], UNLINKED, 0)] and removed == [keys[2]]  # the last event wins

    store.path_of(ids[0]).unlink()  # gone behind this store's back: the reader's miss says so
    assert store.check(ids[:2])[0] == 0
    assert events.take()[1] == [keys[0]]
    assert sorted(store.scan_keys()) == sorted([block_key(ids[1])])
    store.close()


def test_an_overflowing_buffer_drops_and_says_so(tiny):
    woke = []
    events = KvEventBuffer(max_keys=2, wake=lambda: woke.append(1))
    events.stored([(1, ROOT, 0)])
    events.stored([(2, 1, 1)])
    assert woke == [1]  # only when it stops being empty
    events.removed_ids(["ab" * 16])
    assert events.take() == ([], [], True)
    assert events.take() == ([], [], False)
