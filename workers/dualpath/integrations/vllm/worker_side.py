"""The connector's worker half (runs in vLLM's worker process, next to the paged KV cache).

Loads: each planned hit is submitted to the node's read queue (`kv.ReadQueue`: the store's
block format and checksums, the SNIC cap, bounded waits). By default (`hit_load` async) the
request is parked by vLLM and its hit read on a thread of its own, layer by layer into its
blocks, and reported received when the last layer is in (`get_transfer_results`): the forward
thread computes other requests meanwhile. With `hit_load` layerwise the read starts when the
request's forward starts (`start_load_kv`) and `wait_for_layer_load(layer)` blocks only on that
layer's read and copies it into vLLM's cache, so layer l+1 is read while layer l computes. A
bad or missing block ends the hit there: the vLLM blocks from the first one not loaded are reported
(`get_block_ids_with_load_errors`) and vLLM recomputes them (kv_load_failure_policy
"recompute"), never a wrong answer.
Saves: `save_kv_layer` copies the step's completed store blocks out of the cache, layer by
layer; `wait_for_save` writes them with the store's writer (chained ids under the tenant salt,
atomic, checksummed) and the store's KV events go to the scheduler's block index
(`KvEventPublisher`, on a small event loop thread of its own), flushed before the step ends so
the agent's next turn finds them.
Between instances (`nixl.KvAgent` over vLLM's own cache, registered at start on both roles):
- receiver (decode): a `RecvPlan` arrives once vLLM parked the request and it is ready: the
  loopback rendezvous (`rendezvous.py`) answers where to send. Path D reads the hit through
  the read queue into the request's blocks on a thread of its own (only its blocks, off the
  forward thread), layer by layer, publishing after each layer how far it got in the
  request's NIXL progress word: the prefill streams layer l while layer l+1 is read (the
  pipeline storage -> decode -> prefill). A receiver notified while its read still runs is
  reported when the read ends; a hit that ended early (a bad block) reports the blocks from
  its end as load errors (vLLM recomputes them). Each step `get_finished` polls NIXL notifications: the transfer's
  id reports the request received; past its deadline (the prefill died, a transfer failed) it
  is reported received with the blocks past its own hit as load errors, and vLLM recomputes
  them (counted; never a hang, never a wrong answer).
- sender (prefill): path D's hit is READ from the decode's blocks. Parked (`hit_load` async):
  each step (`get_transfer_results`, on the forward thread: every NIXL call of a prefill is
  made there) polls the decode's progress word, posts the READ of every layer the decode has
  read so far and collects the READs done, never blocking; the request is reported received
  once every layer is in. Layerwise: `wait_for_layer_load(l)` polls the progress word until
  layer l is in the decode's cache (posting the READs as it finds them), then waits for layer
  l's READ only. Either way a failure recomputes the hit, as a bad store block does, and a hit
  the decode ended early is shortened; `save_kv_layer(l)` posts the WRITE of layer l's blocks the
  decode lacks, and `wait_for_save` waits for them and then notifies the transfer's id. A step
  whose load failed sends nothing (vLLM recomputes and the next step sends); nothing is sent
  past the deadline less `plan.SEND_MARGIN_S`.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dualpath.config import ClusterConfig
from dualpath.integrations.vllm import blocks, cache, metrics
from dualpath.integrations.vllm.connector_config import ConnectorConfig
from dualpath.integrations.vllm.plan import (
    SEND_MARGIN_S,
    LoadPlan,
    RecvPlan,
    SavePlan,
    SendPlan,
    StepPlan,
)
from dualpath.integrations.vllm.rendezvous import Ready, RendezvousError, RendezvousServer
from dualpath.transfer.protocol import TransferError

log = logging.getLogger(__name__)

_LAYER = re.compile(r"layers\.(\d+)\.")
FLUSH_TIMEOUT_S = 1.0  # events not acknowledged by then: the next turn may miss, never misread


def layer_index(layer_name: str) -> int:
    m = _LAYER.search(layer_name)
    if m is None:
        raise ValueError(f"vLLM layer {layer_name!r} has no 'layers.<i>.' in its name")
    return int(m.group(1))


POLL_S = 0.002  # the notification poller's period while receivers wait
# a step that ran no forward while requests are parked: vLLM steps again at once to poll the
# connector, so on a CPU host its engine and worker would spin a core each for the whole
# wait; this pause bounds that, and delays a parked request's start by at most as much
IDLE_STEP_S = 0.003
PROGRESS_POLL_S = 0.002  # a sender's period between reads of a receiver's progress word
SENT_MEMORY = 4096  # transfer ids a sender remembers having sent (never sends one twice)


@dataclass
class _Load:
    plan: LoadPlan
    handle: object  # kv.queue.LayerReadHandle (None: a NIXL read, `reads`)
    slots: torch.Tensor
    loaded_until: int  # tokens loaded in every layer so far (shrinks on a failure)
    failed: bool = False
    reads: dict[int, object] = field(default_factory=dict)  # layer -> NIXL READ handle
    xfer_deadline_unix: float = 0.0  # the NIXL reads' (`_xfer_deadline`)
    posted: int = 0  # layers whose NIXL READ was posted (in order)


@dataclass
class _Recv:
    plan: RecvPlan
    ready: bool = False
    hit_tokens: int = 0  # tokens of its own hit in the cache (path D; planned while reading)
    answered_tokens: int = -1  # the hit the rendezvous answered (the sender sends from there)
    slot: int | None = None  # its NIXL progress word while its hit is read (path D)
    reading: bool = False  # its hit is being read from the store
    notified: bool = False  # the sender's notification came


@dataclass
class _Parked:
    """A request vLLM parked while its hit is read from the store (`hit_load` async)."""

    plan: LoadPlan
    tokens: int = 0  # tokens of [start, end) read into every layer, once `done`
    done: bool = False


@dataclass
class _Send:
    plan: SendPlan
    writes: list = field(default_factory=list)  # NIXL WRITE handles, one per layer posted
    failed: bool = False


@dataclass
class _Save:
    plan: SavePlan
    slots: torch.Tensor
    layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


class _EventLoop:
    """An asyncio loop on a daemon thread: the KV event publisher's home in vLLM's worker."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="dualpath-kv-events", daemon=True
        )
        self._thread.start()

    def run(self, coro, timeout_s: float):  # noqa: ANN001, ANN201
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=2.0)


class WorkerSide:
    def __init__(self, cfg: ClusterConfig, cc: ConnectorConfig) -> None:
        self.cfg = cfg
        self.storage = cc.storage or cfg.spec.storage.path
        self.node_id = cc.node_id
        self.scheduler = cc.scheduler
        self.token_file = cc.token_file
        self.tls_dir = cc.tls_dir
        self.rendezvous_port = cc.rendezvous_port
        self.agent = None  # nixl.KvAgent, at register_kv_caches
        self._rendezvous: RendezvousServer | None = None
        self._cond = threading.Condition()  # guards _recvs (the rendezvous threads read it)
        self._recvs: dict[str, _Recv] = {}
        self._parked: dict[str, _Parked] = {}  # vLLM request id -> its store read
        self._parked_reads: dict[str, _Load] = {}  # -> its NIXL read (path D; forward thread)
        self._sends: list[_Send] = []
        self._send_plan: StepPlan | None = None
        self._sent: OrderedDict[str, None] = OrderedDict()
        self._poller: threading.Thread | None = None
        self._failed_loads: set[str] = set()  # requests whose load failed this step: no send
        self._load_plan: StepPlan | None = None  # the plan whose loads `_failed_loads` are
        self._arrived: list[bytes] = []  # notifications the poller took, for the next step
        self._closing = False
        self.store = None
        self.read_queue = None
        self._events = None
        self._publisher = None
        self._loop: _EventLoop | None = None
        self._caches: dict[int, torch.Tensor] = {}
        self._loads: list[_Load] = []
        self._saves: list[_Save] = []
        self._save_plan: StepPlan | None = None
        self._load_errors: set[int] = set()
        self._forward_t0: float | None = None  # this step's start (`step_started`)
        self._forward_ran = False  # the step ran the model (a layer saved): not a bare poll

    # ---- start / stop -------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], reshape_and_cache) -> None:  # noqa: ANN001
        from dualpath.kv import KVStore, ReadQueue

        spec = self.cfg.spec
        self._caches = {layer_index(name): t for name, t in kv_caches.items()}
        if sorted(self._caches) != list(range(spec.model.layers)):
            raise ValueError(
                f"vLLM has attention layers {sorted(self._caches)}; spec.model.layers is "
                f"{spec.model.layers}: the served model is not the config's"
            )
        t = self._caches[0]
        _, heads, block, two_hd = t.shape
        if (heads, two_hd // 2) != (spec.model.kv_heads, spec.model.head_dim):
            raise ValueError(
                f"vLLM's KV cache has {heads} heads of {two_hd // 2}; the config says "
                f"{spec.model.kv_heads} of {spec.model.head_dim}"
            )
        cache.check_layout(reshape_and_cache, heads, two_hd // 2, block, t.dtype)
        if self.scheduler:
            from dualpath.kv.events import KvEventBuffer

            self._events = KvEventBuffer()
        self.store = KVStore(
            self.storage, spec.model, spec.storage.capacity_bytes, events=self._events
        )
        self.read_queue = ReadQueue(
            self.store,
            spec.storage.read_concurrency,
            spec.storage.snic_gbps,
            name=self.node_id,
            read_timeout_s=spec.storage.read_timeout_ms / 1000,
        )
        if self.scheduler:
            self._loop = _EventLoop()
            self._loop.run(self._start_publisher(), timeout_s=10.0)
        from dualpath.integrations.vllm.nixl import KvAgent

        self.agent = KvAgent(self.node_id, self._caches)
        if self.rendezvous_port:
            self._rendezvous = RendezvousServer(self.rendezvous_port, self.wait_ready)
        log.info(
            "DualPath connector worker %s: %d layers, KV cache %s, store %s, scheduler %s, "
            "NIXL agent %s, rendezvous %s",
            self.node_id,
            len(self._caches),
            tuple(t.shape),
            self.storage,
            self.scheduler or "none",
            self.agent.name,
            f"127.0.0.1:{self._rendezvous.port}" if self._rendezvous else "none",
        )

    async def _start_publisher(self) -> None:
        from dualpath.grpc_auth import load_auth
        from dualpath.grpc_identity import node_publisher
        from dualpath.scheduler.client import channel
        from dualpath.scheduler.kv_events import KvEventPublisher
        from dualpath.v1 import scheduler_pb2_grpc

        # the worker's own credentials (neither given: unauthenticated, as the worker is)
        auth = (
            load_auth(self.token_file, self.tls_dir, f"vLLM connector {self.node_id}")
            if self.token_file or self.tls_dir
            else None
        )
        stub = scheduler_pb2_grpc.SchedulerStub(channel(self.scheduler, auth))
        # its own publisher id: the worker adapter of this node publishes under node_id
        self._publisher = KvEventPublisher(
            stub, node_publisher(self.node_id, "vllm"), self._events, self.store.scan_keys
        ).start()

    def shutdown(self) -> None:
        self._closing = True
        if self._poller is not None:
            self._poller.join(timeout=2.0)
        if self._rendezvous is not None:
            self._rendezvous.close()
        if self.agent is not None:
            self.agent.close()
        if self._loop is not None and self._publisher is not None:
            try:
                self._loop.run(self._publisher.stop(), timeout_s=3.0)
            except Exception as err:  # noqa: BLE001 (stopping: log and go on)
                log.warning("KV event publisher stop: %s", err)
            self._loop.stop()
        if self.read_queue is not None:
            self.read_queue.close()
        if self.store is not None:
            self.store.close()

    # ---- loads --------------------------------------------------------------------------

    def step_started(self) -> None:
        """vLLM bound this step's plan, before its forward: the forward's clock starts (vLLM
        calls `start_load_kv` before the forward only when the step has a layerwise load,
        else after it)."""
        self._forward_t0 = time.perf_counter()
        self._forward_ran = False

    def start_load(self, plan: StepPlan) -> None:
        for r in plan.recvs:
            self._start_recv(r)
        for p in plan.async_loads:
            if p.source is not None:
                self._parked_reads[p.req_id] = self._start_read(p)
            else:
                self._start_parked(p)
        self._loads = []
        self._failed_loads = set()
        self._load_plan = plan
        for p in plan.loads:
            if p.source is not None:
                self._loads.append(self._start_read(p))
                continue
            handle = self.read_queue.submit(p.block_ids)
            slots = torch.tensor(p.slots, dtype=torch.int64)
            self._loads.append(_Load(p, handle, slots, p.end - p.start))
            metrics.LOADS.labels(path=p.path).inc()

    def _xfer_deadline(self, plan_deadline_unix: float) -> float:
        """A transfer's wait: a dead peer costs at most workers.transferDeadlineSeconds of the
        forward thread, and nothing moves after the receiver's deadline less the margin."""
        return min(
            plan_deadline_unix - SEND_MARGIN_S,
            time.time() + self.cfg.spec.workers.transfer_deadline_seconds,
        )

    def _start_read(self, p: LoadPlan) -> _Load:
        """Path D on a prefill: post every layer's READ of the hit from the decode's blocks."""
        ld = _Load(p, None, torch.empty(0, dtype=torch.int64), p.end - p.start)
        ld.xfer_deadline_unix = self._xfer_deadline(p.deadline_unix)
        try:
            if time.time() > ld.xfer_deadline_unix:
                raise TransferError("its deadline passed before the read started")
            if not p.source.progress_address:  # the whole hit is in the decode's cache
                self._post_reads(ld, len(self._caches))
        except TransferError as err:
            self._read_failed(ld, err)
        return ld

    def _post_reads(self, ld: _Load, layers: int) -> None:
        """Post the READs of layers [posted, layers) of the hit's whole vLLM blocks."""
        n = ld.loaded_until // self._caches[0].shape[2]
        p = ld.plan
        for layer in range(ld.posted, min(layers, len(self._caches))):
            ld.reads[layer] = self.agent.post(
                "READ", p.source, layer, p.local_blocks[:n], p.remote_blocks[:n]
            )
            ld.posted = layer + 1

    def _stream_until(self, ld: _Load, layer: int) -> None:
        """Path D's pipeline: poll the decode's progress word until `layer` of the hit is in
        its cache, posting the READ of each layer found there; a hit the decode's store read
        ended early is shortened here (vLLM recomputes the rest)."""
        while ld.posted <= layer and ld.loaded_until:
            layers, tokens = self.agent.read_progress(ld.plan.source, ld.xfer_deadline_unix)
            if tokens < ld.loaded_until:
                self._shorten(ld, tokens)
                if not ld.loaded_until:
                    return
            self._post_reads(ld, layers)
            if ld.posted <= layer:
                if time.time() > ld.xfer_deadline_unix:
                    raise TransferError(
                        f"layer {layer} of the hit not in {ld.plan.source.agent}'s cache by "
                        "the deadline"
                    )
                time.sleep(PROGRESS_POLL_S)

    def _read_failed(self, ld: _Load, err: Exception) -> None:
        for h in ld.reads.values():
            self.agent.release(h)
        ld.reads = {}
        if not ld.failed:
            metrics.TRANSFER_FAILURES.labels(path="decode", stage="read").inc()
            log.warning("request %s: hit READ from %s failed: %s", ld.plan.req_id,
                        ld.plan.source.agent, err)  # fmt: skip
        self._shorten(ld, 0)

    def wait_for_layer(self, layer: int) -> None:
        """Block on `layer`'s read of every hit of this step, then copy it into the cache."""
        kv_layer = self._caches[layer]
        for ld in self._loads:
            if ld.loaded_until == 0:
                continue
            t0 = time.perf_counter()
            try:
                self._wait_one(ld, layer, kv_layer)
            finally:
                metrics.LOAD_WAIT_SECONDS.labels(path=ld.plan.path).inc(time.perf_counter() - t0)

    def _wait_one(self, ld: _Load, layer: int, kv_layer: torch.Tensor) -> None:
        from dualpath.kv.queue import KVLoadError

        if ld.plan.source is not None:  # a NIXL read: wait for this layer's
            try:
                self._stream_until(ld, layer)
                if ld.loaded_until:
                    self.agent.wait(
                        ld.reads.pop(layer),
                        ld.xfer_deadline_unix,
                        f"READ of layer {layer} from {ld.plan.source.agent}",
                    )
            except TransferError as err:
                self._read_failed(ld, err)
            return
        try:
            # the valid prefix: shorter than planned when a block failed validation
            k, v = ld.handle.layer_sync(layer)
        except KVLoadError:
            # a block of this layer failed its checksum or its read: the layers before
            # hold a longer prefix than this one can, so the whole hit is recomputed
            self._shorten(ld, 0)
            return
        if k.shape[0] < ld.loaded_until:
            self._shorten(ld, k.shape[0])
        n = ld.loaded_until
        if n:
            cache.write_tokens(kv_layer, ld.slots[:n], k[:n], v[:n])

    def _shorten(self, ld: _Load, tokens: int) -> None:
        """End the hit at `tokens` (floored to a vLLM block: vLLM recomputes whole blocks);
        the vLLM blocks after it are reported as load errors."""
        p = ld.plan
        vb = self._caches[0].shape[2]
        ld.loaded_until = tokens // vb * vb  # p.start is a vLLM block boundary
        bad = blocks.failed_vllm_blocks(p.block_table, p.start + ld.loaded_until, p.end, vb)
        self._load_errors |= bad
        self._failed_loads.add(p.req_id)
        if not ld.failed:
            ld.failed = True
            metrics.LOAD_FAILURES.labels(path=p.path).inc()
            log.warning(
                "request %s: hit KV ends at token %d of %d (path %s): %d vLLM blocks recomputed",
                p.req_id,
                p.start + ld.loaded_until,
                p.end,
                p.path,
                len(bad),
            )

    def _read_ended(self, ld: _Load) -> None:
        for h in ld.reads.values():  # layers not waited for (none normally)
            self.agent.release(h)
        ld.reads = {}
        if not ld.failed:
            nbytes = len(ld.plan.local_blocks) * self.agent.block_bytes * len(self._caches)
            metrics.TRANSFER_BYTES.labels(path="decode", direction="decode_to_prefill").inc(nbytes)

    def _advance_read(self, ld: _Load) -> bool:
        """One step of a parked path-D read, never blocking on the decode: post the READs of
        the layers its store read has reached, collect the READs done. True once every layer is
        in the cache (or the hit ended)."""
        layers = len(self._caches)
        if ld.posted < layers and ld.loaded_until:
            if time.time() > ld.xfer_deadline_unix:
                raise TransferError("the hit was not in the decode's cache by the deadline")
            got, tokens = self.agent.read_progress(ld.plan.source, ld.xfer_deadline_unix)
            if tokens < ld.loaded_until:
                self._shorten(ld, tokens)
            if ld.loaded_until:
                self._post_reads(ld, got)
        what = f"READ from {ld.plan.source.agent}"
        for layer, h in list(ld.reads.items()):
            del ld.reads[layer]  # `done` releases it, unless it is still in flight
            if not self.agent.done(h, ld.xfer_deadline_unix, f"{what}, layer {layer}"):
                ld.reads[layer] = h
        return not ld.loaded_until or (ld.posted >= layers and not ld.reads)

    def _finished_reads(self) -> set[str]:
        """The parked path-D reads that ended this step (a failed one: its blocks are load
        errors, vLLM recomputes them)."""
        done = set()
        for req_id, ld in list(self._parked_reads.items()):
            try:
                ended = self._advance_read(ld)
            except TransferError as err:
                self._read_failed(ld, err)
                ended = True
            if ended:
                del self._parked_reads[req_id]
                self._read_ended(ld)
                done.add(req_id)
        return done

    def finish_loads(self) -> None:
        for ld in self._loads:
            if ld.plan.source is not None:
                self._read_ended(ld)
                continue
            if not ld.failed:
                tokens = ld.plan.end - ld.plan.start
                metrics.HIT_TOKENS.labels(path=ld.plan.path).inc(tokens)
                metrics.HIT_BYTES.labels(path=ld.plan.path).inc(
                    tokens * self.cfg.spec.model.kv_bytes_per_token
                )
            elif ld.loaded_until:  # the prefix that was loaded
                metrics.HIT_TOKENS.labels(path=ld.plan.path).inc(ld.loaded_until)
            ld.handle.close()
        self._loads = []

    # ---- receivers (decode) ------------------------------------------------------------

    def _start_recv(self, r: RecvPlan) -> None:
        rv = _Recv(r)
        with self._cond:
            self._recvs[r.xfer_id] = rv
            if self._poller is None or not self._poller.is_alive():
                self._poller = threading.Thread(
                    target=self._poll_notifications, name="dualpath-nixl-poll", daemon=True
                )
                self._poller.start()
        log.info(
            "request %s: receiving %d prompt tokens over NIXL as %s (path %s, own hit %d)",
            r.req_id,
            r.tokens,
            r.xfer_id,
            r.path,
            r.hit.end if r.hit else 0,
        )
        if r.hit is None:
            self._set_ready(rv, 0)
        else:  # off the forward thread: only this request's blocks, which vLLM holds parked
            with self._cond:
                rv.reading = True
                rv.slot = self.agent.take_slot(0, r.hit.end)
            if rv.slot is not None:  # ready now: the sender streams each layer as it lands
                self._set_ready(rv, r.hit.end)
            threading.Thread(
                target=self._read_own_hit, args=(rv,), name="dualpath-hit", daemon=True
            ).start()

    def _read_own_hit(self, rv: _Recv) -> None:
        """Path D: read the hit through this node's read queue into the request's blocks,
        publishing each layer in its progress word (the sender reads layer l meanwhile)."""
        p = rv.plan.hit
        metrics.LOADS.labels(path=p.path).inc()

        def publish(layer: int, tokens: int) -> None:
            if rv.slot is not None:
                self.agent.set_progress(rv.slot, layer + 1, tokens)

        n = self._read_hit(p, publish)
        self._count_hit(p, n)
        if rv.slot is not None:  # the sender stops waiting: every layer, n tokens
            self.agent.set_progress(rv.slot, len(self._caches), n)
        with self._cond:
            rv.reading = False
        self._set_ready(rv, n)

    def _read_hit(self, p: LoadPlan, on_layer: Callable[[int, int], None] | None = None) -> int:
        """Read `p`'s store blocks through this node's read queue into its slots, layer by
        layer, off the forward thread (only the blocks of a request vLLM holds parked);
        `on_layer(layer, tokens)` after each layer. Returns the tokens of [start, end) in every
        layer: fewer than planned where a block was bad or missing (whole vLLM blocks; a
        layer that fails its checksum ends the whole hit)."""
        from dualpath.kv.queue import KVLoadError

        n, vb = p.end - p.start, self._caches[0].shape[2]
        t0 = time.perf_counter()
        handle = None
        try:
            handle = self.read_queue.submit(p.block_ids)
            slots = torch.tensor(p.slots, dtype=torch.int64)
            for layer in range(len(self._caches)):
                try:
                    k, v = handle.layer_sync(layer)
                except KVLoadError:
                    n = 0
                    break
                n = min(n, k.shape[0] // vb * vb)
                if n:
                    cache.write_tokens(self._caches[layer], slots[:n], k[:n], v[:n])
                if on_layer is not None:
                    on_layer(layer, n)
        except Exception as err:  # noqa: BLE001 (the request must go on: no hit, recomputed)
            log.warning("request %s: hit read failed: %s", p.req_id, err)
            n = 0
        finally:
            if handle is not None:
                handle.close()
            metrics.HIT_READ_SECONDS.inc(time.perf_counter() - t0)
        return n

    def _count_hit(self, p: LoadPlan, tokens: int) -> None:
        if tokens < p.end - p.start:
            metrics.LOAD_FAILURES.labels(path=p.path).inc()
            log.warning(
                "request %s: hit ends at token %d of %d (path %s)",
                p.req_id,
                p.start + tokens,
                p.end,
                p.path,
            )
        metrics.HIT_TOKENS.labels(path=p.path).inc(tokens)
        metrics.HIT_BYTES.labels(path=p.path).inc(tokens * self.cfg.spec.model.kv_bytes_per_token)

    # ---- parked loads (`hit_load` async) -----------------------------------------------

    def _start_parked(self, p: LoadPlan) -> None:
        pk = _Parked(p)
        with self._cond:
            self._parked[p.req_id] = pk
        metrics.LOADS.labels(path=p.path).inc()
        threading.Thread(
            target=self._read_parked, args=(pk,), name="dualpath-load", daemon=True
        ).start()

    def _read_parked(self, pk: _Parked) -> None:
        n = self._read_hit(pk.plan)
        with self._cond:
            pk.tokens, pk.done = n, True

    def _finished_parked(self) -> set[str]:
        """The parked loads whose read ended: received, the blocks past what was read as load
        errors (vLLM recomputes them)."""
        with self._cond:
            done = [self._parked.pop(r) for r, pk in list(self._parked.items()) if pk.done]
        vb = self._caches[0].shape[2] if self._caches else 1
        for pk in done:
            p = pk.plan
            self._count_hit(p, pk.tokens)
            self._load_errors |= blocks.failed_vllm_blocks(
                p.block_table, p.start + pk.tokens, p.end, vb
            )
        return {pk.plan.req_id for pk in done}

    def _set_ready(self, rv: _Recv, hit_tokens: int) -> None:
        with self._cond:
            rv.hit_tokens, rv.ready = hit_tokens, True
            self._cond.notify_all()

    def _done_recv(self, xfer_id: str) -> _Recv:
        """Take a receiver out (the caller holds `_cond`), freeing its progress word."""
        rv = self._recvs.pop(xfer_id)
        if rv.slot is not None:
            self.agent.give_slot(rv.slot)
        return rv

    def wait_ready(self, xfer_id: str, timeout_s: float) -> Ready:
        """The rendezvous' question (a server thread): wait until `xfer_id` is parked and its
        own hit read, then where a sender writes it."""
        with self._cond:
            ok = self._cond.wait_for(
                lambda: (rv := self._recvs.get(xfer_id)) is not None and rv.ready, timeout_s
            )
            if not ok:
                raise RendezvousError(
                    f"transfer {xfer_id} not ready to receive within {timeout_s:.0f}s "
                    "(vLLM has not parked the request, or it is gone)"
                )
            rv = self._recvs[xfer_id]
            rv.answered_tokens = rv.hit_tokens
            slot = rv.slot if rv.reading else None  # read already: no polls
            return Ready(self.agent.target(rv.plan.block_table, slot), rv.hit_tokens)

    def _poll_notifications(self) -> None:
        """While receivers wait: poll NIXL, which also drives UCX progress for the transfers
        a sender makes into (and, path D, out of) this cache; vLLM's steps are too sparse for
        that while it decodes a batch. The agent's only user on a receiving instance."""
        while not self._closing:
            with self._cond:
                if not self._recvs:
                    self._poller = None
                    return
            got = self.agent.notifications()
            if got:
                with self._cond:
                    self._arrived.extend(got)
            time.sleep(POLL_S)

    def finished_receiving(self) -> set[str]:
        """vLLM request ids received this step: their notification came, or their deadline
        passed (then the blocks past their own hit are load errors: vLLM recomputes them)."""
        done = self._finished_parked() | self._finished_reads()
        with self._cond:
            if not self._recvs and not self._arrived:
                return done
            arrived, self._arrived = self._arrived, []
        vb = self._caches[0].shape[2] if self._caches else 1
        for msg in arrived:
            xfer_id = msg.decode(errors="replace")
            with self._cond:
                rv = self._recvs.get(xfer_id)
                if rv is not None:
                    rv.notified = True
            if rv is None:
                log.warning("NIXL notification %r names no waiting transfer (late?)", xfer_id)
        now = time.time()
        with self._cond:
            # a receiver reading its own hit is reported when the read ends, and never
            # expired before (its blocks are being written; the read queue's bounded reads
            # end it)
            received = [self._done_recv(x) for x, rv in list(self._recvs.items())
                        if rv.notified and not rv.reading]  # fmt: skip
            late = [x for x, rv in self._recvs.items()
                    if rv.ready and not rv.reading and now > rv.plan.deadline_unix]  # fmt: skip
            expired = [self._done_recv(x) for x in late]
        for rv in received:
            done.add(rv.plan.req_id)
            metrics.TRANSFERS_RECEIVED.labels(path=rv.plan.path).inc()
            if rv.hit_tokens < rv.answered_tokens:  # the hit ended early: the sender sent
                # from the hit it was told, so the blocks from this hit's end are recomputed
                self._load_errors |= set(rv.plan.block_table[rv.hit_tokens // vb :])
            log.info("request %s: prompt KV received over NIXL (%s)", rv.plan.req_id,
                     rv.plan.xfer_id)  # fmt: skip
        for rv in expired:
            p = rv.plan
            bad = set(p.block_table[rv.hit_tokens // vb :])
            self._load_errors |= bad
            done.add(p.req_id)
            metrics.TRANSFER_FAILURES.labels(path=p.path, stage="receive").inc()
            log.warning(
                "request %s: no KV from the prefill by its deadline (%s): %d vLLM blocks "
                "recomputed",
                p.req_id,
                p.xfer_id,
                len(bad),
            )
        return done

    def pause_if_idle(self, finished: set[str]) -> None:
        """After `finished_receiving`: a step that ran no forward and finished nothing, while
        requests are parked, pauses `IDLE_STEP_S` before vLLM polls again."""
        if finished or self._forward_ran:
            return
        with self._cond:
            waiting = bool(self._recvs or self._parked or self._parked_reads)
        if waiting:
            time.sleep(IDLE_STEP_S)

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ---- saves --------------------------------------------------------------------------

    def save_layer(self, plan: StepPlan, layer: int, kv_layer: torch.Tensor) -> None:
        self._forward_ran = True  # vLLM calls it after every layer of a forward
        # vLLM may start the step's loads after its forward (no sync load this step): the saves
        # are bound to the plan here, on the forward's first layer, not in start_load_kv
        if self._save_plan is not plan:
            self._save_plan = plan
            self._saves = [_Save(p, torch.tensor(p.slots, dtype=torch.int64)) for p in plan.saves]
            self._sends = [_Send(p) for p in plan.sends if p.xfer_id not in self._sent]
        for s in self._saves:
            s.layers[layer] = cache.read_tokens(kv_layer, s.slots)
        for snd in self._sends:
            self._send_layer(snd, layer)

    def _load_failed(self, req_id: str) -> bool:
        # vLLM starts a step without loads after its forward: the failures then are an
        # earlier step's, whose recompute this step is (it sends)
        return self._load_plan is self._save_plan and req_id in self._failed_loads

    def _send_layer(self, snd: _Send, layer: int) -> None:
        p = snd.plan
        if snd.failed or self._load_failed(p.req_id):  # a failed load: vLLM recomputes first
            return
        try:
            if time.time() > p.deadline_unix - SEND_MARGIN_S:
                raise TransferError("its deadline passed")
            snd.writes.append(
                self.agent.post("WRITE", p.target, layer, p.local_blocks, p.remote_blocks)
            )
        except TransferError as err:
            self._send_failed(snd, err)

    def _send_failed(self, snd: _Send, err: Exception) -> None:
        snd.failed = True
        for h in snd.writes:
            self.agent.release(h)
        snd.writes = []
        self._remember_sent(snd.plan.xfer_id)  # the receiver recomputes; never sent twice
        metrics.TRANSFER_FAILURES.labels(path=snd.plan.path, stage="send").inc()
        log.warning("request %s: KV not sent to %s: %s", snd.plan.req_id, snd.plan.target.agent,
                    err)  # fmt: skip

    def _remember_sent(self, xfer_id: str) -> None:
        self._sent[xfer_id] = None
        while len(self._sent) > SENT_MEMORY:
            self._sent.popitem(last=False)

    def _finish_sends(self) -> None:
        layers = len(self._caches)
        for snd in self._sends:
            p = snd.plan
            deadline = self._xfer_deadline(p.deadline_unix)
            if snd.failed or self._load_failed(p.req_id):
                for h in snd.writes:  # vLLM recomputes; the recompute's step sends it all
                    self.agent.release(h)
                continue
            try:
                if len(snd.writes) != layers:
                    raise TransferError(f"{len(snd.writes)} of {layers} layers posted")
                while snd.writes:
                    self.agent.wait(snd.writes.pop(0), deadline, f"WRITE to {p.target.agent}")
                if time.time() > p.deadline_unix - SEND_MARGIN_S:
                    raise TransferError("its deadline passed")
                self.agent.notify(p.target, p.xfer_id.encode())
            except TransferError as err:
                self._send_failed(snd, err)
                continue
            self._remember_sent(p.xfer_id)
            nbytes = len(p.local_blocks) * self.agent.block_bytes * layers
            metrics.TRANSFER_BYTES.labels(path=p.path, direction="prefill_to_decode").inc(nbytes)
            log.info(
                "request %s: %d vLLM blocks x %d layers (%d bytes) sent to %s as %s",
                p.req_id,
                len(p.local_blocks),
                layers,
                nbytes,
                p.target.agent,
                p.xfer_id,
            )
        self._sends = []

    def wait_for_save(self) -> None:
        t0 = time.perf_counter()
        try:
            self._wait_for_save()
        finally:
            t1 = time.perf_counter()
            metrics.SAVE_WAIT_SECONDS.inc(t1 - t0)
            # a step without a forward (vLLM polls the connector while requests are parked,
            # many times a second) is no compute
            if self._forward_t0 is not None and self._forward_ran:
                metrics.FORWARD_SECONDS.inc(t1 - self._forward_t0)
            self._forward_t0 = None

    def _wait_for_save(self) -> None:
        self._finish_sends()  # first: the decode waits on them, the store does not
        written = 0
        layers = self.cfg.spec.model.layers
        for s in self._saves:
            if len(s.layers) != layers:  # a step without this request's forward: nothing to save
                continue
            kv = [s.layers[i] for i in range(layers)]
            try:
                ids = self.store.put_tokens(
                    s.plan.tokens, kv, kv_start_token=s.plan.start, salt=s.plan.salt
                )
            except OSError as err:  # a full or read-only store: the turn still answers
                metrics.SAVE_FAILURES.inc()
                log.warning("request %s: blocks not saved: %s", s.plan.req_id, err)
                continue
            written += len(ids)
            metrics.SAVED_BLOCKS.inc(len(ids))
            log.debug(
                "request %s: tokens [%d, %d) saved, %d new blocks",
                s.plan.req_id,
                s.plan.start,
                len(s.plan.tokens),
                len(ids),
            )
        self._saves, self._save_plan = [], None
        if written and self._publisher is not None:
            try:
                self._loop.run(self._publisher.flush(FLUSH_TIMEOUT_S), FLUSH_TIMEOUT_S + 1.0)
            except Exception as err:  # noqa: BLE001 (the next turn may miss: log it)
                log.warning("KV events not flushed: %s", err)
