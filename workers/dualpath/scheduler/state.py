"""The scheduler's view of the cluster: registrations, heartbeats, liveness, in-flight requests.

Plain synchronous code with an injectable clock, so liveness is unit-testable; the gRPC
servicer is a thin adapter over it.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from dualpath.scheduler.policy import (
    ClusterView,
    Decision,
    NodeState,
    Policy,
    RouteRequest,
    Thresholds,
    account,
)

log = logging.getLogger(__name__)


@dataclass(slots=True)
class NodeRecord:
    state: NodeState
    address: str
    transfer_address: str
    config_hash: str
    last_seen_s: float


@dataclass(slots=True)
class InFlight:
    request: RouteRequest
    decision: Decision
    routed_at_s: float


class SchedulerState:
    def __init__(
        self,
        policy: Policy,
        thresholds: Thresholds,
        node_timeout_s: float,
        cnic_bytes_per_s: float = 25.0e9,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = policy
        self.node_timeout_s = node_timeout_s
        self.clock = clock
        self.nodes: dict[str, NodeRecord] = {}
        self.view = ClusterView([], [], thresholds, cnic_bytes_per_s)
        self.in_flight: dict[str, InFlight] = {}
        self.routed_total = 0
        self.drained: set[str] = set()  # drained through the API: sticky over heartbeats
        self._ids = itertools.count(1)

    # -- membership ---------------------------------------------------------------------
    def register(
        self, state: NodeState, address: str, transfer_address: str = "", config_hash: str = ""
    ) -> None:
        known = state.node_id in self.nodes
        state.draining = state.draining or state.node_id in self.drained
        self.nodes[state.node_id] = NodeRecord(
            state, address, transfer_address, config_hash, self.clock()
        )
        self._rebuild_view()
        log.log(
            logging.INFO if len(self.nodes) <= 64 else logging.DEBUG,
            "%s %s node %s at %s",
            "re-registered" if known else "registered",
            state.role,
            state.node_id,
            address,
        )

    def heartbeat(
        self,
        node_id: str,
        read_pending_bytes: int,
        tokens_queued: int,
        tokens_running: int,
        requests_running: int,
        buffer_free_bytes: int,
        draining: bool,
    ) -> bool:
        """Refresh a node's load; False if the node is unknown (it must register again)."""
        rec = self.nodes.get(node_id)
        if rec is None:
            return False
        s = rec.state
        s.read_pending_bytes = read_pending_bytes
        s.tokens_queued = tokens_queued
        s.tokens_running = tokens_running
        s.requests_running = requests_running
        s.buffer_free_bytes = buffer_free_bytes
        draining = draining or node_id in self.drained
        if draining and not s.draining:
            log.info("node %s is draining", node_id)
        s.draining = draining
        if not s.healthy:
            log.info("node %s is back", node_id)
        s.healthy = True
        rec.last_seen_s = self.clock()
        return True

    def drain(self, node_id: str) -> bool:
        rec = self.nodes.get(node_id)
        if rec is None:
            return False
        rec.state.draining = True
        self.drained.add(node_id)
        log.info("node %s drained by request: no new requests", node_id)
        return True

    def expire(self) -> list[str]:
        """Mark nodes whose heartbeats stopped unhealthy (out of the pool); returns them."""
        now = self.clock()
        gone = []
        for node_id, rec in self.nodes.items():
            if rec.state.healthy and now - rec.last_seen_s > self.node_timeout_s:
                rec.state.healthy = False
                gone.append(node_id)
                log.warning(
                    "node %s missed heartbeats for %.2fs: out of the pool",
                    node_id,
                    now - rec.last_seen_s,
                )
        return gone

    def _rebuild_view(self) -> None:
        self.view.prefill = [r.state for r in self.nodes.values() if r.state.role == "prefill"]
        self.view.decode = [r.state for r in self.nodes.values() if r.state.role == "decode"]
        self.view.membership_changed()

    # -- routing ------------------------------------------------------------------------
    def route(self, request: RouteRequest) -> Decision | None:
        if not request.request_id:
            request.request_id = f"r{next(self._ids)}"
        decision = self.policy.decide(request, self.view)
        if decision is None:
            return None
        account(self.view, request, decision)
        self.in_flight[request.request_id] = InFlight(request, decision, self.clock())
        self.routed_total += 1
        return decision

    def complete(self, request_id: str) -> InFlight | None:
        return self.in_flight.pop(request_id, None)
