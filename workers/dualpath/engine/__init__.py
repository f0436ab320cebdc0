"""The workers' inference engine: model, layer-wise prefill, paged continuous-batching decode,
and the intra-node prefill cost model and batcher.

from dualpath.engine import Engine, SamplingParams, MemorySource

Exports load lazily (PEP 562): `dualpath.engine.cost` is pure (numpy only) and imports without
torch, so the scheduler and the simulator can price a prefill without the model's deps.
"""

from __future__ import annotations

from dualpath import lazy

_EXPORTS = {
    "BatchMember": "dualpath.engine.batch",
    "BatchPrefillRun": "dualpath.engine.batch",
    "PrefillRun": "dualpath.engine.batch",
    "load_checkpoint": "dualpath.engine.checkpoint",
    "load_model": "dualpath.engine.checkpoint",
    "save_checkpoint": "dualpath.engine.checkpoint",
    "spec_from_checkpoint": "dualpath.engine.checkpoint",
    "CacheFullError": "dualpath.engine.decode",
    "PagedKVCache": "dualpath.engine.decode",
    "SamplingParams": "dualpath.sampling",
    "StepOutput": "dualpath.engine.decode",
    "sample": "dualpath.engine.decode",
    "Engine": "dualpath.engine.engine",
    "TiledAttention": "dualpath.engine.model",
    "Transformer": "dualpath.engine.model",
    "configure_threads": "dualpath.engine.model",
    "EmptySource": "dualpath.engine.prefill",
    "LayerSource": "dualpath.engine.prefill",
    "MemorySource": "dualpath.engine.prefill",
    "ThrottledSource": "dualpath.engine.prefill",
}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy.exports(__name__, _EXPORTS)
