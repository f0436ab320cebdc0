"""Block ids: chained hashes over (previous id, the block's tokens, the model fingerprint).

A prompt's cached prefix is the longest run of its ids present in the store, so equal prefixes
of different prompts share blocks, and a different model (fingerprint) never matches.
Only full blocks get ids; a partial last block is not stored.

A cache salt (a tenant's, see `dualpath.frontend.auth.cache_salt`) seeds the chain: the first
block's parent is `H(root, len(salt), salt)` instead of the root, so every id of a salted chain
differs from the same tokens' ids under another salt (tenants never share or probe each other's
blocks), and the chain property holds within one salt. The empty salt is the unsalted chain:
the ids of a store written before salts existed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NewType

import numpy as np
import xxhash

from dualpath.config import ModelSpec

# 32 lowercase hex digits (128-bit XXH3); also the block's file name.
BlockId = NewType("BlockId", str)

_ROOT = b"dualpath-kv-v1"
MAX_SALT_BYTES = 64  # a salt is a digest (32 bytes from the frontend); more is a caller's bug


def salted_root(salt: bytes) -> bytes:
    """The chain's first parent under `salt` (the plain root for the empty salt)."""
    if not isinstance(salt, bytes | bytearray):
        raise TypeError(f"cache salt must be bytes (got {type(salt).__name__})")
    if len(salt) > MAX_SALT_BYTES:
        raise ValueError(f"cache_salt is {len(salt)} bytes; at most {MAX_SALT_BYTES}")
    if not salt:
        return _ROOT
    h = xxhash.xxh3_128()
    h.update(_ROOT)
    h.update(len(salt).to_bytes(2, "little"))  # no salt is a prefix-extension of another
    h.update(bytes(salt))
    return h.digest()


def block_ids(
    tokens: Sequence[int] | np.ndarray,
    model: ModelSpec,
    parent: BlockId | None = None,
    salt: bytes = b"",
) -> list[BlockId]:
    """Ids of every full block of `tokens` (token ids < 2**32) under the cache `salt`.

    `parent` continues a chain: the id of the block before `tokens[0]` (tokens must then start
    on a block boundary of the whole sequence); the parent already carries the chain's salt.
    """
    bt = model.block_tokens
    arr = np.asarray(tokens, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be a 1-D sequence of token ids (got shape {arr.shape})")
    if arr.size and (arr.min() < 0 or arr.max() >= 2**32):
        raise ValueError("tokens must be token ids in [0, 2**32)")
    data = arr.astype("<u4")
    fp = model.fingerprint.encode()
    prev = bytes.fromhex(parent) if parent else salted_root(salt)
    out: list[BlockId] = []
    for i in range(arr.size // bt):
        h = xxhash.xxh3_128()
        h.update(prev)
        h.update(fp)
        h.update(data[i * bt : (i + 1) * bt].tobytes())
        prev = h.digest()
        out.append(BlockId(prev.hex()))
    return out


def is_block_id(s: str) -> bool:
    return len(s) == 32 and all(c in "0123456789abcdef" for c in s)


# ---- compact keys: what the scheduler's block index holds -----------------------------------
# A key is the first 63 bits of a block id as an int (0 is never a key: it names "no parent",
# the chain's root). Two ids sharing a key make at most a false hit, which the reader turns into
# a recompute (it opens blocks by their full id); at 1M blocks the chance of any pair is ~1e-7.


def block_key(block_id: str) -> int:
    return (int(block_id[:16], 16) >> 1) or 1


def block_keys(ids: Sequence[str]) -> list[int]:
    return [(int(b[:16], 16) >> 1) or 1 for b in ids]
