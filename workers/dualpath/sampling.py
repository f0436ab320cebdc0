"""How a turn's tokens are sampled: one object from the HTTP request to the engine.

The frontend's admission builds it from the request (`frontend/admission.py`), the worker's
wire module sends and reads it (`worker/wire.py`: the only place its fields meet protobuf), and
the engine samples with it (`engine/decode.py`), as vLLM's and SGLang's `SamplingParams`
travel whole. Pure: no torch, so the frontend carries it too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_STOP_TOKENS = 1024  # stop ids of one request (a tokenizer's special tokens, a few words')


class SamplingError(ValueError):
    """A sampling field out of its range: `field` names it, `reason` says the range."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field} {reason}")
        self.field, self.reason = field, reason


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Checked on construction; an error names the field (the wire's names are the same)."""

    temperature: float = 0.0  # 0 = greedy
    max_tokens: int = 16
    stop_tokens: tuple[int, ...] = ()
    seed: int = 0  # of the sampler when temperature > 0
    top_p: float = 1.0  # nucleus: the smallest set of ids holding this probability; 1 = off
    top_k: int = 0  # the k most likely ids only; 0 = off
    min_tokens: int = 0  # stop tokens cannot be sampled before this many are generated

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise SamplingError("temperature", f"must be >= 0 (0 = greedy); got {self.temperature}")
        if self.max_tokens < 1:
            raise SamplingError("max_tokens", f"must be >= 1; got {self.max_tokens}")
        if not 0 < self.top_p <= 1:  # NaN fails too
            raise SamplingError("top_p", f"must be in (0, 1] (1 = off); got {self.top_p}")
        if self.top_k < 0:
            raise SamplingError("top_k", f"must be >= 0 (0 = off); got {self.top_k}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise SamplingError(
                "min_tokens", f"must be in [0, max_tokens={self.max_tokens}]; got {self.min_tokens}"
            )
        if len(self.stop_tokens) > MAX_STOP_TOKENS:
            raise SamplingError(
                "stop_tokens", f"has {len(self.stop_tokens)} ids; at most {MAX_STOP_TOKENS}"
            )
