"""The KV transfer contract the workers use (docs/design.md section 3): one-sided WRITEs from this
node's registered buffer into a peer's, each followed by a notification the peer waits for.

Two implementations keep it: `transfer.engine.TransferEngine` (NIXL over UCX: RDMA on a
cluster, shared memory locally) and `transfer.fake.MemoryTransfer` (in-process, for tests of
the roles where NIXL is not installed). Both share their bookkeeping (`transfer.base`), so
peers, deadlines, notifications and failures behave the same in both:

- `write` raises `TransferError` when the engine is closed, the peer unknown, dead or
  unreachable, or the WRITE misses its deadline; a failed peer is dropped (`knows` turns
  False) so the next request reconnects from fresh metadata. A source outside the registered
  buffer is a `ValueError` (a bug, not a transfer failure). A failed WRITE the transport
  could not cancel may still land in the peer's buffer: its error says so (`in_flight`), and
  whoever owns the peer's regions must not reuse them before the WRITE's deadline.
- `wait_notif` returns at once for a notification that already arrived, else waits for it and
  raises `TransferError` at its deadline ("did not arrive": the peer is dead or unreachable).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol

from dualpath.transfer.pool import BufferPool


class TransferError(RuntimeError):
    """A KV transfer failed or missed its deadline; the message names the peer and bytes.
    `in_flight`: a WRITE that was abandoned but not cancelled (its handle could not be
    released), so its bytes may still land in the peer's buffer."""

    def __init__(self, message: str, in_flight: bool = False) -> None:
        super().__init__(message)
        self.in_flight = in_flight


class KVTransfer(Protocol):
    """A worker's KV transfer agent with its registered buffer; used from one asyncio loop."""

    name: str  # this agent's name, what peers pass to `write` and `wait_notif`
    metadata: bytes  # what a peer's `add_peer` needs to reach this agent
    pool: BufferPool  # the registered buffer, carved into per-request regions
    deadline_s: float  # default deadline of one WRITE or one notification wait

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's metadata (idempotent); returns the peer's agent name."""
        ...

    def knows(self, peer: str) -> bool: ...

    def covers(self, peer: str, address: int, nbytes: int) -> bool:
        """Whether [address, address + nbytes) lies in `peer`'s registered buffer."""
        ...

    def remove_peer(self, peer: str) -> None: ...

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
        """WRITE `nbytes` at `src_address` of our buffer to `dst_address` of the peer's;
        `notif` is delivered to the peer after the data."""
        ...

    async def wait_notif(self, peer: str, msg: bytes, deadline_s: float | None = None) -> None:
        """Wait for notification `msg` from `peer` (it may already have arrived)."""
        ...

    def discard_notifs(self, prefix: bytes) -> None:
        """Forget arrived notifications starting with `prefix` that nobody will wait for."""
        ...

    def active(self) -> AbstractContextManager[None]:
        """Around a request whose peers may write to us: keeps incoming data progressing."""
        ...

    def start(self) -> KVTransfer: ...

    async def aclose(self) -> None:
        """Fail the waits in progress, drop the peers, release the buffer (idempotent)."""
        ...


def release_leaked(agent, handles: list) -> list:  # noqa: ANN001 (a nixl_agent)
    """Retry releasing the NIXL transfer handles `agent` refused to release earlier (still in
    flight, not cancellable then); the ones it still refuses, to retry again later."""
    still = []
    for h in handles:
        try:
            agent.release_xfer_handle(h)
        except Exception:  # noqa: BLE001 (NIXL raises its own; kept for the next retry)
            still.append(h)
    return still
