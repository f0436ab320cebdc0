"""The emulated compute NIC (CNIC) of one node, shared by the two traffic classes (docs/design.md section 5).

On a cluster the fabric keeps the classes apart: model traffic (collectives) on a high-priority
service level, KV traffic on a low one, arbitrated high:low by weight (default 99:1). Locally
`ComputeLink` plays that NIC so the isolation can be measured: one server of `gbps` that
serves backlogged classes in proportion to their weights (start-time fair queuing over quanta
of `quantum_bytes`), gives a class alone the whole rate (work conserving), and starves no one.

    link = ComputeLink.from_spec(spec.network, name="prefill-0")   # None when uncapped
    await link.acquire("kv", nbytes)          # on an asyncio loop, before each WRITE
    link.acquire_sync("kv", nbytes)           # on a thread (thread-safe)

The core (`FairShareScheduler`) is a pure virtual timeline, replayed lazily up to "now" by
whoever calls (no background thread); all byte accounting and sharing happen on it. A request
is granted (acquire returns) once its slot on that timeline is due: started, or estimated to
start within `grant_ahead_s` (2 ms). The link stays busy with the request's bytes after the
grant, so the class's next request queues behind it. Granting ahead covers the waiter's wake-up
slack (asyncio timers fire ~1 ms late, threads ~0.1 ms, more under GIL contention), so a
closed-loop stream keeps its class backlogged the way posted work requests keep a real NIC's
send queue full; it is a burst allowance of ~2 ms of the link per stream, like TokenBucket's.
A waiter sleeps until its estimated grant and is woken early when its request starts, when a
class drains (its share grew), or when the link closes.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from dualpath.transfer import metrics
from dualpath.units import gbps_to_bytes_per_s

if TYPE_CHECKING:
    from dualpath.config import NetworkSpec

log = logging.getLogger(__name__)

TRAFFIC_CLASSES = ("model", "kv")
DEFAULT_WEIGHTS: Mapping[str, int] = {"model": 99, "kv": 1}
_CLASS_INDEX = {c: i for i, c in enumerate(TRAFFIC_CLASSES)}


class LinkClosed(RuntimeError):
    """The link was closed while (or before) a request waited for it."""


def _class_index(traffic_class: str) -> int:
    try:
        return _CLASS_INDEX[traffic_class]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown traffic class {traffic_class!r}; expected one of {', '.join(TRAFFIC_CLASSES)}"
        ) from None


class LinkRequest:
    """One acquire in the link's queue; `start_s` is set when its first quantum starts."""

    __slots__ = ("cls", "nbytes", "remaining", "arrival_s", "start_s", "wake")

    def __init__(self, cls: int, nbytes: int, arrival_s: float) -> None:
        self.cls = cls
        self.nbytes = nbytes
        self.remaining = nbytes
        self.arrival_s = arrival_s
        self.start_s: float | None = None
        self.wake: Callable[[], None] | None = None


class FairShareScheduler:
    """Pure core: one server of `rate_bytes_per_s` shared by weight (start-time fair queuing).

    Not thread-safe; every method takes the current time. Classes are indices into `weights`.
    Each backlogged class carries a start tag (bytes served / weight); the lowest tag is served
    next, a quantum at a time (runs of quanta in one step when the order is already decided).
    """

    def __init__(
        self, rate_bytes_per_s: float, weights: Sequence[float], quantum_bytes: int
    ) -> None:
        if rate_bytes_per_s <= 0:
            raise ValueError("rate_bytes_per_s must be > 0")
        if quantum_bytes < 1:
            raise ValueError("quantum_bytes must be >= 1")
        if not weights or any(w <= 0 for w in weights):
            raise ValueError("weights must be > 0")
        self.rate = float(rate_bytes_per_s)
        self.weights = tuple(float(w) for w in weights)
        self.quantum = int(quantum_bytes)
        n = len(self.weights)
        self.queues: list[deque[LinkRequest]] = [deque() for _ in range(n)]
        self._tags = [0.0] * n
        self._vtime = 0.0  # start tag of the quantum last served
        self.t_s = -math.inf  # the link is busy until this time
        self.started_bytes = [0] * n  # of requests whose first quantum started
        self.served_bytes = [0] * n  # through the link so far
        self.requests = [0] * n

    def submit(self, cls: int, nbytes: int, now: float) -> LinkRequest:
        """Queue a request at `now`; it may start at once (check `start_s`)."""
        self.advance(now)
        req = LinkRequest(cls, nbytes, now)
        queue = self.queues[cls]
        if not queue:  # newly backlogged: no credit for the time it was idle
            self._tags[cls] = max(self._tags[cls], self._vtime)
        queue.append(req)
        self.requests[cls] += 1
        self.advance(now)
        return req

    def cancel(self, req: LinkRequest) -> bool:
        """Withdraw a request that has not started; False if it already started (or is gone)."""
        if req.start_s is not None:
            return False
        queue = self.queues[req.cls]
        try:
            queue.remove(req)
        except ValueError:
            return False
        self.requests[req.cls] -= 1
        if not queue:
            self._wake_others(req.cls)
        return True

    def advance(self, now: float) -> None:
        """Replay the link up to `now`: serve quanta, start (and wake) requests."""
        queues, tags, weights, rate, quantum = (
            self.queues,
            self._tags,
            self.weights,
            self.rate,
            self.quantum,
        )
        while self.t_s <= now:
            c, best, second = -1, math.inf, math.inf
            for i, queue in enumerate(queues):
                if queue:
                    tag = tags[i]
                    if tag < best:
                        c, best, second = i, tag, best
                    elif tag < second:
                        second = tag
            if c < 0:  # idle: forget history so tags stay small
                self.t_s = now
                self._tags = tags = [0.0] * len(tags)
                self._vtime = 0.0
                return
            req = queues[c][0]
            w = weights[c]
            if req.start_s is None:
                req.start_s = self.t_s
                self.started_bytes[c] += req.nbytes
                if req.wake is not None:
                    req.wake()
            # quanta up to just past `now`, and only while this class keeps the lowest tag
            k = math.ceil((now - self.t_s) * rate / quantum)
            if second < math.inf:
                k = min(k, int((second - best) * w / quantum))
            chunk = min(req.remaining, max(k, 1) * quantum)
            self.t_s += chunk / rate
            tags[c] = best + chunk / w
            self._vtime = tags[c] - min(chunk, quantum) / w
            self.served_bytes[c] += chunk
            req.remaining -= chunk
            if req.remaining == 0:
                queues[c].popleft()
                if not queues[c]:
                    self._wake_others(c)

    def _wake_others(self, drained: int) -> None:
        # a class drained: the others' shares grew, their estimates are now too late
        for i, queue in enumerate(self.queues):
            if i != drained:
                for r in queue:
                    if r.start_s is None and r.wake is not None:
                        r.wake()

    def estimate_start(self, req: LinkRequest, now: float) -> float:
        """When `req` should start if the backlogged set stays as it is (> now while queued)."""
        c = req.cls
        ahead = 0
        for r in self.queues[c]:
            if r is req:
                break
            ahead += r.remaining
        tag = self._tags[c]
        wsum = 0.0
        before = 0.0  # bytes the others get before this class's next turn
        for i, queue in enumerate(self.queues):
            if queue:
                wsum += self.weights[i]
                if i != c and self._tags[i] < tag:
                    before += (tag - self._tags[i]) * self.weights[i]
        t = max(self.t_s, now)
        return t + (before + ahead * wsum / self.weights[c]) / self.rate

    def backlog_bytes(self, cls: int) -> int:
        return sum(r.remaining for r in self.queues[cls])

    def drain(self) -> list[LinkRequest]:
        """Remove every queued request; the ones still waiting to start are returned."""
        waiting = [r for q in self.queues for r in q if r.start_s is None]
        for q in self.queues:
            q.clear()
        return waiting


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def _wake_future(loop: asyncio.AbstractEventLoop, fut: asyncio.Future) -> None:
    try:
        loop.call_soon_threadsafe(_resolve, fut)
    except RuntimeError:  # the waiter's loop is closed: nobody is left to wake
        pass


class ComputeLink:
    """One node's emulated compute NIC: traffic classes share `gbps` by weight (default model 99 : kv 1)."""

    def __init__(
        self,
        gbps: float,
        weights: Mapping[str, int] | None = None,
        quantum_bytes: int = 256 << 10,
        clock: Callable[[], float] = time.monotonic,
        name: str = "node",
        grant_ahead_s: float = 0.002,
    ) -> None:
        if not gbps > 0:
            raise ValueError(
                "gbps must be > 0 (network.cnicGbps; use from_spec, which maps 0 to None)"
            )
        if quantum_bytes < 1:
            raise ValueError("quantum_bytes must be >= 1")
        merged = dict(DEFAULT_WEIGHTS)
        for tc, w in (weights or {}).items():
            _class_index(tc)
            if not w > 0:
                raise ValueError(f"weight of traffic class {tc!r} must be > 0, got {w}")
            merged[tc] = w
        self.gbps = float(gbps)
        self.rate_bytes_per_s = gbps_to_bytes_per_s(self.gbps)
        self.weights = merged
        self.quantum_bytes = int(quantum_bytes)
        self.grant_ahead_s = max(0.0, grant_ahead_s)
        self.name = name
        self._clock = clock
        self._sched = FairShareScheduler(
            self.rate_bytes_per_s, [merged[c] for c in TRAFFIC_CLASSES], self.quantum_bytes
        )
        self._lock = threading.Lock()
        self._closed = False
        self._granted_bytes = [0] * len(TRAFFIC_CLASSES)
        self._wait_s = [0.0] * len(TRAFFIC_CLASSES)
        self._bytes_metric = [
            metrics.LINK_BYTES.labels(link=name, traffic_class=c) for c in TRAFFIC_CLASSES
        ]
        self._wait_metric = [
            metrics.LINK_WAIT.labels(link=name, traffic_class=c) for c in TRAFFIC_CLASSES
        ]
        metrics.LINK_CAPACITY.labels(link=name).set(self.rate_bytes_per_s)
        log.info("compute link %s: %s", name, self.describe())

    @classmethod
    def from_spec(
        cls, network: NetworkSpec, name: str = "node", clock: Callable[[], float] = time.monotonic
    ) -> ComputeLink | None:
        """The link of `spec.network`: None when `cnicGbps` is 0 (uncapped); model gets the
        high QoS weight, kv the low one; with QoS disabled the classes share equally."""
        if not network.cnic_gbps:
            return None
        qos = network.qos
        weights = (
            {"model": qos.high_weight, "kv": qos.low_weight}
            if qos.enabled
            else dict.fromkeys(TRAFFIC_CLASSES, 1)
        )
        return cls(network.cnic_gbps, weights, clock=clock, name=name)

    def describe(self) -> str:
        ratio = ":".join(f"{self.weights[c]:g}" for c in TRAFFIC_CLASSES)
        return f"{self.gbps:g} Gbps, {'/'.join(TRAFFIC_CLASSES)} weights {ratio}"

    # ---- acquiring -----------------------------------------------------------------------

    def _submit(self, traffic_class: str, nbytes: int) -> tuple[LinkRequest | None, float]:
        """Queue the request: (None, 0) when granted at once, else (request, seconds to sleep)."""
        c = _class_index(traffic_class)
        if nbytes <= 0:
            if nbytes < 0:
                raise ValueError(f"nbytes must be >= 0, got {nbytes}")
            return None, 0.0
        with self._lock:
            if self._closed:
                raise LinkClosed(f"compute link {self.name} is closed")
            now = self._clock()
            req = self._sched.submit(c, nbytes, now)
            delay = self._delay(req, now)
            if delay is None:
                self._granted_bytes[c] += nbytes
        if delay is None:
            self._bytes_metric[c].inc(nbytes)
            return None, 0.0
        return req, delay

    def _delay(self, req: LinkRequest, now: float) -> float | None:
        """Under the lock: None when `req` may go (its slot is within grant_ahead_s), else how
        long to sleep before looking again."""
        if req.start_s is None:
            ahead = self._sched.estimate_start(req, now) - now
            if ahead > self.grant_ahead_s:
                return ahead - self.grant_ahead_s
        req.wake = None
        return None

    def _arm(self, req: LinkRequest, wake: Callable[[], None], delay: float) -> float:
        """Set the waiter's wake-up; 0 when what it would wake for already happened."""
        with self._lock:
            req.wake = wake
            return 0.0 if req.start_s is not None or self._closed else delay

    def _poll(self, req: LinkRequest, deadline: float | None) -> float | None:
        """Under the lock, after a sleep: `_delay`, after catching the link up to now."""
        if self._closed and req.start_s is None:
            raise LinkClosed(f"compute link {self.name} closed while waiting")
        now = self._clock()
        self._sched.advance(now)
        delay = self._delay(req, now)
        if delay is None:
            wait = max(0.0, now - req.arrival_s)
            self._granted_bytes[req.cls] += req.nbytes
            self._wait_s[req.cls] += wait
            self._wait_metric[req.cls].inc(wait)
            return None
        if deadline is not None:
            if now >= deadline:
                self._sched.cancel(req)
                raise TimeoutError(
                    f"compute link {self.name}: {req.nbytes} {TRAFFIC_CLASSES[req.cls]} bytes "
                    f"not granted within the timeout"
                )
            delay = min(delay, deadline - now)
        return delay

    async def acquire(self, traffic_class: str, nbytes: int) -> None:
        """Return when `nbytes` of `traffic_class` may be sent (their slot on the link is due)."""
        req, delay = self._submit(traffic_class, nbytes)
        if req is None:
            return
        loop = asyncio.get_running_loop()
        try:
            while delay is not None:
                fut = loop.create_future()
                delay = self._arm(req, lambda f=fut: _wake_future(loop, f), delay)
                timer = loop.call_later(delay, _resolve, fut)
                try:
                    await fut
                finally:
                    timer.cancel()
                with self._lock:
                    delay = self._poll(req, None)
        except BaseException:  # cancelled or closed: withdraw the request unless it started
            with self._lock:
                self._sched.cancel(req)
            raise
        self._bytes_metric[req.cls].inc(nbytes)

    def acquire_sync(self, traffic_class: str, nbytes: int, timeout_s: float | None = None) -> None:
        """`acquire` for threads: blocks; TimeoutError (request withdrawn) after `timeout_s`."""
        req, delay = self._submit(traffic_class, nbytes)
        if req is None:
            return
        deadline = None if timeout_s is None else req.arrival_s + timeout_s
        if deadline is not None:
            delay = min(delay, timeout_s)
        event = threading.Event()
        delay = self._arm(req, event.set, delay)
        while delay is not None:
            event.wait(delay)
            with self._lock:
                event.clear()
                delay = self._poll(req, deadline)
        self._bytes_metric[req.cls].inc(nbytes)

    # ---- state -----------------------------------------------------------------------------

    def stats(self) -> dict[str, dict[str, float]]:
        """Per class: granted_bytes (acquires returned), wait_s (their summed waits),
        served_bytes (through the link so far), requests (acquires queued), backlog_bytes."""
        with self._lock:
            s = self._sched
            if not self._closed:
                s.advance(self._clock())
            return {
                tc: {
                    "granted_bytes": float(self._granted_bytes[i]),
                    "wait_s": self._wait_s[i],
                    "served_bytes": float(s.served_bytes[i]),
                    "requests": float(s.requests[i]),
                    "backlog_bytes": float(s.backlog_bytes(i)),
                }
                for i, tc in enumerate(TRAFFIC_CLASSES)
            }

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Fail every waiting acquire with LinkClosed, and every later one; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            waiting = self._sched.drain()
        for r in waiting:
            if r.wake is not None:
                r.wake()
        log.info("compute link %s closed (%d waiters woken)", self.name, len(waiting))

    def __enter__(self) -> ComputeLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
