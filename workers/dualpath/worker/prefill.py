"""The prefill role: one request's layer-wise prefill with its hit KV from either path.

`PrefillRole.serve(order)` yields what the `Worker.Prefill` RPC streams (the servicer converts
it, `worker/wire.py`):

1. it takes two regions of the registered buffer (hit KV, new KV) and tells the decode worker
   where the hit KV may land (`accepted`);
2. the hit KV arrives layer by layer: path P from this node's storage read queue, path D as
   NIXL WRITEs from the decode node (one notification per layer);
3. the engine computes layer l while layer l+1 arrives; each layer's new K, V is written to the
   decode node as soon as it is computed (path P also forwards each hit layer: the decode node
   needs the whole context, DESIGN section 3 step 4);
4. once every WRITE completed it answers `done` with the last token's logits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from dualpath.config import ModelSpec
from dualpath.engine import BatchMember, Engine, PrefillRun
from dualpath.kv import KVLoadError, block_ids
from dualpath.kv.queue import ReadQueue
from dualpath.transfer.protocol import KVTransfer, TransferError
from dualpath.worker import metrics
from dualpath.worker.admission import BatchAdmission
from dualpath.worker.kvstream import RemoteHitSource, new_notif, stream_hit_layers
from dualpath.worker.layout import RequestLayout
from dualpath.worker.regions import release_regions
from dualpath.worker.wire import Accepted, BadField, Done, PrefillOrder, Region

log = logging.getLogger(__name__)

# trailing metadata of a refused Prefill: the hit tokens that were readable (the valid prefix)
VALID_HIT_KEY = "dualpath-valid-hit-tokens"
# trailing metadata of a failed Prefill whose KV WRITEs to the decode node may still land there
WRITES_IN_FLIGHT_KEY = "dualpath-writes-in-flight"


class HitUnavailable(RuntimeError):
    """The hit KV could not be read (bad or vanished blocks): the caller recomputes from
    `valid_tokens`, the hit prefix that was readable (0 when unknown)."""

    def __init__(self, message: str, valid_tokens: int = 0) -> None:
        super().__init__(message)
        self.valid_tokens = valid_tokens


@dataclass
class PrefillOutcome:
    """What a failed `serve` leaves its caller: a WRITE of ours that may still land."""

    writes_in_flight: bool = False


@dataclass
class PrefillLoad:
    """What the prefill node reports: tokens admitted but not started, and running."""

    tokens_queued: int = 0
    tokens_running: int = 0
    requests_running: int = 0


class PrefillRole:
    """A prefill node's work: given its model, compute engine, KV transfer and storage read
    queue (nothing else of the node), it serves `Worker.Prefill` calls."""

    def __init__(
        self,
        *,
        model: ModelSpec,
        engine: Engine,
        transfer: KVTransfer,
        read_queue: ReadQueue,
        deadline_s: float,
        batch_quota_ms: int = 0,
        max_concurrent: int = 8,
    ) -> None:
        self.model = model
        self.engine = engine
        self.transfer = transfer
        self.read_queue = read_queue
        self.deadline_s = deadline_s  # one transfer, one notification wait, one buffer wait
        self.batch_quota_ms = batch_quota_ms  # workers.prefillBatchQuotaMs (0: no batching)
        self.load = PrefillLoad()
        self._slots = asyncio.Semaphore(max_concurrent)
        self.admission: BatchAdmission | None = None

    async def start(self) -> PrefillRole:
        """With `workers.prefillBatchQuotaMs`, calibrate the cost model and batch admissions."""
        quota_ms = self.batch_quota_ms
        if quota_ms:
            self.admission = (await BatchAdmission.calibrated(self.engine, quota_ms / 1000)).start()
            log.info(
                "prefill batching on: quota %d ms, cost model %s",
                quota_ms,
                self.admission.cost.to_dict(),
            )
        return self

    async def stop(self) -> None:
        if self.admission is not None:
            await self.admission.stop()

    @contextlib.asynccontextmanager
    async def _compute(
        self, rid: str, tokens: list[int], hit_tokens: int, source
    ) -> AsyncIterator[PrefillRun | BatchMember]:  # noqa: ANN001
        """The request's prefill, once compute admits it: a batch member or a run alone."""
        if self.admission is not None:
            yield await self.admission.join(rid, tokens, hit_tokens, source)
            return
        # compute slots: more than one so a request still waiting for its hit KV does not
        # idle the compute thread while the next one's KV is already here
        async with self._slots:
            yield self.engine.prefill(tokens, hit_tokens, source)

    async def serve(
        self, order: PrefillOrder, outcome: PrefillOutcome | None = None
    ) -> AsyncIterator[Accepted | Done]:
        """Yield `Accepted` then `Done` (see the module docstring); raise on failure. A decode
        agent or region no transfer could use is refused (`BadField`) before anything is
        taken or posted; `outcome` says, after a failure, whether a WRITE may still land."""
        outcome = outcome if outcome is not None else PrefillOutcome()
        model = self.model
        prompt = list(order.prompt)
        layout = RequestLayout.of(model, order.hit_tokens, len(prompt))  # checked by the wire
        path = order.read_path
        transfer = self.transfer
        peer = self._peer(order)
        new_tokens = layout.new_tokens
        self.load.tokens_queued += new_tokens
        started = announced = False
        stray = False  # a WRITE of ours to the decode node may still land (not cancelled)
        regions = []
        handle = None
        t0 = time.perf_counter()
        try:
            # I/O starts at arrival (buffer space is the admission limit for KV in flight), so
            # the read queue's pending bytes, which the scheduler balances, include this request
            pool = transfer.pool
            timeout = self.deadline_s
            hit_region = (
                await pool.alloc_wait(layout.hit_bytes, timeout) if layout.hit_blocks else None
            )
            if hit_region is not None:
                regions.append(hit_region)
            new_region = await pool.alloc_wait(layout.new_bytes, timeout)
            regions.append(new_region)
            forward: list[asyncio.Task] = []
            rid = order.request_id
            if path == "prefill":
                ids = block_ids(prompt, model, salt=order.cache_salt)[: layout.hit_blocks]
                handle = self.read_queue.submit(ids, out=hit_region.tensor)
                valid = await handle.ready()
                if valid < layout.hit_blocks:
                    raise HitUnavailable(
                        f"{layout.hit_blocks - valid} of {layout.hit_blocks} hit blocks "
                        f"unreadable ({', '.join(f.reason for f in handle.failed)})",
                        valid_tokens=valid * model.block_tokens,
                    )
                source = handle
                forward = stream_hit_layers(
                    transfer, handle, layout, hit_region, peer, order.decode_hit.address, rid
                )
            elif path == "decode":
                source = RemoteHitSource(transfer, peer, rid, layout, hit_region.tensor, timeout)
            else:
                source = None
            announced = True  # from here on the decode node may WRITE into the hit region
            yield Accepted(
                transfer.name,
                transfer.metadata,
                Region(hit_region.address, hit_region.nbytes) if hit_region is not None else None,
            )
            new_part = prompt[layout.hit_tokens :]
            async with self._compute(rid, new_part, layout.hit_tokens, source) as run:
                self.load.tokens_queued -= new_tokens
                self.load.tokens_running += new_tokens
                self.load.requests_running += 1
                started = True
                writes: list[asyncio.Task] = []
                try:
                    async for layer, k, v in run:
                        layout.put_new(new_region.tensor, layer, k, v)
                        off = layer * layout.new_layer_bytes
                        writes.append(
                            asyncio.create_task(
                                transfer.write(
                                    peer,
                                    new_region.address + off,
                                    layout.new_layer_bytes,
                                    order.decode_new.address + off,
                                    notif=new_notif(rid, layer),
                                )
                            )
                        )
                    await asyncio.gather(*writes, *forward)
                except KVLoadError as err:
                    raise HitUnavailable(str(err), err.valid_blocks * model.block_tokens) from None
                finally:
                    pending = [t for t in (*writes, *forward) if not t.done()]
                    for t in pending:
                        t.cancel()
                    # ended (and their NIXL handles released) before this call's status goes
                    # out: the decode node frees its regions when it sees that status; the
                    # ones already failed too (their error is this call's, not a stray log)
                    ended = await asyncio.gather(*writes, *forward, return_exceptions=True)
                    stray = any(isinstance(e, TransferError) and e.in_flight for e in ended)
                logits = run.logits[-1].float().contiguous()
                yield Done(
                    logits.numpy().tobytes(), logits.numel(), run.times.compute_s, run.times.wait_s
                )
            metrics.REQUESTS.labels("prefill", path, "ok").inc()
            metrics.TOKENS.labels("prefill").inc(new_tokens)
            metrics.PREFILL_SECONDS.labels(path).observe(time.perf_counter() - t0)
            metrics.PREFILL_WAIT_SECONDS.labels(path).inc(run.times.wait_s)
            if layout.hit_blocks:
                metrics.HIT_BYTES.labels(path).inc(layout.hit_bytes)
            log.debug(
                "prefill %s: %d new + %d hit tokens via path %s in %.3fs",
                rid,
                new_tokens,
                layout.hit_tokens,
                path,
                time.perf_counter() - t0,
            )
        except BaseException:
            metrics.REQUESTS.labels("prefill", path, "error").inc()
            ok = False
            if stray:  # the decode node must not reuse its regions before our WRITEs' deadline
                metrics.WRITES_IN_FLIGHT.inc()
                log.warning(
                    "prefill %s failed with a KV WRITE to %s that may still land: the decode "
                    "node is told to hold its regions",
                    order.request_id,
                    peer,
                )
                outcome.writes_in_flight = True
            raise
        else:
            ok = True
        finally:
            if started:
                self.load.tokens_running -= new_tokens
                self.load.requests_running -= 1
            else:
                self.load.tokens_queued -= new_tokens
            if handle is not None:
                handle.close()
            # only path D's hit layers are written here by a peer (the decode node)
            remote = path == "decode" and announced and not ok
            release_regions(transfer.pool, regions, self.deadline_s if remote else 0.0, handle)
            transfer.discard_notifs(f"{order.request_id}/".encode())

    def _peer(self, order: PrefillOrder) -> str:
        """The decode agent, its metadata loaded, and its regions checked against its
        registered buffer: a WRITE there would fail inside NIXL (NIXL_ERR_MISMATCH,
        NIXL_ERR_NOT_FOUND), so a bad one is refused by name before any is posted."""
        transfer, peer = self.transfer, order.decode_agent
        if not transfer.knows(peer):
            try:
                loaded = transfer.add_peer(order.decode_agent_metadata)
            except Exception as err:  # the bindings raise plain exceptions
                raise BadField(
                    "decode_agent_metadata", f"not a loadable agent's metadata ({err})"
                ) from None
            if loaded != peer:
                raise BadField(
                    "decode_agent", f"{peer!r} is not the agent of decode_agent_metadata"
                )
        for field, r in (("decode_new", order.decode_new), ("decode_hit", order.decode_hit)):
            if r is not None and not transfer.covers(peer, r.address, r.length):
                raise BadField(
                    field, f"[{r.address:#x}, +{r.length}) lies outside {peer}'s KV buffer"
                )
        return peer
