"""Both read paths between a real prefill worker process and a decode worker.

The prefill worker runs as its own process (`dualpath worker --role prefill`); the decode
worker runs in the test's process so its KV can be inspected. KV moves between them through
NIXL/UCX exactly as in a cluster.
"""

from __future__ import annotations

import asyncio
import errno
import os
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from prometheus_client import REGISTRY

pytest.importorskip("nixl_cu12")

from dualpath.config import Role  # noqa: E402
from dualpath.kv import block_ids  # noqa: E402
from dualpath.kv.backend import PreadvBackend  # noqa: E402
from dualpath.v1 import scheduler_pb2 as spb  # noqa: E402
from dualpath.v1 import worker_pb2 as wpb  # noqa: E402
from dualpath.worker.common import NodeOptions  # noqa: E402
from dualpath.worker.node import WorkerNode  # noqa: E402
from dualpath.worker.wire import BadField, chunk_to_pb, generate_from_pb  # noqa: E402
from dualpath_proc import spawn_ready  # noqa: E402
from tiny_configs import pools, tiny_cluster, write_config  # noqa: E402

pytestmark = pytest.mark.slow

BT = 16


def _config(tmp: Path):
    return tiny_cluster(
        "paths",
        BT,
        **pools(1, 32 << 20),
        storage={"path": str(tmp / "kv"), "readTimeoutMs": 1000},
    )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("paths")
    cfg = _config(tmp)
    cfg_file = write_config(cfg, tmp / "cluster.yaml")
    proc, line = spawn_ready(
        ["worker", "--role", "prefill", "-f", str(cfg_file), "--host", "127.0.0.1"]
        + ["--node-id", "prefill-0", "--deadline", "20"]
    )
    try:
        address = line.split("grpc=")[1].split()[0]
        yield cfg, address
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.fixture
async def decode(cluster):
    cfg, _ = cluster
    node = await WorkerNode(
        cfg, NodeOptions(role=Role.DECODE, node_id="decode-0", kv_cache_tokens=4096, deadline_s=20)
    ).start()
    yield node
    await node.stop()


def _request(cfg, address, rid, prompt, hit, path, max_new=6, salt=b""):
    """A turn as the decode servicer hands it to the role (through the wire's checks)."""
    return generate_from_pb(
        _message(address, rid, prompt, hit, path, max_new, salt), cfg.spec.model
    )


def _message(address, rid, prompt, hit, path, max_new=6, salt=b""):
    return wpb.GenerateRequest(
        cache_salt=salt,
        request_id=rid,
        prompt_tokens=prompt,
        hit_tokens=hit,
        max_new_tokens=max_new,
        read_path=path,
        prefill_node="prefill-0",
        prefill_address=address,
    )


async def _generate(node, req) -> tuple[list[int], wpb.GenerateChunk]:
    chunks = [chunk_to_pb(c) async for c in node.decode.generate(req)]
    return [t for c in chunks for t in c.tokens], chunks[0]


async def test_path_p_and_path_d_leave_identical_kv_and_tokens(cluster, decode):
    cfg, address = cluster
    model = cfg.spec.model
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(4, model.vocab_size, (70,), generator=g).tolist()
    # turn 1: nothing stored; the decode node stores the turn's full blocks at its end
    gen1, first = await _generate(decode, _request(cfg, address, "t1", prompt, 0, 0))
    assert first.hit_tokens == 0 and len(gen1) == 6
    ctx = prompt + gen1 + torch.randint(4, model.vocab_size, (9,), generator=g).tolist()
    hits = decode.store.lookup(block_ids(ctx, model))
    assert hits == (70 + 5) // BT  # prompt + generated (last token's KV not computed yet)
    hit = hits * BT

    kv, logits = {}, {}
    for path, enum in (("prefill", spb.READ_PATH_PREFILL), ("decode", spb.READ_PATH_DECODE)):
        req = _request(cfg, address, f"kv-{path}", ctx, hit, enum)
        with decode.transfer.active():
            kv[path], logits[path], used_hit, used_path = await decode.decode._prefill(
                req, ctx, hit, path
            )
        assert (used_hit, used_path) == (hit, path)
    for (kp, vp), (kd, vd) in zip(kv["prefill"], kv["decode"], strict=True):
        assert kp.shape == (len(ctx), model.kv_heads, model.head_dim)
        assert torch.equal(kp, kd) and torch.equal(vp, vd)
    assert torch.equal(logits["prefill"], logits["decode"])
    # and the loaded context equals a full recompute of it
    with decode.transfer.active():
        kv_none, logits_none, *_ = await decode.decode._prefill(
            _request(cfg, address, "kv-none", ctx, 0, 0), ctx, 0, "none"
        )
    torch.testing.assert_close(logits["decode"], logits_none, atol=1e-4, rtol=0)
    for (kd, _), (kn, _) in zip(kv["decode"], kv_none, strict=True):
        torch.testing.assert_close(kd, kn, atol=1e-4, rtol=0)

    answers = {}
    for path, enum in (("prefill", spb.READ_PATH_PREFILL), ("decode", spb.READ_PATH_DECODE)):
        tokens, head = await _generate(decode, _request(cfg, address, f"t2-{path}", ctx, hit, enum))
        assert head.hit_tokens == hit and head.read_path == enum
        answers[path] = tokens
    assert answers["prefill"] == answers["decode"]
    assert decode.transfer.pool.regions == 0  # every region went back


async def test_a_corrupted_hit_block_is_recomputed_never_used(cluster, decode):
    cfg, address = cluster
    model = cfg.spec.model
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(4, model.vocab_size, (50,), generator=g).tolist()
    gen1, _ = await _generate(decode, _request(cfg, address, "c1", prompt, 0, 0, max_new=3))
    ctx = prompt + gen1 + [7, 8, 9]
    ids = block_ids(ctx, model)
    hit = decode.store.lookup(ids) * BT
    assert hit == 48
    clean, _ = await _generate(decode, _request(cfg, address, "c-ref", ctx, 0, 0))
    for rid, enum in (("c-d", spb.READ_PATH_DECODE), ("c-p", spb.READ_PATH_PREFILL)):
        # flip one payload byte of the second block (past the header: a layer checksum fails)
        f = decode.store.path_of(ids[1])
        raw = bytearray(f.read_bytes())
        raw[-3] ^= 0xFF
        f.write_bytes(bytes(raw))
        tokens, head = await _generate(decode, _request(cfg, address, rid, ctx, hit, enum))
        assert tokens == clean
        assert head.hit_tokens < hit  # the bad block (and what follows) was not used
        # the bad block was dropped and the recomputed turn wrote it again: repaired
        assert decode.store.check(ids[:3]) == (3, [])


async def test_a_hit_the_index_offers_but_storage_lost_ends_at_the_gap(cluster, decode):
    """The scheduler's index is stale (another process evicted a block): on either path the
    hit ends at the missing block, the rest is recomputed, and the answer is the same."""
    cfg, address = cluster
    model = cfg.spec.model
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(4, model.vocab_size, (50,), generator=g).tolist()
    gen1, _ = await _generate(decode, _request(cfg, address, "g1", prompt, 0, 0, max_new=3))
    ctx = prompt + gen1 + [7, 8, 9]
    ids = block_ids(ctx, model)
    hit = decode.store.lookup(ids) * BT
    assert hit == 48
    clean, _ = await _generate(decode, _request(cfg, address, "g-ref", ctx, 0, 0))
    for rid, enum in (("g-d", spb.READ_PATH_DECODE), ("g-p", spb.READ_PATH_PREFILL)):
        decode.store.path_of(ids[1]).unlink()  # gone behind the index's back
        tokens, head = await _generate(decode, _request(cfg, address, rid, ctx, hit, enum))
        assert tokens == clean
        assert head.hit_tokens == BT and head.read_path == enum  # block 0 still served
        assert decode.store.check(ids[:3]) == (3, [])  # the turn wrote block 1 again


async def test_a_tenant_hits_its_own_blocks_and_never_anothers(cluster, decode):
    """Two tenants (cache salts), one prompt: A's second turn reads A's first turn's blocks on
    either path; B, even when told of a hit (a route it should never get), reads nothing of
    A's and recomputes, with the same answer."""
    cfg, address = cluster
    model = cfg.spec.model
    salt_a, salt_b = b"a" * 32, b"b" * 31
    g = torch.Generator().manual_seed(17)
    prompt = torch.randint(4, model.vocab_size, (50,), generator=g).tolist()
    gen1, _ = await _generate(
        decode, _request(cfg, address, "a1", prompt, 0, 0, max_new=3, salt=salt_a)
    )
    ctx = prompt + gen1 + [7, 8, 9]
    hit = decode.store.lookup(block_ids(ctx, model, salt=salt_a)) * BT
    assert hit == 48  # A's turn stored its blocks under A's salt...
    assert decode.store.lookup(block_ids(ctx, model, salt=salt_b)) == 0  # ...not B's
    assert decode.store.lookup(block_ids(ctx, model)) == 0  # nor the shared chain
    clean, _ = await _generate(decode, _request(cfg, address, "ab-ref", ctx, 0, 0, salt=b"r"))
    for enum in (spb.READ_PATH_PREFILL, spb.READ_PATH_DECODE):
        req = _request(cfg, address, f"a2-{enum}", ctx, hit, enum, salt=salt_a)
        tokens, head = await _generate(decode, req)
        assert head.hit_tokens == hit and head.read_path == enum and tokens == clean
        b = salt_b + bytes([enum])  # a fresh tenant per path: B's turn stores B's own copy
        req = _request(cfg, address, f"b2-{enum}", ctx, hit, enum, salt=b)
        tokens, head = await _generate(decode, req)
        assert head.hit_tokens == 0 and tokens == clean  # nothing of A's was read
        assert decode.store.lookup(block_ids(ctx, model, salt=b)) * BT >= hit  # its own copy
    # an oversized salt is refused by both workers, naming the field
    with pytest.raises(BadField, match="cache_salt: is 65 bytes"):
        await _generate(decode, _request(cfg, address, "x", ctx, 0, 0, salt=b"x" * 65))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await (
            (await decode.worker_stub(address))
            .Prefill(
                wpb.PrefillRequest(request_id="x", prompt_tokens=ctx, cache_salt=b"x" * 65),
                timeout=10,
            )
            .read()
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "cache_salt" in err.value.details()


async def test_transfer_info_names_the_agent_role_and_config(cluster, decode):
    cfg, address = cluster
    info = await (await decode.worker_stub(address)).GetTransferInfo(
        wpb.TransferInfoRequest(), timeout=10
    )
    assert info.role == spb.ROLE_PREFILL and info.node_id == "prefill-0"
    assert info.agent.startswith("prefill-0-") and info.metadata
    assert info.config_hash == cfg.config_hash
    # and a prefill sent to a decode node is refused with a clear status
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await (
            (await decode.worker_stub(decode.address))
            .Prefill(wpb.PrefillRequest(request_id="x", prompt_tokens=[5, 6]), timeout=10)
            .read()
        )
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "decode node" in err.value.details()


class _FaultyReads(PreadvBackend):
    """The decode node's store under a fault: `eio` fails every read, `stuck` never answers
    until released (a hung mount)."""

    def __init__(self, fault: str) -> None:
        self.fault = fault
        self.release = threading.Event()

    def read_run(self, fd, views, offset):  # noqa: ANN001
        if self.fault == "eio":
            raise OSError(errno.EIO, "Input/output error")
        assert self.release.wait(timeout=120)
        super().read_run(fd, views, offset)


async def test_a_hit_on_a_failing_store_is_recomputed_within_the_bound(
    cluster, decode, monkeypatch
):
    cfg, address = cluster
    model = cfg.spec.model
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(4, model.vocab_size, (50,), generator=g).tolist()
    gen1, _ = await _generate(decode, _request(cfg, address, "f1", prompt, 0, 0, max_new=3))
    ctx = prompt + gen1 + [7, 8, 9]
    hit = decode.store.lookup(block_ids(ctx, model)) * BT
    assert hit == 48
    clean, _ = await _generate(decode, _request(cfg, address, "f-ref", ctx, 0, 0))
    bound_s = cfg.spec.storage.read_timeout_ms / 1000
    assert decode.read_queue.read_timeout_s == bound_s

    def misses(reason):
        return REGISTRY.get_sample_value("dualpath_kv_misses_total", {"reason": reason}) or 0.0

    real = decode.store.backend
    for fault, reason in (("eio", "io_error"), ("stuck", "timeout")):
        before = misses(reason)
        decode.store.backend = faulty = _FaultyReads(fault)
        t0 = time.monotonic()
        try:  # path D: the decode node reads the hit and streams it to the prefill node
            req = _request(cfg, address, f"f-{fault}", ctx, hit, spb.READ_PATH_DECODE)
            tokens, head = await asyncio.wait_for(_generate(decode, req), bound_s + 60)
        finally:
            faulty.release.set()
            decode.store.backend = real
        elapsed_s = time.monotonic() - t0
        assert tokens == clean, fault  # the same greedy answer as a recompute
        assert head.hit_tokens == 0  # the hit ended at its first block: all recomputed
        assert misses(reason) >= before + 1
        assert elapsed_s < bound_s + 30  # the read bound ended the wait, not a deadline

    # a read-only store (recency updates fail): the hit is served, the touch counted
    def erofs(path, *a, **kw):  # noqa: ANN001, ANN002, ANN003
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    def touch_failures():
        labels = {"op": "touch", "reason": "read_only"}
        return REGISTRY.get_sample_value("dualpath_kv_write_failures_total", labels) or 0.0

    before = touch_failures()
    monkeypatch.setattr(os, "utime", erofs)
    req = _request(cfg, address, "f-ro", ctx, hit, spb.READ_PATH_DECODE)
    tokens, head = await asyncio.wait_for(_generate(decode, req), bound_s + 60)
    monkeypatch.undo()
    assert tokens == clean and head.hit_tokens == hit
    assert touch_failures() > before


async def test_cancelled_turns_free_their_buffers_at_once_not_after_a_deadline(cluster, decode):
    """20 client disconnects mid-turn: the prefill exchanges in flight run to their end and
    free their regions then; nothing waits out the 20 s transfer deadline (a quarantine would
    leave no decode buffer to route to)."""
    import asyncio

    cfg, address = cluster
    model = cfg.spec.model
    g = torch.Generator().manual_seed(5)
    pool = decode.transfer.pool

    async def turn(i):
        prompt = torch.randint(4, model.vocab_size, (200,), generator=g).tolist()
        return await _generate(decode, _request(cfg, address, f"c{i}", prompt, 0, 0, 40))

    tasks = [asyncio.create_task(turn(i)) for i in range(20)]
    await asyncio.sleep(0.05)
    for i, t in enumerate(tasks):  # some in their prefill exchange, some decoding
        await asyncio.sleep(0.01 * (i % 3))
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    t0 = time.monotonic()
    while pool.free_bytes < pool.nbytes and time.monotonic() - t0 < 10.0:
        await asyncio.sleep(0.02)
    assert pool.free_bytes == pool.nbytes, f"{pool.regions} regions still held"
    assert time.monotonic() - t0 < 10.0  # well under the 20 s deadline
    prompt = torch.randint(4, model.vocab_size, (70,), generator=g).tolist()
    gen, _ = await _generate(decode, _request(cfg, address, "after", prompt, 0, 0))
    assert len(gen) == 6


async def test_a_prefill_nixl_would_fail_is_refused_by_field_before_any_transfer(cluster, decode):
    """Garbage agent metadata (NIXL_ERR_MISMATCH inside NIXL) and a region outside the decode
    node's registered buffer (NIXL_ERR_NOT_FOUND): INVALID_ARGUMENT naming the field, not
    INTERNAL; then a good turn."""
    cfg, address = cluster
    t = decode.transfer
    nbytes = 20 * cfg.spec.model.kv_bytes_per_token
    good = dict(
        request_id="nixl-bad",
        prompt_tokens=[5] * 20,
        decode_node="decode-0",
        decode_agent=t.name,
        decode_agent_metadata=t.metadata,
        decode_new=wpb.Region(address=t.pool.address, length=nbytes),
    )
    outside = wpb.Region(address=t.pool.address + t.pool.nbytes + (1 << 30), length=nbytes)
    cases = {
        "decode_agent_metadata": dict(decode_agent="stranger", decode_agent_metadata=b"junk" * 9),
        "decode_new": dict(decode_new=outside),
    }
    stub = await decode.worker_stub(address)
    for field, over in cases.items():
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in stub.Prefill(wpb.PrefillRequest(**{**good, **over}), timeout=10):
                pass
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert f"PrefillRequest.{field}" in err.value.details()
    prompt = [7] * 40
    tokens, _ = await _generate(decode, _request(cfg, address, "after-bad", prompt, 0, 0))
    assert len(tokens) == 6
