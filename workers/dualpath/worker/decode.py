"""The decode role: serve a turn (`Worker.Generate`) end to end from the decode node.

For one request:
1. regions of the registered buffer for the hit KV and the new tokens' KV;
2. path D: this node reads the hit blocks from storage into its hit region (its own SNIC);
3. it calls the prefill worker's `Prefill`; on `accepted`, path D streams each hit layer to
   the prefill node as soon as it is read (NIXL WRITE + notification per layer);
4. the prefill writes every new-token layer here (path P: every hit layer too), then `done`
   brings the last logits; the whole context's KV is then in this node's buffer;
5. the sequence joins the continuous-batching decode loop; tokens stream back;
6. before the last token is sent, the turn's new full blocks are written to the store and the
   scheduler's block index has acknowledged their KV events, so the agent's next turn hits them.

Hit KV that cannot be loaded (a bad or vanished block: the scheduler's index may be stale) is
never used: the hit ends at the first such block and the rest is recomputed, logged and counted.
Either path retries the turn with the prefix that was readable, in fresh buffer regions (a read
that was closed may still write into its old ones until it returns), validated again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import torch

from dualpath.config import ModelSpec
from dualpath.engine import CacheFullError, Engine
from dualpath.grpc_channels import Unreachable
from dualpath.kv import KVLoadError, block_ids
from dualpath.kv.protocol import BlockStore
from dualpath.kv.queue import ReadQueue
from dualpath.transfer.protocol import KVTransfer, TransferError
from dualpath.v1 import worker_pb2_grpc as wpb_grpc
from dualpath.worker import metrics
from dualpath.worker.kvstream import hit_notif, new_notif, stream_hit_layers
from dualpath.worker.layout import RequestLayout
from dualpath.worker.prefill import VALID_HIT_KEY, WRITES_IN_FLIGHT_KEY, HitUnavailable
from dualpath.worker.regions import release_regions
from dualpath.worker.wire import (
    Accepted,
    Done,
    PrefillOrder,
    Region,
    Turn,
    TurnChunk,
    prefill_message_from_pb,
    prefill_to_pb,
)

log = logging.getLogger(__name__)


class PrefillFailed(RuntimeError):
    pass


class PrefillUnreachable(PrefillFailed):
    """The prefill node a turn names did not connect: a bad target (FAILED_PRECONDITION)."""


# Codes a client call ends with on its own side: the peer may still be running.
_LOCAL_CODES = (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED)


class _Exchange:
    """One prefill exchange's progress, shared with the turn that waits for it."""

    __slots__ = ("started",)

    def __init__(self) -> None:
        self.started = False  # the Prefill call (with this node's buffer addresses) was made


def _retrieve(task: asyncio.Task) -> None:
    """Done callback of an abandoned exchange: its outcome is logged, never left unretrieved."""
    if not task.cancelled() and task.exception() is not None:
        log.debug("abandoned prefill exchange ended: %s", task.exception())


class DecodeRole:
    """A decode node's work: given its model, compute engine, store, KV transfer, storage read
    queue, a stub to reach prefill workers and a way to flush the store's KV events (nothing
    else of the node), it serves `Worker.Generate` calls."""

    def __init__(
        self,
        *,
        node_id: str,
        model: ModelSpec,
        engine: Engine,
        store: BlockStore,
        transfer: KVTransfer,
        read_queue: ReadQueue,
        deadline_s: float,
        request_timeout_s: float,
        worker_stub: Callable[[str], Awaitable[wpb_grpc.WorkerStub]],
        flush_kv_events: Callable[[], Awaitable[None]],
    ) -> None:
        self.node_id = node_id
        self.model = model
        self.engine = engine
        self.store = store
        self.transfer = transfer
        self.read_queue = read_queue
        self.deadline_s = deadline_s  # one transfer, one notification wait, one buffer wait
        self.request_timeout_s = request_timeout_s  # one Prefill call
        self.worker_stub = worker_stub  # prefill worker address -> its Worker stub
        self.flush_kv_events = flush_kv_events  # until the scheduler's index has them
        self.tokens_queued = 0  # prompts being prefilled for this node
        self.tokens_running = 0  # context tokens of sequences in the decode batch
        self.requests_running = 0
        self._queues: dict[str, asyncio.Queue] = {}
        self._work = asyncio.Event()
        self._freed = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._decode_loop(), name="decode")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass

    async def _decode_loop(self) -> None:
        engine = self.engine
        while True:
            await self._work.wait()
            if not engine.running:
                self._work.clear()
                continue
            try:
                outs = await engine.astep()
            except Exception:
                log.exception("decode step failed; failing the running sequences")
                for q in self._queues.values():
                    q.put_nowait(None)
                await asyncio.sleep(0.1)
                continue
            metrics.TOKENS.labels("decode").inc(len(outs))
            for o in outs:
                q = self._queues.get(o.seq_id)
                if q is not None:
                    q.put_nowait(o)

    # ---- one turn -----------------------------------------------------------------------------

    async def generate(self, turn: Turn) -> AsyncIterator[TurnChunk]:
        """Serve one turn (checked by the wire: `wire.generate_from_pb`); yield its chunks."""
        model = self.model
        prompt = list(turn.prompt)
        salt = turn.cache_salt
        rid = turn.request_id
        hit = min(turn.hit_tokens, (len(prompt) - 1) // model.block_tokens * model.block_tokens)
        hit -= hit % model.block_tokens
        path = turn.read_path if hit else "none"
        t0 = time.perf_counter()
        self.tokens_queued += len(prompt)
        try:
            attempt = turn
            for retry in itertools.count(1):
                try:
                    kv, logits, hit, path = await self._exchange(attempt, prompt, hit, path)
                    break
                except (HitUnavailable, KVLoadError) as err:
                    if not hit:
                        raise
                    # the readable prefix, an upper bound the retry verifies again; strictly
                    # shorter each time, so the loop ends at a full recompute at worst
                    if isinstance(err, HitUnavailable):
                        keep = err.valid_tokens
                    else:
                        keep = err.valid_blocks * model.block_tokens
                    keep = min(keep - keep % model.block_tokens, hit - model.block_tokens)
                    metrics.FALLBACKS.labels("hit_unavailable").inc()
                    log.warning(
                        "request %s: hit KV unavailable (%s); recomputing from token %d",
                        rid,
                        err,
                        keep,
                    )
                    hit, path = keep, (path if keep else "none")
                    # a fresh id: a late WRITE notification of the failed attempt must not
                    # satisfy a wait of the retry
                    attempt = dataclasses.replace(turn, request_id=f"{rid}#{retry}")
        finally:
            self.tokens_queued -= len(prompt)
        prefill_s = time.perf_counter() - t0
        params = turn.sampling
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = queue
        admitted = False
        added = False  # the sequence may be in the engine: freed at the end
        outcome = "error"
        try:
            try:
                first = await self._admit(rid, kv, logits, params)
            except asyncio.CancelledError:
                # an addition already running on the compute thread cannot be cancelled and
                # adds the sequence anyway: the free below runs after it, on the same thread
                added = True
                raise
            admitted = added = True
            del kv
            self.tokens_running += len(prompt)
            self.requests_running += 1
            generated = [first.token]
            out = first
            head = dict(hit_tokens=hit, read_path=path, prefill_s=prefill_s)
            t_first = time.perf_counter()
            if not out.finished:
                yield TurnChunk((out.token,), **head)
                head = {}
                self._work.set()
                while True:
                    out = await queue.get()
                    if out is None:
                        raise RuntimeError("decode step failed")
                    generated.append(out.token)
                    if out.finished:
                        break
                    yield TurnChunk((out.token,))
                tpot_s = (time.perf_counter() - t_first) / (len(generated) - 1)
                metrics.TPOT_SECONDS.observe(tpot_s)
            await self._store_turn(rid, prompt, generated, hit, salt)
            yield TurnChunk((out.token,), finish_reason=out.reason or "length", **head)
            outcome = "ok"
        finally:
            self._queues.pop(rid, None)
            if admitted:
                self.tokens_running -= len(prompt)
                self.requests_running -= 1
            if added:
                await asyncio.get_running_loop().run_in_executor(
                    self.engine.executor, self.engine.free, rid
                )
                self._freed.set()
            metrics.REQUESTS.labels("decode", path, outcome).inc()

    async def _admit(self, rid, kv, logits, params):  # noqa: ANN001, ANN202
        """Add the sequence to the decode batch (on the compute thread), waiting for pages."""
        engine = self.engine
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.deadline_s
        while True:
            try:
                return await loop.run_in_executor(
                    engine.executor, engine.add_sequence, rid, kv, logits, params
                )
            except CacheFullError:
                if loop.time() > deadline:
                    raise
                self._freed.clear()
                try:
                    await asyncio.wait_for(self._freed.wait(), 0.5)
                except TimeoutError:
                    pass

    async def _store_turn(
        self, rid: str, prompt: list[int], generated: list[int], hit: int, salt: bytes
    ):
        """Write the turn's new full blocks (prompt + generated, last token excluded), ids
        chained under the request's cache salt."""
        engine = self.engine
        tokens = prompt + generated[:-1]
        bt = self.model.block_tokens
        if len(tokens) // bt <= hit // bt:
            return
        loop = asyncio.get_running_loop()
        kv = await loop.run_in_executor(engine.executor, engine.sequence_kv, rid, hit)
        try:
            written = await asyncio.to_thread(self.store.put_tokens, tokens, kv, hit, salt)
        except OSError as err:  # a full or failing disk must not fail the answer
            log.debug("request %s: writing its KV blocks failed: %s", rid, err)  # store counted it
            return
        log.debug("request %s: %d new blocks stored", rid, len(written))
        await self.flush_kv_events()  # the agent's next turn must find them in the index

    async def _exchange(
        self, req: Turn, prompt: list[int], hit: int, path: str
    ) -> tuple[list, torch.Tensor, int, str]:
        """`_prefill`, shielded from the turn's cancellation once the prefill node holds this
        node's buffer addresses: the exchange then runs to its end (bounded by its deadlines)
        and frees the regions the moment nothing can write into them, instead of quarantining
        them for a whole transfer deadline (a burst of client disconnects would otherwise leave
        no buffer to route to). Cancelled before that, it stops at once."""
        ex = _Exchange()

        async def run() -> tuple[list, torch.Tensor, int, str]:
            with self.transfer.active():
                return await self._prefill(req, prompt, hit, path, ex)

        task = asyncio.ensure_future(run())
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if not ex.started:
                task.cancel()
            elif not task.done():
                log.info(
                    "request %s cancelled during its prefill exchange: letting it end",
                    req.request_id,
                )
            task.add_done_callback(_retrieve)
            raise

    async def _prefill(
        self,
        req: Turn,
        prompt: list[int],
        hit: int,
        path: str,
        ex: _Exchange | None = None,
    ) -> tuple[list, torch.Tensor, int, str]:
        """Steps 1-4 of the module docstring: the whole prompt's KV here, and the logits."""
        model = self.model
        transfer = self.transfer
        rid = req.request_id
        deadline_s = self.deadline_s
        ex = ex or _Exchange()
        regions = []
        handle = None
        call = None
        tasks: list[asyncio.Task] = []
        clean = False
        peer_ended = False  # the prefill node ended its side: none of its WRITEs can land
        try:
            layout = RequestLayout.of(model, hit, len(prompt))
            hit_region = None
            if layout.hit_blocks:
                hit_region = await transfer.pool.alloc_wait(layout.hit_bytes, deadline_s)
                regions.append(hit_region)
            if path == "decode":
                ids = block_ids(prompt, model, salt=req.cache_salt)[: layout.hit_blocks]
                handle = self.read_queue.submit(ids, out=hit_region.tensor)
                valid = await handle.ready()
                if valid < layout.hit_blocks:
                    # the hit ends at the first block that failed validation; the retry reads
                    # the valid prefix afresh into regions of its own: this read, closed, may
                    # still be writing its layout into hit_region from a pool thread (the
                    # region goes back once it returned), and the retry validates again
                    raise KVLoadError(valid, handle.failed)
            new_region = await transfer.pool.alloc_wait(layout.new_bytes, deadline_s)
            regions.append(new_region)
            try:
                stub = await self.worker_stub(req.prefill_address)
            except Unreachable as err:
                raise PrefillUnreachable(
                    f"prefill worker {req.prefill_node} ({req.prefill_address}): unreachable: {err}"
                ) from None
            ex.started = True
            order = PrefillOrder(
                request_id=rid,
                prompt=tuple(prompt),
                hit_tokens=layout.hit_tokens,
                read_path=path,
                decode_node=self.node_id,
                decode_agent=transfer.name,
                decode_agent_metadata=transfer.metadata,
                decode_hit=Region(hit_region.address, hit_region.nbytes)
                if hit_region is not None
                else None,
                decode_new=Region(new_region.address, new_region.nbytes),
                cache_salt=req.cache_salt,
            )
            call = stub.Prefill(prefill_to_pb(order), timeout=self.request_timeout_s)
            stream = call.__aiter__()
            accepted = prefill_message_from_pb(await anext(stream))
            if not isinstance(accepted, Accepted):
                raise PrefillFailed(f"prefill of {rid}: {accepted} before accepted")
            peer = accepted.agent
            if not transfer.knows(peer):
                transfer.add_peer(accepted.metadata)
            if path == "decode":
                if accepted.hit is None:
                    raise PrefillFailed(f"prefill of {rid}: accepted path D without prefill_hit")
                tasks = stream_hit_layers(
                    transfer, handle, layout, hit_region, peer, accepted.hit.address, rid
                )
            # a failed hit-layer read here ends the wait at once (gather raises the first error)
            done_msg, *_ = await asyncio.gather(anext(stream), *tasks)
            peer_ended = True  # `done` follows the completion of all its WRITEs
            done = prefill_message_from_pb(done_msg)
            if not isinstance(done, Done):
                raise PrefillFailed(f"prefill of {rid}: unexpected message {done}")
            waits = [
                transfer.wait_notif(peer, new_notif(rid, i), deadline_s)
                for i in range(layout.layers)
            ]
            if path == "prefill":
                waits += [
                    transfer.wait_notif(peer, hit_notif(rid, i), deadline_s)
                    for i in range(layout.layers)
                ]
            await asyncio.gather(*waits)
            kv = layout.context(
                hit_region.tensor if hit_region is not None else None, new_region.tensor
            )
            logits = torch.frombuffer(bytearray(done.last_logits), dtype=torch.float32)
            if layout.hit_blocks:
                metrics.HIT_BYTES.labels(path).inc(layout.hit_bytes)
            clean = True
            return kv, logits, layout.hit_tokens, path
        except grpc.aio.AioRpcError as err:
            # a status from the peer (or a broken connection: a dead peer) ends its side; our
            # own cancel or deadline does not say its WRITEs stopped, nor does a status that
            # says one of them was abandoned still in flight
            trailers = dict(err.trailing_metadata() or ())
            stray = WRITES_IN_FLIGHT_KEY in trailers
            peer_ended = err.code() not in _LOCAL_CODES and not stray
            if stray:
                log.warning(
                    "prefill of %s failed with a KV WRITE that may still land here: its "
                    "regions are held for %.1fs",
                    rid,
                    deadline_s,
                )
            if err.code() == grpc.StatusCode.FAILED_PRECONDITION:
                valid = trailers.get(VALID_HIT_KEY, "0")
                raise HitUnavailable(err.details(), int(valid) if valid.isdigit() else 0) from None
            raise PrefillFailed(
                f"prefill worker {req.prefill_node} ({req.prefill_address}): "
                f"{err.code().name}: {err.details()}"
            ) from None
        except TransferError as err:
            raise PrefillFailed(f"KV transfer with {req.prefill_node}: {err}") from None
        finally:
            for t in tasks:
                if not t.done():
                    t.cancel()
            if call is not None and not clean:
                call.cancel()
            if handle is not None:
                handle.close()
            release_regions(
                transfer.pool,
                regions,
                0.0 if clean or call is None or peer_ended else deadline_s,
                handle,
            )
            transfer.discard_notifs(f"{rid}/".encode())
