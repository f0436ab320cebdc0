"""The per-node read queue in front of the store (a node's storage NIC, docs/design.md section 2).

`ReadQueue.submit(hit_ids)` returns a `LayerReadHandle`, the per-layer KV source of the team
contract: `await handle.layer(l) -> (K, V)`, each (hit_tokens, heads, dim). Behind it the
request's blocks are validated (headers), then read layer by layer, in chunks of blocks, by a
bounded pool of workers shared by all requests of the node (FIFO). `pending_bytes` (what the
scheduler reads through heartbeats) counts submitted bytes not yet read and drops as chunks
complete. An optional token bucket caps the queue at `snic_gbps` gigabits per second, so one
machine can emulate nodes whose storage NICs have that speed.

Blocks that fail validation shorten the hit prefix (`handle.valid_blocks`, `handle.failed`);
a block whose layer data fails its checksum or cannot be read (an I/O error of any kind) later
makes `layer()` raise `KVLoadError` naming the valid prefix and the failed ids: the caller
recomputes, it never gets bad data. Every wait ends once the reads stall for `read_timeout_s`
(`storage.readTimeoutMs`: a read of the request in flight that long, or a queue that finished
nothing for that long): the layer (or the validation) then fails the same way, as a `timeout`
miss. Whatever goes wrong in a worker resolves the handle's futures, so no failure is lost in
the pool and no caller waits on a read that will never finish.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import torch

from dualpath.config import StorageSpec
from dualpath.kv import metrics
from dualpath.kv.buffers import (
    BlockFailure,
    BlockRead,
    LayerKV,
    request_buffer_bytes,
    request_layer_bytes,
    request_layer_views,
)
from dualpath.kv.ids import BlockId
from dualpath.kv.protocol import BlockRun, BlockStore
from dualpath.units import gbps_to_bytes_per_s

log = logging.getLogger(__name__)

_CHUNK_TARGET_BYTES = 16 << 20
DEFAULT_READ_TIMEOUT_S = StorageSpec.model_fields["read_timeout_ms"].default / 1000
_SLEEP_SLICE_S = 0.05
# Uncapped, later layers are read a few at a time: a block's layers are one run of its file,
# so one syscall and one Python pass cover them (1.2-1.3x the throughput of single layers on
# two workers here), while the first layers still come alone to keep the pipeline's fill one
# layer's read.
MAX_GROUP_LAYERS = 4


def layer_groups(layers: int, max_group: int) -> list[tuple[int, int]]:
    """[l0, l1) ranges covering `layers` in order, sized 1, 1, 2, 4, ... up to `max_group`."""
    out, l0, size = [], 0, 1
    while l0 < layers:
        l1 = min(layers, l0 + size)
        out.append((l0, l1))
        if len(out) >= 2:
            size = min(max_group, size * 2)
        l0 = l1
    return out


class KVLoadError(RuntimeError):
    """Hit blocks that could not be loaded: use the first `valid_blocks`, recompute the rest."""

    def __init__(self, valid_blocks: int, failed: list[BlockFailure], message: str = "") -> None:
        ids = ", ".join(f"{f.block_id}({f.reason})" for f in failed[:3])
        super().__init__(message or f"KV load failed after {valid_blocks} blocks: {ids}")
        self.valid_blocks = valid_blocks
        self.failed = failed


class TokenBucket:
    """Byte-rate limiter with debt: a reservation larger than the bucket waits, never fails.

    `reserve(n)` returns how long the caller must wait before using n bytes; the bucket
    refills at `rate_bytes_per_s` up to `burst_bytes`. The clock is injectable for tests.
    """

    def __init__(
        self,
        rate_bytes_per_s: float,
        burst_bytes: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if rate_bytes_per_s <= 0:
            raise ValueError("rate_bytes_per_s must be > 0")
        self.rate = float(rate_bytes_per_s)
        self.burst = float(burst_bytes)
        self._clock = clock
        self._tokens = self.burst
        self._last = clock()
        self._lock = threading.Lock()
        self.granted_bytes = 0
        self.wait_s_total = 0.0

    @classmethod
    def for_gbps(cls, gbps: float, clock: Callable[[], float] = time.monotonic) -> TokenBucket:
        rate = gbps_to_bytes_per_s(gbps)
        return cls(rate, burst_bytes=max(rate * 0.01, 64 << 10), clock=clock)

    def reserve(self, nbytes: int) -> float:
        with self._lock:
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
            self._tokens -= nbytes
            self.granted_bytes += nbytes
            wait = max(0.0, -self._tokens / self.rate)
            self.wait_s_total += wait
            return wait


class LayerReadHandle:
    """One request's hit blocks being read layer by layer; a per-layer KV source."""

    def __init__(self, queue: ReadQueue, ids: Sequence[BlockId], out: torch.Tensor | None) -> None:
        self._queue = queue
        self.ids = list(ids)
        self.layout = queue.store.layout
        self.requested_blocks = len(self.ids)
        need = request_buffer_bytes(self.layout, self.requested_blocks)
        if out is None:
            out = torch.empty(need, dtype=torch.uint8)
        self.buffer = out.reshape(-1).view(torch.uint8)
        if self.buffer.numel() < need:
            raise ValueError(
                f"out holds {self.buffer.numel()} bytes; {len(ids)} blocks need {need}"
            )
        self.valid_blocks = self.requested_blocks
        self.failed: list[BlockFailure] = []
        self.closed = False
        self._lock = threading.Lock()
        self._ready: cf.Future[int] = cf.Future()
        self._layers: list[cf.Future[LayerKV]] = [cf.Future() for _ in range(self.layout.layers)]
        self._remaining: list[int] = [0] * self.layout.layers
        self._error: KVLoadError | None = None
        self._jobs: list[cf.Future] = []
        self._run: BlockRun | None = None  # the validated blocks, open until the last chunk
        self._in_flight: dict[object, float] = {}  # job -> when its read began (stall check)
        self._run_jobs = 0

    @property
    def hit_tokens(self) -> int:
        return self.valid_blocks * self.layout.block_tokens

    @property
    def busy(self) -> bool:
        """True while a read of this request may still write into its buffer (a chunk job
        queued or running, even after a timeout or close): whoever reuses the buffer waits
        for False. A stuck read keeps it True until the read returns."""
        with self._lock:
            return self._run_jobs > 0

    # ---- the per-layer KV source contract ---------------------------------------------------

    async def ready(self) -> int:
        """Valid hit blocks after header validation (<= requested; 0 when it timed out)."""
        return await self._bounded(self._ready, "validation")

    async def layer(self, l: int) -> LayerKV:  # noqa: E741 (the contract's name)
        return await self._bounded(self._layers[l], f"layer {l}")

    async def _bounded(self, fut: cf.Future, what: str):  # noqa: ANN202
        """`fut`'s result, waiting until the reads stall (`_stall_deadline`; then the hit ends)."""
        waiting = asyncio.wrap_future(fut)
        since = time.monotonic()
        while not fut.done():
            left = self._stall_deadline(since) - time.monotonic()
            if left <= 0:
                self._timed_out(fut, what)
                break
            try:
                return await asyncio.wait_for(asyncio.shield(waiting), left)
            except TimeoutError:
                pass
        return await asyncio.shield(waiting)  # resolved now, one way or another

    def _stall_deadline(self, since: float) -> float:
        """When a wait that began at `since` has stalled: `read_timeout_s` after this request's
        oldest read still in flight began, or after the later of `since` and the queue's last
        finished read. A slow queue that moves is waited for (its requests are read in order);
        a read that does not come back, or a queue that stopped, is not."""
        q = self._queue
        deadline = max(since, q.progress_at) + q.read_timeout_s
        with self._lock:
            if self._in_flight:
                deadline = min(deadline, min(self._in_flight.values()) + q.read_timeout_s)
        return deadline

    def arrived(self, l: int) -> tuple[list[LayerKV], bool]:  # noqa: E741
        """Layer l if its read is done (any thread, never blocks): the prefill's compute thread
        takes it without a trip through the event loop. A failed read shows as not arrived;
        `wait_arrival` raises its error."""
        f = self._layers[l]
        if f.done() and not f.cancelled() and f.exception() is None:
            return [f.result()], True
        return [], False

    async def wait_arrival(self, l: int, have: int) -> None:  # noqa: E741
        await self.layer(l)

    def layer_sync(self, l: int, timeout: float | None = None) -> LayerKV:  # noqa: E741
        """Layer l, blocking at most `timeout` (default: until the reads stall)."""
        return self._sync(self._layers[l], f"layer {l}", timeout).result()

    def wait(self, timeout: float | None = None) -> BlockRead:
        """Block until every layer is read (each at most `timeout`, default until the reads
        stall); the whole request as a BlockRead."""
        self._sync(self._ready, "validation", timeout)
        for layer, f in enumerate(self._layers):
            self._sync(f, f"layer {layer}", timeout).exception()
        return self.result()

    def _sync(self, fut: cf.Future, what: str, timeout: float | None) -> cf.Future:
        since = time.monotonic()
        while not fut.done():
            deadline = since + timeout if timeout is not None else self._stall_deadline(since)
            left = deadline - time.monotonic()
            if left <= 0:
                self._timed_out(fut, what)
                break
            try:
                fut.exception(left)
            except TimeoutError:
                pass
        return fut

    async def done(self) -> BlockRead:
        await self.ready()
        for layer in range(self.layout.layers):
            await self.layer(layer)
        return self.result()

    def result(self) -> BlockRead:
        valid = self._error.valid_blocks if self._error else self.valid_blocks
        failed = self._error.failed if self._error else self.failed
        return BlockRead(self.buffer, self.layout, self.requested_blocks, valid, failed)

    def close(self) -> None:
        """Stop reading: queued chunks are dropped (their pending bytes released)."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            jobs = list(self._jobs)
        for j in jobs:
            j.cancel()
        for f in [self._ready, *self._layers]:
            f.cancel()

    cancel = close

    def __enter__(self) -> LayerReadHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- driven by the queue's workers ------------------------------------------------------

    def _views(self, layer: int) -> LayerKV:
        return request_layer_views(self.buffer, self.layout, self.requested_blocks, layer)

    def _resolve(self, fut: cf.Future, value: object = None, exc: BaseException | None = None):
        try:
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(value)
        except cf.InvalidStateError:  # cancelled by close() meanwhile
            pass

    def _validated(self, valid: int, failed: list[BlockFailure]) -> bool:
        """Settle the valid prefix; False when it was settled already (timed out, closed)."""
        with self._lock:
            if self._ready.done():
                return False
            self.valid_blocks = valid
            self.failed = failed
            self._resolve(self._ready, valid)
        if valid == 0:
            for layer in range(self.layout.layers):
                k, v = self._views(layer)
                self._resolve(self._layers[layer], (k[:0], v[:0]))
        return True

    def _fail(self, valid: int, failure: BlockFailure, message: str = "") -> None:
        """End the hit at `valid` blocks: before validation settled, as a hit of 0 blocks;
        after, as a KVLoadError on every layer not yet read (the rest is recomputed)."""
        if self._validated(0, [failure]):
            return
        with self._lock:
            if self._error is None:
                self._error = KVLoadError(valid, [failure], message)
            err = self._error
        for f in self._layers:
            self._resolve(f, exc=err)
        self._queue._drop(self)

    @contextlib.contextmanager
    def _reading(self, job: object) -> Iterator[None]:
        """Marks a read of this request in flight (a worker thread), for the stall check."""
        with self._lock:
            self._in_flight[job] = time.monotonic()
        try:
            yield
        finally:
            with self._lock:
                self._in_flight.pop(job, None)

    def _timed_out(self, fut: cf.Future, what: str) -> None:
        """`fut` did not resolve within the read timeout: count it, end the hit."""
        if fut.done() or not self.ids:
            return
        t = self._queue.read_timeout_s
        message = f"{what} of {len(self.ids)} hit blocks not read within {t:g}s (reads stalled)"
        failure = self._queue.store.fail_read(self.ids[0], TimeoutError(message))
        self._fail(0, failure, f"KV load failed: {message}")

    def _chunk_finished(self) -> None:
        """A chunk job ran, failed or was cancelled: the last one closes the run."""
        with self._lock:
            self._run_jobs -= 1
            last = self._run_jobs == 0
        if last and self._run is not None:
            self._run.close()

    def _chunk_done(self, layer: int, a: int, got: int, want: int, failed: list) -> None:
        with self._lock:
            if got < want and self._error is None:
                self._error = KVLoadError(a + got, failed)
            self._remaining[layer] -= 1
            last = self._remaining[layer] == 0
            err = self._error
        if err is not None:
            for f in self._layers:
                self._resolve(f, exc=err)
            self._queue._drop(self)
        elif last:
            k, v = self._views(layer)
            t = self.hit_tokens
            self._resolve(self._layers[layer], (k[:t], v[:t]))


class ReadQueue:
    """A node's bounded, optionally bandwidth-capped storage read queue."""

    def __init__(
        self,
        store: BlockStore,
        concurrency: int = 8,
        snic_gbps: float = 0.0,
        name: str = "node",
        chunk_blocks: int | None = None,
        read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
        max_group_layers: int = MAX_GROUP_LAYERS,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be >= 1 (storage.readConcurrency)")
        if snic_gbps < 0:
            raise ValueError("snic_gbps must be >= 0 (0 = uncapped)")
        if not read_timeout_s > 0:
            raise ValueError("read_timeout_s must be > 0 (storage.readTimeoutMs)")
        self.store = store
        self.read_timeout_s = read_timeout_s
        self.progress_at = time.monotonic()  # when a read of this queue last finished
        self.name = name
        self.concurrency = concurrency
        self.snic_gbps = snic_gbps
        self.bucket = TokenBucket.for_gbps(snic_gbps, clock) if snic_gbps > 0 else None
        self.chunk_blocks = chunk_blocks or max(1, _CHUNK_TARGET_BYTES // store.layout.layer_bytes)
        if max_group_layers < 1:
            raise ValueError("max_group_layers must be >= 1")
        self.max_group_layers = max_group_layers
        self._sleep = sleep
        self._clock = clock
        self._pool = cf.ThreadPoolExecutor(concurrency, thread_name_prefix=f"kvread-{name}")
        self._lock = threading.Lock()
        self._pending = 0
        self._inflight = 0
        self._closed = False
        self.read_bytes = 0
        self._pending_gauge = metrics.QUEUE_PENDING.labels(queue=name)
        self._inflight_gauge = metrics.QUEUE_INFLIGHT.labels(queue=name)
        self._throttle = metrics.QUEUE_THROTTLE.labels(queue=name)
        self._pending_gauge.set(0)
        self._inflight_gauge.set(0)
        metrics.QUEUE_CAPACITY.labels(queue=name).set(snic_gbps * 1e9 / 8)
        log.info(
            "read queue %s: concurrency %d, snic_gbps %s",
            name,
            concurrency,
            snic_gbps or "uncapped",
        )

    @property
    def pending_bytes(self) -> int:
        return self._pending

    @property
    def inflight(self) -> int:
        return self._inflight

    def _add_pending(self, delta: int) -> None:
        with self._lock:
            self._pending += delta
            self._pending_gauge.set(self._pending)

    def submit(self, ids: Sequence[BlockId], out: torch.Tensor | None = None) -> LayerReadHandle:
        """Queue a request's hit blocks; `out` is an optional caller buffer
        (`request_buffer_bytes(layout, len(ids))` bytes, layer-major)."""
        if self._closed:
            raise RuntimeError(f"read queue {self.name} is closed")
        handle = LayerReadHandle(self, ids, out)
        total = len(handle.ids) * self.store.layout.payload_bytes
        self._add_pending(total)
        job = self._pool.submit(self._validate, handle)
        job.add_done_callback(lambda f: self._validate_done(f, handle, total))
        with handle._lock:
            handle._jobs.append(job)
        return handle

    async def read_into(self, ids: Sequence[BlockId], out: torch.Tensor | None = None) -> BlockRead:
        """Whole-request read (e.g. path D staging into the decode buffer)."""
        handle = self.submit(ids, out)
        try:
            await handle.done()
        except KVLoadError:
            pass  # reported as data in the result
        return handle.result()

    def _validate_done(self, job: cf.Future, handle: LayerReadHandle, nbytes: int) -> None:
        if job.cancelled():
            self._add_pending(-nbytes)
        elif job.exception() is not None:  # a bug, not an I/O error: still never a hang
            self._job_failed(job, handle, 0)

    def _job_failed(self, job: cf.Future, handle: LayerReadHandle, a: int) -> None:
        err = job.exception()
        log.error("read queue %s: a read job failed", self.name, exc_info=err)
        handle._fail(a, self.store.fail_read(handle.ids[a], err))

    def _validate(self, handle: LayerReadHandle) -> None:
        lo = self.store.layout
        n = handle.requested_blocks
        if handle.closed or handle._ready.done():
            self._add_pending(-n * lo.payload_bytes)
            return
        try:
            with handle._reading("validate"):
                run = self.store.open_run(handle.ids)
        except Exception as err:  # what the store does not classify ends the hit at 0 too
            self._add_pending(-n * lo.payload_bytes)
            handle._fail(0, self.store.fail_read(handle.ids[0], err))
            return
        finally:
            self.progress_at = time.monotonic()
        valid, failed = run.valid_blocks, run.failed
        self._add_pending(-(n - valid) * lo.payload_bytes)
        if not handle._validated(valid, failed):  # timed out or closed meanwhile
            self._add_pending(-valid * lo.payload_bytes)
            run.close()
            return
        if valid == 0:
            run.close()
            return
        chunks = [
            (a, min(a + self.chunk_blocks, valid)) for a in range(0, valid, self.chunk_blocks)
        ]
        # capped (an emulated SNIC) the bucket is the bound: read layer by layer, smoothly
        groups = layer_groups(lo.layers, 1 if self.bucket is not None else self.max_group_layers)
        with handle._lock:
            for layer in range(lo.layers):
                handle._remaining[layer] = len(chunks)
            handle._run = run
            handle._run_jobs = len(groups) * len(chunks)
        for l0, l1 in groups:
            for a, b in chunks:
                nbytes = (b - a) * lo.layer_bytes * (l1 - l0)
                try:
                    job = self._pool.submit(self._read_chunk, handle, l0, l1, a, b)
                except RuntimeError:  # pool shut down by close()
                    self._add_pending(-nbytes)
                    handle._chunk_finished()
                    continue
                job.add_done_callback(
                    lambda f, nb=nbytes, a=a: self._chunk_job_done(f, handle, nb, a)
                )
                with handle._lock:
                    handle._jobs.append(job)

    def _chunk_job_done(self, job: cf.Future, handle: LayerReadHandle, nbytes: int, a: int) -> None:
        try:
            if job.cancelled():
                self._add_pending(-nbytes)
            elif job.exception() is not None:  # never lost here: the handle's futures fail
                self._job_failed(job, handle, a)
        finally:
            handle._chunk_finished()

    def _read_chunk(self, handle: LayerReadHandle, l0: int, l1: int, a: int, b: int) -> None:
        lo = self.store.layout
        nbytes = (b - a) * lo.layer_bytes * (l1 - l0)
        released = False
        try:
            if handle.closed or handle._error is not None:
                return
            if self.bucket is not None and not self._throttle_wait(handle, nbytes):
                return
            with self._lock:
                self._inflight += 1
                self._inflight_gauge.set(self._inflight)
            try:
                kb, vb = lo.k_bytes, lo.v_bytes
                dests = [
                    (k8[a * kb : b * kb], v8[a * vb : b * vb])
                    for k8, v8 in (
                        request_layer_bytes(handle.buffer, lo, handle.requested_blocks, layer)
                        for layer in range(l0, l1)
                    )
                ]
                with handle._reading((l0, a)):
                    got, failed = self.store.read_run_layers_into(handle._run, l0, l1, a, b, dests)
            except Exception as err:  # the store turns I/O errors into failures; anything else
                self._add_pending(-nbytes)  # released before resolving, as below
                released = True
                handle._fail(a, self.store.fail_read(handle.ids[a], err))
                return
            finally:
                self.progress_at = time.monotonic()
                with self._lock:
                    self._inflight -= 1
                    self._inflight_gauge.set(self._inflight)
            self.read_bytes += got * lo.layer_bytes * (l1 - l0)
            # release before resolving: a consumer that saw the layer sees the bytes gone
            self._add_pending(-nbytes)
            released = True
            for layer in range(l0, l1):
                handle._chunk_done(layer, a, got, b - a, failed)
        finally:
            if not released:
                self._add_pending(-nbytes)

    def _throttle_wait(self, handle: LayerReadHandle, nbytes: int) -> bool:
        """Wait for the SNIC token bucket; False when the handle closed meanwhile."""
        wait = self.bucket.reserve(nbytes)
        self._throttle.inc(wait)
        deadline = self._clock() + wait
        while wait > 0:
            self._sleep(min(wait, _SLEEP_SLICE_S))
            if handle.closed:
                return False
            wait = deadline - self._clock()
        return True

    def _drop(self, handle: LayerReadHandle) -> None:
        with handle._lock:
            jobs = list(handle._jobs)
        for j in jobs:
            j.cancel()

    def close(self) -> None:
        """Stop the workers; queued reads are dropped, running ones finish."""
        self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            self._pending = 0
            self._pending_gauge.set(0)

    def __enter__(self) -> ReadQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
