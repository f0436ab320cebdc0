"""Plain data the policy reads and returns: a node's state and load, a request, a decision.
No I/O, no clocks, no globals, and nothing of the policy's own (the pools that rank the nodes,
`pools.py`, and the view that groups them, `view.py`, sit above these types). Keep them cheap:
the decision path is hot.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple, Protocol

# What the scheduler assumes of a node or a cluster that does not say (a registration without
# the field, a view without a configured CNIC). One definition: NodeState, ClusterView, the
# gRPC service (`scheduler.wire`) and the scheduler CLI read these.
DEFAULT_SNIC_BYTES_PER_S = 1.0e9
DEFAULT_CNIC_BYTES_PER_S = 25.0e9
DEFAULT_BUFFER_FREE_BYTES = 1 << 40
DEFAULT_PREFILL_TOKENS_PER_S = 10_000.0


class ReadPath(str, Enum):
    """Which node's storage NIC reads the request's hit KV blocks."""

    PREFILL = "prefill"  # path P: the prefill node reads from storage (today's systems)
    DECODE = "decode"  # path D: the decode node reads, then streams layer-wise to prefill


# The load fields the node choice reads; a change to one tells the node's watcher (`pools`).
_LOAD_FIELDS = ("read_pending_bytes", "tokens_queued", "tokens_running", "buffer_free_bytes")
_FLAGS = ("healthy", "draining", "held")


def _tracks_changes(cls: type) -> type:
    """The load fields and the flags `healthy`, `draining`, `held` become properties whose
    setters tell the node's watcher (`_watch`: the structure of its config pool that ranks it,
    `policy.pools`), so a decision reads only the nodes that changed since the last one. The
    flags' setters also keep `available` (a plain slot) equal to healthy and not draining and
    not held.

    Each field's slot stays reachable as `_<field>` (e.g. `_tokens_queued`): a plain slot,
    about 9x faster to read than the property. The policy's hot loops read those, and
    `policy.account` writes them and tells the watcher once per node. Everyone else reads and
    writes the public names.
    """
    available = cls.__dict__["available"]
    slots = {name: cls.__dict__[name] for name in (*_LOAD_FIELDS, *_FLAGS)}
    healthy, draining, held = (slots[n].__get__ for n in _FLAGS)

    def load(slot):  # noqa: ANN001, ANN202 (a slot's member descriptor)
        put = slot.__set__

        def fset(self, value) -> None:  # noqa: ANN001
            put(self, value)
            w = self._watch
            if w is not None:
                w.touch(self)

        return property(slot.__get__, fset)

    def flag(slot):  # noqa: ANN001, ANN202
        put = slot.__set__

        def fset(self, value) -> None:  # noqa: ANN001
            put(self, value)
            try:
                ok = healthy(self) and not draining(self) and not held(self)
            except AttributeError:
                return  # __init__ has not set them all yet: the last one will
            available.__set__(self, ok)
            w = self._watch
            if w is not None:
                w.touch(self)

        return property(slot.__get__, fset)

    for name, slot in slots.items():
        setattr(cls, f"_{name}", slot)
        setattr(cls, name, (flag if name in _FLAGS else load)(slot))
    return cls


class LoadWatcher(Protocol):
    """What a node tells of its load changes (`NodeState._watch`): the config pool's ranking
    or decode group that holds it (`pools.PrefillRanking`, `pools.DecodeGroup`)."""

    def touch(self, node: NodeState) -> None: ...

    def orphan(self) -> None: ...

    def charged(self, node: NodeState, tokens: int, old_free: int) -> None: ...


@_tracks_changes
@dataclass(slots=True)
class NodeState:
    """What the scheduler knows of one worker node, refreshed by its heartbeats."""

    # Told of every change to the load fields and flags (`_tracks_changes`); set by the config
    # pool that ranks the node (`policy.pools.watch`). First, so __init__ sets it before them.
    _watch: LoadWatcher | None = field(default=None, init=False, repr=False, compare=False)
    node_id: str
    role: str  # "prefill" | "decode"
    # Read queue (the node's SNIC): bytes admitted but not yet read, and its bandwidth.
    read_pending_bytes: int = 0
    snic_bytes_per_s: float = DEFAULT_SNIC_BYTES_PER_S
    # Load indicator: tokens waiting and in flight on this node.
    tokens_queued: int = 0
    tokens_running: int = 0
    requests_running: int = 0
    # KV host/device buffer space left (decode: holds whole contexts; path D stages here).
    buffer_free_bytes: int = DEFAULT_BUFFER_FREE_BYTES
    # Prefill throughput of this node (tokens/s); the overload threshold is seconds of it.
    prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S
    # Decode engines are grouped (e.g. one group per decode pod set); phase 1 picks a group.
    group: str = "default"
    # Hash of the node's rendered config: prefill and decode nodes pair only within one hash,
    # so a rollout never mixes versions (docs/design.md section 9). "" (local runs) pairs with "".
    config_hash: str = ""
    # The one filter before the policy: healthy, not draining, not held. Every policy choice
    # skips a node for which it is False. Kept by the setters of the three flags below.
    available: bool = field(default=True, init=False, compare=False)
    healthy: bool = True
    draining: bool = False
    # Kept out of routing by the scheduler's state: its circuit breaker is open (failed
    # completions), or the request being decided excludes it (a retry). Set before `decide`.
    held: bool = False

    @property
    def tokens(self) -> int:
        return self.tokens_queued + self.tokens_running

    @property
    def load(self) -> NodeLoad:
        return NodeLoad(
            self.read_pending_bytes,
            self.tokens_queued,
            self.tokens_running,
            self.requests_running,
            self.buffer_free_bytes,
            self.draining,
        )


class NodeLoad(NamedTuple):
    """A worker's load as it reports it (Register, every Heartbeat) and ClusterView shows it;
    `scheduler.wire` converts it to and from the proto `NodeLoad`."""

    read_pending_bytes: int = 0
    tokens_queued: int = 0
    tokens_running: int = 0
    requests_running: int = 0
    buffer_free_bytes: int = 0
    draining: bool = False


@dataclass(slots=True, frozen=True)
class Thresholds:
    """The paper's alpha and beta, in seconds of the node's own bandwidth / throughput."""

    short_read_queue_s: float = 3.0  # alpha: read queue "short" under this many s of SNIC reading
    overloaded_prefill_s: float = 5.0  # beta: prefill "overloaded" above this many s of tokens


@dataclass(slots=True)
class RouteRequest:
    """One agent turn as the scheduler sees it. Build it with `RouteRequest.for_turn`, the one
    place that turns tokens into bytes (the service, the frontend and the simulator do)."""

    request_id: str
    prompt_tokens: int  # whole context of this turn
    hit_tokens: int  # prefix already in storage (whole blocks)
    hit_bytes: int  # bytes of those blocks to read (all layers)
    # KV bytes of the whole prompt: what the decode node holds after prefill (the wire's
    # `RouteRequest.context_bytes` means the same; generated tokens are not in it).
    context_bytes: int = 0
    max_new_tokens: int = 0
    session_id: str = ""

    @classmethod
    def for_turn(
        cls,
        request_id: str,
        prompt_tokens: int,
        hit_tokens: int,
        kv_bytes_per_token: int,
        max_new_tokens: int = 0,
        session_id: str = "",
        weight: int = 1,
    ) -> RouteRequest:
        """A turn of `prompt_tokens` (of which `hit_tokens` are in storage) that may generate
        `max_new_tokens`. `weight` > 1: the turn stands for that many identical turns (the
        simulator's agent groups), so every token and byte count is scaled by it."""
        prompt, hit = prompt_tokens * weight, hit_tokens * weight
        return cls(
            request_id,
            prompt,
            hit,
            hit * kv_bytes_per_token,
            prompt * kv_bytes_per_token,
            max_new_tokens * weight,
            session_id,
        )

    @property
    def new_tokens(self) -> int:
        return self.prompt_tokens - self.hit_tokens


class Decision(NamedTuple):
    """Immutable; a named tuple because it is built once per decision (a frozen dataclass's
    `__init__` costs about 1 us of the ~15 us budget)."""

    request_id: str
    prefill_node: str
    decode_node: str
    read_path: ReadPath
    # Estimated seconds until the chosen side's read queue has read this request's bytes,
    # and the same for the other side (for metrics and property tests).
    est_read_finish_s: float = 0.0
    est_other_finish_s: float = 0.0
    reason: str = ""
