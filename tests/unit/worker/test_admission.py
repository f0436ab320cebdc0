"""Prefill admission with the batcher: FIFO within the quota, each member as if alone."""

import asyncio

import pytest
import torch
from dualpath.config import ModelSpec
from dualpath.engine import Engine, MemorySource
from dualpath.engine.cost import CostModel, FlopsModel
from dualpath.worker.admission import BatchAdmission

SPEC = ModelSpec(preset="tiny", block_tokens=8)
# every request estimates 1 s whatever its size: the quota counts requests
PER_REQUEST = CostModel(FlopsModel.from_spec(SPEC), 1.0, 0.0, 0.0)


@pytest.fixture(scope="module")
def engine():
    e = Engine(SPEC, kv_capacity_tokens=256)
    yield e
    e.close()


def toks(n, seed):
    return torch.randint(0, SPEC.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


async def test_queued_requests_form_batches_within_the_quota(engine):
    shapes = [(32, 9), (0, 20), (64, 5), (16, 12), (8, 40)]
    xs = [toks(h + n, i) for i, (h, n) in enumerate(shapes)]
    kvs = [engine.model.forward_full(x)[1] for x in xs]

    def source(i):
        h = shapes[i][0]
        return MemorySource([(k[:h], v[:h]) for k, v in kvs[i]]) if h else None

    alone = [
        await engine.prefill(x[h:], h, source(i)).collect()
        for i, (x, (h, _)) in enumerate(zip(xs, shapes, strict=True))
    ]
    adm = BatchAdmission(engine, PER_REQUEST, quota_s=3.5, max_batches=1).start()
    try:
        members = await asyncio.gather(
            *(
                adm.join(f"r{i}", x[h:], h, source(i))
                for i, (x, (h, _)) in enumerate(zip(xs, shapes, strict=True))
            )
        )
        got = await asyncio.gather(*(m.collect() for m in members))
    finally:
        await adm.stop()
    # quota 3.5 requests: the first batch takes 3 (FIFO), the 4th would overflow and leads the next
    assert [len(m.batch.members) for m in members] == [3, 3, 3, 2, 2]
    assert members[0].batch is members[2].batch is not members[3].batch
    assert adm.batches == 2 and adm.batched_requests == 5
    for (kv_a, la), (kv_b, lb) in zip(alone, got, strict=True):
        assert torch.equal(la, lb)
        assert all(
            torch.equal(a, b)
            for pa, pb in zip(kv_a, kv_b, strict=True)
            for a, b in zip(pa, pb, strict=True)
        )


async def test_a_request_alone_above_the_quota_still_runs(engine):
    adm = BatchAdmission(engine, PER_REQUEST, quota_s=0.5).start()
    try:
        m = await adm.join("big", toks(30, 1), 0, None)
        _, logits = await m.collect()
    finally:
        await adm.stop()
    assert len(m.batch.members) == 1 and logits.shape == (1, SPEC.vocab_size)


async def test_a_caller_that_leaves_the_queue_is_not_batched(engine):
    x = toks(40, 3)
    kv = engine.model.forward_full(x)[1]
    gate = asyncio.Event()

    class Gated:  # its hit arrives when the test opens the gate: the batch holds its slot
        async def layer(self, l):  # noqa: E741
            await gate.wait()
            return kv[l][0][:32], kv[l][1][:32]

    adm = BatchAdmission(engine, PER_REQUEST, quota_s=1.5, max_batches=1).start()
    try:
        first = await adm.join("held", x[32:], 32, Gated())  # holds the one batch slot
        reading = asyncio.ensure_future(first.collect())
        waiter = asyncio.ensure_future(adm.join("gone", toks(6, 4), 0, None))
        for _ in range(100):
            await asyncio.sleep(0)
        assert adm.queued == 1
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        assert adm.queued == 0
        gate.set()
        await asyncio.wait_for(reading, timeout=30)
        nxt = await asyncio.wait_for(adm.join("next", toks(6, 5), 0, None), timeout=30)
        await nxt.collect()
    finally:
        await adm.stop()
    assert adm.batches == 2 and adm.batched_requests == 2


async def test_a_bad_request_is_refused_alone(engine):
    adm = BatchAdmission(engine, PER_REQUEST, quota_s=3.5).start()
    try:
        with pytest.raises(ValueError, match="prefill bad: hit_tokens=8 needs a source"):
            await adm.join("bad", toks(4, 1), 8, None)
        assert adm.queued == 0
        _, logits = await (await adm.join("good", toks(4, 2), 0, None)).collect()
    finally:
        await adm.stop()
    assert logits.shape == (1, SPEC.vocab_size)


def test_quota_must_be_positive(engine):
    with pytest.raises(ValueError, match="prefillBatchQuotaMs"):
        BatchAdmission(engine, PER_REQUEST, quota_s=0)
