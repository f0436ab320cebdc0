"""Plain data the policy reads and returns. No I/O, no clocks, no globals.

The gRPC service, the local cluster and the simulator all build a `ClusterView` and call
`Policy.decide(request, view)`. Keep these types cheap: the decision path is hot.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple, Protocol

from dualpath.scheduler.policy.pools import DecodeGroup, PrefillRanking

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


@_tracks_changes
@dataclass(slots=True)
class NodeState:
    """What the scheduler knows of one worker node, refreshed by its heartbeats."""

    # Told of every change to the load fields and flags (`_tracks_changes`); set by the config
    # pool that ranks the node (`policy.pools.watch`). First, so __init__ sets it before them.
    _watch: PrefillRanking | DecodeGroup | None = field(
        default=None, init=False, repr=False, compare=False
    )
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
class ConfigPool:
    """The nodes of one config hash: only they pair with each other. Built per membership change."""

    config_hash: str
    prefill: list[NodeState]
    decode: list[NodeState]
    # Decode engines by group, sorted by group name (phase 1 of the decode choice).
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    # The prefill nodes in the paper's order, with each node's beta and alpha in its own units
    # (computed once per membership change, not per decision).
    prefill_ranking: PrefillRanking | None = None


@dataclass(slots=True)
class ClusterView:
    """Snapshot the policy decides over. Built by the caller, never mutated by the policy."""

    prefill: list[NodeState]
    decode: list[NodeState]
    thresholds: Thresholds = field(default_factory=Thresholds)
    # Path D's extra hop: decode buffer -> prefill over the compute NIC (kv traffic class).
    cnic_bytes_per_s: float = DEFAULT_CNIC_BYTES_PER_S
    # Order in which config hashes were first registered (higher: newer); equal loads go to the
    # newest hash. Hashes missing here rank by their first appearance in prefill + decode.
    config_hash_seq: dict[str, int] = field(default_factory=dict)
    # Nodes grouped by config hash, then decode group; built lazily. Call `membership_changed()`
    # after adding or removing nodes or changing a node's hash, group, SNIC bandwidth or prefill
    # throughput (health, draining and load are read per decision, never cached).
    _pools: list[ConfigPool] | None = None
    _pools_thresholds: Thresholds | None = None
    _by_id: dict[str, NodeState] | None = None

    def pools(self) -> list[ConfigPool]:
        """One pool per config hash, newest first."""
        if self._pools is None or self._pools_thresholds is not self.thresholds:
            self._pools = _build_pools(
                self.prefill, self.decode, self.config_hash_seq, self.thresholds
            )
            self._pools_thresholds = self.thresholds
        return self._pools

    def node(self, node_id: str) -> NodeState | None:
        if self._by_id is None:
            self._by_id = {n.node_id: n for n in (*self.prefill, *self.decode)}
        return self._by_id.get(node_id)

    def membership_changed(self) -> None:
        self._pools = None
        self._by_id = None


def _build_pools(
    prefill: list[NodeState], decode: list[NodeState], seq: dict[str, int], t: Thresholds
) -> list[ConfigPool]:
    by_hash: dict[str, ConfigPool] = {}
    for nodes, is_prefill in ((prefill, True), (decode, False)):
        for n in nodes:
            pool = by_hash.get(n.config_hash)
            if pool is None:
                pool = by_hash[n.config_hash] = ConfigPool(n.config_hash, [], [])
            (pool.prefill if is_prefill else pool.decode).append(n)
    first_seen = {h: i for i, h in enumerate(by_hash)}
    pools = sorted(
        by_hash.values(),
        key=lambda p: (seq.get(p.config_hash, -1), first_seen[p.config_hash]),
        reverse=True,
    )
    for pool in pools:
        groups: dict[str, list[NodeState]] = {}
        for n in pool.decode:
            groups.setdefault(n.group, []).append(n)
        pool.decode_groups = [
            DecodeGroup(name, members) for name, members in sorted(groups.items())
        ]
        pool.prefill_ranking = PrefillRanking(
            [
                (
                    n,
                    n.prefill_tokens_per_s * t.overloaded_prefill_s,
                    n.snic_bytes_per_s * t.short_read_queue_s,
                )
                for n in pool.prefill
            ]
        )
    return pools


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


class Policy(Protocol):
    """A scheduling policy: small, pure, selected by name (see `policy.get_policy`)."""

    name: str

    def decide(self, request: RouteRequest, view: ClusterView) -> Decision | None:
        """Pick (prefill node, decode node, read path); None means no node can take it now."""
        ...
