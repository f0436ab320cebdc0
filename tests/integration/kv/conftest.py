import types

import pytest
import torch
from dualpath.config import ModelSpec
from dualpath.kv import KVStore, block_ids
from dualpath.kv.buffers import random_layers


@pytest.fixture
def tiny() -> ModelSpec:
    return ModelSpec(preset="tiny")


@pytest.fixture
def make_store(tmp_path, tiny):
    stores = []

    def make(model=None, capacity_bytes=1 << 30, backend="preadv", root=None):
        s = KVStore(root or tmp_path / "kv", model or tiny, capacity_bytes, backend=backend)
        stores.append(s)
        return s

    yield make
    for s in stores:
        s.close()


def fill(store, n_blocks, seed=0, tokens=None):
    """Write n random blocks of one chained prompt; returns (ids, blocks)."""
    bt = store.layout.block_tokens
    tokens = (
        tokens if tokens is not None else [(seed * 7919 + i) % 500 for i in range(n_blocks * bt)]
    )
    ids = block_ids(tokens, store.model)
    gen = torch.Generator().manual_seed(seed)
    blocks = [random_layers(store.layout, gen) for _ in ids]
    for b, layers in zip(ids, blocks, strict=True):
        store.put(b, layers)
    return ids, blocks


def u8(t):
    return t.reshape(-1).view(torch.uint8)


@pytest.fixture
def kvh():
    """Helpers shared by the kv integration tests."""
    return types.SimpleNamespace(fill=fill, u8=u8)
