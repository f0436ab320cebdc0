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
"""

from __future__ import annotations

import heapq
import logging
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from dualpath.scheduler.policy import account
from dualpath.scheduler.policy.types import (
    ClusterView,
    NodeState,
    Policy,
    ReadPath,
    RouteRequest,
    Thresholds,
)
from dualpath.sim.model import CostModel, Hardware
from dualpath.trace import Trajectory

log = logging.getLogger(__name__)

ARRIVE, PREFILL_WAKE, PREFILL_DONE, DECODE_DONE, RETRY = 0, 1, 2, 3, 4


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


@dataclass(slots=True)
class _Decode:
    state: NodeState
    snic_free_s: float = 0.0
    cnic_free_s: float = 0.0
    batch: int = 0
    batch_kv_bytes: int = 0
    read_bytes: int = 0
    write_bytes: int = 0


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
        # Per-agent progress.
        self.ctx = [tr.first_tokens for tr in trajectories]
        self.stored = [0] * len(trajectories)
        self.turn_i = [0] * len(trajectories)

    # -- helpers -----------------------------------------------------------------------------

    def _push(self, t: float, kind: int, obj: object) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, obj))

    def _refresh(self, now: float) -> None:
        """Heartbeat: every node reports its read-queue backlog."""
        bw = self.snic_bw
        for n in self.pre:
            n.state.read_pending_bytes = (
                int((n.snic_free_s - now) * bw) if n.snic_free_s > now else 0
            )
        for n in self.dec:
            n.state.read_pending_bytes = (
                int((n.snic_free_s - now) * bw) if n.snic_free_s > now else 0
            )
        self.last_refresh_s = now

    def _new_turn(self, a: int, now: float) -> _Req:
        t = self.trs[a].turns[self.turn_i[a]]
        prompt = self.ctx[a] + t.append_tokens
        hit = min(self.stored[a], prompt - 1) if prompt > 0 else 0
        w = self.cfg.agent_group
        req = _Req(a, self.turn_i[a], prompt, hit, t.gen_tokens, now, w=w)
        req.compute_s = self.cfg.cost.prefill_s(prompt - hit, hit) * w
        req.ctx_bytes = (prompt + t.gen_tokens) * self.cfg.cost.kv_bytes_per_token * w
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
        wbytes = (full - self.stored[a]) * self.cfg.cost.kv_bytes_per_token * w
        if wbytes > 0:
            d.write_bytes += wbytes
            self.write_bytes += wbytes
        self.stored[a] = full
        self.ctx[a] = ctx
        self.turn_i[a] += 1
        tr = self.trs[a]
        if self.turn_i[a] < len(tr.turns):
            self._push(now + tr.turns[self.turn_i[a]].think_s, ARRIVE, a)
        else:
            self.agents_done += w
            self.last_done_s = now
            if self.next_agent < len(self.trs):
                self._push(now, ARRIVE, self.next_agent)
                self.next_agent += 1
        if self.waiting:
            self._retry(now)

    def _retry(self, now: float) -> None:
        # Like the real scheduler's queue, a refused request is re-offered to the policy at
        # most once per heartbeat: nothing it reads changes faster than that (and it bounds
        # the policy calls of an overloaded cluster).
        if now < self.next_retry_s:
            return
        waiting, self.waiting = self.waiting, []
        for i, req in enumerate(waiting):
            if not self._route(req, now):
                self.waiting.extend(waiting[i:])
                self.next_retry_s = now + self.cfg.heartbeat_s
                self._push(self.next_retry_s, RETRY, None)
                break

    # -- the loop ----------------------------------------------------------------------------

    def run(self, progress: Callable[[float, int], None] | None = None) -> SimResult:
        self.decisions = self.waits = self.turns_done = self.agents_done = 0
        self.gen_tokens = self.prompt_tokens = self.window_gen_tokens = 0
        self.read_p = self.read_d = self.cnic_bytes = self.write_bytes = 0
        self.ttft: list[float] = []
        self.tpot: list[float] = []
        self.last_done_s = 0.0
        self.next_retry_s = -math.inf
        cap = self.cfg.max_active_agents or len(self.trs)
        for a, tr in enumerate(self.trs[:cap]):
            self._push(tr.start_s, ARRIVE, a)
        self.next_agent = min(cap, len(self.trs))
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
                if self.waiting:
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
        all_done = self.agents_done == self.cfg.agent_group * sum(1 for t in self.trs if t.turns)
        sim_s = self.last_done_s if all_done else (horizon if math.isfinite(horizon) else now)
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
        )

    def _path_d_frac(self) -> float:
        total = self.read_p + self.read_d
        return self.read_d / total if total else 0.0


def _stderr_progress(name: str, now: float, horizon: float, turns: int) -> None:
    h = f"/{horizon:.0f}" if math.isfinite(horizon) else ""
    sys.stderr.write(f"[sim {name}] t={now:.1f}{h}s turns={turns}\n")
    sys.stderr.flush()
