"""`Engine`: what a worker process holds — the model, a paged KV cache, one compute thread.

    engine = Engine(ModelSpec(preset="small"))
    run = engine.prefill(new_tokens, hit_tokens, source)        # prefill worker
    kv_new, logits = await run.collect()
    first = engine.add_sequence("r1", hit_kv + new_kv, logits[-1], SamplingParams(max_tokens=64))
    while engine.running: outs = await engine.astep()           # decode worker
    engine.free("r1")

All compute runs on the engine's single compute thread (torch releases the GIL), so the asyncio
loop keeps receiving KV layers and serving RPCs, and results are deterministic.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
from collections.abc import Sequence

import torch

from dualpath.config import ModelSpec
from dualpath.engine.batch import BatchPrefillRun, BatchRequest, PrefillRun
from dualpath.engine.checkpoint import load_model
from dualpath.engine.decode import (
    PagedKVCache,
    SamplingParams,
    Sequence_,
    StepOutput,
    decode_forward,
    sample,
)
from dualpath.engine.model import Transformer, configure_threads
from dualpath.engine.prefill import LayerKV, LayerSource

log = logging.getLogger(__name__)


class Engine:
    def __init__(
        self,
        spec: ModelSpec,
        model: Transformer | None = None,
        kv_capacity_tokens: int = 8192,
        page_tokens: int | None = None,
        threads: int | None = None,
    ) -> None:
        self.threads = configure_threads(threads)
        self.spec = spec
        self.model = model or load_model(spec)
        self.model.min_pack_rows  # noqa: B018 -- measured now, not in a batch's first step
        self.cache = PagedKVCache(self.model, kv_capacity_tokens, page_tokens or spec.block_tokens)
        self.executor = cf.ThreadPoolExecutor(1, thread_name_prefix="engine-compute")
        self.sequences: dict[str, Sequence_] = {}
        log.info(
            "engine %s: %d layers, kv cache %d pages x %d tokens, %d torch threads",
            spec.name,
            spec.layers,
            self.cache.pages,
            self.cache.page_tokens,
            self.threads,
        )

    # ---- prefill ----------------------------------------------------------------------------

    def prefill(
        self,
        tokens: Sequence[int] | torch.Tensor,
        hit_tokens: int = 0,
        source: LayerSource | None = None,
        all_logits: bool = False,
    ) -> PrefillRun:
        """New tokens at positions hit_tokens.., attending to the hit KV `source` delivers."""
        return PrefillRun(self.model, self.executor, tokens, hit_tokens, source, all_logits)

    def prefill_batch(
        self, requests: Sequence[BatchRequest], all_logits: bool = False
    ) -> BatchPrefillRun:
        """Several (tokens, hit_tokens, source) prefills as one forward; each member's output
        is bit-identical to `prefill` of it alone (engine/batch.py)."""
        return BatchPrefillRun(self.model, self.executor, requests, all_logits)

    # ---- decode -----------------------------------------------------------------------------

    @property
    def running(self) -> list[str]:
        return [s for s, q in self.sequences.items() if not q.finished]

    def add_sequence(
        self,
        seq_id: str,
        kv_layers: Sequence[LayerKV],
        logits: torch.Tensor,
        params: SamplingParams | None = None,
    ) -> StepOutput:
        """Admit a prefilled sequence: its whole context's KV per layer and the last logits.

        Samples and returns the first generated token (which may already finish it).
        """
        if seq_id in self.sequences:
            raise ValueError(f"sequence {seq_id!r} already in the engine; free it first")
        if len(kv_layers) != self.spec.layers:
            raise ValueError(
                f"kv_layers has {len(kv_layers)} layers; the model has {self.spec.layers}"
            )
        params = params or SamplingParams()
        length = kv_layers[0][0].shape[0]
        pages = self.cache.allocate(self.cache.pages_for(length + params.max_tokens))
        self.cache.write(pages, 0, kv_layers)
        gen = torch.Generator().manual_seed(params.seed) if params.temperature > 0 else None
        seq = Sequence_(seq_id, params, length, pages, last_token=-1, generator=gen)
        self.sequences[seq_id] = seq
        return self._emit(seq, sample(logits, params, gen))

    def _emit(self, seq: Sequence_, token: int) -> StepOutput:
        seq.last_token = token
        seq.generated.append(token)
        reason = None
        if token in seq.params.stop_tokens:
            reason = "stop"
        elif len(seq.generated) >= seq.params.max_tokens:
            reason = "length"
        seq.finished = reason is not None
        return StepOutput(seq.seq_id, token, seq.finished, reason)

    def step(self) -> list[StepOutput]:
        """One continuous-batching decode step over every running sequence (compute thread)."""
        seqs = [q for q in self.sequences.values() if not q.finished]
        if not seqs:
            return []
        with torch.no_grad():
            logits = decode_forward(self.model, self.cache, seqs)
        outs = []
        for i, q in enumerate(seqs):
            q.length += 1
            outs.append(self._emit(q, sample(logits[i], q.params, q.generator, len(q.generated))))
        return outs

    async def astep(self) -> list[StepOutput]:
        return await asyncio.get_running_loop().run_in_executor(self.executor, self.step)

    def tokens(self, seq_id: str) -> list[int]:
        return list(self.sequences[seq_id].generated)

    def sequence_kv(self, seq_id: str, start: int = 0) -> list[LayerKV]:
        """Cached KV of a sequence (context + generated tokens fed so far) from token
        `start` on, per layer."""
        q = self.sequences[seq_id]
        return self.cache.read(q.pages, q.length, start)

    def free(self, seq_id: str) -> None:
        q = self.sequences.pop(seq_id, None)
        if q is not None:
            self.cache.release(q.pages)

    def close(self) -> None:
        self.executor.shutdown(wait=True)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
