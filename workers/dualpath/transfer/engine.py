"""The KV transfer engine of one worker: a NIXL agent (UCX backend), one registered host
buffer, one-sided WRITEs with a notification each, and deadlines (docs/design.md sections 3 and 5).

    engine = TransferEngine("decode-0", pool_bytes=256 << 20, link=ComputeLink.from_spec(net))
    peer = engine.add_peer(metadata_from_peer)            # exchanged over the workers' gRPC
    region = await engine.pool.alloc_wait(nbytes, 30)     # registered once, carved per request
    await engine.write(peer, region.address, nbytes, remote_address, notif=b"r1/hit/0")
    await engine.wait_notif(peer, b"r1/new/0", deadline_s=30)   # on the receiving side

All NIXL calls happen on the owning asyncio loop's thread (the agent is not shared across
threads). UCX runs without its own progress thread: on a 2-core machine that thread costs
more than it gives (about 3x less throughput here); progress is driven by the loop: the
writer polls its transfer, and a poller task reads notifications (fast while someone waits,
slow otherwise). On a cluster UCX takes the RDMA path; locally it uses shared memory.

Every transfer names its traffic class (`kv` for all KV movement). When the node has an
emulated compute link (`network.cnicGbps`), a WRITE first acquires its bytes on the link,
which shares the NIC between classes by weight. A transfer to a dead or unreachable peer
fails with `TransferError` within its deadline; the handle is released (or kept for a later
release if UCX cannot cancel it yet: the error then says the WRITE may still land,
`in_flight`) and the peer is dropped so the next call reconnects.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid

from dualpath.log import quiet_nixl_logs
from dualpath.transfer.base import TransferBase, TransferStats
from dualpath.transfer.pool import BufferPool
from dualpath.transfer.protocol import TransferError, release_leaked

__all__ = ["NixlUnavailable", "TransferEngine", "TransferError", "TransferStats"]

log = logging.getLogger(__name__)

_POLL_BUSY_S = 0.0002  # notification poll period while someone waits
_POLL_IDLE_S = 0.005
_SPIN_S = 0.003  # poll a WRITE back to back this long (a few MiB at a few GB/s)


class NixlUnavailable(TransferError):
    pass


def _name(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x


class TransferEngine(TransferBase):
    """A worker's NIXL agent with its registered KV buffer; use from one asyncio loop."""

    def __init__(
        self,
        node_id: str,
        pool_bytes: int,
        link=None,  # noqa: ANN001 (dualpath.transfer.link.ComputeLink | None)
        deadline_s: float = 30.0,
        max_inflight: int = 16,
    ) -> None:
        self._reg = None  # close() may run on an engine whose start failed half-way
        try:
            from nixl_cu12._api import nixl_agent, nixl_agent_config
        except ImportError as err:
            raise NixlUnavailable(f"nixl_cu12 not importable: {err}") from err
        quiet_nixl_logs()
        name = f"{node_id}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        try:
            self.agent = nixl_agent(
                name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
            )
        except Exception as err:  # the bindings raise plain exceptions
            raise NixlUnavailable(f"NIXL agent with UCX failed to start: {err}") from err
        if "UCX" not in self.agent.backends:
            raise NixlUnavailable("NIXL has no UCX backend plugin")
        super().__init__(node_id, name, BufferPool(pool_bytes), link, deadline_s, max_inflight)
        self._reg = self.agent.register_memory(
            [(self.pool.address, self.pool.nbytes, 0, "")], "DRAM"
        )
        self.metadata: bytes = self.agent.get_agent_metadata()
        self._leaked: list = []
        self._poller: asyncio.Task | None = None
        self._wake = asyncio.Event()
        log.info(
            "transfer engine %s: NIXL UCX, %d MiB registered KV buffer, compute link %s",
            self.name,
            self.pool.nbytes >> 20,
            link.describe() if link is not None else "uncapped",
        )

    # ---- peers ------------------------------------------------------------------------------

    def _connect(self, metadata: bytes) -> str:
        return _name(self.agent.add_remote_agent(metadata))

    def _disconnect(self, peer: str) -> None:
        try:
            self.agent.remove_remote_agent(peer)
        except Exception as err:  # already gone on the NIXL side
            log.debug("remove_remote_agent(%s): %s", peer, err)

    def _covers(self, peer: str, address: int, nbytes: int) -> bool:
        # NIXL's own lookup of the descriptor in the peer's metadata (the one a WRITE's
        # preparation fails with NIXL_ERR_NOT_FOUND), without posting anything
        try:
            descs = self.agent.get_xfer_descs([(address, nbytes, 0)], "DRAM")
            return bool(self.agent.check_remote_metadata(peer, descs))
        except Exception as err:  # the bindings raise plain exceptions (an address > 2^64)
            log.debug("check_remote_metadata(%s, %#x, %d): %s", peer, address, nbytes, err)
            return False

    # ---- writes ------------------------------------------------------------------------------

    async def _write(
        self, peer: str, src: int, nbytes: int, dst: int, notif: bytes, deadline: float
    ) -> None:
        loop = asyncio.get_running_loop()
        agent = self.agent
        handle = None
        try:
            try:
                local = agent.get_xfer_descs([(src, nbytes, 0)], "DRAM")
                remote = agent.get_xfer_descs([(dst, nbytes, 0)], "DRAM")
                handle = agent.initialize_xfer("WRITE", local, remote, peer, notif)
                state = agent.transfer(handle)
            except Exception as err:
                raise self._fail(peer, f"WRITE of {nbytes} bytes to {peer} failed: {err}") from err
            # Without a progress thread the data moves while we poll (shared-memory copies run
            # in progress calls): spin, yielding to other tasks, for as long as a layer-sized
            # WRITE takes, then back off. A timed sleep is ~1 ms at least (epoll granularity).
            spin_until = loop.time() + _SPIN_S
            delay = 1e-4
            while state == "PROC":
                now = loop.time()
                if now > deadline:
                    raise self._fail(
                        peer,
                        f"WRITE of {nbytes} bytes to {peer} did not complete within its "
                        "deadline (peer dead or unreachable)",
                    )
                if now < spin_until:
                    await asyncio.sleep(0)
                else:
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 1e-3)
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise self._fail(peer, f"WRITE of {nbytes} bytes to {peer} failed (state {state})")
        except TransferError as err:
            # released before the error goes out, so it can say whether the WRITE may land yet
            if handle is not None:
                h, handle = handle, None
                if not self._release(h):
                    err.in_flight = True
                    log.warning("%s: its handle is not released yet, it may still land", err)
            raise
        finally:
            if handle is not None:
                self._release(handle)

    def _release(self, handle) -> bool:  # noqa: ANN001
        """Release a transfer handle; False when NIXL refused (still in flight and not
        cancellable yet): it is kept and retried later."""
        try:
            self.agent.release_xfer_handle(handle)
            released = True
        except Exception as err:  # still in flight and not cancellable yet: retry later
            log.debug("xfer handle release deferred: %s", err)
            self._leaked.append(handle)
            released = False
        self.stats.leaked_handles = len(self._leaked)
        return released

    def _retry_releases(self) -> None:
        self._leaked = release_leaked(self.agent, self._leaked)
        self.stats.leaked_handles = len(self._leaked)

    # ---- notifications -----------------------------------------------------------------------

    def _poke(self) -> None:
        self._ensure_poller()
        self._wake.set()

    def _ensure_poller(self) -> None:
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(
                self._poll(), name=f"nixl-notifs-{self.node_id}"
            )

    def start(self) -> TransferEngine:
        """Start the notification poller (also driving UCX progress for incoming data)."""
        self._ensure_poller()
        return self

    async def _poll(self) -> None:
        while not self._closed:
            try:
                notifs = self.agent.get_new_notifs()
            except Exception as err:
                log.warning("NIXL notification poll failed: %s", err)
                notifs = {}
            for peer, msgs in notifs.items():
                peer = _name(peer)
                for m in msgs:
                    self._deliver(peer, bytes(m))
            if self._leaked:
                self._retry_releases()
            if self._waiters or self.stats.inflight or self._active:
                await asyncio.sleep(_POLL_BUSY_S)
            else:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), _POLL_IDLE_S)
                except TimeoutError:
                    pass

    # ---- teardown -------------------------------------------------------------------------------

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._poller is not None:
            self._poller.cancel()
            try:
                await self._poller
            except (asyncio.CancelledError, Exception):
                pass
        self._fail_waiters()
        self.close()

    def close(self) -> None:
        """Release handles, drop peers, deregister the buffer (idempotent)."""
        self._closed = True
        if self._reg is None:
            return
        self._retry_releases()
        for peer in list(self._peers):
            self.remove_peer(peer)
        try:
            self.agent.deregister_memory(self._reg)
        except Exception as err:
            log.warning("deregistering the KV buffer failed: %s", err)
        self._reg = None
        log.info("transfer engine %s closed (%d handles unreleased)", self.name, len(self._leaked))

    @property
    def registered(self) -> bool:
        return self._reg is not None
