"""The KV block store: content-addressed blocks in a POSIX directory (docs/design.md section 2).

Files live at `<root>/blocks/<id[:2]>/<id>`. `KVStore` is the store's one public face; each
job lives in its own module and the store wires them to one directory, one layout, one lock:

- `kv/index.py` (`BlockIndex`): the LRU index (rebuilt from the directory's mtimes on start;
  lookups and reads refresh a block's mtime), bytes used, eviction beyond `capacity_bytes`;
- `kv/writer.py` (`BlockWriter`): atomic, checksummed writes, made room for, announced;
- `kv/reader.py` (`BlockReader`, `OpenRun`): opening runs of blocks, range reads, and the
  verification of every header and layer checksum read; a bad block is a miss, dropped;
- `kv/buffers.py`: request buffers, K/V views of their layers, and the read results;
- `kv/files.py`: the cache of open block fds and their validated headers.

Several processes may share a directory: each indexes what it sees; a block another process
evicted is a `missing` miss. The store is a best-effort cache: an I/O error on a read is a miss
by its reason (`kv/errors.py`) that ends the prefix there; a recency update or removal that
fails is counted and the read goes on; a write that finds the disk full evicts least recently
used blocks and tries once more, and a write that fails is counted and raised. It keeps the
`kv.protocol.BlockStore` contract the read queue and the workers use (`kv.memory.MemoryStore`
is its in-memory twin for tests).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

from dualpath.config import ModelSpec
from dualpath.kv import errors, metrics
from dualpath.kv.backend import ReadBackend, make_backend
from dualpath.kv.events import KvEventBuffer
from dualpath.kv.files import OpenBlocks
from dualpath.kv.format import BlockLayout
from dualpath.kv.ids import BlockId, block_key, is_block_id
from dualpath.kv.index import BlockIndex
from dualpath.kv.reader import BlockReader, open_files_limit
from dualpath.kv.writer import BlockWriter

log = logging.getLogger(__name__)

_OPEN_FILES = 1024


class KVStore:
    """Thread-safe block store of one model in one directory."""

    def __init__(
        self,
        root: str | Path,
        model: ModelSpec,
        capacity_bytes: int,
        backend: str | ReadBackend = "auto",
        durable: bool = True,
        open_files: int = _OPEN_FILES,
        events: KvEventBuffer | None = None,
    ) -> None:
        self.root = Path(root)
        self.events = events  # KV events for the scheduler's block index (stored / removed)
        self.model = model
        self.layout = BlockLayout.from_model(model)
        if capacity_bytes < self.layout.file_bytes:
            raise ValueError(
                f"capacity_bytes ({capacity_bytes}) is smaller than one block "
                f"({self.layout.file_bytes} bytes); raise storage.capacityBytes"
            )
        self.capacity_bytes = capacity_bytes
        self.durable = durable
        warn = errors.LogLimiter(log)
        self._files = OpenBlocks(open_files_limit(open_files))
        self.index = BlockIndex(self.root, capacity_bytes, self._files, events, warn)
        self.writer = BlockWriter(self.root, model, self.layout, self.index, durable)
        self.reader = BlockReader(
            self.layout,
            make_backend(backend) if isinstance(backend, str) else backend,
            self._files,
            self.index,
            warn,
        )
        # reads: see kv/reader.py
        self.check = self.reader.check
        self.open_run = self.reader.open_run
        self.fail_read = self.reader.fail_read
        self.read_layer = self.reader.read_layer
        self.read_run_layer = self.reader.read_run_layer
        self.read_run_layers_into = self.reader.read_run_layers_into
        self.read_blocks = self.reader.read_blocks
        # writes: see kv/writer.py
        self.put = self.writer.put
        self.put_tokens = self.writer.put_tokens
        # eviction: see kv/index.py
        self.evict = self.index.evict
        (self.root / "blocks").mkdir(parents=True, exist_ok=True)
        (self.root / "tmp").mkdir(parents=True, exist_ok=True)
        self.index.rebuild()
        log.info(
            "KV store %s: %d blocks, %d/%d bytes, backend %s",
            self.root,
            len(self),
            self.used_bytes,
            capacity_bytes,
            self.backend.name,
        )

    @property
    def backend(self) -> ReadBackend:
        return self.reader.backend

    @backend.setter
    def backend(self, backend: ReadBackend) -> None:  # tests swap in a faulty one
        self.reader.backend = backend

    def path_of(self, block_id: BlockId) -> Path:
        return Path(self.index.file(block_id))

    @property
    def used_bytes(self) -> int:
        return self.index.used

    def __len__(self) -> int:
        return len(self.index.lru)

    def __contains__(self, block_id: object) -> bool:
        return isinstance(block_id, str) and self.index.present(BlockId(block_id))

    def lru_order(self) -> list[BlockId]:
        """Indexed ids, least recently used first."""
        with self.index.lock:
            return list(self.index.lru)

    def lookup(self, ids: Sequence[BlockId]) -> int:
        """Length of the longest prefix of `ids` present in the store."""
        hits = 0
        for b in ids:
            if not self.index.present(b):
                break
            hits += 1
        metrics.LOOKUP_BLOCKS.inc(len(ids))
        metrics.LOOKUP_HITS.inc(hits)
        self.index.touch(ids[:hits])
        return hits

    def scan_keys(self) -> list[int]:
        """The keys (`block_key`) of every block file in the directory now, whoever wrote it:
        the snapshot the scheduler rebuilds its block index from."""
        keys = []
        with os.scandir(self.root / "blocks") as shards:
            for shard in shards:
                if not shard.is_dir():
                    continue
                with os.scandir(shard.path) as files:
                    keys.extend(block_key(f.name) for f in files if is_block_id(f.name))
        return keys

    def close(self) -> None:
        self._files.close()
        self.backend.close()
