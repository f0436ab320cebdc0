"""The frontend's view of the cluster: "route then generate" as one small interface.

`Backend.generate(TurnRequest)` yields `Routed` once, then `Tokens` chunks, then `Finished`.
`GrpcBackend` is the real thing (scheduler Route -> decode worker Generate -> Complete);
`FakeBackend` is a first-class in-memory implementation (deterministic greedy "model", a
block-id prefix store) used by unit tests and for trying the HTTP surface without a cluster.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client.registry import Collector

from dualpath.config import ModelSpec
from dualpath.kv.ids import block_ids
from dualpath.sampling import SamplingParams

log = logging.getLogger(__name__)


class BackendError(Exception):
    """The cluster could not serve the turn; `status` is the HTTP status to answer with (429:
    overloaded), `retry_after_s` when a retry later may succeed (the `Retry-After` header)."""

    def __init__(self, message: str, status: int = 503, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s


@dataclass(slots=True)
class TurnRequest:
    request_id: str
    session_id: str
    prompt_ids: list[int]
    sampling: SamplingParams  # travels whole to the engine (max_tokens, stops, sampler)
    cache_salt: bytes = b""  # seeds the block-id chain (auth.cache_salt); b"": shared cache


@dataclass(slots=True)
class Routed:
    request_id: str
    prefill_node: str
    decode_node: str
    read_path: str  # "prefill" | "decode" | "none"
    hit_tokens: int
    policy: str


@dataclass(slots=True)
class Tokens:
    ids: list[int]


@dataclass(slots=True)
class Finished:
    reason: str  # "stop" | "length"
    generated: int


Event = Routed | Tokens | Finished


class Backend(Protocol):
    collectors: Sequence[Collector]  # its own metrics, served on the app's /metrics

    async def start(self) -> None: ...
    async def close(self) -> None: ...
    async def health(self) -> tuple[bool, str]: ...
    def generate(self, req: TurnRequest) -> AsyncIterator[Event]: ...


def greedy_next(model: ModelSpec, context: list[int]) -> int:
    """The fake model: a deterministic function of the last 8 tokens (never a special id)."""
    h = hashlib.blake2b(repr(context[-8:]).encode(), digest_size=8).digest()
    return 4 + int.from_bytes(h, "little") % (min(model.vocab_size, 260) - 4)


@dataclass
class FakeBackend:
    """In-memory cluster: one prefix store keyed by `block_ids`, alternating read paths."""

    model: ModelSpec
    policy: str = "dualpath"
    delay_s: float = 0.0
    healthy: bool = True
    stored: set[str] = field(default_factory=set)
    turns: list[Routed] = field(default_factory=list)
    collectors: tuple[Collector, ...] = ()
    _counter: itertools.count = field(default_factory=itertools.count)

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def health(self) -> tuple[bool, str]:
        return (self.healthy, "ok" if self.healthy else "fake backend marked unhealthy")

    def hit_tokens(self, ids: list[int], salt: bytes = b"") -> int:
        hit = 0
        for bid in block_ids(ids, self.model, salt=salt):
            if bid not in self.stored:
                break
            hit += self.model.block_tokens
        return hit

    async def generate(self, req: TurnRequest) -> AsyncIterator[Event]:
        if not self.healthy:
            raise BackendError("no healthy decode node")
        n = next(self._counter)
        hit = self.hit_tokens(req.prompt_ids, req.cache_salt)
        path = (
            "none"
            if hit == 0
            else (
                "decode"
                if self.policy == "dualpath" and n % 2
                else "decode"
                if self.policy == "decode-read"
                else "prefill"
            )
        )
        routed = Routed(req.request_id, "prefill-0", f"decode-{n % 2}", path, hit, self.policy)
        self.turns.append(routed)
        yield routed
        ctx = list(req.prompt_ids)
        reason = "length"
        sampling = req.sampling
        for _ in range(sampling.max_tokens):
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            tok = greedy_next(self.model, ctx)
            ctx.append(tok)
            yield Tokens([tok])
            if (
                tok in sampling.stop_tokens
                and len(ctx) - len(req.prompt_ids) >= sampling.min_tokens
            ):
                reason = "stop"
                break
        self.stored.update(block_ids(ctx, self.model, salt=req.cache_salt))
        yield Finished(reason, len(ctx) - len(req.prompt_ids))
