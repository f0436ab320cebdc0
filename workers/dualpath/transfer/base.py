"""What every `KVTransfer` implementation shares: peers, the WRITE's preconditions, deadline,
traffic class and accounting, failures, and notifications (waiters and early arrivals).

A subclass says how bytes move: `_connect(metadata) -> peer name` and `_disconnect(peer)`,
`_write(peer, src, nbytes, dst, notif, deadline)` (raises `self._fail(...)` on failure), and
`_poke()`, called when someone starts waiting or becomes active (NIXL wakes its poller). It
calls `_deliver(peer, msg)` for each notification that arrives.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

from dualpath.transfer import metrics
from dualpath.transfer.pool import BufferPool
from dualpath.transfer.protocol import TransferError

log = logging.getLogger(__name__)


@dataclass
class TransferStats:
    bytes_written: int = 0
    writes: int = 0
    failed: int = 0
    inflight: int = 0
    leaked_handles: int = 0


class TransferBase:
    """The shared half of a transfer engine; see the module docstring for the other half."""

    def __init__(
        self,
        node_id: str,
        name: str,
        pool: BufferPool,
        link=None,  # noqa: ANN001 (dualpath.transfer.link.ComputeLink | None)
        deadline_s: float = 30.0,
        max_inflight: int = 16,
    ) -> None:
        self.node_id = node_id
        self.name = name
        self.pool = pool
        self.link = link
        self.deadline_s = deadline_s
        self.stats = TransferStats()
        self._peers: dict[str, bytes] = {}  # agent name -> metadata loaded
        self._waiters: dict[tuple[str, bytes], asyncio.Future] = {}
        self._arrived: dict[tuple[str, bytes], float] = {}
        self._slots = asyncio.Semaphore(max_inflight)
        self._closed = False
        self._active = 0
        metrics.BUFFER_BYTES.labels(state="total").set(pool.nbytes)

    # ---- what a subclass provides ------------------------------------------------------------

    def _connect(self, metadata: bytes) -> str:
        raise NotImplementedError

    def _disconnect(self, peer: str) -> None:
        """Forget a dropped peer on the transport's side (nothing to do by default)."""

    def _covers(self, peer: str, address: int, nbytes: int) -> bool:
        raise NotImplementedError

    async def _write(
        self, peer: str, src: int, nbytes: int, dst: int, notif: bytes, deadline: float
    ) -> None:
        raise NotImplementedError

    def _poke(self) -> None:
        """Someone waits for a notification or became active (nothing to do by default)."""

    # ---- peers ------------------------------------------------------------------------------

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's agent metadata (idempotent); returns the peer's agent name."""
        name = self._connect(metadata)
        if name not in self._peers:
            log.info("connected to KV peer %s", name)
        self._peers[name] = metadata
        return name

    def knows(self, peer: str) -> bool:
        return peer in self._peers

    def covers(self, peer: str, address: int, nbytes: int) -> bool:
        """Whether [address, address + nbytes) lies in the registered buffer of `peer` (a
        known one): what a WRITE there needs, checked before it is posted."""
        if peer not in self._peers or address < 0 or nbytes < 0 or address + nbytes >= 1 << 64:
            return False  # (NIXL's own lookup wraps an end past 2^64 around)
        return self._covers(peer, address, nbytes)

    def remove_peer(self, peer: str) -> None:
        if self._peers.pop(peer, None) is not None:
            self._disconnect(peer)
            log.info("dropped KV peer %s", peer)

    # ---- writes ------------------------------------------------------------------------------

    async def write(
        self,
        peer: str,
        src_address: int,
        nbytes: int,
        dst_address: int,
        notif: bytes = b"",
        traffic_class: str = "kv",
        deadline_s: float | None = None,
    ) -> None:
        """One-sided WRITE of `nbytes` from our buffer to the peer's; `notif` is delivered to
        the peer after the data. Raises TransferError on failure or after the deadline."""
        if self._closed:
            raise TransferError("transfer engine is closed")
        if peer not in self._peers:
            raise TransferError(f"unknown KV peer {peer!r}: exchange metadata first")
        if not (
            self.pool.address <= src_address
            and src_address + nbytes <= self.pool.address + self.pool.nbytes
        ):
            raise ValueError("WRITE source must lie inside the registered KV buffer")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (deadline_s or self.deadline_s)
        if self.link is not None:
            await self.link.acquire(traffic_class, nbytes)
        async with self._slots:
            t0 = time.perf_counter()
            self.stats.inflight += 1
            try:
                await self._write(peer, src_address, nbytes, dst_address, notif, deadline)
            finally:
                self.stats.inflight -= 1
            self.stats.bytes_written += nbytes
            self.stats.writes += 1
            metrics.WRITE_SECONDS.observe(time.perf_counter() - t0)
        metrics.BYTES.labels(traffic_class=traffic_class).inc(nbytes)

    def _fail(self, peer: str, message: str, in_flight: bool = False) -> TransferError:
        self.stats.failed += 1
        metrics.FAILURES.inc()
        log.warning("%s%s", message, " (may still land)" if in_flight else "")
        self.remove_peer(peer)  # the next request reconnects from fresh metadata
        return TransferError(message, in_flight)

    # ---- notifications -----------------------------------------------------------------------

    async def wait_notif(self, peer: str, msg: bytes, deadline_s: float | None = None) -> None:
        """Wait for notification `msg` from `peer` (it may already have arrived)."""
        key = (peer, msg)
        if self._arrived.pop(key, None) is not None:
            return
        if self._closed:
            raise TransferError("transfer engine is closed")
        fut = asyncio.get_running_loop().create_future()
        self._waiters[key] = fut
        self._poke()
        timeout = deadline_s or self.deadline_s
        try:
            await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise TransferError(
                f"notification {msg!r} from {peer} did not arrive within {timeout:.1f}s "
                "(peer dead or unreachable)"
            ) from None
        finally:
            if self._waiters.get(key) is fut:
                del self._waiters[key]

    def _deliver(self, peer: str, msg: bytes) -> None:
        """A notification arrived: wake its waiter, or keep it until someone asks."""
        key = (peer, msg)
        fut = self._waiters.pop(key, None)
        if fut is not None and not fut.done():
            fut.set_result(None)
        else:
            self._arrived[key] = time.monotonic()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """`with engine.active():` around a request keeps incoming data progressing quickly
        while peers may write to us (NIXL without a progress thread: the target polls too)."""
        self._active += 1
        self._poke()
        try:
            yield
        finally:
            self._active -= 1

    def discard_notifs(self, prefix: bytes) -> None:
        """Forget notifications of a finished or failed request that nobody will wait for."""
        for key in [k for k in self._arrived if k[1].startswith(prefix)]:
            del self._arrived[key]

    def _fail_waiters(self) -> None:
        for fut in self._waiters.values():
            if not fut.done():
                fut.set_exception(TransferError("transfer engine closed"))
        self._waiters.clear()
