"""The connector's worker half (runs in vLLM's worker process, next to the paged KV cache).

Loads: each planned hit is submitted to the node's read queue (`kv.ReadQueue`: the store's
block format and checksums, the SNIC cap, bounded waits) when the forward starts
(`start_load_kv`); `wait_for_layer_load(layer)` blocks only on that layer's read and copies it
into vLLM's cache, so layer l+1 is read while layer l computes. A bad or missing block ends the
hit there: the vLLM blocks from the first one not loaded are reported
(`get_block_ids_with_load_errors`) and vLLM recomputes them (kv_load_failure_policy
"recompute"), never a wrong answer.
Saves: `save_kv_layer` copies the step's completed store blocks out of the cache, layer by
layer; `wait_for_save` writes them with the store's writer (chained ids under the tenant salt,
atomic, checksummed) and the store's KV events go to the scheduler's block index
(`KvEventPublisher`, on a small event loop thread of its own), flushed before the step ends so
the agent's next turn finds them.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
from dataclasses import dataclass, field

import torch

from dualpath.config import ClusterConfig
from dualpath.integrations.vllm import blocks, cache, metrics
from dualpath.integrations.vllm.plan import LoadPlan, SavePlan, StepPlan

log = logging.getLogger(__name__)

_LAYER = re.compile(r"layers\.(\d+)\.")
FLUSH_TIMEOUT_S = 1.0  # events not acknowledged by then: the next turn may miss, never misread


def layer_index(layer_name: str) -> int:
    m = _LAYER.search(layer_name)
    if m is None:
        raise ValueError(f"vLLM layer {layer_name!r} has no 'layers.<i>.' in its name")
    return int(m.group(1))


@dataclass
class _Load:
    plan: LoadPlan
    handle: object  # kv.queue.LayerReadHandle
    slots: torch.Tensor
    loaded_until: int  # tokens loaded in every layer so far (shrinks on a failure)
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
    def __init__(
        self,
        cfg: ClusterConfig,
        storage: str,
        node_id: str,
        scheduler: str = "",
        token_file: str = "",
        tls_dir: str = "",
    ) -> None:
        self.cfg = cfg
        self.storage = storage
        self.node_id = node_id
        self.scheduler = scheduler
        self.token_file = token_file
        self.tls_dir = tls_dir
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
        log.info(
            "DualPath connector worker %s: %d layers, KV cache %s, store %s, scheduler %s",
            self.node_id,
            len(self._caches),
            tuple(t.shape),
            self.storage,
            self.scheduler or "none",
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

    def start_load(self, plan: StepPlan) -> None:
        self._loads = []
        for p in plan.loads:
            handle = self.read_queue.submit(p.block_ids)
            slots = torch.tensor(p.slots, dtype=torch.int64)
            self._loads.append(_Load(p, handle, slots, p.end - p.start))
            metrics.LOADS.labels(path=p.path).inc()

    def wait_for_layer(self, layer: int) -> None:
        """Block on `layer`'s read of every hit of this step, then copy it into the cache."""
        from dualpath.kv.queue import KVLoadError

        kv_layer = self._caches[layer]
        for ld in self._loads:
            if ld.loaded_until == 0:
                continue
            try:
                # the valid prefix: shorter than planned when a block failed validation
                k, v = ld.handle.layer_sync(layer)
            except KVLoadError:
                # a block of this layer failed its checksum or its read: the layers before
                # hold a longer prefix than this one can, so the whole hit is recomputed
                self._shorten(ld, 0)
                continue
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

    def finish_loads(self) -> None:
        for ld in self._loads:
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

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ---- saves --------------------------------------------------------------------------

    def save_layer(self, plan: StepPlan, layer: int, kv_layer: torch.Tensor) -> None:
        # vLLM may start the step's loads after its forward (no sync load this step): the saves
        # are bound to the plan here, on the forward's first layer, not in start_load_kv
        if self._save_plan is not plan:
            self._save_plan = plan
            self._saves = [_Save(p, torch.tensor(p.slots, dtype=torch.int64)) for p in plan.saves]
        for s in self._saves:
            s.layers[layer] = cache.read_tokens(kv_layer, s.slots)

    def wait_for_save(self) -> None:
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
