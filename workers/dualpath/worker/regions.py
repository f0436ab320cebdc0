"""When a request's regions of the registered KV buffer may go back to the pool.

Not before anything can still write into them: a peer's WRITE that may still be in flight
(path D's hit layers on the prefill node, every layer on the decode node), or a storage read
still running in a pool thread (a stuck mount) that fills the buffer whenever it returns.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Protocol

from dualpath.transfer.pool import BufferPool, Region

log = logging.getLogger(__name__)


class Reading(Protocol):
    """A request's storage read (`kv.queue.LayerReadHandle`)."""

    @property
    def busy(self) -> bool:
        """A read of it still runs in a pool thread."""
        ...


def release_regions(
    pool: BufferPool, regions: Sequence[Region], hold_s: float = 0.0, reading: Reading | None = None
) -> None:
    """Free a request's buffer regions, at once when nothing can still be written into them
    (`hold_s` 0: the request ended cleanly, its peer never learned their addresses, is dead
    or has ended its side), else after `hold_s`, the deadline of the peer's WRITEs that may
    still be in flight. `reading`: the request's storage read handle; a read still running in
    a pool thread writes into the buffer until it returns, so the regions wait for it first."""
    if not regions:
        return
    if reading is not None and reading.busy:
        loop = asyncio.get_running_loop()

        def later() -> None:
            if reading.busy:
                loop.call_later(0.05, later)
            else:
                release_regions(pool, regions, hold_s)

        log.info("KV buffer waits for a storage read still running in its pool thread")
        loop.call_later(0.05, later)
        return
    if hold_s <= 0:
        for r in regions:
            pool.free(r)
        return
    log.info(
        "quarantining %d KV buffer bytes for %.1fs: a peer's WRITE may still land in them",
        sum(r.nbytes for r in regions),
        hold_s,
    )
    asyncio.get_running_loop().call_later(hold_s, lambda: [pool.free(r) for r in regions])
