"""The prefill and decode roles over the in-memory store and transfer engine: both read paths,
bad and vanished hit blocks, stuck reads and dead peers, everywhere (no NIXL, no disk).

Two worker nodes run in the test's process with their real roles, read queues, engines and
gRPC service; only the store (`kv.memory.MemoryStore`, shared like a storage mount) and the KV
transfer (`transfer.fake.MemoryTransfer`) are the fakes. tests/integration/worker/test_paths.py
runs the same paths over NIXL between processes.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from dualpath.kv import block_ids
from dualpath.v1 import scheduler_pb2 as spb
from dualpath.v1 import worker_pb2 as wpb
from dualpath.worker.decode import PrefillFailed
from dualpath.worker.prefill import HitUnavailable
from dualpath.worker.wire import chunk_to_pb, generate_from_pb
from prometheus_client import REGISTRY

BT = 16
DEADLINE_S = 1.0
PATHS = {"prefill": spb.READ_PATH_PREFILL, "decode": spb.READ_PATH_DECODE}


def _request(prefill, rid, prompt, hit, path, max_new=4):
    """A turn as the decode servicer hands it to the role (through the wire's checks)."""
    msg = wpb.GenerateRequest(
        request_id=rid,
        prompt_tokens=prompt,
        hit_tokens=hit,
        max_new_tokens=max_new,
        read_path=PATHS.get(path, spb.READ_PATH_UNSPECIFIED),
        prefill_node=prefill.node_id,
        prefill_address=prefill.address,
    )
    return generate_from_pb(msg, prefill.cfg.spec.model)


async def _generate(decode, req):
    chunks = [chunk_to_pb(c) async for c in decode.decode.generate(req)]
    return [t for c in chunks for t in c.tokens], chunks[0]


async def _turn_then_context(prefill, decode, store, seed):
    """Turn 1 stores its blocks; the next turn's context hits 3 of them."""
    model = decode.cfg.spec.model
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(4, model.vocab_size, (50,), generator=g).tolist()
    gen1, first = await _generate(decode, _request(prefill, f"t1-{seed}", prompt, 0, "none", 3))
    assert first.hit_tokens == 0
    ctx = prompt + gen1 + [7, 8, 9]
    ids = block_ids(ctx, model)
    assert store.lookup(ids) == 3  # prompt + generated, last token's KV not computed yet
    clean, _ = await _generate(decode, _request(prefill, f"ref-{seed}", ctx, 0, "none"))
    return ctx, ids, clean


async def _all_regions_back(*nodes, within_s=5.0):
    loop = asyncio.get_running_loop()
    end = loop.time() + within_s
    while any(n.transfer.pool.regions for n in nodes) and loop.time() < end:
        await asyncio.sleep(0.02)
    return [n.transfer.pool.regions for n in nodes] == [0] * len(nodes)


async def test_each_path_reads_on_its_own_side_and_leaves_the_same_kv(cluster):
    prefill, decode, store, _ = cluster
    ctx, _, clean = await _turn_then_context(prefill, decode, store, seed=3)
    hit = 3 * BT
    kv, logits = {}, {}
    for path in ("prefill", "decode"):
        reads = (prefill.read_queue.read_bytes, decode.read_queue.read_bytes)
        writes = (prefill.transfer.stats.writes, decode.transfer.stats.writes)
        req = _request(prefill, f"kv-{path}", ctx, hit, path)
        with decode.transfer.active():
            kv[path], logits[path], used_hit, used_path = await decode.decode._prefill(
                req, ctx, hit, path
            )
        assert (used_hit, used_path) == (hit, path)
        read_p = prefill.read_queue.read_bytes - reads[0]
        read_d = decode.read_queue.read_bytes - reads[1]
        layers = decode.cfg.spec.model.layers
        if path == "prefill":  # path P: the prefill node reads, then sends hit and new KV
            assert read_p > 0 and read_d == 0
            assert prefill.transfer.stats.writes - writes[0] == 2 * layers
            assert decode.transfer.stats.writes == writes[1]
        else:  # path D: the decode node reads and relays the hit, layer by layer
            assert read_d > 0 and read_p == 0
            assert decode.transfer.stats.writes - writes[1] == layers
            assert prefill.transfer.stats.writes - writes[0] == layers  # new KV only
    for (kp, vp), (kd, vd) in zip(kv["prefill"], kv["decode"], strict=True):
        assert torch.equal(kp, kd) and torch.equal(vp, vd)
    assert torch.equal(logits["prefill"], logits["decode"])
    for path, enum in PATHS.items():
        tokens, head = await _generate(decode, _request(prefill, f"t2-{path}", ctx, hit, path))
        assert (head.hit_tokens, head.read_path, tokens) == (hit, enum, clean)
    assert await _all_regions_back(prefill, decode)


@pytest.mark.parametrize("path", ["prefill", "decode"])
async def test_a_hit_that_ends_at_a_bad_block_is_recomputed_from_there(cluster, path):
    prefill, decode, store, _ = cluster
    ctx, ids, clean = await _turn_then_context(prefill, decode, store, seed=5)
    store.corrupt(ids[1], layer=1)
    checksum_misses = store.misses["checksum"]
    tokens, head = await _generate(decode, _request(prefill, f"bad-{path}", ctx, 3 * BT, path))
    assert tokens == clean  # the bad block's KV was never used
    assert head.hit_tokens == BT and head.read_path == PATHS[path]  # block 0 still served
    assert store.misses["checksum"] == checksum_misses + 1
    assert store.lookup(ids) == 3  # dropped, and the recomputed turn wrote it again
    assert await _all_regions_back(prefill, decode)


@pytest.mark.parametrize("path", ["prefill", "decode"])
async def test_a_hit_the_store_lost_ends_at_the_gap(cluster, path):
    prefill, decode, store, _ = cluster
    ctx, ids, clean = await _turn_then_context(prefill, decode, store, seed=11)
    store.remove(ids[0])  # gone behind the index's back: nothing of the hit is readable
    tokens, head = await _generate(decode, _request(prefill, f"gap-{path}", ctx, 3 * BT, path))
    assert tokens == clean and head.hit_tokens == 0
    assert head.read_path == spb.READ_PATH_UNSPECIFIED  # all recomputed, no path used
    assert store.lookup(ids) == 3


def _on_reads(decode, before=None, after=None):
    """Every read the decode node submits to its queue, in order: `before(n)` runs before the
    n-th (0-based) goes to the queue, `after(n, handle)` before the node gets its handle."""
    queue = decode.decode.read_queue
    submit, handles = queue.submit, []

    def submitted(ids, out=None):  # noqa: ANN001, ANN202
        if before is not None:
            before(len(handles))
        handle = submit(ids, out=out)
        if after is not None:
            after(len(handles), handle)
        handles.append(handle)
        return handle

    queue.submit = submitted
    return handles


def _record_contexts(decode):
    """The whole-context KV of every sequence the decode node admits to its batch."""
    admit, contexts = decode.decode._admit, []

    async def recorded(rid, kv, logits, params):  # noqa: ANN001, ANN202
        contexts.append(kv)
        return await admit(rid, kv, logits, params)

    decode.decode._admit = recorded
    return contexts


async def test_a_hit_cut_at_validation_is_reread_where_no_closed_read_still_writes(cluster):
    """Path D, block 2 of a 3-block hit gone: the hit is the 2 valid blocks. The first read
    (the 3-block layout) is closed while one of its chunks is still in a pool thread (a slow
    read); that chunk lands after the valid prefix was read again, and never in the KV used."""
    prefill, decode, store, _ = cluster
    ctx, ids, clean = await _turn_then_context(prefill, decode, store, seed=23)
    with decode.transfer.active():
        want, _, _, _ = await decode.decode._prefill(
            _request(prefill, "want", ctx, 2 * BT, "decode"), ctx, 2 * BT, "decode"
        )
    store.remove(ids[2])
    release = store.hold(ids[0], reads=1)  # the first read's chunk with block 0 is slow
    loop = asyncio.get_running_loop()
    first: list = []
    layers = decode.cfg.spec.model.layers

    def slow_then_fast(n, handle):  # noqa: ANN001, ANN202
        if n == 0:  # validated once its slow chunk is in a pool thread
            first.append(handle)
            ready = handle.ready

            async def ready_with_a_chunk_in_flight() -> int:
                valid = await ready()
                end = loop.time() + 5
                while not store.waiting(ids[0]) and loop.time() < end:
                    await asyncio.sleep(0.005)
                assert store.waiting(ids[0]) == 1 and handle.busy
                return valid

            handle.ready = ready_with_a_chunk_in_flight
        elif n == 1:  # every layer of it read before the slow chunk lands
            layer = handle.layer

            async def all_read_then_the_slow_chunk_lands() -> None:
                for i in range(layers):
                    await layer(i)
                release.set()
                while first[0].busy:
                    await asyncio.sleep(0.005)

            landed = asyncio.ensure_future(all_read_then_the_slow_chunk_lands())

            async def layer_once_landed(i):  # noqa: ANN001, ANN202
                await asyncio.shield(landed)
                return await layer(i)

            handle.layer = layer_once_landed

    handles = _on_reads(decode, after=slow_then_fast)
    contexts = _record_contexts(decode)
    try:
        req = _request(prefill, "cut", ctx, 3 * BT, "decode")
        tokens, head = await asyncio.wait_for(_generate(decode, req), 30)
    finally:
        release.set()
    assert len(handles) == 2 and not first[0].busy
    assert head.hit_tokens == 2 * BT and head.read_path == PATHS["decode"]
    (got,) = contexts
    for (kg, vg), (kw, vw) in zip(got, want, strict=True):
        assert torch.equal(kg, kw) and torch.equal(vg, vw)
    assert tokens == clean
    assert await _all_regions_back(prefill, decode)


async def test_a_hit_that_shrinks_again_while_it_is_reread_ends_at_what_is_left(cluster):
    """Path D: block 2 gone at the first validation, block 1 gone before the valid prefix is
    read again: the hit is block 0, never bytes that no read filled."""
    prefill, decode, store, _ = cluster
    ctx, ids, clean = await _turn_then_context(prefill, decode, store, seed=29)
    assert await _all_regions_back(prefill, decode)
    pool = decode.transfer.pool
    whole = pool.alloc(pool.free_bytes)
    whole.tensor.fill_(0xFF)  # what the buffer held before: NaN if it were ever used
    pool.free(whole)
    store.remove(ids[2])
    _on_reads(decode, before=lambda n: store.remove(ids[1]) if n == 1 else None)
    tokens, head = await _generate(decode, _request(prefill, "shrinks", ctx, 3 * BT, "decode"))
    assert head.hit_tokens == BT and head.read_path == PATHS["decode"]
    assert tokens == clean
    assert await _all_regions_back(prefill, decode)


async def test_a_stuck_read_ends_at_the_read_bound_and_is_recomputed(cluster):
    prefill, decode, store, _ = cluster
    ctx, ids, clean = await _turn_then_context(prefill, decode, store, seed=13)
    release = store.hold(ids[0])
    try:
        req = _request(prefill, "stuck", ctx, 3 * BT, "decode")
        tokens, head = await asyncio.wait_for(_generate(decode, req), 30)
    finally:
        release.set()
    assert tokens == clean and head.hit_tokens == 0
    assert store.misses["timeout"] == 1


async def test_a_dead_prefill_peer_fails_the_turn_naming_it_then_recovers(cluster):
    prefill, decode, store, fabric = cluster
    ctx, _, clean = await _turn_then_context(prefill, decode, store, seed=17)
    fabric.kill(prefill.transfer.name)  # path D's relay WRITEs to it fail
    with pytest.raises(PrefillFailed, match=r"KV transfer with prefill-0: .*peer is gone"):
        await _generate(decode, _request(prefill, "dead", ctx, 3 * BT, "decode"))
    assert not decode.transfer.knows(prefill.transfer.name)  # dropped: reconnects next time
    # the decode node's regions wait out the deadline (a WRITE may still land), then go back
    assert await _all_regions_back(decode, within_s=DEADLINE_S + 3)
    fabric.heal(prefill.transfer.name)
    await _all_regions_back(prefill, within_s=DEADLINE_S + 3)
    tokens, head = await _generate(decode, _request(prefill, "healed", ctx, 3 * BT, "decode"))
    assert tokens == clean and head.hit_tokens == 3 * BT


async def test_a_hung_decode_peer_fails_path_p_within_the_deadline(cluster):
    prefill, decode, store, fabric = cluster
    ctx, _, _ = await _turn_then_context(prefill, decode, store, seed=19)
    fabric.hang(decode.transfer.name)  # the prefill node's WRITEs to it stall
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(PrefillFailed, match="prefill worker prefill-0 .*INTERNAL"):
        await _generate(decode, _request(prefill, "hung", ctx, 3 * BT, "prefill"))
    assert loop.time() - t0 < DEADLINE_S + 5  # the transfer deadline ended it
    fabric.heal(decode.transfer.name)
    assert await _all_regions_back(prefill, decode, within_s=DEADLINE_S + 3)


@pytest.mark.parametrize("lands_late", [False, True])
async def test_a_prefill_whose_write_may_still_land_keeps_the_decode_regions_held(
    cluster, lands_late
):
    """The prefill's WRITEs to the decode node miss their deadline. Cancelled, the decode node
    frees its regions as soon as the error arrives; abandoned still in flight (NIXL would not
    release their handles), the error says so and the regions stay held for a transfer
    deadline: the stray bytes land in them, not in another request's."""
    prefill, decode, store, fabric = cluster
    ctx, _, clean = await _turn_then_context(prefill, decode, store, seed=23)
    counted = REGISTRY.get_sample_value("dualpath_worker_writes_in_flight_total") or 0.0
    fabric.hang(decode.transfer.name, lands_late=lands_late)
    with pytest.raises(PrefillFailed, match="prefill worker prefill-0 .*INTERNAL"):
        await _generate(decode, _request(prefill, "stray", ctx, 3 * BT, "prefill"))
    assert REGISTRY.get_sample_value("dualpath_worker_writes_in_flight_total") == counted + (
        1 if lands_late else 0
    )
    pool = decode.transfer.pool
    assert pool.regions == (2 if lands_late else 0)  # hit and new regions held, or both back
    fabric.heal(decode.transfer.name)  # the stray WRITEs land now
    assert await _all_regions_back(prefill, decode, within_s=DEADLINE_S + 3)
    tokens, _ = await _generate(decode, _request(prefill, "after", ctx, 3 * BT, "prefill"))
    assert tokens == clean


async def test_a_refused_hit_keeps_the_decode_regions_held_when_a_write_may_still_land(
    cluster, monkeypatch
):
    """The in-flight mark travels with any error status, the refused hit's too (its valid
    prefix still reaches the decode node)."""
    prefill, decode, _, _ = cluster

    async def serve(order, outcome):  # noqa: ANN001, ANN202
        outcome.writes_in_flight = True
        raise HitUnavailable("blocks gone", valid_tokens=BT)
        yield  # an async generator, as the role's

    monkeypatch.setattr(prefill.prefill, "serve", serve)
    req = _request(prefill, "refused", [5] * 50, 3 * BT, "prefill")
    with pytest.raises(HitUnavailable) as caught:
        await decode.decode._prefill(req, list(req.prompt), 3 * BT, "prefill")
    assert caught.value.valid_tokens == BT
    assert decode.transfer.pool.regions == 2  # held for the deadline, then back
    assert await _all_regions_back(decode, within_s=DEADLINE_S + 3)


async def test_a_prefill_node_that_is_down_fails_the_turn_naming_it(cluster):
    prefill, decode, store, _ = cluster
    await prefill.stop()
    with pytest.raises(PrefillFailed, match=r"prefill worker prefill-0 \(.*\): unreachable"):
        await _generate(decode, _request(prefill, "down", [5] * 20, 0, "none"))
    assert await _all_regions_back(decode)


async def test_a_turn_cancelled_while_its_sequence_joins_the_batch_leaves_nothing_behind(cluster):
    """The client goes away while its sequence is being added to the batch on the compute
    thread (a running job cannot be cancelled): the sequence is freed right after, its pages
    back, nothing decoding for nobody."""
    prefill, decode, store, _ = cluster
    ctx, _, clean = await _turn_then_context(prefill, decode, store, seed=31)
    engine = decode.engine
    free_pages = engine.cache.free_pages
    loop = asyncio.get_running_loop()
    entered, gate = threading.Event(), threading.Event()
    add = engine.add_sequence

    def add_slowly(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        entered.set()
        gate.wait(10)
        return add(*args, **kwargs)

    engine.add_sequence = add_slowly
    turn = asyncio.ensure_future(_generate(decode, _request(prefill, "gone", ctx, 0, "none", 64)))
    try:
        assert await loop.run_in_executor(None, entered.wait, 10)  # being added, on the thread
        turn.cancel()
        await asyncio.sleep(0.05)  # the turn has seen its cancel
    finally:
        gate.set()
        del engine.add_sequence
    with pytest.raises(asyncio.CancelledError):
        await turn
    await loop.run_in_executor(engine.executor, lambda: None)  # what was queued there ran
    assert "gone" not in engine.sequences
    assert engine.cache.free_pages == free_pages
    tokens, _ = await _generate(decode, _request(prefill, "next", ctx, 0, "none"))
    assert tokens == clean
