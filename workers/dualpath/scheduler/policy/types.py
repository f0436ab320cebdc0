"""Plain data the policy reads and returns. No I/O, no clocks, no globals.

The gRPC service, the local cluster and the simulator all build a `ClusterView` and call
`Policy.decide(request, view)`. Keep these types cheap: the decision path is hot.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol


class ReadPath(str, Enum):
    """Which node's storage NIC reads the request's hit KV blocks."""

    PREFILL = "prefill"  # path P: the prefill node reads from storage (today's systems)
    DECODE = "decode"  # path D: the decode node reads, then streams layer-wise to prefill


@dataclass(slots=True)
class NodeState:
    """What the scheduler knows of one worker node, refreshed by its heartbeats."""

    node_id: str
    role: str  # "prefill" | "decode"
    # Read queue (the node's SNIC): bytes admitted but not yet read, and its bandwidth.
    read_pending_bytes: int = 0
    snic_bytes_per_s: float = 1.0e9
    # Load indicator: tokens waiting and in flight on this node.
    tokens_queued: int = 0
    tokens_running: int = 0
    requests_running: int = 0
    # KV host/device buffer space left (decode: holds whole contexts; path D stages here).
    buffer_free_bytes: int = 1 << 40
    # Prefill throughput of this node (tokens/s); the overload threshold is seconds of it.
    prefill_tokens_per_s: float = 10_000.0
    # Decode engines are grouped (e.g. one group per decode pod set); phase 1 picks a group.
    group: str = "default"
    healthy: bool = True
    draining: bool = False

    @property
    def tokens(self) -> int:
        return self.tokens_queued + self.tokens_running

    @property
    def available(self) -> bool:
        return self.healthy and not self.draining


@dataclass(slots=True)
class Thresholds:
    """The paper's alpha and beta, in seconds of the node's own bandwidth / throughput."""

    short_read_queue_s: float = 3.0  # alpha: read queue "short" under this many s of SNIC reading
    overloaded_prefill_s: float = 5.0  # beta: prefill "overloaded" above this many s of tokens


@dataclass(slots=True)
class ClusterView:
    """Snapshot the policy decides over. Built by the caller, never mutated by the policy."""

    prefill: list[NodeState]
    decode: list[NodeState]
    thresholds: Thresholds = field(default_factory=Thresholds)
    # Path D's extra hop: decode buffer -> prefill over the compute NIC (kv traffic class).
    cnic_bytes_per_s: float = 25.0e9
    # Decode engines by group, built lazily; call `membership_changed()` after adding or
    # removing nodes (health and draining are read per decision, not cached).
    _decode_groups: dict[str, list[NodeState]] | None = None

    def decode_groups(self) -> dict[str, list[NodeState]]:
        if self._decode_groups is None:
            groups: dict[str, list[NodeState]] = {}
            for n in self.decode:
                groups.setdefault(n.group, []).append(n)
            self._decode_groups = groups
        return self._decode_groups

    def membership_changed(self) -> None:
        self._decode_groups = None


@dataclass(slots=True)
class RouteRequest:
    """One agent turn as the scheduler sees it."""

    request_id: str
    prompt_tokens: int  # whole context of this turn
    hit_tokens: int  # prefix already in storage (whole blocks)
    hit_bytes: int  # bytes of those blocks to read (all layers)
    context_bytes: int = 0  # KV bytes of the whole context on the decode node after prefill
    max_new_tokens: int = 0
    session_id: str = ""

    @property
    def new_tokens(self) -> int:
        return self.prompt_tokens - self.hit_tokens


@dataclass(slots=True, frozen=True)
class Decision:
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
