"""The snapshot the policy decides over: the nodes, grouped per config hash into pools.

The gRPC service, the local cluster and the simulator all build a `ClusterView` and call
`Policy.decide(request, view)`. The pools are built once per membership change; their rankings
(`pools.py`) follow the nodes' loads between decisions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dualpath.scheduler.policy.pools import DecodeGroup, PrefillRanking
from dualpath.scheduler.policy.types import DEFAULT_CNIC_BYTES_PER_S, NodeState, Thresholds


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
