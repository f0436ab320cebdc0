"""One forward over several requests: each member bit-identical to its prefill alone."""

import asyncio
import random

import pytest
import torch
from dualpath.config import ModelSpec
from dualpath.engine import Engine, MemorySource, ThrottledSource
from stepped_source import SteppedSource

SPEC = ModelSpec(preset="tiny", block_tokens=8)


@pytest.fixture(scope="module")
def engine():
    e = Engine(SPEC, kv_capacity_tokens=2048)
    yield e
    e.close()


def toks(n, seed=0):
    return torch.randint(0, SPEC.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def hit_kv(engine, tokens):
    return engine.model.forward_full(tokens)[1]


class LayerOnly:
    """A source with only `layer(l)` (pumped by the engine), like the remote stream of path D."""

    def __init__(self, kv, delay_s=0.0):
        self.kv, self.delay_s = kv, delay_s

    async def layer(self, l):  # noqa: E741
        await asyncio.sleep(self.delay_s)
        return self.kv[l]


def make_source(kind, kv, hit):
    if not hit:
        return None
    cut = [(k[:hit], v[:hit]) for k, v in kv]
    if kind == "memory":
        return MemorySource(cut)
    if kind == "throttled":  # arrives in pieces over ~40 ms: tiles attended to early
        nbytes = sum(t.numel() * t.element_size() for kv in cut for t in kv)
        return ThrottledSource(cut, nbytes / 0.04, piece_tokens=8)
    if kind == "stepped":  # a piece lands each time the engine waits: early tiles, no clock
        return SteppedSource(cut, piece_tokens=8)
    return LayerOnly(cut, delay_s=0.002)


async def alone_and_batched(engine, shapes, kinds, all_logits=False):
    reqs, alone = [], []
    for i, ((hit, new), kind) in enumerate(zip(shapes, kinds, strict=True)):
        x = toks(hit + new, seed=i)
        kv = hit_kv(engine, x) if hit else None
        alone.append(
            await engine.prefill(
                x[hit:], hit, make_source(kind, kv, hit), all_logits=all_logits
            ).collect()
        )
        reqs.append((x[hit:], hit, make_source(kind, kv, hit)))
    batch = engine.prefill_batch(reqs, all_logits=all_logits)
    got = await asyncio.gather(*(m.collect() for m in batch.members))
    return alone, got, batch


def assert_identical(a, b):
    (kv_a, logits_a), (kv_b, logits_b) = a, b
    assert torch.equal(logits_a, logits_b)
    assert len(kv_a) == len(kv_b) == SPEC.layers
    for (ka, va), (kb, vb) in zip(kv_a, kv_b, strict=True):
        assert torch.equal(ka, kb) and torch.equal(va, vb)


@pytest.mark.parametrize("all_logits", [False, True])
async def test_each_member_is_bit_identical_to_its_prefill_alone(engine, all_logits):
    # different hit and new lengths, sources of all kinds, no hit, and short requests (< 4 rows)
    shapes = [(64, 37), (0, 20), (128, 5), (16, 1), (200, 3), (8, 130), (40, 4), (0, 2)]
    kinds = ["memory", "memory", "throttled", "layer", "stepped", "layer", "memory", "memory"]
    alone, got, batch = await alone_and_batched(engine, shapes, kinds, all_logits)
    for a, b in zip(alone, got, strict=True):
        assert_identical(a, b)
    # short ones alone (fewer rows than this CPU's BLAS keeps bit-exact in a pack), the rest packed
    rows = engine.model.min_pack_rows
    assert [m.index for m in batch.packs[0]] == [i for i, (_, n) in enumerate(shapes) if n >= rows]
    assert len(batch.packs[0]) >= 3  # 20, 37 and 130 rows pack on any CPU seen
    assert all(len(p) == 1 for p in batch.packs[1:])
    assert all(m.new_tokens < rows for p in batch.packs[1:] for m in p)
    assert batch.times.compute_s > 0
    # the stepped 200-token hit: its first 128-token tile is attended to before the rest lands
    assert [m.times.early_tiles for m in batch.members] == [0, 0, 0, 0, SPEC.layers, 0, 0, 0]


async def test_random_batches_are_bit_identical(engine):
    rng = random.Random(5)
    for _ in range(4):
        n = rng.randint(2, 6)
        shapes = [(rng.choice([0, 8, 24, 64, 136]), rng.randint(1, 90)) for _ in range(n)]
        kinds = [rng.choice(["memory", "throttled", "layer"]) for _ in range(n)]
        alone, got, _ = await alone_and_batched(engine, shapes, kinds)
        for a, b in zip(alone, got, strict=True):
            assert_identical(a, b)


async def test_a_failing_member_leaves_and_the_others_are_unchanged(engine):
    good = toks(72, seed=1)
    kv_good = hit_kv(engine, good)
    alone = await engine.prefill(
        good[64:], 64, MemorySource([(k[:64], v[:64]) for k, v in kv_good])
    ).collect()
    bad = toks(40, seed=2)
    kv_bad = hit_kv(engine, bad)

    class FailsAtLayer2:
        async def layer(self, l):  # noqa: E741
            if l == 2:
                raise OSError("storage went away")
            return kv_bad[l][0][:32], kv_bad[l][1][:32]

    wrong_shape = MemorySource([(k[:16], v[:16]) for k, v in kv_bad])  # says 32, has 16
    batch = engine.prefill_batch(
        [
            (good[64:], 64, MemorySource([(k[:64], v[:64]) for k, v in kv_good])),
            (bad[32:], 32, FailsAtLayer2()),
            (bad[32:], 32, wrong_shape),
        ]
    )
    ok, failed, misshapen = batch.members
    seen = []

    async def read_failed():
        async for layer, _, _ in failed:
            seen.append(layer)

    results = await asyncio.gather(
        ok.collect(), read_failed(), misshapen.collect(), return_exceptions=True
    )
    assert_identical(alone, results[0])
    assert isinstance(results[1], OSError) and seen == [0, 1]
    assert isinstance(results[2], ValueError) and "(32, " in str(results[2])
    # the compute thread is free again
    await asyncio.wait_for(engine.prefill(good[:8]).collect(), timeout=30)


async def test_a_member_whose_caller_leaves_does_not_stop_the_others(engine):
    x = toks(100, seed=7)
    kv = hit_kv(engine, x)
    cut = [(k[:90], v[:90]) for k, v in kv]
    alone = await engine.prefill(x[90:], 90, MemorySource(cut)).collect()
    layer_bytes = sum(t.numel() * t.element_size() for t in cut[0])
    batch = engine.prefill_batch(
        [
            (x[90:], 90, ThrottledSource(cut, layer_bytes / 0.02)),
            (x[90:], 90, MemorySource(cut)),
        ]
    )
    leaver, stayer = batch.members
    layers = leaver.__aiter__()
    stay = asyncio.ensure_future(stayer.collect())
    assert (await anext(layers))[0] == 0
    await layers.aclose()  # the caller gives up after layer 0
    assert_identical(alone, await asyncio.wait_for(stay, timeout=30))
    assert leaver.left and not stayer.left


async def test_every_caller_leaving_stops_the_batch(engine):
    x = toks(100, seed=7)
    kv = hit_kv(engine, x)
    gate = asyncio.Event()

    class Gated:  # layer 0 at once, the rest only when the gate opens (never here)
        async def layer(self, l):  # noqa: E741
            if l:
                await gate.wait()
            return kv[l][0][:90], kv[l][1][:90]

    batch = engine.prefill_batch([(x[90:], 90, Gated())])
    layers = batch.members[0].__aiter__()
    assert (await anext(layers))[0] == 0
    await layers.aclose()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(batch._task, timeout=30)


def test_a_batch_refuses_bad_requests(engine):
    with pytest.raises(ValueError, match="at least one request"):
        engine.prefill_batch([])
    with pytest.raises(ValueError, match="request 1 .*no new tokens"):
        engine.prefill_batch([(toks(3), 0, None), ([], 0, None)])
    with pytest.raises(ValueError, match="request 0 .*needs a source"):
        engine.prefill_batch([(toks(3), 8, None)])


async def test_a_long_prefill_hands_the_compute_thread_back_between_layers(engine):
    """Past its quantum a run yields (between key tiles, between layers): a short prefill queued behind
    a long one finishes first, and the long one's output is bit-identical to a run without
    yields."""
    long_tokens, short_tokens = toks(1500, seed=1), toks(20, seed=2)
    whole = engine.prefill(long_tokens)
    whole.batch.quantum_s = float("inf")
    expected = await whole.collect()
    assert whole.batch.times.yields == 0

    done: list[str] = []
    sliced = engine.prefill(long_tokens)
    sliced.batch.quantum_s = 0.0  # a yield after every self-attention tile and layer

    async def run(name, prefill):
        out = await prefill.collect()
        done.append(name)
        return out

    long_task = asyncio.create_task(run("long", sliced))
    await asyncio.sleep(0)  # its first job is on the compute thread
    short = await run("short", engine.prefill(short_tokens))
    got = await long_task
    assert done == ["short", "long"]
    assert sliced.batch.times.yields >= SPEC.layers - 1
    assert_identical(expected, got)
    assert short[1].shape[-1] == SPEC.vocab_size
