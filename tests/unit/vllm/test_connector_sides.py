"""The connector's two halves without vLLM: the scheduler half on stand-ins of vLLM's request
and scheduler output, the worker half on a real store and a paged cache laid out as vLLM's
CPU attention lays it out (`_vllm_reshape_and_cache`, an independent restatement of it; the
real kernel is checked in tests/integration/vllm when vLLM is installed)."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import torch
from dualpath.integrations.vllm import blocks, cache
from dualpath.integrations.vllm.connector_config import ConnectorConfig
from dualpath.integrations.vllm.plan import Route
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
    w.start_load(plan)
    for layer, t in caches.items():
        w.wait_for_layer(layer)
        if kv_of_tokens is not None:  # "compute": write this step's K/V as attention would
            slots, k, v = kv_of_tokens(layer)
            cache.write_tokens(t, slots, k, v)
        w.save_layer(plan, layer, t)
    w.finish_loads()
    w.wait_for_save()


def test_a_turn_saves_its_blocks_and_the_next_loads_them_layer_by_layer(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    m = cfg.spec.model
    ids = lambda t, salt: block_ids(t, m, salt=salt)  # noqa: E731
    sched = SchedulerSide(VB, SB, ids)
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
    assert sched.get_num_new_matched_tokens(r2, 0) == (256, False)
    sched.update_state_after_alloc(r2, [9, 4, 11, 12], 256)
    plan = sched.build(_step("r2", t2, [9, 4, 11, 12], 256, 144))
    (load,) = plan.loads
    assert load.path == "decode" and load.block_ids == ids(t2, b"")[:4]
    for t in caches.values():
        t.zero_()
    _forward(worker, caches, plan)
    got = torch.tensor([9 * VB + i for i in range(128)] + [4 * VB + i for i in range(128)])
    for layer, t in caches.items():
        k, v = cache.read_tokens(t, got)
        assert torch.equal(k, kv[layer][0][:256]) and torch.equal(v, kv[layer][1][:256])
    assert worker.take_load_errors() == set()
    worker.shutdown()


def test_a_corrupt_block_ends_the_hit_and_names_the_vllm_blocks_to_recompute(
    tmp_path: Path,
) -> None:
    cfg = _cfg(tmp_path)
    m = cfg.spec.model
    sched = SchedulerSide(VB, SB, lambda t, salt: block_ids(t, m, salt=salt))
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
    assert sched.get_num_new_matched_tokens(r2, 0) == (384, False)
    sched.update_state_after_alloc(r2, [5, 6, 7, 8], 384)
    plan = sched.build(_step("r2", tokens, [5, 6, 7, 8], 384, 16))
    _forward(worker, caches, plan)
    # a checksum failure in a layer drops the whole hit: every loaded vLLM block is recomputed
    assert worker.take_load_errors() == {5, 6, 7}
    worker.shutdown()
