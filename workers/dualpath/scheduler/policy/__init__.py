"""Scheduling policy: pure, synchronous, no I/O. One code path for service, local cluster, sim.

    policy = get_policy("dualpath")
    decision = policy.decide(request, view)   # None: no node can take it now, re-offer later
    account(view, request, decision)          # what the caller does until the next heartbeat

A prefill node pairs only with a decode node of its own config hash (`ClusterView.pools()`,
`pick_pair`); after a None, `config_mismatch(view)` tells load apart from a missing pair.
"""

from __future__ import annotations

from collections.abc import Callable

from dualpath.config import PolicyName
from dualpath.scheduler.policy.inter_node import config_mismatch, pick_pair
from dualpath.scheduler.policy.policies import (
    DualPathPolicy,
    FixedPathPolicy,
    Policy,
    RoundRobinPolicy,
)
from dualpath.scheduler.policy.types import (
    DEFAULT_BUFFER_FREE_BYTES,
    DEFAULT_CNIC_BYTES_PER_S,
    DEFAULT_PREFILL_TOKENS_PER_S,
    DEFAULT_SNIC_BYTES_PER_S,
    Decision,
    NodeLoad,
    NodeState,
    ReadPath,
    RouteRequest,
    Thresholds,
)
from dualpath.scheduler.policy.view import ClusterView, ConfigPool

# The one registry of policies: name -> factory, over the config model's names (`PolicyName`,
# the CRD's enum, below this package); the CLIs and `get_policy` read it.
POLICIES: dict[str, Callable[[], Policy]] = {
    PolicyName.DUALPATH.value: DualPathPolicy,
    PolicyName.PREFILL_READ.value: lambda: FixedPathPolicy("prefill-read", ReadPath.PREFILL),
    PolicyName.DECODE_READ.value: lambda: FixedPathPolicy("decode-read", ReadPath.DECODE),
    PolicyName.ROUND_ROBIN.value: RoundRobinPolicy,
}
POLICY_NAMES = tuple(POLICIES)
if set(POLICY_NAMES) != {p.value for p in PolicyName}:  # a name without a class, or the reverse
    raise ImportError(f"policy registry {POLICY_NAMES} != config.PolicyName {list(PolicyName)}")


def get_policy(name: str) -> Policy:
    """A fresh policy instance by name (policies are plain instances, never singletons)."""
    factory = POLICIES.get(name)
    if factory is None:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
    return factory()


def thresholds_from_spec(spec) -> Thresholds:  # spec: dualpath.config.SchedulerSpec
    """alpha and beta from the cluster spec: the one derivation (scheduler, sim, local)."""
    return Thresholds(
        short_read_queue_s=float(spec.short_read_queue_seconds),
        overloaded_prefill_s=float(spec.overloaded_prefill_seconds),
    )


def account(view: ClusterView, request: RouteRequest, decision: Decision) -> None:
    """Charge a routed request to its nodes until their next heartbeat replaces the numbers.

    Without this a burst between two heartbeats would all go to the same least-loaded node.
    """
    p, d = view.node(decision.prefill_node), view.node(decision.decode_node)
    # The slots themselves (`NodeState._tracks_changes`), then one `touch` per node: this runs
    # on every Route, and five property setters would cost it more than the decision's reads.
    reader = d if decision.read_path is ReadPath.DECODE else p
    if reader is not None:
        reader._read_pending_bytes += request.hit_bytes
    if p is not None:
        p._tokens_queued += request.new_tokens
        if p._watch is not None:
            p._watch.touch(p)
    if d is not None:
        tokens, free = request.prompt_tokens + request.max_new_tokens, d._buffer_free_bytes
        d._tokens_queued += tokens
        d.requests_running += 1
        d._buffer_free_bytes = free - request.context_bytes
        if d._watch is not None:  # its group's totals follow the charge, mostly unsummed
            d._watch.charged(d, tokens, free)


__all__ = [
    "DEFAULT_BUFFER_FREE_BYTES",
    "DEFAULT_CNIC_BYTES_PER_S",
    "DEFAULT_PREFILL_TOKENS_PER_S",
    "DEFAULT_SNIC_BYTES_PER_S",
    "POLICIES",
    "POLICY_NAMES",
    "ClusterView",
    "ConfigPool",
    "Decision",
    "NodeLoad",
    "NodeState",
    "Policy",
    "ReadPath",
    "RouteRequest",
    "Thresholds",
    "account",
    "config_mismatch",
    "get_policy",
    "pick_pair",
    "thresholds_from_spec",
]
