"""The vLLM block <-> store block mapping and the route a request carries (pure)."""

from __future__ import annotations

import pytest
from dualpath.integrations.vllm import blocks
from dualpath.integrations.vllm.plan import Route
from hypothesis import given
from hypothesis import strategies as st


def test_block_sizes_must_nest() -> None:
    blocks.check_block_sizes(128, 64)
    blocks.check_block_sizes(64, 64)
    with pytest.raises(ValueError, match="--block-size"):
        blocks.check_block_sizes(96, 64)


@pytest.mark.parametrize(
    ("route_hit", "prompt", "computed", "want"),
    [
        (320, 747, 0, 256),  # 5 store blocks -> 2 vLLM blocks
        (256, 256, 0, 128),  # never the prompt's last token
        (256, 257, 0, 256),
        (256, 600, 128, 128),  # vLLM holds the first block already
        (256, 600, 256, 0),
        (0, 600, 0, 0),
        (100, 600, 0, 0),  # less than one vLLM block
    ],
)
def test_new_matched_tokens_are_whole_vllm_blocks(route_hit, prompt, computed, want) -> None:
    assert blocks.new_matched_tokens(route_hit, prompt, computed, 128) == want


@given(st.integers(0, 5000), st.integers(0, 5000))
def test_each_store_block_is_completed_by_exactly_one_step(a: int, b: int) -> None:
    lo, hi = sorted((a, b))
    mid = (lo + hi) // 2
    split = list(blocks.completed_store_blocks(lo, mid, 64)) + list(
        blocks.completed_store_blocks(mid, hi, 64)
    )
    assert split == list(blocks.completed_store_blocks(lo, hi, 64))
    assert split == [i for i in range(hi // 64 + 1) if lo < (i + 1) * 64 <= hi]


def test_slots_and_failed_blocks_follow_the_block_table() -> None:
    table = [7, 3, 9]
    assert blocks.slots(table, 126, 130, 128) == [7 * 128 + 126, 7 * 128 + 127, 3 * 128, 385]
    assert blocks.failed_vllm_blocks(table, 128, 384, 128) == {3, 9}
    assert blocks.failed_vllm_blocks(table, 200, 384, 128) == {3, 9}  # a partly loaded block
    assert blocks.failed_vllm_blocks(table, 384, 384, 128) == set()


def test_route_round_trips_and_refuses_bad_fields() -> None:
    r = Route(1024, "decode", "decode-1", b"\x01\x02", "req-1")
    assert Route.of(r.params()) == r
    assert Route.of(None) == Route() and Route.of({}) == Route()
    for bad, field in (
        ({"hit_tokens": -1}, "hit_tokens"),
        ({"read_path": "x"}, "read_path"),
        ({"cache_salt": "zz"}, "cache_salt"),
    ):
        with pytest.raises(ValueError, match=field):
            Route.of({"dualpath": bad})


async def test_sse_payloads_split_on_newlines_only() -> None:
    """A generated text may carry U+2028 or U+0085 unescaped in vLLM's JSON: not a line end."""
    import json

    from dualpath.worker.vllm import _sse_data

    events = [{"choices": [{"text": "a\u2028b\x85c", "token_ids": [1, 2]}]}, {"choices": []}]
    body = b"".join(
        b"data: " + json.dumps(e, ensure_ascii=False).encode() + b"\n\n" for e in events
    )
    body += b"data: [DONE]\n\n"

    class _Response:
        async def aiter_bytes(self):  # noqa: ANN202 (in pieces that cut lines anywhere)
            for i in range(0, len(body), 7):
                yield body[i : i + 7]

    got = [json.loads(x) async for x in _sse_data(_Response())]
    assert got == events
