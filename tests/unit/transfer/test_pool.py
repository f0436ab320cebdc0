"""The registered KV buffer's allocator: regions, alignment, merging, waiting for space."""

from __future__ import annotations

import asyncio

import pytest
from dualpath.transfer.pool import ALIGN, BufferFull, BufferPool


def test_regions_are_aligned_disjoint_views_and_free_merges_back():
    pool = BufferPool(64 * ALIGN)
    a, b, c = pool.alloc(100), pool.alloc(3 * ALIGN), pool.alloc(ALIGN + 1)
    assert [r.offset for r in (a, b, c)] == [0, ALIGN, 4 * ALIGN]
    assert a.address == pool.address and a.tensor.numel() == 100
    b.tensor.fill_(7)
    assert int(pool.tensor[ALIGN : 4 * ALIGN].sum()) == 7 * 3 * ALIGN
    assert pool.free_bytes == 64 * ALIGN - 6 * ALIGN and pool.regions == 3
    for r in (b, a, c):  # any order: neighbours merge into one extent again
        pool.free(r)
    assert pool.free_bytes == pool.nbytes and pool.regions == 0
    assert pool.alloc(64 * ALIGN).offset == 0


def test_full_and_bad_requests_name_the_fix():
    pool = BufferPool(4 * ALIGN)
    r = pool.alloc(3 * ALIGN)
    with pytest.raises(BufferFull, match="kvBufferBytes"):
        pool.alloc(2 * ALIGN)
    with pytest.raises(ValueError, match="> 0"):
        pool.alloc(0)
    pool.free(r)
    with pytest.raises(ValueError, match="double free"):
        pool.free(r)
    with pytest.raises(ValueError, match="outside region"):
        r.view(3 * ALIGN - 1, 2)


async def test_alloc_wait_gets_space_when_another_request_frees_it():
    pool = BufferPool(4 * ALIGN)
    held = pool.alloc(4 * ALIGN)
    waiter = asyncio.create_task(pool.alloc_wait(2 * ALIGN, timeout_s=5))
    await asyncio.sleep(0.05)
    assert not waiter.done()
    pool.free(held)
    got = await asyncio.wait_for(waiter, 2)
    assert got.offset == 0
    with pytest.raises(BufferFull, match="whole buffer"):
        await pool.alloc_wait(8 * ALIGN, timeout_s=1)
    with pytest.raises(BufferFull):
        await pool.alloc_wait(3 * ALIGN, timeout_s=0.1)
