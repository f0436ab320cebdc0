"""The scheduler's view of the cluster: registrations, heartbeats, liveness, in-flight requests.

Plain synchronous code with an injectable clock, so liveness is unit-testable; the gRPC
servicer is a thin adapter over it.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dualpath.scheduler.index import BlockIndex
from dualpath.scheduler.policy import (
    ClusterView,
    Decision,
    NodeState,
    Policy,
    RouteRequest,
    Thresholds,
    account,
    config_mismatch,
)

log = logging.getLogger(__name__)


# Seconds between warnings about requests refused for want of a pair (each carries the count).
UNPAIRED_LOG_INTERVAL_S = 5.0


@dataclass(slots=True)
class NodeRecord:
    state: NodeState
    address: str
    transfer_address: str
    last_seen_s: float

    @property
    def config_hash(self) -> str:
        return self.state.config_hash


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
        block_tokens: int = 64,
        index: BlockIndex | None = None,
    ) -> None:
        self.policy = policy
        self.block_tokens = block_tokens
        self.index = index if index is not None else BlockIndex()
        self.node_timeout_s = node_timeout_s
        self.clock = clock
        self.nodes: dict[str, NodeRecord] = {}
        self.view = ClusterView([], [], thresholds, cnic_bytes_per_s)
        self.in_flight: dict[str, InFlight] = {}
        self.routed_total = 0
        # drained through the API: sticky over heartbeats, cleared by a fresh registration
        self.drained: set[str] = set()
        self.refused_unpaired_total = 0
        self._ids = itertools.count(1)
        self._hash_seq = itertools.count()
        self._unpaired_logged_s = -float("inf")
        self._unpaired_since_log = 0

    # -- membership ---------------------------------------------------------------------
    def register(
        self, state: NodeState, address: str, transfer_address: str = "", config_hash: str = ""
    ) -> None:
        known = state.node_id in self.nodes
        # A registration says what the node is now: a draining process says so itself, and a
        # new process under a drained id (a StatefulSet pod replaced after its drain) serves.
        if not state.draining:
            self.drained.discard(state.node_id)
        if config_hash:
            state.config_hash = config_hash
        seq = self.view.config_hash_seq
        if state.config_hash not in seq:
            seq[state.config_hash] = next(self._hash_seq)  # newest hash: ties go to it
        self.nodes[state.node_id] = NodeRecord(state, address, transfer_address, self.clock())
        self._rebuild_view()
        level = logging.INFO if len(self.nodes) <= 64 else logging.DEBUG
        log.log(
            level,
            "%s %s node %s at %s (config %s)",
            "re-registered" if known else "registered",
            state.role,
            state.node_id,
            address,
            state.config_hash or "-",
        )
        pool = next(p for p in self.view.pools() if p.config_hash == state.config_hash)
        if not pool.prefill or not pool.decode:
            log.log(
                level,
                "config %s has no %s node yet: its %s nodes take no requests until one registers",
                state.config_hash or "-",
                "decode" if pool.prefill else "prefill",
                state.role,
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
    def hit_tokens(self, prompt_tokens: int, block_keys: Sequence[int]) -> int:
        """The prompt's hit: its longest prefix of blocks in the index, leaving at least one
        prompt token to prefill (the last token's logits start the decode)."""
        limit = (prompt_tokens - 1) // self.block_tokens
        return self.index.hit_blocks(block_keys, limit) * self.block_tokens

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

    def routed_in_flight(self, node_id: str) -> int:
        """Requests routed to `node_id` (either side) and not completed yet."""
        return sum(
            1
            for f in self.in_flight.values()
            if node_id in (f.decision.prefill_node, f.decision.decode_node)
        )

    def complete(self, request_id: str) -> InFlight | None:
        return self.in_flight.pop(request_id, None)

    def refusal(self) -> tuple[bool, str]:
        """Why a request found no node: (no prefill/decode pair shares a config hash, message).

        Counted and logged (at most one line per UNPAIRED_LOG_INTERVAL_S, with the count) when
        the cause is a missing pair: a rollout stuck half-way is a bug to show, not a wait.
        """
        gap = config_mismatch(self.view)
        if gap is None:
            return False, "all overloaded, without room, draining or unhealthy"
        pre, dec = (", ".join(h or "-" for h in hs) for hs in gap)
        msg = f"no prefill and decode node share a config hash (prefill: {pre}; decode: {dec})"
        self.refused_unpaired_total += 1
        self._unpaired_since_log += 1
        now = self.clock()
        if now - self._unpaired_logged_s >= UNPAIRED_LOG_INTERVAL_S:
            log.warning("refused %d request(s): %s", self._unpaired_since_log, msg)
            self._unpaired_logged_s = now
            self._unpaired_since_log = 0
        return True, msg
