"""The connector's scheduler half (runs in vLLM's engine-core process; no I/O, no torch).

It learns each request's hit from its route (`plan.Route`, from `Scheduler.Route`'s block
index), in whole vLLM blocks (`blocks.py`), never by probing the store; and each step it plans
the loads of newly allocated hits and the saves of the store blocks the step completes.

Between instances (`plan.py`): a *receiver* (decode) answers the prompt but its last token,
loaded asynchronously (vLLM allocates the blocks and parks the request until the worker half
reports it received, then recomputes the last token), and plans one `RecvPlan` once the
blocks are allocated; a *sender* (prefill) plans, on path D, its hit as a NIXL read from the
decode's blocks, and, in the step that computes the prompt's last token, a `SendPlan` of the
blocks the decode lacks (path D: from the hit's end; otherwise every prompt block).

A hit is, by default (`async_loads`), loaded asynchronously too: vLLM parks the request with
its blocks allocated, the worker half moves the hit (read from the store; path D on a prefill
instance, streamed from the decode's cache layer by layer as the decode reads it) and
reports it received, and only then does vLLM schedule its compute. So one request's hit
overlaps the compute of the others, instead of each forward waiting for its batch's hits
(load + compute, one after the other; docs/vllm.md "Measured").
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dualpath.integrations.vllm import blocks
from dualpath.integrations.vllm.plan import (
    PARAMS_KEY,
    LoadPlan,
    RecvPlan,
    Route,
    SavePlan,
    SendPlan,
    StepPlan,
)

log = logging.getLogger(__name__)

# chain ids of a token sequence under a salt: kv.ids.block_ids bound to the served model
BlockIdsFn = Callable[[Sequence[int], bytes], list[str]]


@dataclass
class _Request:
    request: Any  # vllm.v1.request.Request (its all_token_ids grow as it decodes)
    route: Route
    local_computed: int = 0  # tokens vLLM's own prefix cache had (get_num_new_matched_tokens)
    load: tuple[int, int] | None = None  # tokens [start, end) to load, once allocated
    loaded_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    received: bool = False  # receiver: its one receive is planned (a preempted one recomputes)
    load_planned: bool = False  # its one asynchronous load is planned (the same)
    received_tokens: int = 0


class SchedulerSide:
    def __init__(
        self,
        vllm_block: int,
        store_block: int,
        block_ids: BlockIdsFn,
        async_loads: bool = True,
    ) -> None:
        blocks.check_block_sizes(vllm_block, store_block)
        self.vllm_block = vllm_block
        self.store_block = store_block
        self.block_ids = block_ids
        self.async_loads = async_loads
        self._reqs: dict[str, _Request] = {}
        self._recvs: list[RecvPlan] = []  # allocated receivers, for the next step's plan
        self._async_loads: list[LoadPlan] = []  # allocated parked loads, the same

    def _state(self, request: Any) -> _Request:
        st = self._reqs.get(request.request_id)
        if st is None:
            try:
                route = Route.of(request.kv_transfer_params)
            except ValueError as err:  # a malformed route is no hit, never a wrong load
                log.warning("request %s: %s; no hit loaded", request.request_id, err)
                route = Route()
            st = self._reqs[request.request_id] = _Request(request, route)
        return st

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """(tokens vLLM may take as computed, whether they arrive asynchronously)."""
        st = self._state(request)
        st.local_computed = num_computed_tokens
        if st.route.receive:
            if st.received:  # received (or given up) once: a preempted request recomputes
                return 0, False
            n = blocks.received_tokens(request.num_prompt_tokens) - num_computed_tokens
            return (n, True) if n > 0 else (0, False)
        hit = blocks.new_matched_tokens(
            st.route.hit_tokens, request.num_prompt_tokens, num_computed_tokens, self.vllm_block
        )
        if hit and self.async_loads:
            if st.load_planned:  # loaded (or given up) once: a preempted request recomputes
                return 0, False
            return hit, True
        return hit, False

    def update_state_after_alloc(
        self, request: Any, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """`block_ids`: the request's vLLM blocks (its first KV cache group's)."""
        st = self._state(request)
        if num_external_tokens <= 0:
            return
        end = st.local_computed + num_external_tokens
        if st.route.receive:
            if not st.received:
                st.received = True
                st.received_tokens = end
                self._recvs.append(self._recv(request.request_id, st, list(block_ids), end))
            return
        st.load = (st.local_computed, end)
        if self.async_loads and not st.load_planned:
            st.load_planned = True
            st.block_table = list(block_ids)
            self._async_loads.append(self._load(request.request_id, st))

    def _recv(self, req_id: str, st: _Request, table: list[int], tokens: int) -> RecvPlan:
        r = st.route
        hit = None
        if r.read_path == "decode":  # path D: this node reads the hit into its own blocks
            n = blocks.usable_hit_tokens(
                r.hit_tokens, st.request.num_prompt_tokens, self.vllm_block
            )
            if n:
                sb = self.store_block
                ids = self.block_ids(st.request.all_token_ids[:n], r.cache_salt)
                hit = LoadPlan(
                    req_id=req_id,
                    path="decode",
                    block_ids=ids[: n // sb],
                    start=0,
                    end=n,
                    slots=blocks.slots(table, 0, n, self.vllm_block),
                    block_table=table,
                )
        return RecvPlan(
            req_id=req_id,
            xfer_id=r.xfer_id,
            path=r.read_path if r.hit_tokens else "none",
            block_table=table,
            tokens=tokens,
            deadline_unix=r.deadline_unix,
            hit=hit,
        )

    def build(self, so: Any) -> StepPlan:
        """The step's plan from vLLM's SchedulerOutput."""
        plan = StepPlan(recvs=self._recvs, async_loads=self._async_loads)
        self._recvs, self._async_loads = [], []
        for new in so.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:
                continue
            st.block_table = list(new.block_ids[0])
            if st.load is not None:
                plan.loads.append(self._load(new.req_id, st))
            before = new.num_computed_tokens
            after = before + so.num_scheduled_tokens[new.req_id]
            self._save(plan, new.req_id, st, before, after)
            self._send(plan, new.req_id, st, before, after)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                st.block_table = list(new_ids[0]) if new_ids else []
                if st.load is not None:  # preempted before its hit was loaded
                    plan.loads.append(self._load(req_id, st))
            elif new_ids:
                st.block_table.extend(new_ids[0])
            before = cached.num_computed_tokens[i]
            after = before + so.num_scheduled_tokens[req_id]
            self._save(plan, req_id, st, before, after)
            self._send(plan, req_id, st, before, after)
        return plan

    def _load(self, req_id: str, st: _Request) -> LoadPlan:
        start, end = st.load
        st.load = None
        st.loaded_tokens = end - start
        sb, vb = self.store_block, self.vllm_block
        r = st.route
        if r.send_to is not None and r.read_path == "decode":
            # path D between instances: the hit is in the decode's blocks, read over NIXL
            first, last = start // vb, end // vb
            return LoadPlan(
                req_id=req_id,
                path="decode",
                block_ids=[],
                start=start,
                end=end,
                slots=[],
                block_table=list(st.block_table),
                source=r.send_to,
                local_blocks=list(st.block_table[first:last]),
                remote_blocks=list(r.send_to.block_ids[first:last]),
                deadline_unix=r.deadline_unix,
            )
        ids = self.block_ids(st.request.all_token_ids[:end], r.cache_salt)
        return LoadPlan(
            req_id=req_id,
            path=r.read_path,
            block_ids=ids[start // sb : end // sb],
            start=start,
            end=end,
            slots=blocks.slots(st.block_table, start, end, vb),
            block_table=list(st.block_table),
        )

    def _send(self, plan: StepPlan, req_id: str, st: _Request, before: int, after: int) -> None:
        """A sender's step that computes the prompt's last token sends what the decode lacks
        (a step that recomputes it after a failed load sends again: the worker half sends a
        transfer once)."""
        r, n = st.route, st.request.num_prompt_tokens
        if r.send_to is None or not before < n <= after:
            return
        vb = self.vllm_block
        first = (
            blocks.usable_hit_tokens(r.hit_tokens, n, vb) // vb if r.read_path == "decode" else 0
        )
        last = min(-(-n // vb), len(r.send_to.block_ids), len(st.block_table))
        if first >= last:
            return
        plan.sends.append(
            SendPlan(
                req_id=req_id,
                xfer_id=r.xfer_id,
                path=r.read_path if r.hit_tokens else "prefill",
                target=r.send_to,
                local_blocks=list(st.block_table[first:last]),
                remote_blocks=list(r.send_to.block_ids[first:last]),
                deadline_unix=r.deadline_unix,
            )
        )

    def _save(self, plan: StepPlan, req_id: str, st: _Request, before: int, after: int) -> None:
        done = blocks.completed_store_blocks(before, after, self.store_block)
        if not done:
            return
        sb = self.store_block
        start, end = done.start * sb, done.stop * sb
        tokens = list(st.request.all_token_ids[:end])
        if len(tokens) < end:  # tokens not known here yet (async scheduling): not saved
            log.debug("request %s: tokens up to %d unknown; blocks not saved", req_id, end)
            return
        plan.saves.append(
            SavePlan(
                req_id=req_id,
                tokens=tokens,
                start=start,
                slots=blocks.slots(st.block_table, start, end, self.vllm_block),
                salt=st.route.cache_salt,
            )
        )

    def request_finished(self, request: Any) -> dict[str, Any] | None:
        """Forget the request; its answer's `kv_transfer_params` say what was loaded, how."""
        st = self._reqs.pop(request.request_id, None)
        if st is None:
            return None
        return {
            PARAMS_KEY: {
                "read_path": st.route.read_path if st.loaded_tokens else "none",
                "loaded_tokens": st.loaded_tokens,
                "route_hit_tokens": st.route.hit_tokens,
                "received_tokens": st.received_tokens,
            }
        }
