"""proto <-> domain for the scheduler's messages, in one place.

- `NodeLoad`: a worker's load (Register, every Heartbeat; ClusterView shows it back).
- `NodeState` from a `RegisterRequest`, with the defaults of a node that leaves a field out.
- `RouteRequest`: the frontend sends `route_fields(request)`, the service reads it back with
  `route_from_pb(message, hit_tokens)`; both sides mean by `context_bytes` the KV bytes of the
  whole prompt (`RouteRequest.for_turn` is the one place that computes it).
"""

from __future__ import annotations

from typing import Any

from dualpath.scheduler.policy.types import (
    DEFAULT_BUFFER_FREE_BYTES,
    DEFAULT_PREFILL_TOKENS_PER_S,
    DEFAULT_SNIC_BYTES_PER_S,
    NodeLoad,
    NodeState,
    RouteRequest,
)
from dualpath.v1 import scheduler_pb2 as pb

ROLE_FROM_PB = {pb.ROLE_PREFILL: "prefill", pb.ROLE_DECODE: "decode"}
ROLE_TO_PB = {role: value for value, role in ROLE_FROM_PB.items()}


def load_to_pb(load: NodeLoad) -> pb.NodeLoad:
    return pb.NodeLoad(**load._asdict())


def load_from_pb(msg: pb.NodeLoad) -> NodeLoad:
    return NodeLoad(
        msg.read_pending_bytes,
        msg.tokens_queued,
        msg.tokens_running,
        msg.requests_running,
        msg.buffer_free_bytes,
        msg.draining,
    )


def node_from_register(msg: pb.RegisterRequest) -> NodeState:
    """The scheduler's first view of a node. A field left out (0) takes the default: a
    registration may precede the node's first measurement of its buffer or throughput."""
    load = load_from_pb(msg.load)
    return NodeState(
        node_id=msg.node_id,
        role=ROLE_FROM_PB[msg.role],
        read_pending_bytes=load.read_pending_bytes,
        snic_bytes_per_s=msg.snic_bytes_per_s or DEFAULT_SNIC_BYTES_PER_S,
        tokens_queued=load.tokens_queued,
        tokens_running=load.tokens_running,
        requests_running=load.requests_running,
        buffer_free_bytes=load.buffer_free_bytes or DEFAULT_BUFFER_FREE_BYTES,
        prefill_tokens_per_s=msg.prefill_tokens_per_s or DEFAULT_PREFILL_TOKENS_PER_S,
        group=msg.group or "default",
        draining=load.draining,
    )


def route_fields(request: RouteRequest) -> dict[str, Any]:
    """The wire fields of a route request (the hit is the scheduler's to find: not sent)."""
    return {
        "request_id": request.request_id,
        "session_id": request.session_id,
        "prompt_tokens": request.prompt_tokens,
        "context_bytes": request.context_bytes,
        "max_new_tokens": request.max_new_tokens,
    }


def route_from_pb(msg: pb.RouteRequest, hit_tokens: int) -> RouteRequest:
    """The request the policy sees, with the hit the block index found; bytes per token come
    from the caller's own context size (its model's KV layout)."""
    return RouteRequest.for_turn(
        msg.request_id,
        msg.prompt_tokens,
        hit_tokens,
        msg.context_bytes // msg.prompt_tokens,
        msg.max_new_tokens,
        msg.session_id,
    )
