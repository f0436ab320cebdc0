"""Second turn with its prefix KV loaded from the store == recomputing the whole context."""

import pytest
import torch
from dualpath.config import ModelSpec
from dualpath.engine import Engine, SamplingParams
from dualpath.kv import KVStore, ReadQueue, block_ids

SPEC = ModelSpec(preset="tiny", block_tokens=8)
GEN = 6


@pytest.fixture(scope="module")
def engine():
    e = Engine(SPEC, kv_capacity_tokens=4096)
    yield e
    e.close()


@pytest.fixture
def store(tmp_path):
    s = KVStore(tmp_path / "kv", SPEC, 1 << 28, backend="preadv", durable=False)
    yield s
    s.close()


def toks(n, seed):
    return torch.randint(0, SPEC.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


async def generate(engine, seq_id, kv, logits, n=GEN):
    outs = [engine.add_sequence(seq_id, kv, logits, SamplingParams(max_tokens=n))]
    while engine.running:
        outs += await engine.astep()
    return [o.token for o in outs if o.seq_id == seq_id]


# (first prompt, appended in turn 2): context lengths hit block boundaries and fall between them
@pytest.mark.parametrize("first,appended", [(8, 5), (13, 8), (29, 11), (40, 1), (3, 21)])
async def test_second_turn_from_store_matches_recompute(engine, store, first, appended):
    prompt = toks(first, seed=first)
    # turn 1: prefill from scratch, decode, write the turn's full blocks to the store
    kv, logits = await engine.prefill(prompt).collect()
    gen1 = await generate(engine, "t1", kv, logits[-1])
    turn1_tokens = torch.cat([prompt, torch.tensor(gen1[:-1])])  # last token's KV not computed
    kv1 = engine.sequence_kv("t1")
    assert kv1[0][0].shape[0] == turn1_tokens.numel()
    engine.free("t1")
    written = store.put_tokens(turn1_tokens.tolist(), kv1)
    assert len(written) == turn1_tokens.numel() // SPEC.block_tokens

    # turn 2: context = turn 1 + its last token + appended user tokens
    context = torch.cat([turn1_tokens, torch.tensor(gen1[-1:]), toks(appended, seed=99)])
    ids = block_ids(context.tolist(), SPEC)
    hits = store.lookup(ids)
    assert hits == len(written)
    hit = hits * SPEC.block_tokens
    with ReadQueue(store, concurrency=2) as queue:
        handle = queue.submit(ids[:hits])
        run = engine.prefill(context[hit:], hit, handle, all_logits=True)
        new_kv, logits2 = await run.collect()
        hit_kv = [
            tuple(t.clone() for t in handle.layer_sync(layer)) for layer in range(SPEC.layers)
        ]
        handle.close()

    ref_logits, ref_kv = engine.model.forward_full(context)
    torch.testing.assert_close(logits2, ref_logits[hit:], atol=1e-4, rtol=0)
    full_kv = [
        (torch.cat([hk, nk]), torch.cat([hv, nv]))
        for (hk, hv), (nk, nv) in zip(hit_kv, new_kv, strict=True)
    ]
    from_store = await generate(engine, "t2-store", full_kv, logits2[-1])
    recompute = await generate(engine, "t2-ref", ref_kv, ref_logits[-1])
    engine.free("t2-store")
    engine.free("t2-ref")
    assert from_store == recompute
