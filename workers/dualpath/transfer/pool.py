"""A worker's KV host buffer: one registered allocation carved into per-request regions.

Registering memory with NIXL (and pinning it, on a real NIC) is expensive, so a worker
registers one buffer of `kvBufferBytes` at start and hands out regions of it: a first-fit
allocator over sorted free extents, aligned to 4 KiB. `alloc_wait` queues a request until
enough contiguous space is free (the buffer is the node's admission limit for KV in flight).
"""

from __future__ import annotations

import asyncio
import bisect
import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

ALIGN = 4096


class BufferFull(RuntimeError):
    """No contiguous region of the requested size is free (and none will be in time)."""


class BufferTooSmall(BufferFull):
    """The request needs more than the whole buffer: no wait, no retry makes room."""


@dataclass(frozen=True)
class Region:
    """`nbytes` of the pool at `offset`; `address` is what a peer's NIXL WRITE targets."""

    offset: int
    nbytes: int
    address: int
    tensor: torch.Tensor  # uint8 view of exactly this region

    def view(self, start: int, nbytes: int) -> torch.Tensor:
        if start < 0 or start + nbytes > self.nbytes:
            raise ValueError(f"view [{start}, {start + nbytes}) outside region of {self.nbytes}")
        return self.tensor[start : start + nbytes]


def _round_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class BufferPool:
    """First-fit allocator over one contiguous uint8 tensor (not thread-safe: one loop)."""

    def __init__(self, nbytes: int) -> None:
        if nbytes < ALIGN:
            raise ValueError(f"buffer of {nbytes} bytes is smaller than one page ({ALIGN})")
        self.nbytes = nbytes // ALIGN * ALIGN
        # zeros, not empty: the pages are touched now, not on the first transfer into them
        self.tensor = torch.zeros(self.nbytes, dtype=torch.uint8)
        self.address = self.tensor.data_ptr()
        self._free: list[tuple[int, int]] = [(0, self.nbytes)]  # (offset, length), sorted
        self._used: dict[int, int] = {}  # offset -> rounded length
        self._freed = asyncio.Condition() if _has_loop() else None

    @property
    def free_bytes(self) -> int:
        return self.nbytes - sum(self._used.values())

    @property
    def regions(self) -> int:
        return len(self._used)

    def alloc(self, nbytes: int) -> Region:
        if nbytes <= 0:
            raise ValueError(f"region size must be > 0 (got {nbytes})")
        need = _round_up(nbytes)
        for i, (off, length) in enumerate(self._free):
            if length >= need:
                if length == need:
                    self._free.pop(i)
                else:
                    self._free[i] = (off + need, length - need)
                self._used[off] = need
                return Region(off, nbytes, self.address + off, self.tensor[off : off + nbytes])
        raise BufferFull(
            f"KV buffer: no free region of {nbytes} bytes ({self.free_bytes} of {self.nbytes} "
            "free, fragmented or in use); raise kvBufferBytes or lower concurrency"
        )

    async def alloc_wait(self, nbytes: int, timeout_s: float) -> Region:
        """`alloc`, waiting up to `timeout_s` for other requests to free space."""
        if _round_up(nbytes) > self.nbytes:
            raise BufferTooSmall(
                f"a request needs {nbytes} bytes of KV buffer but the whole buffer is "
                f"{self.nbytes}; raise kvBufferBytes"
            )
        if self._freed is None:
            self._freed = asyncio.Condition()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        async with self._freed:
            while True:
                try:
                    return self.alloc(nbytes)
                except BufferFull:
                    left = deadline - loop.time()
                    if left <= 0:
                        raise
                    try:
                        await asyncio.wait_for(self._freed.wait(), left)
                    except TimeoutError:
                        pass

    def free(self, region: Region) -> None:
        need = self._used.pop(region.offset, None)
        if need is None:
            raise ValueError(f"region at offset {region.offset} is not allocated (double free?)")
        i = bisect.bisect(self._free, (region.offset, 0))
        self._free.insert(i, (region.offset, need))
        # merge with neighbours so large regions become available again
        if i + 1 < len(self._free) and region.offset + need == self._free[i + 1][0]:
            self._free[i] = (region.offset, need + self._free.pop(i + 1)[1])
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == self._free[i][0]:
            prev = self._free[i - 1]
            self._free[i - 1] = (prev[0], prev[1] + self._free.pop(i)[1])
        if self._freed is not None:
            cond = self._freed

            async def notify() -> None:
                async with cond:
                    cond.notify_all()

            try:
                asyncio.get_running_loop().create_task(notify())
            except RuntimeError:  # no loop (tests, shutdown): nobody can be waiting
                pass


def _has_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
