"""Scheduling policies: small classes behind one interface (`Policy`), selected by name.

`dualpath` is the paper's policy; `prefill-read` (today's systems), `decode-read` and
`round-robin` are the baselines. The node choice of the first three is the same code
(`inter_node.pick_pair`), so a comparison isolates the read path. Every policy draws its
prefill and decode node from one config pool (`ClusterView.pools()`), so versions never pair.
"""

from __future__ import annotations

from typing import Protocol

from dualpath.scheduler.policy.inter_node import path_finish_s, pick_pair, pick_path
from dualpath.scheduler.policy.types import Decision, NodeState, ReadPath, RouteRequest
from dualpath.scheduler.policy.view import ClusterView


class Policy(Protocol):
    """A scheduling policy: small, pure, selected by name (see `policy.get_policy`)."""

    name: str

    def decide(self, request: RouteRequest, view: ClusterView) -> Decision | None:
        """Pick (prefill node, decode node, read path); None means no node can take it now."""
        ...


class DualPathPolicy:
    """Pick the pair by the paper's inter-node rules, read through the faster side."""

    name = "dualpath"

    def decide(self, request: RouteRequest, view: ClusterView) -> Decision | None:
        pair = pick_pair(request, view)
        if pair is None:
            return None
        p, d = pair
        path, chosen, other = pick_path(request, p, d, view)
        return Decision(request.request_id, p.node_id, d.node_id, path, chosen, other)


class FixedPathPolicy:
    """Same pair choice as `dualpath`, one fixed read path (the baselines)."""

    def __init__(self, name: str, path: ReadPath) -> None:
        self.name = name
        self.path = path

    def decide(self, request: RouteRequest, view: ClusterView) -> Decision | None:
        pair = pick_pair(request, view)
        if pair is None:
            return None
        p, d = pair
        via_p, via_d = path_finish_s(request, p, d, view)
        chosen, other = (via_p, via_d) if self.path is ReadPath.PREFILL else (via_d, via_p)
        return Decision(request.request_id, p.node_id, d.node_id, self.path, chosen, other)


class RoundRobinPolicy:
    """Load-unaware: nodes in turn, read path alternating (a naive dual path)."""

    name = "round-robin"

    def __init__(self) -> None:
        self._n = 0

    def decide(self, request: RouteRequest, view: ClusterView) -> Decision | None:
        # Prefill nodes in turn over the pools that have a decode engine with room, then that
        # pool's engines in turn (one pool: the plain round robin).
        pairs: list[tuple[NodeState, list[NodeState]]] = []
        for pool in view.pools():
            ds = [
                n
                for n in pool.decode
                if n.available and n.buffer_free_bytes >= request.context_bytes
            ]
            if ds:
                pairs.extend((n, ds) for n in pool.prefill if n.available)
        if not pairs:
            return None
        k = self._n
        self._n += 1
        p, ds = pairs[k % len(pairs)]
        d = ds[k % len(ds)]
        path = ReadPath.DECODE if k % 2 else ReadPath.PREFILL
        via_p, via_d = path_finish_s(request, p, d, view)
        chosen, other = (via_p, via_d) if path is ReadPath.PREFILL else (via_d, via_p)
        return Decision(request.request_id, p.node_id, d.node_id, path, chosen, other)
