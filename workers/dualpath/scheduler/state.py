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

from dualpath.config import SchedulerSpec
from dualpath.scheduler.index import BlockIndex
from dualpath.scheduler.policy import (
    DEFAULT_CNIC_BYTES_PER_S,
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
# Circuit breaker: consecutive failed completions that open a node's breaker, and how long it
# stays open before one probe request may go there (half-open): spec.scheduler's defaults.
BREAKER_FAILURES: int = SchedulerSpec.model_fields["breaker_failures"].default
BREAKER_COOLDOWN_S: float = SchedulerSpec.model_fields["breaker_open_seconds"].default
# A node silent this many node timeouts is forgotten (dropped from the view, its breaker and
# drain mark with it): a ghost of a process that is gone for good is not listed forever. Its
# process, if it comes back, is told it is unknown and registers again.
FORGET_AFTER_TIMEOUTS = 5
# A routed request no worker claims this long is released: spec.scheduler's default.
ROUTE_LEASE_S: float = SchedulerSpec.model_fields["route_lease_seconds"].default


class NodeConflict(ValueError):
    """A second process registers a node id that is alive under another incarnation."""


@dataclass(slots=True)
class Breaker:
    """A node's circuit breaker over the outcomes of the requests routed to it."""

    failures: int = 0  # consecutive failed completions
    open: bool = False  # no requests (but one probe once `retry_at_s` has passed)
    retry_at_s: float = 0.0


@dataclass(slots=True)
class NodeRecord:
    state: NodeState
    address: str
    transfer_address: str
    last_seen_s: float
    incarnation: str = ""  # one per process start ("": a client that does not send it)
    stream: object | None = None  # the heartbeat stream of the moment (a token)

    @property
    def config_hash(self) -> str:
        return self.state.config_hash


@dataclass(slots=True)
class InFlight:
    request: RouteRequest
    decision: Decision
    routed_at_s: float
    # node -> the incarnation it was routed to: the outcome says nothing of a later process
    incarnations: dict[str, str] | None = None


class SchedulerState:
    def __init__(
        self,
        policy: Policy,
        thresholds: Thresholds,
        node_timeout_s: float,
        cnic_bytes_per_s: float = DEFAULT_CNIC_BYTES_PER_S,
        clock: Callable[[], float] = time.monotonic,
        block_tokens: int = 64,
        index: BlockIndex | None = None,
        breaker_failures: int = BREAKER_FAILURES,
        breaker_cooldown_s: float = BREAKER_COOLDOWN_S,
        forget_after_s: float | None = None,
        max_in_flight_per_node: int = 0,
        route_lease_s: float = ROUTE_LEASE_S,
    ) -> None:
        """`forget_after_s`: a node silent this long is dropped (default FORGET_AFTER_TIMEOUTS
        node timeouts). `max_in_flight_per_node`: a node with this many requests routed and
        not completed takes no more (0: no cap). `route_lease_s`: a routed request that no
        node of its pair claims (its call reached neither) this long is released."""
        self.route_lease_s = route_lease_s
        # request id -> when it was routed, for the routed requests not claimed yet (in route
        # order: the oldest first, so a release pass stops at the first one still leased)
        self._unclaimed: dict[str, float] = {}
        self.released_total = 0
        self.max_in_flight_per_node = max_in_flight_per_node
        self._routed: dict[str, int] = {}  # node -> requests routed to it, not completed
        self.forget_after_s = (
            node_timeout_s * FORGET_AFTER_TIMEOUTS if forget_after_s is None else forget_after_s
        )
        self.forgotten_total = 0
        self.breaker_failures = breaker_failures
        self.breaker_cooldown_s = breaker_cooldown_s
        self.breakers: dict[str, Breaker] = {}
        self._open: set[str] = set()  # ids of the nodes whose breaker is open
        self.breaker_opens_total = 0
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
        self,
        state: NodeState,
        address: str,
        transfer_address: str = "",
        config_hash: str = "",
        incarnation: str = "",
    ) -> None:
        """Add or refresh a node. Raises NodeConflict when another incarnation of the id is
        alive (heartbeating within the node timeout) and not draining: a second process under
        a taken id must not take over its traffic. A timed-out or draining one is replaced."""
        old = self.nodes.get(state.node_id)
        known = old is not None
        # a registrant that sends no incarnation is another identity too (no way around it)
        if old is not None and old.incarnation != incarnation:
            now = self.clock()
            alive = old.state.healthy and now - old.last_seen_s <= self.node_timeout_s
            if alive and not old.state.draining:
                log.warning(
                    "refused node %s at %s: incarnation %s at %s is alive",
                    state.node_id,
                    address,
                    old.incarnation,
                    old.address,
                )
                raise NodeConflict(
                    f"node_id {state.node_id!r} is registered and alive at {old.address} "
                    f"(another incarnation); pick another node_id or stop that process"
                )
            log.info(
                "node %s: incarnation %s replaces %s (%s)",
                state.node_id,
                incarnation,
                old.incarnation,
                "draining" if old.state.draining else "timed out",
            )
            self.breakers.pop(state.node_id, None)  # a fresh process starts with a clean slate
            self._open.discard(state.node_id)
        breaker = self.breakers.get(state.node_id)
        state.held = breaker is not None and breaker.open
        # A registration says what the node is now: a draining process says so itself, and a
        # new process under a drained id (a StatefulSet pod replaced after its drain) serves.
        if not state.draining:
            self.drained.discard(state.node_id)
        if config_hash:
            state.config_hash = config_hash
        seq = self.view.config_hash_seq
        if state.config_hash not in seq:
            seq[state.config_hash] = next(self._hash_seq)  # newest hash: ties go to it
        self.nodes[state.node_id] = NodeRecord(
            state, address, transfer_address, self.clock(), incarnation
        )
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
        incarnation: str = "",
    ) -> bool:
        """Refresh a node's load; False if the node is unknown (it must register again) or
        the heartbeat comes from an incarnation that was replaced."""
        rec = self.nodes.get(node_id)
        if rec is None:
            return False
        if incarnation and rec.incarnation and incarnation != rec.incarnation:
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

    def stream_opened(self, node_id: str) -> object | None:
        """A heartbeat stream of a known node started: a token for `stream_closed`."""
        rec = self.nodes.get(node_id)
        if rec is None:
            return None
        rec.stream = object()
        return rec.stream

    def stream_closed(self, node_id: str, token: object) -> bool:
        """The node's heartbeat stream ended (its process died or stopped): out of the pool
        now rather than after the node timeout, unless a newer stream (a re-registration)
        replaced it. True when the node left the pool."""
        rec = self.nodes.get(node_id)
        if rec is None or rec.stream is not token:
            return False
        rec.stream = None
        if not rec.state.healthy:
            return False
        rec.state.healthy = False
        log.warning("node %s: heartbeat stream closed: out of the pool", node_id)
        self.index.snapshot_lost(node_id)
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
        """Mark nodes whose heartbeats stopped unhealthy (out of the pool); returns them. A
        node whose scan the block index awaits is not asked any longer: the next node that
        heartbeats is."""
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
                self.index.snapshot_lost(node_id)
        return gone

    def forget_silent(self) -> list[str]:
        """Drop the nodes silent for `forget_after_s` (ghosts of processes gone for good) from
        the view, with their breaker and drain mark; returns their ids. A request still in
        flight on one keeps its entry until its Complete."""
        now = self.clock()
        ghosts = [
            node_id
            for node_id, rec in self.nodes.items()
            if now - rec.last_seen_s > self.forget_after_s
        ]
        for node_id in ghosts:
            rec = self.nodes.pop(node_id)
            self.breakers.pop(node_id, None)
            self._open.discard(node_id)
            self.drained.discard(node_id)
            self.index.forget_publisher(node_id)
            self.forgotten_total += 1
            log.warning(
                "node %s (%s at %s) silent for %.0fs: forgotten",
                node_id,
                rec.state.role,
                rec.address,
                now - rec.last_seen_s,
            )
        if ghosts:
            self._rebuild_view()
        return ghosts

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

    def route(self, request: RouteRequest, exclude: Sequence[str] = ()) -> Decision | None:
        """The policy's decision over the available nodes: neither an open breaker's node (a
        half-open one takes one probe) nor one in `exclude` (a retry's failed pair)."""
        if not request.request_id:
            request.request_id = f"r{next(self._ids)}"
        now = self.clock()
        for node_id in self._open:
            if now >= self.breakers[node_id].retry_at_s:
                node = self.view.node(node_id)
                if node is not None:
                    node.held = False  # half-open: a decision may probe it
        cap = self.max_in_flight_per_node
        if cap:
            exclude = [*exclude, *(n for n, k in self._routed.items() if k >= cap)]
        held = [n for n in map(self.view.node, exclude) if n is not None and not n.held]
        for n in held:
            n.held = True
        try:
            decision = self.policy.decide(request, self.view)
        finally:
            for n in held:
                n.held = False
        if decision is not None and self._open:
            for node_id in {decision.prefill_node, decision.decode_node} & self._open:
                node = self.view.node(node_id)
                if node is not None:
                    node.held = True  # one probe at a time; another after a cool-down
                self.breakers[node_id].retry_at_s = now + self.breaker_cooldown_s
                log.info("node %s: breaker half-open, probing with %s", node_id, request.request_id)
        if decision is None:
            return None
        account(self.view, request, decision)
        pair = (decision.prefill_node, decision.decode_node)
        incarnations = {n: self.nodes[n].incarnation for n in pair if n in self.nodes}
        self.in_flight[request.request_id] = InFlight(request, decision, now, incarnations)
        self._unclaimed[request.request_id] = now
        for node_id in {decision.prefill_node, decision.decode_node}:
            self._routed[node_id] = self._routed.get(node_id, 0) + 1
        self.routed_total += 1
        return decision

    def claim(self, node_id: str, request_ids: Sequence[str]) -> int:
        """A node's call for routed requests arrived (Generate on decode, Prefill on prefill):
        they hold no lease any longer. Only a node of a request's pair claims it. Returns the
        requests claimed."""
        claimed = 0
        for request_id in request_ids:
            flight = self.in_flight.get(request_id)
            if flight is None or request_id not in self._unclaimed:
                continue
            if node_id in (flight.decision.prefill_node, flight.decision.decode_node):
                del self._unclaimed[request_id]
                claimed += 1
        return claimed

    def release_unclaimed(self) -> list[str]:
        """Release the routed requests no node claimed within the lease (the client or the
        frontend went away between Route and the worker call): out of the in-flight count and
        of their nodes' routed counts, as a cancel (no breaker counts it). Returns their ids."""
        horizon = self.clock() - self.route_lease_s
        released = []
        for request_id, routed_at in self._unclaimed.items():
            if routed_at > horizon:
                break
            released.append(request_id)
        for request_id in released:
            self.complete(request_id, ok=False, cancelled=True)
        if released:
            self.released_total += len(released)
            log.warning(
                "released %d routed request(s) no worker claimed within %.0fs (%s%s)",
                len(released),
                self.route_lease_s,
                ", ".join(released[:4]),
                ", ..." if len(released) > 4 else "",
            )
        return released

    def routed_in_flight(self, node_id: str) -> int:
        """Requests routed to `node_id` (either side) and not completed yet."""
        return self._routed.get(node_id, 0)

    def complete(
        self, request_id: str, ok: bool = True, cancelled: bool = False, failed_node: str = ""
    ) -> InFlight | None:
        """End a routed request; a failure (not a cancel) counts against the node it came
        from (`failed_node`, when it is of the pair) or else both nodes of its pair; a success
        closes their breakers. An outcome of a node's earlier incarnation (routed before a
        restart, completed after the new process registered) counts against neither."""
        done = self.in_flight.pop(request_id, None)
        if done is None:
            return done
        self._unclaimed.pop(request_id, None)
        pair = {done.decision.prefill_node, done.decision.decode_node}
        for node_id in pair:
            left = self._routed.get(node_id, 0) - 1
            if left > 0:
                self._routed[node_id] = left
            else:
                self._routed.pop(node_id, None)
        if cancelled:
            return done
        for node_id in pair if ok or failed_node not in pair else (failed_node,):
            rec = self.nodes.get(node_id)
            routed_to = (done.incarnations or {}).get(node_id)
            if rec is not None and routed_to is not None and rec.incarnation != routed_to:
                continue  # a request of the process before a restart: not this one's record
            self._outcome(node_id, ok)
        return done

    def has_pair_without(self, exclude: Sequence[str]) -> bool:
        """Whether an available prefill and decode node of one config hash remain when the
        nodes in `exclude` are left out (a retry has somewhere else to go)."""
        ex = set(exclude)
        return any(
            any(n.available and n.node_id not in ex for n in pool.prefill)
            and any(n.available and n.node_id not in ex for n in pool.decode)
            for pool in self.view.pools()
        )

    def _outcome(self, node_id: str, ok: bool) -> None:
        b = self.breakers.setdefault(node_id, Breaker())
        node = self.view.node(node_id)
        if ok:
            b.failures = 0
            if b.open:
                b.open = False
                self._open.discard(node_id)
                if node is not None:
                    node.held = False
                log.info("node %s: breaker closed (a request succeeded)", node_id)
            return
        b.failures += 1
        if b.open:  # a failed probe: open for another cool-down
            b.retry_at_s = self.clock() + self.breaker_cooldown_s
            if node is not None:
                node.held = True
            return
        if b.failures < self.breaker_failures or node is None:
            return
        # never the last available node of its role: shedding every request is worse than
        # trying (and the frontend retries a failed turn on another pair)
        peers = self.view.prefill if node.role == "prefill" else self.view.decode
        if not any(n.available and n is not node for n in peers):
            return
        b.open = True
        self._open.add(node_id)
        b.retry_at_s = self.clock() + self.breaker_cooldown_s
        node.held = True
        self.breaker_opens_total += 1
        log.warning(
            "node %s: breaker open after %d failed requests in a row: no requests for %.1fs",
            node_id,
            b.failures,
            self.breaker_cooldown_s,
        )

    def open_breakers(self) -> int:
        return len(self._open)

    def refusal(self) -> tuple[bool, str]:
        """Why a request found no node: (no prefill/decode pair shares a config hash, message).

        Counted and logged (at most one line per UNPAIRED_LOG_INTERVAL_S, with the count) when
        the cause is a missing pair: a rollout stuck half-way is a bug to show, not a wait.
        """
        gap = config_mismatch(self.view)
        if gap is None:
            return (
                False,
                "all overloaded, without room, at their in-flight cap, draining, unhealthy or "
                "failing (breaker open)",
            )
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
