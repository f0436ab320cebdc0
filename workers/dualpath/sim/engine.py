"""The discrete-event simulation of a P/D cluster serving agent trajectories.

One event loop (heapq of (time, seq, kind, request)); every routing decision calls the policy
given (`dualpath.scheduler.policy.get_policy(name)` in the CLI) over a `ClusterView` that the
simulator keeps up to date incrementally, like the real scheduler does from heartbeats:
per-node token and buffer counters change at the events that change them, and read-queue
pending bytes (which drain continuously) are refreshed every `heartbeat_s` and bumped
immediately for the node a decision just loaded.

A turn's life:
1. ARRIVE: the agent sends prompt = context + append; hit = the context's full blocks already
   written to storage. The policy picks (prefill node, decode node, read path).
2. The hit bytes are read through the chosen side's SNIC (a FIFO at the SNIC's bandwidth). On
   path D the decode node streams them layer by layer to the prefill node over the CNIC's KV
   class (overlapping the read; finish = max(read end + one layer, send start + bytes/bw)).
3. Layer-wise prefill, modelled per request (not one event per layer): the GPU computes layer l
   as soon as layer l is loaded, so prefill ends at max(start + compute, load end + compute/L).
   A prefill node runs one request at a time on all its GPUs, choosing the one whose load
   finishes first, and starts it just late enough not to stall on its load.
4. PREFILL_DONE: KV goes to the decode node over the CNIC KV class (path P: the whole
   context's; path D: only the new tokens', the decode node already holds the hit part).
5. The decode node adds the sequence to its batch; every token costs one decode step at the
   batch size and batch KV at admission (memory-bound). First token = TTFT.
6. DECODE_DONE: new full blocks are written to storage (through the decode SNIC's write
   direction; SNICs are full duplex, so writes do not slow reads), the agent thinks (tool
   call) and sends its next turn.

Recorded turns (`dualpath.trace`) bring their own prompt and hit; a subagent starts `start_s`
after its parent's `after_turn`-th turn finished, as an agent of its own. A session is done when
it and all its subagents are. Before routing, a turn is checked once: over the model's context
limit it is truncated or refused (`context_rule`), and one whose KV cannot fit a decode node
even when empty is refused and counted, never re-offered. With `recycle`, a finished session's
slot starts the next session of the list (cycling) until the horizon: the steady state.
Utilisation of each resource (prefill GPUs, SNICs, CNICs, decode KV memory) is measured over
the window after the warm-up; the highest is the run's binding resource.
"""

from __future__ import annotations

import heapq
import logging
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from dualpath.scheduler.policy import ClusterView, Policy, account
from dualpath.scheduler.policy.types import NodeState, ReadPath, RouteRequest, Thresholds
from dualpath.sim.model import CostModel, Hardware
from dualpath.trace import Trajectory

log = logging.getLogger(__name__)

ARRIVE, PREFILL_WAKE, PREFILL_DONE, DECODE_DONE, RETRY, WARMUP = 0, 1, 2, 3, 4, 5
CONTEXT_RULES = ("truncate", "refuse")
# what each rule does to a turn whose prompt + output exceeds the limit, and so to the figures
CONTEXT_RULE_EFFECT = {
    "truncate": "served cut to the limit (the prompt's first limit - output tokens, the output "
    "at most half the limit, the hit capped to the cut prompt): it counts in goodput and the "
    "SLO with its cut tokens, so the longest sessions weigh less than recorded",
    "refuse": "skipped and counted as refused: it counts in no figure, and its session goes on "
    "with its next turn",
}
# Resources whose utilisation a run reports; the highest binds.
RESOURCES = (
    "prefill_gpu",
    "prefill_snic",
    "decode_snic",
    "prefill_cnic",
    "decode_cnic",
    "decode_kv_memory",
)


@dataclass(slots=True)
class SimConfig:
    prefill_nodes: int
    decode_nodes: int
    hardware: Hardware
    cost: CostModel
    block_tokens: int = 64
    thresholds: Thresholds = field(default_factory=Thresholds)
    heartbeat_s: float = 0.02
    horizon_s: float = math.inf  # stop simulating at this time
    warmup_s: float = 0.0  # online stats only count turns arriving after this
    mean_context_tokens: float = 16_000.0  # for the nodes' advertised prefill tokens/s
    progress: bool = False  # report progress on stderr
    # Each simulated agent stands for this many identical agents in lockstep: one request
    # carries their tokens, bytes and GPU time (cuts events by this factor at cluster scale).
    agent_group: int = 1
    # Offline batch jobs run at most this many (simulated) agents at once; the next one starts
    # when one finishes (0 = all start at their start_s).
    max_active_agents: int = 0
    # A turn whose prompt + generation exceeds this (0 = no limit) is truncated to it (the
    # prompt keeps its first limit - gen tokens, gen at most half the limit) or refused.
    max_context_tokens: int = 0
    context_rule: str = "truncate"
    # Steady state: a finished session's slot starts the next session, cycling the list, until
    # the horizon (needs a finite horizon_s and max_active_agents).
    recycle: bool = False

    def __post_init__(self) -> None:
        if self.context_rule not in CONTEXT_RULES:
            raise ValueError(
                f"SimConfig.context_rule: {self.context_rule!r}, choose one of {CONTEXT_RULES}"
            )
        if self.recycle and not (math.isfinite(self.horizon_s) and self.max_active_agents > 0):
            raise ValueError("SimConfig.recycle: needs a finite horizon_s and max_active_agents")
        if self.max_context_tokens < 0 or self.agent_group < 1:
            raise ValueError("SimConfig.max_context_tokens >= 0 and agent_group >= 1 required")


@dataclass(slots=True)
class _Req:
    agent: int
    turn: int
    prompt: int
    hit: int
    gen: int
    arrive_s: float
    compute_s: float = 0.0
    ready_s: float = 0.0  # hit KV fully on the prefill node
    p: int = 0
    d: int = 0
    path_d: bool = False
    ctx_bytes: int = 0  # KV of prompt + generated tokens on the decode node (its step cost)
    step_s: float = 0.0
    first_token_s: float = -1.0
    w: int = 1  # agents this request stands for (SimConfig.agent_group)
    routed: RouteRequest | None = None  # what the policy saw and `account` charged


@dataclass(slots=True)
class _Prefill:
    state: NodeState
    snic_free_s: float = 0.0
    cnic_free_s: float = 0.0
    gpu_free_s: float = 0.0
    wake_s: float = math.inf  # time of the pending PREFILL_WAKE, inf if none
    ready: list = field(default_factory=list)  # heap of (start_ok_s, seq, req)
    busy_s: float = 0.0
    read_bytes: int = 0
    cnic_bytes: int = 0


@dataclass(slots=True)
class _Decode:
    state: NodeState
    snic_free_s: float = 0.0
    cnic_free_s: float = 0.0
    batch: int = 0
    batch_kv_bytes: int = 0
    read_bytes: int = 0
    write_bytes: int = 0
    cnic_bytes: int = 0


@dataclass(slots=True)
class SimResult:
    policy: str
    sim_s: float  # simulated time at the end (or the horizon)
    wall_s: float
    events: int
    decisions: int
    waits: int  # decisions that returned None (request queued until something frees)
    turns_done: int
    agents_done: int
    agents: int
    gen_tokens: int
    prompt_tokens: int
    read_bytes_prefill: int  # hit bytes read through prefill SNICs
    read_bytes_decode: int  # hit bytes read through decode SNICs
    cnic_kv_bytes: int
    write_bytes: int
    jct_s: float  # offline: time when the last agent finished (nan if not all did)
    ttft_s: list[float]
    tpot_s: list[float]
    prefill_busy: float  # mean prefill GPU utilisation
    path_d_fraction: float
    window_gen_tokens: int = 0  # generated tokens of turns finishing after warmup_s
    warmup_s: float = 0.0
    refused_context: int = 0  # turns over the context limit, refused (context_rule refuse)
    truncated_context: int = 0  # turns over the context limit, truncated to it
    truncated_tokens: int = 0  # prompt + generated tokens cut by truncation
    refused_unfittable: int = 0  # turns whose KV exceeds an empty decode node
    waiting_at_end: int = 0  # turns still queued for a decision at the end (the horizon)
    sessions_started: int = 0
    # Fraction of each resource busy over the window after the warm-up (RESOURCES).
    utilisation: dict[str, float] = field(default_factory=dict)

    @property
    def binding(self) -> str:
        """The resource with the highest utilisation ("" when nothing ran)."""
        if not self.utilisation or max(self.utilisation.values()) <= 0:
            return ""
        return max(self.utilisation, key=self.utilisation.__getitem__)

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per simulated second."""
        return self.gen_tokens / self.sim_s if self.sim_s > 0 else 0.0

    @property
    def steady_tokens_per_s(self) -> float:
        """Generated tokens per simulated second after the warm-up."""
        span = self.sim_s - self.warmup_s
        return self.window_gen_tokens / span if span > 0 else 0.0

    @property
    def read_bytes_per_s(self) -> float:
        total = self.read_bytes_prefill + self.read_bytes_decode
        return total / self.sim_s if self.sim_s > 0 else 0.0


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return math.nan
    s = sorted(xs)
    k = min(len(s) - 1, max(0, int(math.ceil(q / 100.0 * len(s))) - 1))
    return s[k]


class Simulator:
    """Run `trajectories` (their `start_s` are the agents' start times) under `policy`."""

    def __init__(self, cfg: SimConfig, policy: Policy, trajectories: list[Trajectory]) -> None:
        if cfg.prefill_nodes < 1 or cfg.decode_nodes < 1:
            raise ValueError("SimConfig: needs at least one prefill and one decode node")
        for tr in trajectories:
            if not tr.turns:
                raise ValueError(f"trajectory {tr.agent_id}: has no turns")
        self.cfg = cfg
        self.policy = policy
        self.trs = trajectories
        hw = cfg.hardware
        self.snic_bw = hw.snic_bytes_per_s
        self.cnic_bw = hw.cnic_kv_bytes_per_s
        ptps = cfg.cost.prefill_tokens_per_s(cfg.mean_context_tokens)
        self.pre = [
            _Prefill(
                NodeState(
                    f"p{i}",
                    "prefill",
                    snic_bytes_per_s=self.snic_bw,
                    prefill_tokens_per_s=ptps,
                    buffer_free_bytes=hw.decode_kv_capacity_bytes,
                )
            )
            for i in range(cfg.prefill_nodes)
        ]
        self.dec = [
            _Decode(
                NodeState(
                    f"d{i}",
                    "decode",
                    snic_bytes_per_s=self.snic_bw,
                    prefill_tokens_per_s=ptps,
                    buffer_free_bytes=hw.decode_kv_capacity_bytes,
                )
            )
            for i in range(cfg.decode_nodes)
        ]
        self.nodes: list[_Prefill | _Decode] = [*self.pre, *self.dec]
        self.p_index = {n.state.node_id: i for i, n in enumerate(self.pre)}
        self.d_index = {n.state.node_id: i for i, n in enumerate(self.dec)}
        self.view = ClusterView(
            prefill=[n.state for n in self.pre],
            decode=[n.state for n in self.dec],
            thresholds=cfg.thresholds,
            cnic_bytes_per_s=self.cnic_bw,
        )
        self.heap: list[tuple[float, int, int, object]] = []
        self.seq = 0
        self.waiting: list[_Req] = []
        self.last_refresh_s = -math.inf
        self.kv_capacity = hw.decode_kv_capacity_bytes
        # Per running agent (an instance of a trajectory: a session's root or a subagent).
        self.inst: list[Trajectory] = []
        self.inst_session: list[int] = []  # session (root instance) of each instance
        self.ctx: list[int] = []
        self.stored: list[int] = []
        self.turn_i: list[int] = []
        self.live: dict[int, int] = {}  # session -> its instances not finished yet

    # -- helpers -----------------------------------------------------------------------------

    def _push(self, t: float, kind: int, obj: object) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, obj))

    def _refresh(self, now: float) -> None:
        """Heartbeat: every node reports its read-queue backlog."""
        bw = self.snic_bw
        # Only a changed value is written: the setter tells the policy's pools to re-rank the
        # node, and most read queues are empty (0 -> 0) at most heartbeats (the hot path).
        for n in self.nodes:
            v = int((n.snic_free_s - now) * bw) if n.snic_free_s > now else 0
            st = n.state
            if st._read_pending_bytes != v:
                st.read_pending_bytes = v
        self.last_refresh_s = now

    def _start(self, tr: Trajectory, at: float, session: int = -1) -> int:
        """A new running instance of `tr` arriving at `at`; returns its index."""
        a = len(self.inst)
        self.inst.append(tr)
        self.inst_session.append(a if session < 0 else session)
        self.ctx.append(tr.first_tokens)
        self.stored.append(0)
        self.turn_i.append(0)
        s = self.inst_session[a]
        self.live[s] = self.live.get(s, 0) + 1
        if session < 0:
            self.sessions_started += 1
        self._push(at, ARRIVE, a)
        self._spawn(a, 0, at)
        return a

    def _spawn(self, a: int, done_turns: int, now: float) -> None:
        """Start the subagents of instance `a` due after its `done_turns`-th turn."""
        tr = self.inst[a]
        last = len(tr.turns)
        for sub in tr.subagents:
            if min(sub.after_turn, last) == done_turns and sub.turns:
                self._start(sub, now + sub.start_s, self.inst_session[a])

    def _new_turn(self, a: int, now: float) -> _Req | None:
        """The request of instance `a`'s next turn, or None if it is refused (counted)."""
        cfg = self.cfg
        t = self.inst[a].turns[self.turn_i[a]]
        prompt = t.prompt(self.ctx[a])
        gen = t.gen_tokens
        hit = t.hit(self.stored[a], prompt)
        limit = cfg.max_context_tokens
        if limit and prompt + gen > limit:
            if cfg.context_rule == "refuse":
                self.refused_context += 1
                return None
            cut_gen = min(gen, limit // 2)
            cut_prompt = limit - cut_gen
            self.truncated_context += 1
            self.truncated_tokens += prompt + gen - limit
            prompt, gen = cut_prompt, cut_gen
            hit = min(hit, prompt - 1)
        w = cfg.agent_group
        req = _Req(a, self.turn_i[a], prompt, hit, gen, now, w=w)
        req.ctx_bytes = (prompt + gen) * cfg.cost.kv_bytes_per_token * w
        if req.ctx_bytes > self.kv_capacity:
            self.refused_unfittable += 1
            if self.refused_unfittable == 1:
                log.warning(
                    "sim: turn of %d tokens x %d agents needs %.1f GB of KV, more than a decode "
                    "node holds (%.1f GB): refused (lower --agent-group or --max-context)",
                    prompt + gen,
                    w,
                    req.ctx_bytes / 1e9,
                    self.kv_capacity / 1e9,
                )
            return None
        req.compute_s = cfg.cost.prefill_s(prompt - hit, hit) * w
        return req

    # -- the decision ------------------------------------------------------------------------

    def _route(self, req: _Req, now: float) -> bool:
        cfg = self.cfg
        if now - self.last_refresh_s >= cfg.heartbeat_s:
            self._refresh(now)
        rr = RouteRequest.for_turn(
            f"{req.agent}.{req.turn}",
            req.prompt,
            req.hit,
            cfg.cost.kv_bytes_per_token,
            req.gen,
            str(req.agent),
            weight=req.w,
        )
        hit_bytes = rr.hit_bytes
        self.decisions += 1
        dec = self.policy.decide(rr, self.view)
        if dec is None:
            self.waits += 1
            return False
        # the scheduler's own accounting, as the service does until the next heartbeat
        account(self.view, rr, dec)
        req.routed = rr
        self.inflight += 1
        self._kv_change(now, rr.context_bytes)
        pi = self.p_index[dec.prefill_node]
        di = self.d_index[dec.decode_node]
        p, d = self.pre[pi], self.dec[di]
        req.p, req.d = pi, di
        layers = cfg.cost.layers
        if dec.read_path is ReadPath.DECODE:
            req.path_d = True
            start = d.snic_free_s if d.snic_free_s > now else now
            read_end = start + hit_bytes / self.snic_bw
            d.snic_free_s = read_end
            d.read_bytes += hit_bytes
            self.read_d += hit_bytes
            send = hit_bytes / self.cnic_bw
            s0 = d.cnic_free_s if d.cnic_free_s > start else start
            end = max(read_end + send / layers, s0 + send)
            d.cnic_free_s = end
            self.cnic_bytes += hit_bytes
            d.cnic_bytes += hit_bytes
            req.ready_s = end
        else:
            start = p.snic_free_s if p.snic_free_s > now else now
            p.snic_free_s = start + hit_bytes / self.snic_bw
            p.read_bytes += hit_bytes
            self.read_p += hit_bytes
            req.ready_s = p.snic_free_s
        # Start as late as possible without stalling on the load (layer-wise overlap).
        start_ok = req.ready_s - req.compute_s * (layers - 1) / layers
        self.seq += 1
        heapq.heappush(p.ready, (start_ok, self.seq, req))
        self._wake(pi, max(now, p.gpu_free_s, p.ready[0][0]))
        return True

    def _wake(self, pi: int, t: float) -> None:
        p = self.pre[pi]
        if t < p.wake_s:
            p.wake_s = t
            self._push(t, PREFILL_WAKE, pi)

    def _prefill_wake(self, pi: int, now: float) -> None:
        p = self.pre[pi]
        if now != p.wake_s:
            return  # superseded by an earlier wake
        p.wake_s = math.inf
        if p.gpu_free_s > now or not p.ready:
            return
        start_ok, _, req = p.ready[0]
        if start_ok > now:
            self._wake(pi, start_ok)
            return
        heapq.heappop(p.ready)
        layers = self.cfg.cost.layers
        end = max(now + req.compute_s, req.ready_s + req.compute_s / layers)
        p.busy_s += end - now
        p.gpu_free_s = end
        self._push(end, PREFILL_DONE, req)
        if p.ready:
            self._wake(pi, max(end, p.ready[0][0]))

    def _prefill_done(self, req: _Req, now: float) -> None:
        p, d = self.pre[req.p], self.dec[req.d]
        w = req.w
        rr = req.routed
        # The nodes' own counters from here on (the heartbeat's numbers): the prefill node
        # drops what `account` queued on it, the decode node moves the turn to running.
        p.state.tokens_queued -= rr.new_tokens
        kvpt = self.cfg.cost.kv_bytes_per_token
        nbytes = (req.prompt - req.hit if req.path_d else req.prompt) * kvpt * w
        s0 = p.cnic_free_s if p.cnic_free_s > now else now
        arrive = s0 + nbytes / self.cnic_bw
        p.cnic_free_s = arrive
        self.cnic_bytes += nbytes
        p.cnic_bytes += nbytes
        ds = d.state
        ds.tokens_queued -= rr.prompt_tokens + rr.max_new_tokens
        ds.tokens_running += rr.prompt_tokens + rr.max_new_tokens
        d.batch += w
        d.batch_kv_bytes += req.ctx_bytes
        step = self.cfg.cost.decode_step_s(d.batch, d.batch_kv_bytes)
        req.step_s = step
        req.first_token_s = arrive + step
        self._push(arrive + step * max(req.gen, 1), DECODE_DONE, req)
        if self.waiting:
            self._retry(now)

    def _decode_done(self, req: _Req, now: float) -> None:
        d = self.dec[req.d]
        ds = d.state
        w = req.w
        rr = req.routed
        ds.tokens_running -= rr.prompt_tokens + rr.max_new_tokens
        ds.requests_running -= 1
        ds.buffer_free_bytes += rr.context_bytes
        self.inflight -= 1
        self._kv_change(now, -rr.context_bytes)
        d.batch -= w
        d.batch_kv_bytes -= req.ctx_bytes
        a = req.agent
        self.turns_done += w
        if now >= self.cfg.warmup_s:
            self.window_gen_tokens += req.gen * w
        self.gen_tokens += req.gen * w
        self.prompt_tokens += req.prompt * w
        if req.arrive_s >= self.cfg.warmup_s:
            self.ttft.append(req.first_token_s - req.arrive_s)
            self.tpot.append(req.step_s)
        ctx = req.prompt + req.gen
        bt = self.cfg.block_tokens
        full = (ctx // bt) * bt
        # Blocks past the hit are new in storage (a partial hit rewrites what it re-sent).
        wbytes = (full - (req.hit // bt) * bt) * self.cfg.cost.kv_bytes_per_token * w
        if wbytes > 0:
            d.write_bytes += wbytes
            self.write_bytes += wbytes
        self.stored[a] = full
        self._advance(a, ctx, now)
        if self.waiting:
            self._retry(now)

    def _advance(self, a: int, ctx: int, now: float) -> None:
        """Instance `a` finished (or was refused) a turn leaving `ctx` tokens of context."""
        self.ctx[a] = ctx
        self.turn_i[a] += 1
        tr = self.inst[a]
        self._spawn(a, self.turn_i[a], now)
        if self.turn_i[a] < len(tr.turns):
            self._push(now + tr.turns[self.turn_i[a]].think_s, ARRIVE, a)
            return
        s = self.inst_session[a]
        self.live[s] -= 1
        if self.live[s]:
            return
        del self.live[s]
        self.agents_done += self.cfg.agent_group
        self.last_done_s = now
        if self.next_agent < len(self.trs) or (self.cfg.recycle and self.trs):
            self._start(self.trs[self.next_agent % len(self.trs)], now)
            self.next_agent += 1

    def _kv_change(self, now: float, delta: int) -> None:
        self.kv_area += self.kv_used * (now - self.kv_last_s)
        self.kv_last_s = now
        self.kv_used += delta

    def _retry(self, now: float) -> None:
        # Like the real scheduler's queue, a refused request is re-offered to the policy at
        # most once per heartbeat: nothing it reads changes faster than that (and it bounds
        # the policy calls of an overloaded cluster).
        if now < self.next_retry_s:
            return
        waiting, self.waiting = self.waiting, []
        for i, req in enumerate(waiting):
            if not self._route(req, now):
                if self.inflight == 0:
                    # Nothing runs that could free room: the policy would refuse it forever.
                    self._refuse_stuck(req, now)
                    self.waiting.extend(waiting[i + 1 :])
                    if self.waiting:
                        self._push(now, RETRY, None)
                        self.next_retry_s = now
                    break
                self.waiting.extend(waiting[i:])
                self.next_retry_s = now + self.cfg.heartbeat_s
                self._push(self.next_retry_s, RETRY, None)
                break

    def _refuse_stuck(self, req: _Req, now: float) -> None:
        self.refused_unfittable += 1
        log.warning(
            "sim: turn %d.%d (%d tokens) refused on an idle cluster: it fits no decode node",
            req.agent,
            req.turn,
            req.prompt,
        )
        self._advance(req.agent, req.prompt + req.gen, now)

    # -- the loop ----------------------------------------------------------------------------

    def run(self, progress: Callable[[float, int], None] | None = None) -> SimResult:
        self.decisions = self.waits = self.turns_done = self.agents_done = 0
        self.gen_tokens = self.prompt_tokens = self.window_gen_tokens = 0
        self.read_p = self.read_d = self.cnic_bytes = self.write_bytes = 0
        self.ttft: list[float] = []
        self.tpot: list[float] = []
        self.last_done_s = 0.0
        self.next_retry_s = -math.inf
        self.refused_context = self.truncated_context = self.truncated_tokens = 0
        self.refused_unfittable = self.sessions_started = self.inflight = 0
        self.kv_used = self.kv_area = 0
        self.kv_last_s = 0.0
        self.snap: dict[str, float] = {}
        cap = self.cfg.max_active_agents or len(self.trs)
        for tr in self.trs[:cap]:
            self._start(tr, tr.start_s)
        self.next_agent = min(cap, len(self.trs))
        if self.cfg.warmup_s > 0:
            self._push(self.cfg.warmup_s, WARMUP, None)
        horizon = self.cfg.horizon_s
        heap = self.heap
        pop = heapq.heappop
        wall0 = time.perf_counter()
        next_report = wall0 + 2.0
        events = 0
        now = 0.0
        while heap:
            t, _, kind, obj = heap[0]
            if t > horizon:
                break
            pop(heap)
            now = t
            events += 1
            if kind == ARRIVE:
                req = self._new_turn(obj, now)  # type: ignore[arg-type]
                if req is None:
                    a = obj
                    t = self.inst[a].turns[self.turn_i[a]]  # type: ignore[index]
                    self._advance(a, t.prompt(self.ctx[a]) + t.gen_tokens, now)  # type: ignore[arg-type]
                elif self.waiting:
                    self.waiting.append(req)
                elif not self._route(req, now):
                    self.waiting.append(req)
                    self.next_retry_s = now + self.cfg.heartbeat_s
                    self._push(self.next_retry_s, RETRY, None)
            elif kind == PREFILL_WAKE:
                self._prefill_wake(obj, now)  # type: ignore[arg-type]
            elif kind == PREFILL_DONE:
                self._prefill_done(obj, now)  # type: ignore[arg-type]
            elif kind == DECODE_DONE:
                self._decode_done(obj, now)  # type: ignore[arg-type]
            elif kind == WARMUP:
                self.snap = self._counters(now)
            elif self.waiting:
                self._retry(now)
            if events & 0x3FFF == 0:
                w = time.perf_counter()
                if w >= next_report:
                    next_report = w + 2.0
                    if progress is not None:
                        progress(now, self.turns_done)
                    elif self.cfg.progress:
                        _stderr_progress(self.policy.name, now, horizon, self.turns_done)
        wall = time.perf_counter() - wall0
        all_done = not self.cfg.recycle and self.agents_done == self.cfg.agent_group * sum(
            1 for t in self.trs if t.turns
        )
        sim_s = self.last_done_s if all_done else (horizon if math.isfinite(horizon) else now)
        if self.waiting and not heap:
            # Nothing left to free room: the queue can never drain (a policy refusing forever).
            log.warning("sim: %d turns can never be placed; stopped", len(self.waiting))
        util = self._utilisation(sim_s)
        if not all_done and math.isfinite(horizon):
            # Turns still waiting for their first token at the horizon count as that late.
            for _, _, kind, obj in heap:
                if kind == DECODE_DONE and obj.first_token_s > horizon:  # type: ignore[union-attr]
                    r = obj
                    if r.arrive_s >= self.cfg.warmup_s:  # type: ignore[union-attr]
                        self.ttft.append(horizon - r.arrive_s)  # type: ignore[union-attr]
            for p in self.pre:
                for _, _, r in p.ready:
                    if r.arrive_s >= self.cfg.warmup_s:
                        self.ttft.append(horizon - r.arrive_s)
            self.ttft.extend(
                horizon - r.arrive_s for r in self.waiting if r.arrive_s >= self.cfg.warmup_s
            )
        # Bytes still queued on a SNIC at the end were admitted but not read: do not count them.
        bw = self.snic_bw
        self.read_p -= sum(int(max(0.0, n.snic_free_s - sim_s) * bw) for n in self.pre)
        self.read_d -= sum(int(max(0.0, n.snic_free_s - sim_s) * bw) for n in self.dec)
        busy = sum(min(p.busy_s, sim_s) for p in self.pre) / (len(self.pre) * sim_s or 1.0)
        return SimResult(
            policy=self.policy.name,
            sim_s=sim_s,
            wall_s=wall,
            events=events,
            decisions=self.decisions,
            waits=self.waits,
            turns_done=self.turns_done,
            agents_done=self.agents_done,
            agents=len(self.trs) * self.cfg.agent_group,
            gen_tokens=self.gen_tokens,
            prompt_tokens=self.prompt_tokens,
            read_bytes_prefill=self.read_p,
            read_bytes_decode=self.read_d,
            cnic_kv_bytes=self.cnic_bytes,
            write_bytes=self.write_bytes,
            jct_s=self.last_done_s if all_done else math.nan,
            ttft_s=self.ttft,
            tpot_s=self.tpot,
            prefill_busy=busy,
            path_d_fraction=self._path_d_frac(),
            window_gen_tokens=self.window_gen_tokens,
            warmup_s=self.cfg.warmup_s,
            refused_context=self.refused_context,
            truncated_context=self.truncated_context,
            truncated_tokens=self.truncated_tokens,
            refused_unfittable=self.refused_unfittable,
            waiting_at_end=len(self.waiting),
            sessions_started=self.sessions_started,
            utilisation=util,
        )

    def _counters(self, now: float) -> dict[str, float]:
        """Cumulative busy seconds / bytes of each resource at `now` (for window deltas)."""
        self._kv_change(now, 0)
        return {
            "t": now,
            "prefill_gpu": sum(p.busy_s - max(0.0, p.gpu_free_s - now) for p in self.pre),
            "prefill_snic": sum(p.read_bytes for p in self.pre)
            - sum(max(0.0, p.snic_free_s - now) * self.snic_bw for p in self.pre),
            "decode_snic": sum(d.read_bytes for d in self.dec)
            - sum(max(0.0, d.snic_free_s - now) * self.snic_bw for d in self.dec),
            "prefill_cnic": sum(p.cnic_bytes for p in self.pre)
            - sum(max(0.0, p.cnic_free_s - now) * self.cnic_bw for p in self.pre),
            "decode_cnic": sum(d.cnic_bytes for d in self.dec)
            - sum(max(0.0, d.cnic_free_s - now) * self.cnic_bw for d in self.dec),
            "decode_kv_memory": float(self.kv_area),
        }

    def _utilisation(self, end: float) -> dict[str, float]:
        c1 = self._counters(end)
        c0 = self.snap or dict.fromkeys(c1, 0.0)
        span = c1["t"] - c0["t"]
        if span <= 0:
            return dict.fromkeys(RESOURCES, 0.0)
        npre, ndec = len(self.pre), len(self.dec)
        cap = {
            "prefill_gpu": npre * span,
            "prefill_snic": npre * self.snic_bw * span,
            "decode_snic": ndec * self.snic_bw * span,
            "prefill_cnic": npre * self.cnic_bw * span,
            "decode_cnic": ndec * self.cnic_bw * span,
            "decode_kv_memory": ndec * float(self.kv_capacity) * span,
        }
        return {k: round(max(0.0, min(1.0, (c1[k] - c0[k]) / cap[k])), 4) for k in RESOURCES}

    def _path_d_frac(self) -> float:
        total = self.read_p + self.read_d
        return self.read_d / total if total else 0.0


def _stderr_progress(name: str, now: float, horizon: float, turns: int) -> None:
    h = f"/{horizon:.0f}" if math.isfinite(horizon) else ""
    sys.stderr.write(f"[sim {name}] t={now:.1f}{h}s turns={turns}\n")
    sys.stderr.flush()


def slo_attainment(r: SimResult, ttft_s: float, tpot_s: float | None) -> float | None:
    """Fraction of measured turns meeting both SLOs (turns unfinished at the end fail)."""
    if not r.ttft_s:
        return None
    tpot = r.tpot_s
    ok = sum(
        1
        for i, t in enumerate(r.ttft_s[: len(tpot)])
        if t <= ttft_s and (tpot_s is None or tpot[i] <= tpot_s)
    )
    return round(ok / len(r.ttft_s), 4)
