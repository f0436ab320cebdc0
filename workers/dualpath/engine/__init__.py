"""The workers' inference engine: model, layer-wise prefill, paged continuous-batching decode,
and the intra-node prefill cost model and batcher.

from dualpath.engine import Engine, SamplingParams, MemorySource
"""

from dualpath.engine.batch import BatchMember, BatchPrefillRun
from dualpath.engine.decode import CacheFullError, PagedKVCache, SamplingParams, StepOutput, sample
from dualpath.engine.engine import Engine
from dualpath.engine.model import (
    TiledAttention,
    Transformer,
    configure_threads,
    load_checkpoint,
    save_checkpoint,
    spec_from_checkpoint,
)
from dualpath.engine.prefill import (
    EmptySource,
    LayerSource,
    MemorySource,
    PrefillRun,
    ThrottledSource,
)

__all__ = [
    "BatchMember",
    "BatchPrefillRun",
    "CacheFullError",
    "EmptySource",
    "Engine",
    "LayerSource",
    "MemorySource",
    "PagedKVCache",
    "PrefillRun",
    "SamplingParams",
    "StepOutput",
    "ThrottledSource",
    "TiledAttention",
    "Transformer",
    "configure_threads",
    "load_checkpoint",
    "sample",
    "save_checkpoint",
    "spec_from_checkpoint",
]
