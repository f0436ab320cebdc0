"""The paper's inter-node scheduling (arXiv 2602.21548, DESIGN section 4), as pure functions.

Three choices per request, each over the nodes that are healthy and not draining:
- prefill node: skip overloaded nodes (more than beta seconds of queued prefill tokens); among
  the rest prefer a short read queue (less than alpha seconds of SNIC reading pending); ties by
  fewest tokens. No non-overloaded node: wait (None), the caller re-offers the request.
- decode node: phase 1 the group with fewest tokens; phase 2 within it the engines with buffer
  room for the whole context, preferring tok + len <= Z (fewest requests), else fewest tokens.
- read path: the side whose read queue reads this request's hit bytes first. Path D also
  streams the hit bytes decode -> prefill over the compute NIC; the stream is pipelined with the
  reads layer by layer, so path D finishes at max(read, stream).
"""

from __future__ import annotations

from dualpath.scheduler.policy.types import (
    ClusterView,
    NodeState,
    ReadPath,
    RouteRequest,
    Thresholds,
)

# Z slack of the paper's decode phase 2.
DECODE_BALANCE_SLACK = 1.05


def is_overloaded(node: NodeState, t: Thresholds) -> bool:
    return node.tokens > node.prefill_tokens_per_s * t.overloaded_prefill_s


def has_short_read_queue(node: NodeState, t: Thresholds) -> bool:
    return node.read_pending_bytes < node.snic_bytes_per_s * t.short_read_queue_s


def pick_prefill(view: ClusterView) -> NodeState | None:
    # Hot path: one pass, plain comparisons, no per-node allocation.
    t = view.thresholds
    beta_s, alpha_s = t.overloaded_prefill_s, t.short_read_queue_s
    short: NodeState | None = None
    short_tok = 0
    long: NodeState | None = None
    long_tok = 0
    for n in view.prefill:
        if not n.healthy or n.draining:
            continue
        tok = n.tokens_queued + n.tokens_running
        if tok > n.prefill_tokens_per_s * beta_s:
            continue  # overloaded
        if n.read_pending_bytes < n.snic_bytes_per_s * alpha_s:
            if short is None or tok < short_tok or (tok == short_tok and _before(n, short)):
                short, short_tok = n, tok
        elif long is None or tok < long_tok or (tok == long_tok and _before(n, long)):
            long, long_tok = n, tok
    return short if short is not None else long


def _before(a: NodeState, b: NodeState) -> bool:
    """Tie-break of equal token counts: shorter read queue, then node id (deterministic)."""
    if a.read_pending_bytes != b.read_pending_bytes:
        return a.read_pending_bytes < b.read_pending_bytes
    return a.node_id < b.node_id


def pick_decode(request: RouteRequest, view: ClusterView) -> NodeState | None:
    # Phase 1: the group with the fewest tokens (over its available engines).
    group, group_tok, group_n, engines = None, 0, 0, None
    for g, members in view.decode_groups().items():
        tok = 0
        cnt = 0
        for n in members:
            if n.healthy and not n.draining:
                tok += n.tokens_queued + n.tokens_running
                cnt += 1
        if cnt and (group is None or tok < group_tok or (tok == group_tok and g < group)):
            group, group_tok, group_n, engines = g, tok, cnt, members
    if engines is None:
        return None
    # Phase 2: engines with room; threshold Z balances tokens across the group's engines.
    length = request.prompt_tokens + request.max_new_tokens
    z = DECODE_BALANCE_SLACK * (length + group_tok) / group_n
    need = request.context_bytes
    fit: NodeState | None = None
    room: NodeState | None = None
    room_tok = 0
    for n in engines:
        if n.buffer_free_bytes < need or not n.healthy or n.draining:
            continue
        tok = n.tokens_queued + n.tokens_running
        if tok + length <= z and (
            fit is None
            or n.requests_running < fit.requests_running
            or (
                n.requests_running == fit.requests_running
                and (tok, n.node_id) < (fit.tokens_queued + fit.tokens_running, fit.node_id)
            )
        ):
            fit = n
        if room is None or tok < room_tok or (tok == room_tok and n.node_id < room.node_id):
            room, room_tok = n, tok
    return fit if fit is not None else room


def read_finish_s(request: RouteRequest, node: NodeState) -> float:
    """Seconds until `node`'s read queue has read this request's hit bytes (0: none)."""
    if request.hit_bytes <= 0:
        return 0.0
    return (node.read_pending_bytes + request.hit_bytes) / node.snic_bytes_per_s


def path_finish_s(
    request: RouteRequest, prefill: NodeState, decode: NodeState, view: ClusterView
) -> tuple[float, float]:
    """(path P finish, path D finish) estimates for this request on this pair."""
    via_p = read_finish_s(request, prefill)
    stream_s = request.hit_bytes / view.cnic_bytes_per_s if view.cnic_bytes_per_s > 0 else 0.0
    via_d = max(read_finish_s(request, decode), stream_s)
    return via_p, via_d


def pick_path(
    request: RouteRequest, prefill: NodeState, decode: NodeState, view: ClusterView
) -> tuple[ReadPath, float, float]:
    """The faster side; ties go to path P (no extra hop). Returns (path, chosen, other)."""
    via_p, via_d = path_finish_s(request, prefill, decode, view)
    if via_d < via_p:
        return ReadPath.DECODE, via_d, via_p
    return ReadPath.PREFILL, via_p, via_d
