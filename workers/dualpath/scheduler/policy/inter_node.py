"""The paper's inter-node scheduling (arXiv 2602.21548, docs/design.md section 4), as pure functions.

Three choices per request, each over the available nodes (`NodeState.available`: healthy, not
draining, not held by the scheduler's breaker or a retry's exclusion) and, for the pair, of one
config hash (`pick_pair`; docs/design.md section 9: versions never pair):
- prefill node: skip overloaded nodes (more than beta seconds of queued prefill tokens); among
  the rest prefer a short read queue (less than alpha seconds of SNIC reading pending); ties by
  fewest tokens. No non-overloaded node: wait (None), the caller re-offers the request.
- decode node: phase 1 the group with fewest tokens; phase 2 within it the engines with buffer
  room for the whole context, preferring tok + len <= Z (fewest requests), else fewest tokens.
  A least-loaded group without room gives way to the least-loaded group with room.
- read path: the side whose read queue reads this request's hit bytes first. Path D also
  streams the hit bytes decode -> prefill over the compute NIC; the stream is pipelined with the
  reads layer by layer, so path D finishes at max(read, stream).
"""

from __future__ import annotations

from dualpath.scheduler.policy.pools import DecodeGroup
from dualpath.scheduler.policy.types import NodeState, ReadPath, RouteRequest, Thresholds
from dualpath.scheduler.policy.view import ClusterView

# Z slack of the paper's decode phase 2.
DECODE_BALANCE_SLACK = 1.05
_NO_TOKENS = 1 << 62  # more tokens than any group has: the first group with room beats it


def is_overloaded(node: NodeState, t: Thresholds) -> bool:
    return node.tokens > node.prefill_tokens_per_s * t.overloaded_prefill_s


def has_short_read_queue(node: NodeState, t: Thresholds) -> bool:
    return node.read_pending_bytes < node.snic_bytes_per_s * t.short_read_queue_s


def pick_pair(request: RouteRequest, view: ClusterView) -> tuple[NodeState, NodeState] | None:
    """The (prefill, decode) pair of every load-aware policy; both of one config hash. None: wait.

    Each config pool's best prefill node competes by the paper's rule (short read queue first,
    then fewest tokens, then shorter read queue); equal ones go to the newest hash. The winner's
    pool must have a decode engine with room, else the next pool's best tries. So a rollout is
    load-balanced over every version that has a full pair, never mixes two, and a version with
    only prefill (or only decode) nodes up gets nothing yet. Each pool keeps its prefill order
    and decode group totals up to date as loads change (`policy.pools`), so a decision reads
    the few nodes that changed since the last one, not every node.
    """
    pools = view.pools()
    if len(pools) == 1:  # the common case: one config, no rollout in progress
        pool = pools[0]
        c = pool.prefill_ranking.best()
        if c is None:
            return None
        d = pick_decode(request, pool.decode_groups)
        return None if d is None else (c[0], d)
    ranked = []
    for rank, pool in enumerate(pools):  # newest first
        if not pool.decode:
            continue
        c = pool.prefill_ranking.best()
        if c is not None:
            p, short, tok = c
            ranked.append(((not short, tok, p.read_pending_bytes, rank), p, pool))
    ranked.sort(key=lambda r: r[0])
    for _, p, pool in ranked:
        d = pick_decode(request, pool.decode_groups)
        if d is not None:
            return p, d
    return None


def pick_decode(request: RouteRequest, groups: list[DecodeGroup]) -> NodeState | None:
    """The paper's decode choice over one config pool's groups; None: no engine has room.

    Phase 1 takes the group with the fewest tokens (over its available engines). The paper's
    group would queue a request until memory frees up; a router has no such queue, so a
    least-loaded group without an engine that has room for the context gives way to the
    least-loaded group that has one. That is one rule, "the least-loaded group with room",
    found in one pass over the groups' totals (the least-loaded group, when it has room, is
    also the first of them).
    """
    need = request.context_bytes
    best: DecodeGroup | None = None
    best_tok = _NO_TOKENS
    for g in groups:  # sorted by name: the first of equal groups wins
        if g.stale:
            g.refresh()
        if g.most_free >= need and g.tokens < best_tok:  # most_free: -1 with no engine up
            best, best_tok = g, g.tokens
    # Phase 2 within the group: it has an available engine with room, so this is never None.
    return None if best is None else _pick_engine(request, best.members, best.tokens, best.engines)


def _pick_engine(
    request: RouteRequest, engines: list[NodeState], group_tok: int, group_n: int
) -> NodeState | None:
    # Phase 2: engines with room; threshold Z balances tokens across the group's engines.
    length = request.prompt_tokens + request.max_new_tokens
    z = DECODE_BALANCE_SLACK * (length + group_tok) / group_n
    need = request.context_bytes
    fit: NodeState | None = None
    fit_tok = 0
    room: NodeState | None = None
    room_tok = 0
    for n in engines:  # the slots' private names: this loop is hot (`NodeState`)
        if n._buffer_free_bytes < need or not n.available:
            continue
        tok = n._tokens_queued + n._tokens_running
        if tok + length <= z and (
            fit is None
            or n.requests_running < fit.requests_running
            or (
                n.requests_running == fit.requests_running
                and (tok, n.node_id) < (fit_tok, fit.node_id)
            )
        ):
            fit, fit_tok = n, tok
        if room is None or tok < room_tok or (tok == room_tok and n.node_id < room.node_id):
            room, room_tok = n, tok
    return fit if fit is not None else room


def config_mismatch(view: ClusterView) -> tuple[list[str], list[str]] | None:
    """(prefill hashes, decode hashes) when available prefill and decode nodes exist but no
    config hash has both; None otherwise (nothing available, or a pair exists and the wait is
    load). Not on the hot path: callers ask after a request found no node.
    """
    pre: list[str] = []
    dec: list[str] = []
    for pool in view.pools():
        has_p = any(n.available for n in pool.prefill)
        has_d = any(n.available for n in pool.decode)
        if has_p and has_d:
            return None
        if has_p:
            pre.append(pool.config_hash)
        if has_d:
            dec.append(pool.config_hash)
    return (pre, dec) if pre and dec else None


def path_finish_s(
    request: RouteRequest, prefill: NodeState, decode: NodeState, view: ClusterView
) -> tuple[float, float]:
    """(path P finish, path D finish) estimates for this request on this pair."""
    hit = request.hit_bytes
    if hit <= 0:
        return 0.0, 0.0
    # each side: seconds until its read queue has read this request's hit bytes
    via_p = (prefill._read_pending_bytes + hit) / prefill.snic_bytes_per_s
    via_d = (decode._read_pending_bytes + hit) / decode.snic_bytes_per_s
    cnic = view.cnic_bytes_per_s
    if cnic > 0 and hit / cnic > via_d:
        via_d = hit / cnic
    return via_p, via_d


def pick_path(
    request: RouteRequest, prefill: NodeState, decode: NodeState, view: ClusterView
) -> tuple[ReadPath, float, float]:
    """The faster side; ties go to path P (no extra hop). Returns (path, chosen, other)."""
    via_p, via_d = path_finish_s(request, prefill, decode, view)
    if via_d < via_p:
        return ReadPath.DECODE, via_d, via_p
    return ReadPath.PREFILL, via_p, via_d
