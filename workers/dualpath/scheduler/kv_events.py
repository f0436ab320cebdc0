"""A worker's KV event publisher: its store's stored/removed blocks to the scheduler's index.

One background task drains the store's `KvEventBuffer` into `KvEvents` batches, numbered from 1
within this process's `epoch`, one at a time and in order; a batch that fails is retried as is
(the scheduler ignores a seq it has already applied), so batches are only lost when the buffer
overflows, and that loss is sent as a skipped seq: a gap the scheduler answers with a rebuild.
When the scheduler asks (a heartbeat ack's `kv_snapshot_id`), it scans the store on a thread and
streams the keys (`KvSnapshot`). `flush()` waits until everything buffered before the call is
acknowledged: the decode worker calls it before a turn's last token, so the agent's next turn
finds the blocks its last one wrote.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable

import grpc

from dualpath.kv.events import KvEventBuffer
from dualpath.scheduler.index import pack_keys
from dualpath.v1 import scheduler_pb2 as pb
from dualpath.v1 import scheduler_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SNAPSHOT_CHUNK_KEYS = 1 << 16  # 512 KiB of keys per message


class KvEventPublisher:
    def __init__(
        self,
        stub: pb_grpc.SchedulerStub,
        node_id: str,
        buffer: KvEventBuffer,
        scan: Callable[[], list[int]],
        rpc_timeout_s: float = 2.0,
        snapshot_timeout_s: float = 60.0,
    ) -> None:
        self.stub = stub
        self.node_id = node_id
        self.buffer = buffer
        self.scan = scan
        self.rpc_timeout_s = rpc_timeout_s
        self.snapshot_timeout_s = snapshot_timeout_s
        self.epoch = uuid.uuid4().hex[:12]
        self.seq = 0
        self.batches_sent = 0
        self.snapshots_sent = 0
        self._wake = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._waiters: list[asyncio.Future] = []
        self._snapshot_id = 0
        self._stopping = False
        self._task: asyncio.Task | None = None
        buffer.wake = self.wake_threadsafe

    def start(self) -> KvEventPublisher:
        self._task = asyncio.create_task(self._run(), name=f"kv-events-{self.node_id}")
        return self

    def wake_threadsafe(self) -> None:
        """Called by the store (any thread) when events arrive."""
        try:
            self._loop.call_soon_threadsafe(self._wake.set)
        except RuntimeError:  # the loop is closed: the process is stopping
            pass

    def request_snapshot(self, snapshot_id: int) -> None:
        self._snapshot_id = snapshot_id
        self._wake.set()

    async def flush(self, timeout_s: float = 1.0) -> bool:
        """Wait until the events buffered so far are acknowledged; False after `timeout_s`
        (the scheduler is unreachable: the next turn may then miss, never read wrong KV)."""
        if self._task is None or self._task.done():
            return False
        fut = self._loop.create_future()
        self._waiters.append(fut)
        self._wake.set()
        try:
            await asyncio.wait_for(asyncio.shield(fut), timeout_s)
            return True
        except TimeoutError:
            log.warning("KV events of %s not acknowledged within %.1fs", self.node_id, timeout_s)
            return False

    async def _run(self) -> None:
        while not self._stopping:
            await self._wake.wait()
            self._wake.clear()
            waiters, self._waiters = self._waiters, []
            try:
                if self._snapshot_id:
                    await self._send_snapshot()
                await self._send_events()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug here must not end publishing: log it and go on
                log.exception("KV event publisher of %s failed a round", self.node_id)
            for fut in waiters:
                if not fut.done():
                    fut.set_result(None)

    async def _send_events(self) -> None:
        stored, removed, lost = self.buffer.take()
        if lost:
            self.seq += 1  # the dropped events: a seq the scheduler never sees is a gap
            log.warning("KV event buffer of %s overflowed: events dropped", self.node_id)
        if not stored and not removed and not lost:
            return
        self.seq += 1
        keys, parents, depths = zip(*stored, strict=True) if stored else ((), (), ())
        batch = pb.KvEventBatch(
            node_id=self.node_id,
            epoch=self.epoch,
            seq=self.seq,
            stored_keys=pack_keys(keys),
            stored_parents=pack_keys(parents),
            stored_depths=pack_keys(depths),
            removed_keys=pack_keys(removed),
        )
        backoff = 0.05
        while True:  # at least once: a stopping worker still sends what it has left
            try:
                await self.stub.KvEvents(batch, timeout=self.rpc_timeout_s, wait_for_ready=True)
                self.batches_sent += 1
                return
            except grpc.aio.AioRpcError as err:
                if self._stopping:
                    log.warning("KV events %s#%d dropped at stop", self.node_id, self.seq)
                    return
                log.warning(
                    "KV events %s#%d not delivered (%s); retry in %.2fs",
                    self.node_id,
                    self.seq,
                    err.code().name,
                    backoff,
                )
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 1.0)

    async def _send_snapshot(self) -> None:
        snapshot_id, self._snapshot_id = self._snapshot_id, 0
        keys = await asyncio.to_thread(self.scan)

        def chunks():
            for i in range(0, max(len(keys), 1), SNAPSHOT_CHUNK_KEYS):
                yield pb.KvSnapshotChunk(
                    node_id=self.node_id,
                    snapshot_id=snapshot_id,
                    keys=pack_keys(keys[i : i + SNAPSHOT_CHUNK_KEYS]),
                )

        try:
            ack = await self.stub.KvSnapshot(chunks(), timeout=self.snapshot_timeout_s)
        except grpc.aio.AioRpcError as err:  # the scheduler asks again after its timeout
            log.warning("KV store scan %d not delivered: %s", snapshot_id, err.code().name)
            return
        self.snapshots_sent += 1
        log.info(
            "sent a KV store scan to the scheduler: %d blocks (snapshot %d, %s)",
            len(keys),
            snapshot_id,
            "installed" if ack.installed else "not awaited any more",
        )

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, timeout=2.0)
            except (TimeoutError, asyncio.CancelledError):
                self._task.cancel()
