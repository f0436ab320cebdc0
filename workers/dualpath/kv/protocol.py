"""The block store contract the read queue and the workers use (docs/design.md section 2).

Two implementations keep it: `kv.store.KVStore` (block files in a POSIX directory, read through
NIXL's POSIX backend or preadv) and `kv.memory.MemoryStore` (blocks in memory, for tests of the
read queue and the worker roles without a disk or NIXL). Both behave alike where callers can see
it:

- a read is of a run of blocks opened first (`open_run`): the run is the longest valid prefix
  of the ids asked for, and `failed` the failure that ended it (a block gone: `missing`; a bad
  header: its reason); failures are data (`BlockFailure`, reasons from `kv/errors.py`), never a
  bad block's bytes;
- `read_run_layers_into` fills the caller's buffers and verifies every layer it reads: a block
  whose checksum fails, or whose read fails, ends the valid prefix (`checksum`, `io_error`, ...);
  a bad or vanished block is dropped from the store, so the next turn writes it again;
- `fail_read` turns an error the caller met reading a block (a timeout, say) into a counted miss;
- `put_tokens` writes a context's full blocks, chained under the request's cache salt, and
  `lookup` is the length of the longest stored prefix of a chain.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from dualpath.config import ModelSpec
from dualpath.kv.buffers import BlockFailure, LayerKV
from dualpath.kv.format import BlockLayout
from dualpath.kv.ids import BlockId


class BlockRun(Protocol):
    """The valid prefix of a run of blocks, held open for one request's reads."""

    ids: list[BlockId]  # the valid prefix's ids
    failed: list[BlockFailure]  # the failure that ended the prefix (empty: all valid)

    @property
    def valid_blocks(self) -> int: ...

    def close(self) -> None:
        """Idempotent and thread-safe."""
        ...


class BlockStore(Protocol):
    """A thread-safe store of one model's KV blocks."""

    model: ModelSpec
    layout: BlockLayout

    def lookup(self, ids: Sequence[BlockId]) -> int:
        """Length of the longest prefix of `ids` present in the store."""
        ...

    def open_run(self, ids: Sequence[BlockId]) -> BlockRun:
        """Validate `ids` and hold the valid prefix open for reads; the caller closes it."""
        ...

    def read_run_layers_into(
        self,
        run: BlockRun,
        l0: int,
        l1: int,
        a: int,
        b: int,
        dests: Sequence[tuple[torch.Tensor, torch.Tensor]],
    ) -> tuple[int, list[BlockFailure]]:
        """Layers [l0, l1) of blocks [a, b) of an open run: dests[j] = flat uint8 (K, V) of
        layer l0+j, blocks back to back. (valid blocks, failures)."""
        ...

    def fail_read(self, block_id: BlockId, err: BaseException) -> BlockFailure:
        """An error reading `block_id` (the block is left alone): a miss by its reason."""
        ...

    def put_tokens(
        self,
        tokens: Sequence[int],
        kv_layers: Sequence[LayerKV],
        kv_start_token: int = 0,
        salt: bytes = b"",
    ) -> list[BlockId]:
        """Write the full blocks of `tokens` that `kv_layers` (from `kv_start_token`) covers;
        the ids written."""
        ...

    def scan_keys(self) -> list[int]:
        """The keys of every block stored now (the scheduler's index snapshot)."""
        ...

    def close(self) -> None: ...
