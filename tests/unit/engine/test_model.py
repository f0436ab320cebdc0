"""Model, prefill over a per-layer source, paged decode: against full recomputation."""

import asyncio
import concurrent.futures as cf

import pytest
import torch
from dualpath.config import ModelSpec
from dualpath.engine import (
    CacheFullError,
    Engine,
    MemorySource,
    PrefillRun,
    SamplingParams,
    ThrottledSource,
    TiledAttention,
    Transformer,
    load_checkpoint,
    save_checkpoint,
    spec_from_checkpoint,
)
from stepped_source import SteppedSource

SPEC = ModelSpec(preset="tiny", block_tokens=8)


@pytest.fixture(scope="module")
def engine():
    e = Engine(SPEC, kv_capacity_tokens=2048)
    yield e
    e.close()


def toks(n, seed=0):
    return torch.randint(0, SPEC.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def greedy_reference(model, tokens, n):
    seq, out = list(tokens.tolist()), []
    for _ in range(n):
        logits, _ = model.forward_full(torch.tensor(seq))
        out.append(int(logits[-1].argmax()))
        seq.append(out[-1])
    return out


def test_seeded_init_is_deterministic_and_seed_dependent():
    a, b = Transformer.from_seed(SPEC), Transformer.from_seed(SPEC)
    c = Transformer.from_seed(SPEC, seed=1)
    x = toks(10)
    la, lb, lc = a.forward_full(x)[0], b.forward_full(x)[0], c.forward_full(x)[0]
    assert torch.equal(la, lb)
    assert not torch.allclose(la, lc)


@pytest.mark.parametrize("hit_blocks,new", [(1, 5), (2, 8), (3, 13), (0, 7)])
async def test_prefill_with_hit_matches_full(engine, hit_blocks, new):
    hit = hit_blocks * SPEC.block_tokens
    x = toks(hit + new, seed=hit + new)
    ref_logits, ref_kv = engine.model.forward_full(x)
    src = MemorySource([(k[:hit], v[:hit]) for k, v in ref_kv])
    run = engine.prefill(x[hit:], hit, src, all_logits=True)
    seen = []
    async for layer, k, v in run:
        seen.append(layer)
        assert k.shape == (new, SPEC.kv_heads, SPEC.head_dim)
        torch.testing.assert_close(k, ref_kv[layer][0][hit:], atol=1e-4, rtol=0)
        torch.testing.assert_close(v, ref_kv[layer][1][hit:], atol=1e-4, rtol=0)
    assert seen == list(range(SPEC.layers))
    torch.testing.assert_close(run.logits, ref_logits[hit:], atol=1e-4, rtol=0)


async def test_prefill_rejects_wrong_hit_shape(engine):
    x = toks(12)
    _, kv = engine.model.forward_full(x)
    src = MemorySource([(k[:4], v[:4]) for k, v in kv])
    with pytest.raises(ValueError, match="hit_tokens, kv_heads, head_dim"):
        await engine.prefill(x[8:], 8, src).collect()


async def test_throttled_source_delivers_the_same_kv(engine):
    x = toks(24)
    ref_logits, kv = engine.model.forward_full(x)
    src = ThrottledSource([(k[:16], v[:16]) for k, v in kv], bytes_per_s=50e6)
    _, logits = await engine.prefill(x[16:], 16, src).collect()
    torch.testing.assert_close(logits[0], ref_logits[-1], atol=1e-4, rtol=0)


async def test_continuous_batching_matches_recompute(engine):
    # three sequences of different lengths, one joining late; greedy == recomputation
    lengths = [9, 16, 21]
    prompts = [toks(n, seed=100 + n) for n in lengths]
    want = [greedy_reference(engine.model, p, 6) for p in prompts]
    got = {i: [] for i in range(3)}
    for i in (0, 1):
        kv, logits = await engine.prefill(prompts[i]).collect()
        got[i].append(
            engine.add_sequence(f"s{i}", kv, logits[-1], SamplingParams(max_tokens=6)).token
        )
    for out in await engine.astep():
        got[int(out.seq_id[1])].append(out.token)
    kv, logits = await engine.prefill(prompts[2]).collect()
    got[2].append(engine.add_sequence("s2", kv, logits[-1], SamplingParams(max_tokens=6)).token)
    for _ in range(10):
        outs = await engine.astep()
        if not outs:
            break
        for out in outs:
            got[int(out.seq_id[1])].append(out.token)
    assert [got[i] for i in range(3)] == want
    assert engine.running == []
    # the cached KV of a finished sequence equals the recomputed context's KV
    full = torch.cat([prompts[0], torch.tensor(want[0][:-1])])
    _, ref_kv = engine.model.forward_full(full)
    cached = engine.sequence_kv("s0")
    torch.testing.assert_close(cached[1][0], ref_kv[1][0], atol=1e-4, rtol=0)
    for i in range(3):
        engine.free(f"s{i}")


async def test_stop_tokens_and_max_tokens(engine):
    p = toks(10, seed=7)
    ref = greedy_reference(engine.model, p, 4)
    kv, logits = await engine.prefill(p).collect()
    first = engine.add_sequence(
        "stop", kv, logits[-1], SamplingParams(max_tokens=50, stop_tokens=(ref[2],))
    )
    outs = [first]
    while engine.running:
        outs += engine.step()
    assert [o.token for o in outs] == ref[: ref.index(ref[2]) + 1]
    assert outs[-1].reason == "stop" and outs[-1].finished
    engine.free("stop")
    one = engine.add_sequence("one", kv, logits[-1], SamplingParams(max_tokens=1))
    assert one.finished and one.reason == "length"
    engine.free("one")


async def test_temperature_sampling_is_seeded(engine):
    p = toks(10, seed=3)
    kv, logits = await engine.prefill(p).collect()
    runs = []
    for seed in (1, 1, 2):
        params = SamplingParams(temperature=1.5, max_tokens=8, seed=seed)
        out = [engine.add_sequence("t", kv, logits[-1], params).token]
        while engine.running:
            out += [o.token for o in engine.step()]
        engine.free("t")
        runs.append(out)
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_cache_full_is_an_error_naming_the_fix():
    e = Engine(SPEC, kv_capacity_tokens=16)
    try:
        _, kv = e.model.forward_full(toks(10))
        with pytest.raises(CacheFullError, match="kv_capacity_tokens"):
            e.add_sequence("big", kv, torch.zeros(SPEC.vocab_size), SamplingParams(max_tokens=20))
    finally:
        e.close()


def test_checkpoint_roundtrip(tmp_path):
    model = Transformer.from_seed(SPEC)
    save_checkpoint(model, tmp_path / "ckpt")
    spec = spec_from_checkpoint(tmp_path / "ckpt", block_tokens=8)
    assert (spec.layers, spec.heads, spec.kv_heads, spec.head_dim) == (4, 4, 2, 16)
    loaded = load_checkpoint(tmp_path / "ckpt", spec)
    x = toks(12)
    assert torch.equal(model.forward_full(x)[0], loaded.forward_full(x)[0])


def test_missing_checkpoint_names_the_field(tmp_path):
    with pytest.raises(FileNotFoundError, match="checkpointPath"):
        load_checkpoint(tmp_path)


def test_prefill_runs_compute_off_the_loop(engine):
    # the loop stays responsive while a prefill computes: a ticker advances during it
    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        t = asyncio.ensure_future(ticker())
        await engine.prefill(toks(200)).collect()
        t.cancel()
        return ticks

    # the loop turns at least once per layer computed off it (on it, the ticker would not run
    # until the prefill ended); how many more times depends on the machine's load, not asserted
    assert asyncio.run(main()) >= SPEC.layers


def _sdpa_reference(q, k, v, hit_k, hit_v, scale):
    n = q.shape[0]
    keys, vals = torch.cat([hit_k, k]), torch.cat([hit_v, v])
    mask = torch.arange(keys.shape[0])[None, :] <= torch.arange(n)[:, None] + hit_k.shape[0]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1),
        keys.transpose(0, 1),
        vals.transpose(0, 1),
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(0, 1).reshape(n, -1)


@pytest.mark.parametrize("new,hit", [(1, 0), (5, 0), (19, 0), (3, 7), (8, 33), (21, 40), (1, 64)])
def test_tiled_attention_matches_sdpa_whatever_the_cut(new, hit):
    g = torch.Generator().manual_seed(new * 100 + hit)
    q = torch.randn(new, 4, 16, generator=g)
    k, v = torch.randn(new, 2, 16, generator=g), torch.randn(new, 2, 16, generator=g)
    hk, hv = torch.randn(hit, 2, 16, generator=g), torch.randn(hit, 2, 16, generator=g)
    want = _sdpa_reference(q, k, v, hk, hv, 0.25)
    outs = []
    for cuts in ([hit], [1] * hit, [hit // 3, hit - hit // 3]):
        acc = TiledAttention(q, 2, 0.25, tile=8)
        acc.add_self(k, v)
        a = 0
        for c in cuts:
            acc.push(hk[a : a + c], hv[a : a + c])
            a += c
        acc.compute_ready(final=True)
        outs.append(acc.result())
    torch.testing.assert_close(outs[0], want, atol=1e-5, rtol=0)
    # the tiles are counted from the hit's first token: the cut never changes a bit
    assert all(torch.equal(outs[0], o) for o in outs[1:])


async def test_prefill_over_pieces_attends_early_and_is_bit_identical(engine):
    hit, new = 600, 37  # several 128-token tiles, a partial last one
    x = toks(hit + new, seed=11)
    ref_logits, ref_kv = engine.model.forward_full(x)
    layers = [(k[:hit], v[:hit]) for k, v in ref_kv]
    whole = engine.prefill(x[hit:], hit, MemorySource(layers))
    kv_whole, logits_whole = await whole.collect()
    pieces = engine.prefill(x[hit:], hit, SteppedSource(layers, piece_tokens=50))
    kv_pieces, logits_pieces = await pieces.collect()
    assert torch.equal(logits_whole, logits_pieces)
    assert all(
        torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        for a, b in zip(kv_whole, kv_pieces, strict=True)
    )
    torch.testing.assert_close(logits_pieces[0], ref_logits[-1], atol=1e-4, rtol=0)
    # tiles were attended to while the rest of their layer was arriving (4 of 5 a layer)
    assert pieces.times.early_tiles == 4 * SPEC.layers
    assert whole.times.early_tiles == 0


async def test_prefill_rejects_a_short_piece_stream(engine):
    x = toks(20)
    _, kv = engine.model.forward_full(x)

    class Short:  # a stream (layer_pieces) that ends early
        async def layer(self, l):  # noqa: E741
            raise AssertionError("the prefill reads a source with layer_pieces piece by piece")

        async def layer_pieces(self, l):  # noqa: E741
            k, v = kv[l]
            yield k[:8], v[:8]  # 8 of the 12 announced tokens

    with pytest.raises(ValueError, match="has 8 tokens"):
        await engine.prefill(x[12:], 12, Short()).collect()


class CountingExecutor(cf.ThreadPoolExecutor):
    def __init__(self) -> None:
        super().__init__(1)
        self.jobs = 0

    def submit(self, fn, /, *args, **kwargs):
        self.jobs += 1
        return super().submit(fn, *args, **kwargs)


async def test_prefill_with_its_hit_at_hand_is_one_compute_job(engine):
    # a trip through the loop costs a thread handoff: with every layer's hit already here
    # the forward never comes back to the loop before its logits
    hit, x = 64, toks(80, seed=5)
    _, kv = engine.model.forward_full(x)
    with CountingExecutor() as ex:
        src = MemorySource([(k[:hit], v[:hit]) for k, v in kv])
        run = PrefillRun(engine.model, ex, x[hit:], hit, src)
        run.batch.quantum_s = float("inf")  # no hand-back for its quantum (a loaded CPU's)
        layers = [layer async for layer, _, _ in run]
        assert layers == list(range(SPEC.layers)) and ex.jobs == 1
        assert run.times.wait_s == 0 and run.times.compute_s > 0


async def test_a_source_error_reaches_the_caller_and_frees_the_compute_thread(engine):
    x = toks(40, seed=6)
    _, kv = engine.model.forward_full(x)

    class FailsAtLayer2:  # only layer(): read through the loop-side pump
        async def layer(self, l):  # noqa: E741
            if l == 2:
                raise OSError("storage went away")
            return kv[l][0][:32], kv[l][1][:32]

    run = engine.prefill(x[32:], 32, FailsAtLayer2())
    seen = []
    with pytest.raises(OSError, match="storage went away"):
        async for layer, _, _ in run:
            seen.append(layer)
    assert seen == [0, 1]  # the layers before the missing one were computed and yielded
    # the engine's one compute thread is free again
    await asyncio.wait_for(engine.prefill(x[:8]).collect(), timeout=30)


async def test_a_source_whose_read_was_cancelled_ends_the_prefill(engine):
    # a layer that will never come (its read was cancelled) must not leave the prefill waiting
    x = toks(40, seed=8)
    _, kv = engine.model.forward_full(x)

    class Cancelled:
        async def layer(self, l):  # noqa: E741
            if l == 1:
                raise asyncio.CancelledError()
            return kv[l][0][:32], kv[l][1][:32]

    run = engine.prefill(x[32:], 32, Cancelled())
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(run.collect(), timeout=30)


async def test_leaving_a_prefill_early_stops_it(engine):
    x = toks(100, seed=7)
    _, kv = engine.model.forward_full(x)
    layer_bytes = sum(t[:90].numel() * t.element_size() for t in kv[0])
    slow = ThrottledSource([(k[:90], v[:90]) for k, v in kv], layer_bytes / 0.05)
    run = engine.prefill(x[90:], 90, slow)
    layers = run.__aiter__()
    assert (await anext(layers))[0] == 0
    await layers.aclose()  # the caller gives up after layer 0
    assert run.batch._task is not None
    with pytest.raises(asyncio.CancelledError):
        await run.batch._task
    assert run.logits is None
    await asyncio.wait_for(engine.prefill(x[:8]).collect(), timeout=30)


@pytest.mark.parametrize("new", [1, 3, 20])
def test_tiles_computed_together_have_the_bits_of_tiles_computed_alone(new, monkeypatch):
    # the full tiles at hand are attended to in one call (in groups bounded by SCORE_FLOATS);
    # a tile's partial must not depend on how many came with it, or the cut would show
    from dualpath.engine import model as model_mod

    g = torch.Generator().manual_seed(new)
    hit = 600  # 9 full tiles of 64 and a partial one
    q = torch.randn(new, 4, 16, generator=g)
    k, v = torch.randn(new, 2, 16, generator=g), torch.randn(new, 2, 16, generator=g)
    hk, hv = torch.randn(hit, 2, 16, generator=g), torch.randn(hit, 2, 16, generator=g)
    want = _sdpa_reference(q, k, v, hk, hv, 0.25)
    outs = []
    for score_floats, cut in ((1 << 22, hit), (1 << 22, 64), (4 * new * 64 * 2, hit), (1, 37)):
        monkeypatch.setattr(model_mod, "SCORE_FLOATS", score_floats)
        acc = TiledAttention(q, 2, 0.25, tile=64)
        acc.add_self(k, v)
        for a in range(0, hit, cut):
            acc.push(hk[a : a + cut], hv[a : a + cut])
        acc.compute_ready(final=True)
        outs.append(acc.result())
    torch.testing.assert_close(outs[0], want, atol=1e-5, rtol=0)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_a_prefill_alone_is_a_batch_of_one(engine):
    run = engine.prefill(toks(5))
    assert run.batch.members == [run.member] and run.member.new_tokens == 5
    with pytest.raises(ValueError, match="the prefill has no new tokens"):
        engine.prefill([])
