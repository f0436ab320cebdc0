"""The one mapping between vLLM's KV blocks and the store's (pure: no torch, no vLLM).

vLLM pages its KV cache in blocks of `vllm_block` tokens (128 on CPU by default); the store
keeps blocks of `store_block` tokens (`spec.model.blockTokens`, 64 by default) under chained
ids (`kv.ids.block_ids`, DESIGN section 2). The two meet here:

- `vllm_block` must be a multiple of `store_block`: one vLLM block holds
  `vllm_block // store_block` whole store blocks, so every store block lies in one vLLM block.
- A hit is whole vLLM blocks: the route's hit (whole store blocks, from the scheduler's block
  index) is rounded down to a multiple of `vllm_block`, and never covers the prompt's last
  token (vLLM must compute at least one token to sample from).
- A save is whole store blocks: a store block is written in the step whose computed tokens
  complete it (prompt and generated tokens alike), with the chain id of all tokens before it.
- A load that ends early (a bad or missing block) fails every vLLM block from the one holding
  the first token not loaded: vLLM recomputes from there (`get_block_ids_with_load_errors`).
"""

from __future__ import annotations

from collections.abc import Sequence


def check_block_sizes(vllm_block: int, store_block: int) -> None:
    """Refuse block sizes that do not nest, naming both settings."""
    if vllm_block <= 0 or store_block <= 0 or vllm_block % store_block:
        raise ValueError(
            f"vLLM's block size ({vllm_block}, --block-size) must be a multiple of the "
            f"store's block (spec.model.blockTokens = {store_block})"
        )


def usable_hit_tokens(route_hit_tokens: int, prompt_tokens: int, vllm_block: int) -> int:
    """Tokens of the route's hit vLLM can load: whole vLLM blocks, never the last prompt token."""
    top = min(max(route_hit_tokens, 0), max(prompt_tokens - 1, 0))
    return top // vllm_block * vllm_block


def new_matched_tokens(
    route_hit_tokens: int, prompt_tokens: int, num_computed_tokens: int, vllm_block: int
) -> int:
    """`get_num_new_matched_tokens`: the hit beyond what vLLM already holds (its prefix cache)."""
    return max(
        0, usable_hit_tokens(route_hit_tokens, prompt_tokens, vllm_block) - num_computed_tokens
    )


def received_tokens(prompt_tokens: int) -> int:
    """Tokens a receiver (decode) takes from the sender: the prompt but its last token, which
    vLLM computes to sample the first output token (an async load of the whole prompt would be
    cut to this by vLLM anyway)."""
    return max(prompt_tokens - 1, 0)


def completed_store_blocks(computed_before: int, computed_after: int, store_block: int) -> range:
    """Indices of the store blocks a step completes: those ending in (before, after]."""
    # block i ends at (i + 1) * store_block: in (before, after] iff before // sb <= i < after // sb
    return range(computed_before // store_block, computed_after // store_block)


def slots(block_table: Sequence[int], start: int, end: int, vllm_block: int) -> list[int]:
    """vLLM cache slots (block id * block size + offset) of token positions [start, end)."""
    return [block_table[p // vllm_block] * vllm_block + p % vllm_block for p in range(start, end)]


def failed_vllm_blocks(
    block_table: Sequence[int], loaded_until: int, load_end: int, vllm_block: int
) -> set[int]:
    """vLLM block ids to recompute when a load that should have reached token `load_end`
    stopped at `loaded_until`: every block from the one holding `loaded_until`."""
    if loaded_until >= load_end:
        return set()
    first = loaded_until // vllm_block
    last = -(-load_end // vllm_block)
    return set(block_table[first:last])
