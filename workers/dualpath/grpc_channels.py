"""Channels to other DualPath processes, cached by address and closed when no longer useful.

A channel grpc keeps open reconnects forever (with backoff) to an address that does not
answer: one per bad or stale address was a leak (a decode node given 100 bad prefill addresses
made ~100 connects a second long after). `ChannelCache` closes a channel

- that did not connect within the bounded wait (`grpc_auth.connected`): the call fails at once
  with `Unreachable`, and nothing is left behind;
- idle for `idle_s` (swept by its owner's task, `start_sweeper`);
- the least recently used, when more than `max_channels` are open;
- whose address left the cluster (`keep_only`, from the scheduler's view).

A channel closed while a call on it runs is given `close_grace_s` for the call to end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence

import grpc
from prometheus_client import Gauge

from dualpath.grpc_auth import CONNECT_WAIT_S, Auth, connected
from dualpath.grpc_auth import channel as auth_channel
from dualpath.log import clip

log = logging.getLogger(__name__)

MAX_CHANNELS = 64
IDLE_S = 120.0
SWEEP_S = 5.0

OPEN = Gauge(
    "dualpath_grpc_channels_open",
    "Channels this process keeps open to other DualPath servers, by the servers' role",
    ["server_role"],
)


class Unreachable(ConnectionError):
    """An address that did not connect within the bounded wait (its channel is closed)."""


class ChannelCache:
    """Channels by address to servers of `server_role` (see the module docstring)."""

    def __init__(
        self,
        auth: Auth | None,
        server_role: str | None = None,
        options: Sequence[tuple[str, object]] = (),
        max_channels: int = MAX_CHANNELS,
        idle_s: float = IDLE_S,
        connect_wait_s: float = CONNECT_WAIT_S,
        close_grace_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.auth, self.server_role, self.options = auth, server_role, list(options)
        self.max_channels, self.idle_s = max_channels, idle_s
        self.connect_wait_s, self.close_grace_s = connect_wait_s, close_grace_s
        self._clock = clock
        self._open: OrderedDict[str, tuple[grpc.aio.Channel, float]] = OrderedDict()
        self._closing: set[asyncio.Task] = set()
        self._sweeper: asyncio.Task | None = None

    def _count(self) -> None:
        OPEN.labels(self.server_role or "any").set(len(self._open))

    def __len__(self) -> int:
        return len(self._open)

    def __contains__(self, address: str) -> bool:
        return address in self._open

    async def get(self, address: str) -> grpc.aio.Channel:
        """The channel to `address`, connected; `Unreachable` (its channel closed) when it
        did not connect within `connect_wait_s`."""
        entry = self._open.pop(address, None)
        ch = entry[0] if entry else auth_channel(address, self.auth, self.options, self.server_role)
        self._open[address] = (ch, self._clock())  # the most recently used, last
        while len(self._open) > self.max_channels:
            old, (old_ch, _) = self._open.popitem(last=False)
            log.info("closing the channel to %s: over %d channels", clip(old), self.max_channels)
            self._close_later(old_ch)
        try:
            ok = await connected(ch, self.connect_wait_s)
        except grpc.aio.UsageError:  # closed meanwhile: evicted, or another caller's failure
            ok = False
        if not ok:
            if self._open.get(address, (None,))[0] is ch:
                del self._open[address]
            await ch.close()
            self._count()
            raise Unreachable(f"{clip(address)} did not connect within {self.connect_wait_s:g}s")
        if address in self._open:
            self._open[address] = (ch, self._clock())
        self._count()
        return ch

    def sweep(self) -> list[str]:
        """Close the channels idle for `idle_s`; their addresses."""
        now = self._clock()
        idle = [a for a, (_, used) in self._open.items() if now - used >= self.idle_s]
        for a in idle:
            self._close_later(self._open.pop(a)[0])
        self._count()
        return idle

    def keep_only(self, addresses: set[str]) -> list[str]:
        """Close the channels to addresses not in `addresses` (their nodes left the
        cluster); those addresses."""
        gone = [a for a in self._open if a not in addresses]
        for a in gone:
            log.info("closing the channel to %s: no node of the cluster has it", clip(a))
            self._close_later(self._open.pop(a)[0])
        self._count()
        return gone

    def start_sweeper(
        self, live_addresses: Callable[[], Awaitable[set[str] | None]] | None = None
    ) -> None:
        """Every SWEEP_S: close idle channels and, when `live_addresses` says (None: it
        cannot now), those to addresses that left the cluster. Stopped by `close`."""

        async def run() -> None:
            while True:
                await asyncio.sleep(SWEEP_S)
                self.sweep()
                if live_addresses is not None:
                    try:
                        live = await live_addresses()
                    except Exception as err:  # noqa: BLE001 (the view is advisory: next sweep)
                        log.debug("no cluster view for the channel sweep: %s", err)
                        continue
                    if live is not None:
                        self.keep_only(live)

        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(run(), name="channel-sweep")

    def _close_later(self, ch: grpc.aio.Channel) -> None:
        task = asyncio.get_running_loop().create_task(ch.close(self.close_grace_s))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        chans = [ch for ch, _ in self._open.values()]
        self._open.clear()
        self._count()
        for ch in chans:
            await ch.close()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
