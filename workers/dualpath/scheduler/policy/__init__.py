"""Scheduling policy: pure, synchronous, no I/O. One code path for service, local cluster, sim.

    policy = get_policy("dualpath")
    decision = policy.decide(request, view)   # None: no node can take it now, re-offer later
    account(view, request, decision)          # what the caller does until the next heartbeat

A prefill node pairs only with a decode node of its own config hash (`ClusterView.pools()`,
`pick_pair`); after a None, `config_mismatch(view)` tells load apart from a missing pair.
"""

from __future__ import annotations

from dualpath.scheduler.policy.inter_node import config_mismatch, pick_pair
from dualpath.scheduler.policy.policies import DualPathPolicy, FixedPathPolicy, RoundRobinPolicy
from dualpath.scheduler.policy.types import (
    ClusterView,
    ConfigPool,
    Decision,
    NodeState,
    Policy,
    ReadPath,
    RouteRequest,
    Thresholds,
)

POLICY_NAMES = ("dualpath", "prefill-read", "decode-read", "round-robin")


def get_policy(name: str) -> Policy:
    """A fresh policy instance by name (policies are plain instances, never singletons)."""
    if name == "dualpath":
        return DualPathPolicy()
    if name == "prefill-read":
        return FixedPathPolicy("prefill-read", ReadPath.PREFILL)
    if name == "decode-read":
        return FixedPathPolicy("decode-read", ReadPath.DECODE)
    if name == "round-robin":
        return RoundRobinPolicy()
    raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")


def thresholds_from_spec(spec) -> Thresholds:  # spec: dualpath.config.SchedulerSpec
    return Thresholds(
        short_read_queue_s=float(spec.short_read_queue_seconds),
        overloaded_prefill_s=float(spec.overloaded_prefill_seconds),
    )


def account(view: ClusterView, request: RouteRequest, decision: Decision) -> None:
    """Charge a routed request to its nodes until their next heartbeat replaces the numbers.

    Without this a burst between two heartbeats would all go to the same least-loaded node.
    """
    p, d = view.node(decision.prefill_node), view.node(decision.decode_node)
    reader = d if decision.read_path is ReadPath.DECODE else p
    if reader is not None:
        reader.read_pending_bytes += request.hit_bytes
    if p is not None:
        p.tokens_queued += request.new_tokens
    if d is not None:
        d.tokens_queued += request.prompt_tokens + request.max_new_tokens
        d.requests_running += 1
        d.buffer_free_bytes -= request.context_bytes


__all__ = [
    "POLICY_NAMES",
    "ClusterView",
    "ConfigPool",
    "Decision",
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
