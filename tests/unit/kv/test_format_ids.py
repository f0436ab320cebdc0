"""Block ids and the block header format (pure)."""

import pytest
from dualpath.config import ModelSpec
from dualpath.kv.format import BlockFormatError, BlockLayout, decode_header, encode_header
from dualpath.kv.ids import block_ids, is_block_id

TINY = ModelSpec(preset="tiny")


def test_ids_are_chained_and_prefix_stable():
    a = block_ids(list(range(200)), TINY)
    b = block_ids(list(range(128)) + [7] * 72, TINY)
    assert len(a) == 200 // TINY.block_tokens == 3
    assert a[:2] == b[:2] and a[2] != b[2]
    assert all(is_block_id(x) for x in a)
    # a change in block 0 changes every later id (chain)
    c = block_ids([1] + list(range(1, 200)), TINY)
    assert not set(a) & set(c)


def test_ids_continue_from_parent_and_depend_on_model():
    toks = list(range(256))
    full = block_ids(toks, TINY)
    assert block_ids(toks[128:], TINY, parent=full[1]) == full[2:]
    other = ModelSpec(preset="tiny", seed=1)
    assert block_ids(toks, other)[0] != full[0]


def test_a_salt_seeds_the_whole_chain_and_the_empty_salt_is_the_plain_chain():
    toks = list(range(256))
    plain = block_ids(toks, TINY)
    assert block_ids(toks, TINY, salt=b"") == plain  # stores written before salts stay valid
    a = block_ids(toks, TINY, salt=b"tenant-a")
    b = block_ids(toks, TINY, salt=b"tenant-b")
    # no id in common between salts, at any depth: a tenant cannot probe another's blocks
    assert not set(a) & set(b) and not set(a) & set(plain)
    assert block_ids(toks, TINY, salt=b"tenant-a") == a  # stable
    # the chain property holds within a salt: a prefix's ids are the sequence's first ids,
    # and a parent continues the salted chain (it carries the salt)
    assert block_ids(toks[:128], TINY, salt=b"tenant-a") == a[:2]
    assert block_ids(toks[128:], TINY, parent=a[1]) == a[2:]
    # salts of different lengths do not collide by concatenation with what follows
    assert block_ids(toks, TINY, salt=b"ab")[0] != block_ids(toks, TINY, salt=b"a")[0]
    assert block_ids(toks, TINY, salt=b"\0")[0] != plain[0]


def test_ids_refuse_bad_salts():
    with pytest.raises(ValueError, match="cache_salt is 65 bytes"):
        block_ids(list(range(64)), TINY, salt=b"x" * 65)
    with pytest.raises(TypeError, match="bytes"):
        block_ids(list(range(64)), TINY, salt="tenant")  # type: ignore[arg-type]


def test_ids_refuse_bad_tokens():
    with pytest.raises(ValueError, match="token ids"):
        block_ids([-1] * 64, TINY)


def test_layout_offsets_are_layer_major():
    lo = BlockLayout.from_model(ModelSpec(preset="llama3-8b"))
    assert lo.k_bytes == 64 * 8 * 128 * 2 and lo.layer_bytes == 2 * lo.k_bytes
    assert lo.header_bytes % 4096 == 0
    assert lo.layer_offset(3) == lo.header_bytes + 3 * lo.layer_bytes
    assert lo.file_bytes == lo.header_bytes + 32 * lo.layer_bytes
    mla = BlockLayout.from_model(ModelSpec(preset="dsmla-27b"))
    assert mla.k_dim == 576 and mla.v_bytes == 0


def test_header_round_trip_and_rejections():
    lo = BlockLayout.from_model(TINY)
    bid = block_ids(list(range(64)), TINY)[0]
    sums = list(range(100, 100 + lo.layers))
    raw = encode_header(lo, bid, sums)
    assert len(raw) == lo.header_bytes
    assert decode_header(raw, lo, bid).checksums == tuple(sums)

    flipped = bytearray(raw)
    flipped[40] ^= 1
    with pytest.raises(BlockFormatError) as e:
        decode_header(bytes(flipped), lo, bid)
    assert e.value.reason in ("checksum", "bad_header")

    with pytest.raises(BlockFormatError) as e:
        decode_header(b"XXXX" + raw[4:], lo, bid)
    assert e.value.reason == "bad_header"

    foreign = BlockLayout.from_model(ModelSpec(preset="tiny", seed=3))
    with pytest.raises(BlockFormatError) as e:
        decode_header(encode_header(foreign, bid, sums), lo, bid)
    assert e.value.reason == "foreign_model"

    with pytest.raises(BlockFormatError) as e:
        decode_header(raw[:10], lo, bid)
    assert e.value.reason == "truncated"
