"""An in-memory `KVTransfer`: engines of one process joined by a `MemoryFabric`.

    fabric = MemoryFabric()
    a, b = MemoryTransfer("decode-0", 8 << 20, fabric), MemoryTransfer("prefill-0", 8 << 20, fabric)
    peer = a.add_peer(b.metadata)
    await a.write(peer, region.address, n, remote_address, notif=b"r1/hit/0")  # bytes copied
    await b.wait_notif(a.name, b"r1/hit/0")

A WRITE copies the bytes into the peer's buffer, then delivers the notification, as NIXL does;
peers, deadlines, notifications and failure accounting are `transfer.base`'s, the code the NIXL
engine runs too. Faults a test sets on the fabric: `kill(name)` (a dead peer: WRITEs to it fail
at once, nothing it would send arrives, so waits end at their deadline) and `hang(name)` (an
unreachable peer: WRITEs to it stall until their deadline). Both fail with `TransferError` and
drop the peer, as the NIXL engine does. `hang(name, lands_late=True)`: the stalled WRITEs are
abandoned at their deadline without being cancelled (NIXL refused to release their handles),
fail with `TransferError(in_flight=True)` and land, data then notification, at `heal(name)`.

It lives in the runtime package, not under tests/, because it is the contract's second
implementation (as vLLM's and LMCache's in-memory connectors are): any package's tests, and
tools that run the workers' logic without NIXL, import it; the import-linter contracts keep the
runtime itself from using it.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable

from dualpath.transfer.base import TransferBase
from dualpath.transfer.pool import BufferPool
from dualpath.transfer.protocol import TransferError

_ids = itertools.count()


class MemoryFabric:
    """The engines that can reach each other, by name, and the faults set on them."""

    def __init__(self) -> None:
        self.engines: dict[str, MemoryTransfer] = {}
        self.dead: set[str] = set()
        self.hung: set[str] = set()
        self.lands_late: set[str] = set()
        self.strays: dict[str, list[Callable[[], None]]] = {}  # peer -> abandoned WRITEs

    def kill(self, name: str) -> None:
        """`name` is dead: WRITEs to it fail at once; its own WRITEs never land."""
        self.dead.add(name)

    def hang(self, name: str, lands_late: bool = False) -> None:
        """`name` is unreachable: WRITEs to it stall until their deadline. `lands_late`: they
        are abandoned there still in flight, and land when `name` is healed."""
        self.hung.add(name)
        if lands_late:
            self.lands_late.add(name)

    def heal(self, name: str) -> None:
        """`name` is reachable again; the WRITEs abandoned in flight to it land now."""
        self.dead.discard(name)
        self.hung.discard(name)
        self.lands_late.discard(name)
        for land in self.strays.pop(name, []):
            land()


class MemoryTransfer(TransferBase):
    """A `KVTransfer` whose WRITEs are memory copies between buffers of one process."""

    def __init__(
        self,
        node_id: str,
        pool_bytes: int,
        fabric: MemoryFabric,
        link=None,  # noqa: ANN001 (dualpath.transfer.link.ComputeLink | None)
        deadline_s: float = 30.0,
        max_inflight: int = 16,
    ) -> None:
        name = f"{node_id}-mem-{next(_ids)}"
        super().__init__(node_id, name, BufferPool(pool_bytes), link, deadline_s, max_inflight)
        self.metadata = name.encode()
        self.fabric = fabric
        fabric.engines[name] = self

    def _connect(self, metadata: bytes) -> str:
        name = metadata.decode()
        if name not in self.fabric.engines:
            raise TransferError(f"no KV peer {name!r} on the fabric")
        return name

    def _covers(self, peer: str, address: int, nbytes: int) -> bool:
        target = self.fabric.engines.get(peer)
        if target is None:
            return False
        start = target.pool.address
        return start <= address and address + nbytes <= start + target.pool.nbytes

    async def _write(
        self, peer: str, src: int, nbytes: int, dst: int, notif: bytes, deadline: float
    ) -> None:
        target = self.fabric.engines.get(peer)
        if target is None or target._closed or peer in self.fabric.dead:
            raise self._fail(peer, f"WRITE of {nbytes} bytes to {peer} failed: peer is gone")
        if self.name in self.fabric.dead:  # a dead sender's bytes go nowhere
            return
        at = dst - target.pool.address
        if not 0 <= at <= target.pool.nbytes - nbytes:
            raise self._fail(peer, f"WRITE of {nbytes} bytes to {peer}: outside its buffer")
        s = src - self.pool.address
        if peer in self.fabric.hung:
            await asyncio.sleep(max(0.0, deadline - asyncio.get_running_loop().time()))
            late = peer in self.fabric.lands_late
            if late:
                data = self.pool.tensor[s : s + nbytes].clone()
                self.fabric.strays.setdefault(peer, []).append(
                    lambda: self._land(target, at, data, notif)
                )
            raise self._fail(
                peer,
                f"WRITE of {nbytes} bytes to {peer} did not complete within its "
                "deadline (peer dead or unreachable)",
                in_flight=late,
            )
        target.pool.tensor[at : at + nbytes] = self.pool.tensor[s : s + nbytes]
        await asyncio.sleep(0)  # a real WRITE yields while the data moves
        if notif:
            target._deliver(self.name, notif)

    def _land(self, target: MemoryTransfer, at: int, data, notif: bytes) -> None:  # noqa: ANN001
        """An abandoned WRITE lands after all (unless the peer has closed)."""
        if target._closed:
            return
        target.pool.tensor[at : at + data.numel()] = data
        if notif:
            target._deliver(self.name, notif)

    def start(self) -> MemoryTransfer:
        return self

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        """Fail the waits in progress and leave the fabric (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._fail_waiters()
        for peer in list(self._peers):
            self.remove_peer(peer)
        self.fabric.engines.pop(self.name, None)
