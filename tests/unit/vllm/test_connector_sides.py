"""The connector's two halves without vLLM: the scheduler half on stand-ins of vLLM's request
and scheduler output, the worker half on a real store and a paged cache laid out as vLLM's
CPU attention lays it out (`_vllm_reshape_and_cache`, an independent restatement of it; the
real kernel is checked in tests/integration/vllm when vLLM is installed). The NIXL flow
between two instances runs a decode connector (receiver) and a prefill connector (sender) in
one process with two real NIXL agents (UCX)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from dualpath.integrations.vllm import blocks, cache
from dualpath.integrations.vllm.connector_config import ConnectorConfig
from dualpath.integrations.vllm.nixl import block_descs
from dualpath.integrations.vllm.plan import KvTarget, RecvPlan, Route, StepPlan
from dualpath.integrations.vllm.rendezvous import RendezvousError
from dualpath.integrations.vllm.scheduler_side import SchedulerSide
from dualpath.integrations.vllm.worker_side import WorkerSide
from dualpath.kv.ids import block_ids
from tiny_configs import tiny_local

VB, SB = 128, 64  # vLLM's block, the store's


def _vllm_reshape_and_cache(key, value, key_cache, value_cache, slots) -> None:  # noqa: ANN001
    """vLLM 0.32's CPU layout: per block and head, K is (head_dim, block) and V (block, dim)."""
    bs = key_cache.shape[2]
    nb, heads = key_cache.shape[:2]
    k = key_cache.reshape(nb, heads, -1)  # views of the (blocks, heads, 2*bs, hd) halves
    for i, s in enumerate(slots.tolist()):
        b, o = divmod(s, bs)
        for h in range(heads):
            for d in range(key.shape[2]):
                k[b, h, d * bs + o] = key[i, h, d]
            value_cache[b, h, o] = value[i, h]


def test_the_cache_layout_reads_back_what_vllms_layout_wrote() -> None:
    cache.check_layout(
        _vllm_reshape_and_cache, heads=2, head_dim=8, block_size=32, dtype=torch.float32
    )


def _cfg(tmp: Path):
    return tiny_local(
        **{
            "model": {"preset": "tiny64", "name": "dualpath-tiny64", "blockTokens": SB},
            "storage.path": str(tmp / "kv"),
            "storage.capacityBytes": 1 << 28,
        }
    )


def _request(rid: str, tokens: list[int], route: Route | None = None) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=rid,
        all_token_ids=tokens,
        num_prompt_tokens=len(tokens),
        kv_transfer_params=route.params() if route else None,
    )


def _step(rid: str, tokens: list[int], table: list[int], computed: int, scheduled: int):
    new = SimpleNamespace(
        req_id=rid, prompt_token_ids=tokens, block_ids=(table,), num_computed_tokens=computed
    )
    cached = SimpleNamespace(
        req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[]
    )
    return SimpleNamespace(
        scheduled_new_reqs=[new],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={rid: scheduled},
    )


def _worker(tmp: Path, cfg) -> tuple[WorkerSide, dict[int, torch.Tensor]]:
    m = cfg.spec.model
    caches = {
        f"model.layers.{i}.self_attn.attn": torch.zeros(16, m.kv_heads, VB, 2 * m.head_dim)
        for i in range(m.layers)
    }
    w = WorkerSide(cfg, ConnectorConfig(storage=str(tmp / "kv"), node_id="t"))
    w.register_kv_caches(caches, _vllm_reshape_and_cache)
    return w, {i: t for i, t in enumerate(caches.values())}


def _forward(w: WorkerSide, caches, plan, kv_of_tokens=None) -> None:  # noqa: ANN001
    """What vLLM does around one forward: loads, per layer wait / (compute) / save, then save."""
    w.step_started()
    w.start_load(plan)
    for layer, t in caches.items():
        w.wait_for_layer(layer)
        if kv_of_tokens is not None:  # "compute": write this step's K/V as attention would
            slots, k, v = kv_of_tokens(layer)
            cache.write_tokens(t, slots, k, v)
        w.save_layer(plan, layer, t)
    w.finish_loads()
    w.wait_for_save()


def _received(w: WorkerSide, req_id: str, timeout_s: float = 30.0) -> None:
    """What vLLM does while a request is parked: a step each poll until the worker reports it."""
    deadline = time.monotonic() + timeout_s
    while req_id not in w.finished_receiving():
        assert time.monotonic() < deadline, f"{req_id} never reported received"
        time.sleep(0.005)


def _load_and_compute(sched, worker, caches, req, table, hit, computed, scheduled) -> StepPlan:  # noqa: ANN001
    """One hit's load as vLLM drives it, both `store_load` modes: parked (async: the load is
    planned at allocation and reported received before the request's forward) or inside the
    request's forward (layerwise). Returns the forward's plan."""
    sched.update_state_after_alloc(req, table, hit)
    if sched.async_loads:
        parked = sched.build(_idle_step())
        (load,) = parked.async_loads
        assert not parked.loads
        _forward(worker, caches, parked)  # a step of other requests: the read runs meanwhile
        _received(worker, req.request_id)
    plan = sched.build(_step(req.request_id, req.all_token_ids, table, computed, scheduled))
    assert len(plan.loads) == (0 if sched.async_loads else 1)
    _forward(worker, caches, plan)
    return plan


def _idle_step() -> SimpleNamespace:
    cached = SimpleNamespace(
        req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[]
    )
    return SimpleNamespace(
        scheduled_new_reqs=[], scheduled_cached_reqs=cached, num_scheduled_tokens={}
    )


@pytest.mark.parametrize("parked", [True, False], ids=["async", "layerwise"])
def test_a_turn_saves_its_blocks_and_the_next_loads_them(tmp_path: Path, parked: bool) -> None:
    cfg = _cfg(tmp_path)
    m = cfg.spec.model
    ids = lambda t, salt: block_ids(t, m, salt=salt)  # noqa: E731
    sched = SchedulerSide(VB, SB, ids, async_loads=parked)
    worker, caches = _worker(tmp_path, cfg)
    tokens = [5 + i % 300 for i in range(300)]
    gen = torch.Generator().manual_seed(1)
    kv = {
        layer: (torch.randn(300, m.kv_heads, m.head_dim, generator=gen),
                torch.randn(300, m.kv_heads, m.head_dim, generator=gen))
        for layer in caches
    }  # fmt: skip
    # turn 1: no route, nothing loaded; blocks 0..3 (256 tokens) saved from vLLM blocks [2, 5, 6]
    r1 = _request("r1", tokens)
    assert sched.get_num_new_matched_tokens(r1, 0) == (0, False)
    sched.update_state_after_alloc(r1, [], 0)
    plan = sched.build(_step("r1", tokens, [2, 5, 6], 0, 300))
    assert not plan.loads and [(s.start, len(s.tokens)) for s in plan.saves] == [(0, 256)]
    slots = torch.tensor(blocks.slots([2, 5, 6], 0, 300, VB))  # where vLLM computes them
    _forward(worker, caches, plan, lambda layer: (slots, *kv[layer]))
    assert set(ids(tokens, b"")[:4]) <= {p.name for p in (tmp_path / "kv/blocks").rglob("*")}
    assert sched.request_finished(r1)["dualpath"]["loaded_tokens"] == 0
    # turn 2: the route says 4 store blocks hit; vLLM loads 2 whole vLLM blocks into [9, 4, ...]
    t2 = tokens + [7] * 100
    r2 = _request("r2", t2, Route(256, "decode"))
    assert sched.get_num_new_matched_tokens(r2, 0) == (256, parked)
    for t in caches.values():
        t.zero_()
    sched.update_state_after_alloc(r2, [9, 4, 11, 12], 256)
    loads = sched.build(_idle_step() if parked else _step("r2", t2, [9, 4, 11, 12], 256, 144))
    (load,) = loads.async_loads if parked else loads.loads
    assert load.path == "decode" and load.block_ids == ids(t2, b"")[:4]
    _forward(worker, caches, loads)
    if parked:  # reported received; its forward then loads nothing
        _received(worker, "r2")
        plan = sched.build(_step("r2", t2, [9, 4, 11, 12], 256, 144))
        assert not plan.loads and not plan.async_loads
        _forward(worker, caches, plan)
        assert sched.get_num_new_matched_tokens(r2, 0) == (0, False)  # loaded once only
    got = torch.tensor([9 * VB + i for i in range(128)] + [4 * VB + i for i in range(128)])
    for layer, t in caches.items():
        k, v = cache.read_tokens(t, got)
        assert torch.equal(k, kv[layer][0][:256]) and torch.equal(v, kv[layer][1][:256])
    assert worker.take_load_errors() == set()
    worker.shutdown()


@pytest.mark.parametrize("parked", [True, False], ids=["async", "layerwise"])
def test_a_corrupt_block_ends_the_hit_and_names_the_vllm_blocks_to_recompute(
    tmp_path: Path, parked: bool
) -> None:
    cfg = _cfg(tmp_path)
    m = cfg.spec.model
    sched = SchedulerSide(VB, SB, lambda t, salt: block_ids(t, m, salt=salt), async_loads=parked)
    worker, caches = _worker(tmp_path, cfg)
    tokens = [9 + i % 200 for i in range(400)]
    r1 = _request("r1", tokens)
    sched.get_num_new_matched_tokens(r1, 0)
    plan = sched.build(_step("r1", tokens, [1, 2, 3, 4], 0, 400))
    _forward(worker, caches, plan)  # saves blocks 0..5 (whatever the cache holds)
    ids = block_ids(tokens, m)
    third = next((tmp_path / "kv/blocks").rglob(ids[2]))
    with open(third, "r+b") as f:  # garbage in block 2's KV: its checksum fails
        f.seek(third.stat().st_size // 2)
        f.write(os.urandom(64))
    r2 = _request("r2", tokens, Route(384, "prefill"))
    assert sched.get_num_new_matched_tokens(r2, 0) == (384, parked)
    _load_and_compute(sched, worker, caches, r2, [5, 6, 7, 8], 384, 384, 16)
    # a checksum failure in a layer drops the whole hit: every loaded vLLM block is recomputed
    assert worker.take_load_errors() == {5, 6, 7}
    worker.shutdown()


# ---- the NIXL flow between two instances -------------------------------------------------
TARGET = KvTarget("decode-0-vllm-1", b"meta", (4096, 8192), 1024, (3, 4, 5))


def test_a_route_carries_the_receiver_and_the_sender_and_refuses_naming_the_field() -> None:
    recv = Route(256, "decode", "prefill-0", b"\x01", "t1", "t1/x", True, 1e9)
    assert Route.of(recv.params()) == recv
    send = Route(256, "decode", "decode-0", b"", "t1", "t1/x", False, 1e9, TARGET)
    assert Route.of(send.params()) == send
    bad = [
        ({"receive": True, "deadline_unix": 1.0}, "xfer_id"),
        ({"receive": "yes"}, "receive"),
        ({"xfer_id": "x", "deadline_unix": -1}, "deadline_unix"),
        ({"xfer_id": "x", "deadline_unix": 1.0, "send_to": {"agent": "a"}}, "send_to.metadata"),
        ({**send.params()["dualpath"], "receive": True}, "exclude"),
    ]
    for raw, field in bad:
        with pytest.raises(ValueError, match=field):
            Route.of({"dualpath": raw})
    t = TARGET.params() | {"block_ids": []}
    with pytest.raises(ValueError, match="send_to.block_ids"):
        Route.of({"dualpath": {"xfer_id": "x", "deadline_unix": 1.0, "send_to": t}})


def test_a_block_of_a_layer_is_one_descriptor() -> None:
    assert block_descs(1000, 64, [3, 0]) == [(1000 + 192, 64, 0), (1000, 64, 0)]


def _empty_step() -> SimpleNamespace:
    cached = SimpleNamespace(
        req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[]
    )
    return SimpleNamespace(
        scheduled_new_reqs=[], scheduled_cached_reqs=cached, num_scheduled_tokens={}
    )


def test_the_receiver_takes_all_but_the_last_token_once_and_plans_its_own_hit() -> None:
    ids = lambda t, salt: [f"b{i}" for i in range(len(t) // SB)]  # noqa: E731
    sched = SchedulerSide(VB, SB, ids)
    tokens = list(range(400))
    r = _request("r", tokens, Route(300, "decode", xfer_id="x", receive=True, deadline_unix=9.0))
    assert sched.get_num_new_matched_tokens(r, 0) == (399, True)
    sched.update_state_after_alloc(r, [7, 8, 9, 10], 399)
    (recv,) = sched.build(_empty_step()).recvs
    assert (recv.xfer_id, recv.tokens, recv.block_table, recv.deadline_unix) == (
        "x",
        399,
        [7, 8, 9, 10],
        9.0,
    )
    # path D: the receiver's own hit, whole vLLM blocks (300 -> 256), from the store
    assert (recv.hit.start, recv.hit.end, recv.hit.block_ids) == (0, 256, ["b0", "b1", "b2", "b3"])
    assert recv.hit.slots == blocks.slots([7, 8], 0, 256, VB)
    assert sched.build(_empty_step()).recvs == []  # planned once
    # received (or given up) once: a preempted request recomputes, it never waits again
    assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
    one = _request("one", [5], Route(xfer_id="y", receive=True, deadline_unix=9.0))
    assert sched.get_num_new_matched_tokens(one, 0) == (0, False)  # nothing to receive


def test_the_sender_reads_the_hit_from_the_decode_and_sends_only_what_it_lacks() -> None:
    sched = SchedulerSide(VB, SB, lambda t, salt: [], async_loads=False)
    tokens = list(range(400))
    target = KvTarget("d", b"m", (1, 2), 64, (20, 21, 22, 23))
    r = _request("p", tokens, Route(256, "decode", xfer_id="x", deadline_unix=9.0, send_to=target))
    assert sched.get_num_new_matched_tokens(r, 0) == (256, False)
    sched.update_state_after_alloc(r, [5, 6, 7, 8], 256)
    plan = sched.build(_step("p", tokens, [5, 6, 7, 8], 256, 144))
    (load,) = plan.loads
    assert (load.source, load.local_blocks, load.remote_blocks) == (target, [5, 6], [20, 21])
    (send,) = plan.sends
    assert (send.local_blocks, send.remote_blocks, send.xfer_id) == ([7, 8], [22, 23], "x")
    # path P: the prefill computes everything and sends every prompt block, in the step that
    # computes the last prompt token only
    rp = _request("q", tokens, Route(0, "prefill", xfer_id="z", deadline_unix=9.0, send_to=target))
    assert sched.get_num_new_matched_tokens(rp, 0) == (0, False)
    assert sched.build(_step("q", tokens, [1, 2, 3, 4], 0, 200)).sends == []  # chunk 1
    st = sched._reqs["q"]
    st.block_table = [1, 2, 3, 4]
    plan = StepPlan()
    sched._send(plan, "q", st, 200, 400)
    assert [(s.local_blocks, s.remote_blocks) for s in plan.sends] == [
        ([1, 2, 3, 4], [20, 21, 22, 23])
    ]


def _named_worker(tmp: Path, cfg, name: str, blocks_n: int = 16):  # noqa: ANN202
    m = cfg.spec.model
    caches = {
        f"model.layers.{i}.self_attn.attn": torch.zeros(blocks_n, m.kv_heads, VB, 2 * m.head_dim)
        for i in range(m.layers)
    }
    w = WorkerSide(cfg, ConnectorConfig(storage=str(tmp / "kv"), node_id=name))
    w.register_kv_caches(caches, _vllm_reshape_and_cache)
    return w, {i: t for i, t in enumerate(caches.values())}


def _tokens_kv(cache_t: torch.Tensor, table: list[int], start: int, end: int):  # noqa: ANN202
    return cache.read_tokens(cache_t, torch.tensor(blocks.slots(table, start, end, VB)))


@pytest.mark.parametrize("parked", [True, False], ids=["async", "layerwise"])
def test_path_d_streams_the_hit_to_the_prefill_and_the_new_blocks_back(
    tmp_path: Path, parked: bool
) -> None:
    cfg = _cfg(tmp_path)
    decode, dcaches, prefill, pcaches, tokens, kv, scheds = _path_d_pair(
        tmp_path, cfg, "t/1", parked
    )
    # the decode answers at once (its hit streams while it is read); the prefill streams the
    # hit from the decode layer by layer, computes the rest, sends it
    plan, ready = _path_d_sender_plan(decode, scheds, tokens, "t/1")
    assert ready.hit_tokens == 256 and ready.target.block_ids == (1, 2, 3, 4)
    assert ready.target.progress_address
    new_slots = torch.tensor(blocks.slots([5, 6, 7, 8], 256, 400, VB))
    compute = lambda layer: (new_slots, kv[layer][0][256:], kv[layer][1][256:])  # noqa: E731
    if parked:
        _computed_after_parked(prefill, pcaches, scheds[1], tokens, plan, compute)
    else:
        _forward(prefill, pcaches, plan, compute)
    assert prefill.take_load_errors() == set()
    for layer, t in pcaches.items():  # the hit came from the decode's cache
        assert torch.equal(_tokens_kv(t, [5, 6], 0, 256)[1], kv[layer][1][:256])
    _received(decode, "rd")  # the notification: bounded polls, not a timing assertion
    assert decode.take_load_errors() == set()
    for layer, t in dcaches.items():  # every prompt token but the last is in the decode's
        assert torch.equal(_tokens_kv(t, [1, 2], 0, 256)[0], kv[layer][0][:256])
        k, v = _tokens_kv(t, [1, 2, 3, 4], 0, 399)
        assert torch.equal(k, kv[layer][0][:399]) and torch.equal(v, kv[layer][1][:399])
    decode.shutdown()
    prefill.shutdown()


def test_a_receiver_past_its_deadline_is_received_with_its_blocks_to_recompute(
    tmp_path: Path,
) -> None:
    cfg = _cfg(tmp_path)
    decode, _ = _named_worker(tmp_path, cfg, "decode-0")
    with pytest.raises(RendezvousError, match="not ready"):
        decode.wait_ready("nobody", 0.01)
    gone = RecvPlan("r", "x", "prefill", [3, 4, 5], 300, time.time() - 1)
    decode.start_load(StepPlan(recvs=[gone]))
    assert decode.wait_ready("x", 1).target.block_ids == (3, 4, 5)
    assert decode.finished_receiving() == {"r"}
    assert decode.take_load_errors() == {3, 4, 5}  # no hit of its own: all recomputed
    assert decode.finished_receiving() == set()  # reported once
    decode.shutdown()


def test_a_failed_hit_read_recomputes_the_hit_and_sends_nothing_that_step(tmp_path: Path) -> None:
    """The decode's agent cannot be reached (here: metadata NIXL refuses): the prefill's hit
    blocks are load errors (vLLM recomputes them) and the step sends no KV computed over a
    hit it does not hold; the recompute's step may still send (the transfer is not spent)."""
    cfg = _cfg(tmp_path)
    prefill, pcaches = _named_worker(tmp_path, cfg, "prefill-0")
    m = cfg.spec.model
    target = KvTarget(
        "decode-0-vllm-1", b"not NIXL metadata", tuple(range(1 << 20, (m.layers + 1) << 20, 1 << 20)),
        prefill.agent.block_bytes, (1, 2, 3, 4),
    )  # fmt: skip
    sched = SchedulerSide(VB, SB, lambda t, salt: [], async_loads=False)
    tokens = list(range(400))
    route = Route(256, "decode", xfer_id="t/2", deadline_unix=time.time() + 60, send_to=target)
    r = _request("rp", tokens, route)
    sched.get_num_new_matched_tokens(r, 0)
    sched.update_state_after_alloc(r, [5, 6, 7, 8], 256)
    plan = sched.build(_step("rp", tokens, [5, 6, 7, 8], 256, 144))
    assert plan.sends
    _forward(prefill, pcaches, plan)
    assert prefill.take_load_errors() == {5, 6}
    assert "t/2" not in prefill._sent
    prefill.shutdown()


class _GatedReads:
    """The decode's store reads, each layer from 1 on held until the test opens its gate."""

    def __init__(self, queue, layers: int) -> None:  # noqa: ANN001
        self.queue, self.submit_real = queue, queue.submit
        self.gates = [threading.Event() for _ in range(layers)]
        self.gates[0].set()
        self.asked: list[int] = []  # layers the decode's reader asked for, in order
        queue.submit = self.submit

    def submit(self, ids, out=None):  # noqa: ANN001, ANN201
        handle = self.submit_real(ids, out)
        real = handle.layer_sync

        def layer_sync(layer: int, timeout: float | None = None):  # noqa: ANN202
            self.asked.append(layer)
            assert self.gates[layer].wait(60), f"layer {layer}'s gate never opened"
            return real(layer, timeout)

        handle.layer_sync = layer_sync
        return handle


def test_path_d_waits_for_layer_l_only_while_later_layers_are_still_read(tmp_path: Path) -> None:
    """The pipeline storage -> decode -> prefill: the prefill's wait for layer 0 of a path-D
    hit returns (with layer 0's KV, from the decode's cache) while the decode's store read of
    layer 1 is still held; each later layer's wait returns once that layer is let through."""
    cfg = _cfg(tmp_path)
    m = cfg.spec.model
    assert m.layers >= 2
    decode, dcaches, prefill, pcaches, tokens, kv, scheds = _path_d_pair(tmp_path, cfg, "t/3")
    gated = _GatedReads(decode.read_queue, m.layers)
    plan, _ = _path_d_sender_plan(decode, scheds, tokens, "t/3")
    new_slots = torch.tensor(blocks.slots([5, 6, 7, 8], 256, 400, VB))
    waited: list[int] = []  # layers whose wait returned with their KV, the next one held

    def forward() -> None:
        prefill.start_load(plan)
        for layer, t in pcaches.items():
            prefill.wait_for_layer(layer)
            held = layer + 1 == m.layers or not gated.gates[layer + 1].is_set()
            got = _tokens_kv(t, [5, 6], 0, 256)[0]
            waited.append(layer if held and torch.equal(got, kv[layer][0][:256]) else -1)
            cache.write_tokens(t, new_slots, kv[layer][0][256:], kv[layer][1][256:])
            prefill.save_layer(plan, layer, t)
        prefill.finish_loads()
        prefill.wait_for_save()

    fwd = threading.Thread(target=forward)
    fwd.start()
    for layer in range(1, m.layers):  # let layer l be read once the prefill has layer l-1
        for _ in range(6000):  # bounded polls, not a timing assertion
            if len(waited) >= layer or not fwd.is_alive():
                break
            time.sleep(0.01)
        assert waited == list(range(layer)), "the prefill's wait for a layer needed a later one"
        gated.gates[layer].set()
    fwd.join(60)
    assert not fwd.is_alive() and waited == list(range(m.layers))
    assert gated.asked == list(range(m.layers))  # the decode read each layer once, in order
    assert prefill.take_load_errors() == set()
    _received(decode, "rd")  # the notification: bounded polls, not a timing assertion
    assert decode.take_load_errors() == set()
    for layer, t in dcaches.items():
        k, v = _tokens_kv(t, [1, 2, 3, 4], 0, 399)
        assert torch.equal(k, kv[layer][0][:399]) and torch.equal(v, kv[layer][1][:399])
    decode.shutdown()
    prefill.shutdown()


def _path_d_pair(tmp: Path, cfg, xfer_id: str, parked: bool = False):  # noqa: ANN001, ANN202
    """A decode whose store holds tokens [0, 256) of `tokens` (an earlier turn saved them)
    and whose scheduler half parked the turn as receiver `xfer_id` (path D, hit 256, its
    blocks 1..4); a prefill (`parked`: its hit loads while vLLM parks the request, else inside
    its forward, layer by layer); both scheduler halves (decode, prefill)."""
    m = cfg.spec.model
    ids = lambda t, salt: block_ids(t, m, salt=salt)  # noqa: E731
    decode, dcaches = _named_worker(tmp, cfg, "decode-0")
    prefill, pcaches = _named_worker(tmp, cfg, "prefill-0")
    gen = torch.Generator().manual_seed(5)
    tokens = [7 + i % 200 for i in range(400)]
    kv = {
        layer: (torch.randn(400, m.kv_heads, m.head_dim, generator=gen),
                torch.randn(400, m.kv_heads, m.head_dim, generator=gen))
        for layer in dcaches
    }  # fmt: skip
    dsched = SchedulerSide(VB, SB, ids)
    r0 = _request("r0", tokens[:300])
    dsched.get_num_new_matched_tokens(r0, 0)
    plan = dsched.build(_step("r0", tokens[:300], [9, 10, 11], 0, 300))
    slots0 = torch.tensor(blocks.slots([9, 10, 11], 0, 300, VB))
    _forward(decode, dcaches, plan, lambda layer: (slots0, kv[layer][0][:300], kv[layer][1][:300]))
    rd = _request("rd", tokens, Route(256, "decode", xfer_id=xfer_id, receive=True,
                                      deadline_unix=time.time() + 120))  # fmt: skip
    assert dsched.get_num_new_matched_tokens(rd, 0) == (399, True)
    dsched.update_state_after_alloc(rd, [1, 2, 3, 4], 399)
    psched = SchedulerSide(VB, SB, ids, async_loads=parked)
    return decode, dcaches, prefill, pcaches, tokens, kv, (dsched, psched)


def _path_d_sender_plan(decode: WorkerSide, scheds, tokens: list[int], xfer_id: str):  # noqa: ANN001, ANN202
    """The decode starts its receiver (its store read runs) and answers the rendezvous; the
    prefill's first step (parked: the step that starts its hit's load), and the answer."""
    dsched, psched = scheds
    decode.start_load(dsched.build(_empty_step()))
    ready = decode.wait_ready(xfer_id, 60)
    rp = _request("rp", tokens, Route(ready.hit_tokens, "decode", xfer_id=xfer_id,
                                      deadline_unix=time.time() + 120, send_to=ready.target))  # fmt: skip
    assert psched.get_num_new_matched_tokens(rp, 0) == (256, psched.async_loads)
    psched.update_state_after_alloc(rp, [5, 6, 7, 8], 256)
    if psched.async_loads:
        plan = psched.build(_idle_step())
        assert [p.req_id for p in plan.async_loads] == ["rp"] and not plan.loads
        return plan, ready
    return psched.build(_step("rp", tokens, [5, 6, 7, 8], 256, 144)), ready


def _computed_after_parked(prefill: WorkerSide, pcaches, psched, tokens, parked_plan, kv_of=None):  # noqa: ANN001, ANN202
    """A parked prefill request: the step that starts its load, the steps until it is reported
    received, then the step that computes the rest of its prompt (and sends it)."""
    _forward(prefill, pcaches, parked_plan)
    _received(prefill, "rp", timeout_s=60)
    plan = psched.build(_step("rp", tokens, [5, 6, 7, 8], 256, 144))
    assert not plan.loads and not plan.async_loads and plan.sends
    _forward(prefill, pcaches, plan, kv_of)
    return plan


def test_a_parked_hit_the_decode_could_not_read_is_recomputed_then_sent(tmp_path: Path) -> None:
    """Parked: every store block is corrupt, the decode's read of its hit fails, the prefill
    reports the request received with its hit's blocks as load errors (vLLM recomputes them
    in the step that computes the prompt), and that step sends what the decode lacks; the
    decode, whose own hit ended at 0, recomputes the blocks it was not sent."""
    cfg = _cfg(tmp_path)
    decode, _, prefill, pcaches, tokens, _, scheds = _path_d_pair(tmp_path, cfg, "t/5", True)
    for p in (tmp_path / "kv" / "blocks").rglob("*"):
        if p.is_file():
            with open(p, "r+b") as f:
                f.seek(p.stat().st_size // 2)
                f.write(os.urandom(64))
    plan, _ = _path_d_sender_plan(decode, scheds, tokens, "t/5")
    _forward(prefill, pcaches, plan)
    _received(prefill, "rp", timeout_s=60)
    assert prefill.take_load_errors() == {5, 6}
    step = scheds[1].build(_step("rp", tokens, [5, 6, 7, 8], 0, 400))  # the recompute
    _forward(prefill, pcaches, step)
    assert "t/5" in prefill._sent
    _received(decode, "rd")  # the notification: bounded polls, not a timing assertion
    assert decode.take_load_errors() == {1, 2, 3, 4}
    decode.shutdown()
    prefill.shutdown()


def test_a_parked_path_d_read_takes_each_layer_as_the_decode_reads_it(tmp_path: Path) -> None:
    """The pipeline storage -> decode -> prefill with the request parked: each step's poll
    READs the layers the decode has read so far, so layer 0 is in the prefill's cache while
    the decode's store read of layer 1 is still held; reported received once all are in."""
    cfg = _cfg(tmp_path)
    m = cfg.spec.model
    decode, _, prefill, pcaches, tokens, kv, scheds = _path_d_pair(tmp_path, cfg, "t/6", True)
    gated = _GatedReads(decode.read_queue, m.layers)
    plan, _ = _path_d_sender_plan(decode, scheds, tokens, "t/6")
    _forward(prefill, pcaches, plan)
    received: set[str] = set()

    def layer_in(layer: int) -> bool:
        return torch.equal(_tokens_kv(pcaches[layer], [5, 6], 0, 256)[0], kv[layer][0][:256])

    for layer in range(m.layers):
        for _ in range(6000):  # the steps of a parked request: bounded polls
            received |= prefill.finished_receiving()
            if layer_in(layer):
                break
            time.sleep(0.01)
        assert layer_in(layer), f"layer {layer} never reached the prefill"
        assert not any(g.is_set() for g in gated.gates[layer + 1 :])  # still held at the decode
        if layer + 1 < m.layers:
            assert "rp" not in received  # not every layer is in yet
            gated.gates[layer + 1].set()
    if "rp" not in received:
        _received(prefill, "rp", timeout_s=60)
    assert prefill.take_load_errors() == set()
    decode.shutdown()
    prefill.shutdown()


def test_a_hit_the_decode_could_not_read_is_recomputed_and_sent_in_the_next_step(
    tmp_path: Path,
) -> None:
    """Every store block is corrupt: the decode's read of its hit fails part-way, the prefill
    (streaming it) recomputes the hit and its step sends nothing; the recompute step, which
    vLLM starts after its forward (it has no load), sends; the decode, whose own hit ended
    at 0, recomputes the blocks it was not sent (load errors), never a wrong answer."""
    cfg = _cfg(tmp_path)
    decode, _, prefill, pcaches, tokens, _, scheds = _path_d_pair(tmp_path, cfg, "t/4")
    for p in (tmp_path / "kv" / "blocks").rglob("*"):
        if p.is_file():  # 64 bytes of garbage in the middle of every block
            with open(p, "r+b") as f:
                f.seek(p.stat().st_size // 2)
                f.write(os.urandom(64))
    plan, _ = _path_d_sender_plan(decode, scheds, tokens, "t/4")
    _forward(prefill, pcaches, plan)
    assert prefill.take_load_errors() == {5, 6} and "t/4" not in prefill._sent
    st = scheds[1]._reqs["rp"]
    again = StepPlan()
    scheds[1]._send(again, "rp", st, 0, 400)  # the recompute step computes every token
    for layer, t in pcaches.items():  # vLLM's order in a step without loads
        prefill.wait_for_layer(layer)
        prefill.save_layer(again, layer, t)
    prefill.start_load(again)
    prefill.finish_loads()
    prefill.wait_for_save()
    assert "t/4" in prefill._sent
    _received(decode, "rd")  # the notification: bounded polls, not a timing assertion
    assert decode.take_load_errors() == {1, 2, 3, 4}
    decode.shutdown()
    prefill.shutdown()


def test_a_forward_is_timed_from_its_bound_plan_when_its_loads_start_after_it(
    tmp_path: Path,
) -> None:
    """A step without layerwise loads: vLLM starts its (parked) loads after the forward, so the
    forward's clock (the bench's compute) starts when the plan is bound, before the forward."""
    from dualpath.integrations.vllm import metrics

    worker, caches = _worker(tmp_path, _cfg(tmp_path))
    plan = StepPlan()
    before = metrics.FORWARD_SECONDS._value.get()
    worker.step_started()
    time.sleep(0.05)  # the model's forward, layer by layer
    for layer, t in caches.items():
        worker.save_layer(plan, layer, t)
    worker.start_load(plan)
    worker.finish_loads()
    worker.wait_for_save()
    assert metrics.FORWARD_SECONDS._value.get() - before >= 0.05
    # a step that ran no forward (vLLM polling while requests are parked) is not counted
    before = metrics.FORWARD_SECONDS._value.get()
    worker.step_started()
    time.sleep(0.05)
    worker.start_load(StepPlan())
    worker.finish_loads()
    worker.wait_for_save()
    assert metrics.FORWARD_SECONDS._value.get() == before
    worker.shutdown()


def test_a_step_without_a_forward_pauses_only_while_requests_are_parked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM steps again at once while requests are parked; a bare poll pauses (bounded), a
    step with a forward or a finished request, or with nothing parked, does not."""
    from dualpath.integrations.vllm import worker_side

    worker, caches = _worker(tmp_path, _cfg(tmp_path))
    pauses: list[float] = []
    monkeypatch.setattr(worker_side.time, "sleep", pauses.append)

    def paused(finished: set[str]) -> bool:
        pauses.clear()
        worker.pause_if_idle(finished)
        return pauses == [worker_side.IDLE_STEP_S]

    worker.step_started()
    assert not paused(set())  # nothing parked: vLLM would not poll
    worker._recvs["x"] = object()  # a parked receiver
    assert paused(set())
    assert not paused({"r"})  # something finished: step again at once
    worker.save_layer(StepPlan(), 0, caches[0])  # a forward ran
    assert not paused(set())
    worker._recvs.clear()
    monkeypatch.undo()
    worker.shutdown()
