"""The KV block store: content-addressed blocks in a POSIX directory (DESIGN section 2).

Files live at `<root>/blocks/<id[:2]>/<id>`; writes go to `<root>/tmp/` first and are renamed
into place after fsync, so a reader sees a whole block or none. The store keeps an LRU index
(rebuilt from the directory's mtimes on start; lookups and reads refresh a block's mtime) and
evicts the least recently used blocks beyond `capacity_bytes`. Several processes may share a
directory: each indexes what it sees; a block another process evicted is a `missing` miss.

Every read verifies the block's header (magic, version, model fingerprint, shape) and the
checksum of each layer it reads. A bad block is a miss, logged and counted by reason, and
dropped from the store so it is rewritten; reads return the valid prefix and the failed ids.
The store is a best-effort cache: an I/O error on a read (read-only, permission, EIO, a short
read) is a miss by its reason (`kv/errors.py`) that ends the prefix there; a recency update or
removal that fails is counted and the read goes on; a write that finds the disk full evicts least
recently used blocks and tries once more, and a write that fails is counted and raised.
Block fds and their validated headers stay open between reads (`kv/files.py`): each read stats
the path and reuses an fd only while the path still names the inode it was opened on.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from dualpath.config import ModelSpec
from dualpath.kv import errors, metrics
from dualpath.kv.backend import (
    NBYTES,
    ReadBackend,
    ReadBatch,
    make_backend,
    reads_runs,
)
from dualpath.kv.events import KvEventBuffer, chain_events
from dualpath.kv.files import OpenBlock, OpenBlocks
from dualpath.kv.format import (
    BlockFormatError,
    BlockLayout,
    decode_header,
    encode_header,
    layer_checksum,
)
from dualpath.kv.ids import BlockId, block_ids, block_key, is_block_id

log = logging.getLogger(__name__)

TORCH_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float8": torch.float8_e4m3fn,
}
_STALE_TMP_S = 600.0
_OPEN_FILES = 1024
_VERIFY_STEP_BYTES = 4 << 20  # read then checksum this much at a time: stays in L2/L3

LayerKV = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class BlockFailure:
    block_id: BlockId
    reason: str  # metric label: one of kv/errors.py READ_REASONS


@dataclass
class LayerRead:
    """One layer of a run of blocks: K, V of the valid prefix's tokens."""

    k: torch.Tensor
    v: torch.Tensor
    valid_blocks: int
    failed: list[BlockFailure] = field(default_factory=list)


@dataclass
class BlockRead:
    """A whole-request read: every layer of the valid prefix, in a layer-major host buffer."""

    buffer: torch.Tensor  # uint8, RequestBuffer layout for the requested block count
    layout: BlockLayout
    requested_blocks: int
    valid_blocks: int
    failed: list[BlockFailure] = field(default_factory=list)

    def layer(self, layer: int) -> LayerKV:
        return request_layer_views(
            self.buffer, self.layout, self.requested_blocks, layer, self.valid_blocks
        )


def request_buffer_bytes(layout: BlockLayout, blocks: int) -> int:
    """Bytes of a request buffer: per layer, K of all blocks' tokens then V of all."""
    return layout.payload_bytes * blocks


def request_layer_bytes(
    buffer: torch.Tensor, layout: BlockLayout, blocks: int, layer: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat uint8 K and V ranges of `layer` in a request buffer sized for `blocks` blocks:
    layer-major, K of every block back to back, then V of every block."""
    base = layer * blocks * layout.layer_bytes
    v0 = base + blocks * layout.k_bytes
    return buffer[base:v0], buffer[v0 : v0 + blocks * layout.v_bytes]


def request_layer_views(
    buffer: torch.Tensor, layout: BlockLayout, blocks: int, layer: int, valid: int | None = None
) -> LayerKV:
    """K, V views of `layer` in a request buffer sized for `blocks` blocks (first `valid`)."""
    valid = blocks if valid is None else valid
    dtype = TORCH_DTYPES[layout.dtype]
    k8, v8 = request_layer_bytes(buffer, layout, blocks, layer)
    tokens = valid * layout.block_tokens
    k = k8[: valid * layout.k_bytes].view(dtype).view(tokens, layout.k_heads, layout.k_dim)
    v = v8[: valid * layout.v_bytes].view(dtype).view(tokens, layout.v_heads, layout.v_dim)
    return k, v


def layers_segments(layout: BlockLayout, fds: np.ndarray, l0: int, l1: int) -> np.ndarray:
    """Segment table reading layers [l0, l1) of blocks `fds` into 2 dests a layer: K of layer
    l0+j of every block back to back in dest 2j, V in dest 2j+1. Rows: block 0 layer l0 K, V,
    block 0 layer l0+1 K, V, ...; each block's rows are one contiguous run of its file."""
    n, g = len(fds), l1 - l0
    seg = np.empty((n, g, 2, 5), dtype=np.int64)
    blk = np.arange(n, dtype=np.int64)[:, None]
    lay = np.arange(g, dtype=np.int64)[None, :]
    seg[:, :, :, 0] = fds[:, None, None]
    seg[:, :, 0, 1] = layout.layer_offset(l0) + lay * layout.layer_bytes
    seg[:, :, 1, 1] = seg[:, :, 0, 1] + layout.k_bytes
    seg[:, :, 0, 2] = layout.k_bytes
    seg[:, :, 1, 2] = layout.v_bytes
    seg[:, :, 0, 3] = 2 * lay
    seg[:, :, 1, 3] = 2 * lay + 1
    seg[:, :, 0, 4] = blk * layout.k_bytes
    seg[:, :, 1, 4] = blk * layout.v_bytes
    return seg.reshape(-1, 5)


def block_segments(layout: BlockLayout, fds: np.ndarray) -> np.ndarray:
    """Segment table reading every layer of blocks `fds` into one request buffer (dest 0,
    `request_layer_views` layout). Rows: block 0 layer 0 K, V, block 0 layer 1 K, V, ...;
    each block's rows are one contiguous run of its file."""
    n, layers = len(fds), layout.layers
    seg = np.empty((n, layers, 2, 5), dtype=np.int64)
    blk = np.arange(n, dtype=np.int64)[:, None]
    lay = np.arange(layers, dtype=np.int64)[None, :]
    seg[:, :, :, 0] = fds[:, None, None]
    seg[:, :, 0, 1] = layout.header_bytes + lay * layout.layer_bytes
    seg[:, :, 1, 1] = seg[:, :, 0, 1] + layout.k_bytes
    seg[:, :, 0, 2] = layout.k_bytes
    seg[:, :, 1, 2] = layout.v_bytes
    seg[:, :, :, 3] = 0
    base = lay * n * layout.layer_bytes
    seg[:, :, 0, 4] = base + blk * layout.k_bytes
    seg[:, :, 1, 4] = base + n * layout.k_bytes + blk * layout.v_bytes
    return seg.reshape(-1, 5)


def split_blocks(kv_layers: Sequence[LayerKV], block_tokens: int) -> list[list[LayerKV]]:
    """Split a context's per-layer (K, V), each (tokens, heads, dim), into full blocks."""
    if not kv_layers:
        return []
    tokens = kv_layers[0][0].shape[0]
    out = []
    for i in range(tokens // block_tokens):
        s = slice(i * block_tokens, (i + 1) * block_tokens)
        out.append([(k[s], v[s]) for k, v in kv_layers])
    return out


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _dest(t: torch.Tensor, name: str) -> torch.Tensor:
    if not t.is_contiguous():  # reshape would copy, and the read would land in the copy
        raise ValueError(f"{name} must be contiguous")
    return _u8(t)


class OpenRun:
    """The valid prefix of a run of blocks, held open for one request's reads
    (`KVStore.open_run`). Its reads use the inodes the blocks' paths named when it was opened,
    checked against their headers; `close()` hands the fds back to the store's cache (closing
    those evicted, dropped or replaced meanwhile). Idempotent and thread-safe."""

    def __init__(
        self, files: OpenBlocks, ids: list[BlockId], entries: list[OpenBlock], failed: list
    ) -> None:
        self._files = files
        self.ids = ids[: len(entries)]
        self.entries = entries
        self.failed: list[BlockFailure] = failed
        self._lock = threading.Lock()
        self._open = True

    @property
    def valid_blocks(self) -> int:
        return len(self.entries)

    def close(self) -> None:
        with self._lock:
            if not self._open:
                return
            self._open = False
        self._files.release(self.entries)

    def __enter__(self) -> OpenRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
        self._blocks_dir = str(self.root / "blocks")
        self.model = model
        self.layout = BlockLayout.from_model(model)
        if capacity_bytes < self.layout.file_bytes:
            raise ValueError(
                f"capacity_bytes ({capacity_bytes}) is smaller than one block "
                f"({self.layout.file_bytes} bytes); raise storage.capacityBytes"
            )
        self.capacity_bytes = capacity_bytes
        self.durable = durable
        self.backend = make_backend(backend) if isinstance(backend, str) else backend
        self._read_seconds = metrics.READ_SECONDS.labels(backend=self.backend.name)
        self._read_bytes = metrics.READ_BYTES.labels(backend=self.backend.name)
        self._lock = threading.Lock()
        self._lru: OrderedDict[BlockId, int] = OrderedDict()  # id -> file bytes, oldest first
        self._files = OpenBlocks(_open_files_limit(open_files))
        self._used = 0
        self._warn = errors.LogLimiter(log)
        (self.root / "blocks").mkdir(parents=True, exist_ok=True)
        (self.root / "tmp").mkdir(parents=True, exist_ok=True)
        self._rebuild_index()
        log.info(
            "KV store %s: %d blocks, %d/%d bytes, backend %s",
            self.root,
            len(self._lru),
            self._used,
            capacity_bytes,
            self.backend.name,
        )

    # ---- index ---------------------------------------------------------------------------

    def path_of(self, block_id: BlockId) -> Path:
        return Path(self._file(block_id))

    def _file(self, block_id: BlockId) -> str:
        return f"{self._blocks_dir}/{block_id[:2]}/{block_id}"

    def _rebuild_index(self) -> None:
        found = []
        for shard in (self.root / "blocks").iterdir():
            if not shard.is_dir():
                continue
            for f in shard.iterdir():
                if is_block_id(f.name):
                    try:
                        st = f.stat()
                    except OSError:  # gone meanwhile, or unreadable: not a block we can use
                        continue
                    found.append((st.st_mtime_ns, f.name, st.st_size))
        now = time.time()
        for f in (self.root / "tmp").iterdir():
            try:  # temp files of writers that died; live writers finish well within this age
                if now - f.stat().st_mtime > _STALE_TMP_S:
                    f.unlink()
            except FileNotFoundError:
                pass
            except OSError as err:  # e.g. a read-only store: it still serves reads
                self._write_failed("evict", err, f"stale temp file {f}")
        found.sort()
        with self._lock:
            for _, name, size in found:
                self._lru[BlockId(name)] = size
                self._used += size
            self._evict_locked(keep=None)
            metrics.USED_BYTES.set(self._used)

    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, block_id: object) -> bool:
        return isinstance(block_id, str) and self._present(BlockId(block_id))

    def lru_order(self) -> list[BlockId]:
        """Indexed ids, least recently used first."""
        with self._lock:
            return list(self._lru)

    def _present(self, block_id: BlockId) -> bool:
        with self._lock:
            if block_id in self._lru:
                return True
        try:  # written by another process sharing the directory
            size = self.path_of(block_id).stat().st_size
        except OSError:  # not there, or not ours to read
            return False
        with self._lock:
            if block_id not in self._lru:
                self._lru[block_id] = size
                self._used += size
                self._evict_locked(keep=block_id)
                metrics.USED_BYTES.set(self._used)
        return True

    def _touch(self, ids: Sequence[BlockId]) -> None:
        """Mark a chain prefix used. Deepest first, so a chain's first blocks end up the most
        recent: LRU then evicts chains from their tails and leaves no holes in what remains
        (a hole cuts every later block of the chain out of every hit)."""
        ids = ids[::-1]
        with self._lock:
            for b in ids:
                if b in self._lru:
                    self._lru.move_to_end(b)
        for b in ids:  # persist recency for the next start's rebuild (best effort)
            try:
                os.utime(self._file(b))
            except FileNotFoundError:
                pass
            except OSError as err:  # a read-only or full store still serves what it holds
                self._write_failed("touch", err, f"block {b}: refreshing its mtime")
                break

    def _write_failed(self, op: str, err: OSError, what: str) -> None:
        """Count a failed write-side operation (op: block, touch, evict) and log it (limited)."""
        reason = errors.error_reason(err)
        metrics.WRITE_FAILURES.labels(op=op, reason=reason).inc()
        self._warn.warning(
            f"{op}:{reason}", "KV store %s: %s failed (%s): %s", self.root, what, reason, err
        )

    def _evict_locked(self, keep: BlockId | None, room: int = 0) -> None:
        """Evict least recently used blocks (never `keep`) until `room` more bytes fit."""
        while self._used + room > self.capacity_bytes and self._lru:
            victim = next(iter(self._lru))
            if victim == keep:
                self._lru.move_to_end(victim)
                if len(self._lru) == 1:
                    break
                continue
            self._drop_locked(victim)
            metrics.EVICTIONS.inc()
            log.debug("evicted block %s", victim)

    def _drop_locked(self, block_id: BlockId) -> None:
        size = self._lru.pop(block_id, None)
        if size is not None:
            self._used -= size
        self._files.invalidate(block_id)
        try:
            self._unlink(block_id)
        except FileNotFoundError:
            pass
        if self.events is not None:
            self.events.removed_ids((block_id,))

    def _unlink(self, block_id: BlockId) -> None:
        """Remove a block's file; a failure other than its absence is counted, and the index
        forgets the block all the same (the file is left for a store that can remove it)."""
        try:
            self.path_of(block_id).unlink()
        except FileNotFoundError:
            raise
        except OSError as err:
            self._write_failed("evict", err, f"block {block_id}: removing it")

    def _evict_for_space(self, nbytes: int, keep: BlockId) -> int:
        """The disk is full below capacity_bytes (other data, other writers): evict least
        recently used blocks worth `nbytes`; how many were evicted."""
        freed = evicted = 0
        with self._lock:
            for victim in list(self._lru):
                if freed >= nbytes:
                    break
                if victim == keep:
                    continue
                freed += self._lru[victim]
                self._drop_locked(victim)
                metrics.EVICTIONS.inc()
                evicted += 1
            metrics.USED_BYTES.set(self._used)
        self._warn.warning(
            "no_space_evict",
            "KV store %s full (no space): evicted %d blocks (%d bytes) to make room",
            self.root,
            evicted,
            freed,
        )
        return evicted

    def evict(self, block_id: BlockId) -> None:
        with self._lock:
            self._drop_locked(block_id)
            metrics.USED_BYTES.set(self._used)

    def lookup(self, ids: Sequence[BlockId]) -> int:
        """Length of the longest prefix of `ids` present in the store."""
        hits = 0
        for b in ids:
            if not self._present(b):
                break
            hits += 1
        metrics.LOOKUP_BLOCKS.inc(len(ids))
        metrics.LOOKUP_HITS.inc(hits)
        self._touch(ids[:hits])
        return hits

    # ---- writes --------------------------------------------------------------------------

    def put(self, block_id: BlockId, layers: Sequence[LayerKV], announce: bool = True) -> bool:
        """Write one block (per layer K, V of (block_tokens, heads, dim)); False if present.

        `announce`: publish a stored event without a chain link (put_tokens announces its
        blocks with their links instead)."""
        written = self._put(block_id, layers)
        if announce and self.events is not None:
            # a block already present is announced too: it heals an index that lost the event
            # of its first write
            self.events.stored_ids((block_id,))
        return written

    def _put(self, block_id: BlockId, layers: Sequence[LayerKV]) -> bool:
        self._check_block(block_id, layers)
        if self._present(block_id):
            if os.path.exists(self._file(block_id)):
                self._touch([block_id])
                return False
            # indexed here but dropped by another process sharing the directory (evicted, or
            # found bad by its reader): forget it and write it again, so the store heals
            with self._lock:
                self._drop_locked(block_id)
        bufs = []
        checksums = []
        for k, v in layers:
            kb, vb = _u8(k.detach().cpu().contiguous()), _u8(v.detach().cpu().contiguous())
            checksums.append(layer_checksum(kb.numpy().data, vb.numpy().data))
            bufs += [kb, vb]
        header = encode_header(self.layout, block_id, checksums)
        self._write_or_make_room(block_id, header, bufs)
        size = self.layout.file_bytes
        with self._lock:
            if block_id not in self._lru:
                self._lru[block_id] = size
                self._used += size
            self._lru.move_to_end(block_id)
            self._evict_locked(keep=block_id)
            metrics.USED_BYTES.set(self._used)
        metrics.WRITE_BYTES.inc(size)
        metrics.BLOCKS_WRITTEN.inc()
        return True

    def _write_or_make_room(self, block_id: BlockId, header: bytes, bufs: list) -> None:
        """Write a block file, making room first (capacity) and, when the disk is full anyway,
        evicting least recently used blocks and trying once more; a failure is counted, raised."""
        size = self.layout.file_bytes
        with self._lock:
            self._evict_locked(keep=block_id, room=size)
            metrics.USED_BYTES.set(self._used)
        try:
            self._write_file(block_id, header, bufs)
            return
        except OSError as err:
            if errors.error_reason(err) != "no_space" or not self._evict_for_space(size, block_id):
                self._write_failed("block", err, f"block {block_id}: writing it")
                raise
        try:
            self._write_file(block_id, header, bufs)
        except OSError as err:
            self._write_failed("block", err, f"block {block_id}: writing it after evicting")
            raise

    def _write_file(self, block_id: BlockId, header: bytes, bufs: list) -> None:
        final = self.path_of(block_id)
        tmp = self.root / "tmp" / f"{block_id}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            try:
                _write_all(fd, memoryview(header))
                for b in bufs:
                    _write_all(fd, memoryview(b.numpy()))
                if self.durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
            final.parent.mkdir(exist_ok=True)
            os.rename(tmp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise
        if self.durable:
            dfd = os.open(final.parent, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

    def put_tokens(
        self,
        tokens: Sequence[int],
        kv_layers: Sequence[LayerKV],
        kv_start_token: int = 0,
        salt: bytes = b"",
    ) -> list[BlockId]:
        """Write the full blocks of `tokens` whose KV `kv_layers` covers; returns written ids
        (the chain under the request's cache `salt`, see `ids.block_ids`).

        `kv_layers[l]` = (K, V) of shape (tokens covered, heads, dim) for tokens
        `tokens[kv_start_token:]` (e.g. a turn's new tokens). Blocks not fully covered are
        skipped; blocks already present are not rewritten.
        """
        bt = self.layout.block_tokens
        ids = block_ids(tokens, self.model, salt=salt)
        written = []
        end = 0
        for i, bid in enumerate(ids):
            start = i * bt - kv_start_token
            if start < 0:
                end = i + 1
                continue
            if start + bt > kv_layers[0][0].shape[0]:
                break
            blk = [(k[start : start + bt], v[start : start + bt]) for k, v in kv_layers]
            if self._put(bid, blk):
                written.append(bid)
            end = i + 1
        with self._lock:  # the turn's chain, deepest first (see _touch): tails go first
            for b in reversed(ids[:end]):
                if b in self._lru:
                    self._lru.move_to_end(b)
        if self.events is not None and end:
            # the whole chain with its links: the blocks written here, and the prefix this
            # process still holds (it links keys a scan found, and heals lost events)
            with self._lock:
                first = 0
                for i in range(end - 1, -1, -1):
                    if ids[i] not in self._lru:
                        first = i + 1
                        break
            self.events.stored(chain_events(ids, end, first))
        return written

    def scan_keys(self) -> list[int]:
        """The keys (`block_key`) of every block file in the directory now, whoever wrote it:
        the snapshot the scheduler rebuilds its block index from."""
        keys = []
        with os.scandir(self._blocks_dir) as shards:
            for shard in shards:
                if not shard.is_dir():
                    continue
                with os.scandir(shard.path) as files:
                    keys.extend(block_key(f.name) for f in files if is_block_id(f.name))
        return keys

    def _check_block(self, block_id: BlockId, layers: Sequence[LayerKV]) -> None:
        lo = self.layout
        if not is_block_id(block_id):
            raise ValueError(f"block id {block_id!r} is not 32 hex digits (use block_ids())")
        if len(layers) != lo.layers:
            raise ValueError(f"block needs {lo.layers} layers of (K, V), got {len(layers)}")
        dtype = TORCH_DTYPES[lo.dtype]
        for i, (k, v) in enumerate(layers):
            for name, t, shape in (("K", k, lo.k_shape), ("V", v, lo.v_shape)):
                if tuple(t.shape) != shape or t.dtype != dtype:
                    raise ValueError(
                        f"layer {i} {name}: expected {shape} {dtype}, got "
                        f"{tuple(t.shape)} {t.dtype}"
                    )

    # ---- reads ---------------------------------------------------------------------------

    def _acquire(self, ids: Sequence[BlockId]) -> tuple[list[OpenBlock], list[BlockFailure]]:
        """Open (or reuse) the longest valid prefix of `ids`; the first failure ends it.
        The caller releases the entries (`self._files.release`)."""
        got: list[OpenBlock] = []
        failed: list[BlockFailure] = []
        try:
            for b in ids:
                entry = self._acquire_one(b, failed)
                if entry is None:
                    break
                got.append(entry)
        except BaseException:
            self._files.release(got)
            raise
        return got, failed

    def _acquire_one(self, b: BlockId, failed: list[BlockFailure]) -> OpenBlock | None:
        path = self._file(b)
        lo = self.layout
        try:
            st = os.stat(path)  # the path must still name the inode a cached fd was opened on
            if st.st_size != lo.file_bytes:
                raise BlockFormatError(
                    "truncated", f"block {b}: {st.st_size} bytes, expected {lo.file_bytes}"
                )
            entry = self._files.acquire(b, st.st_dev, st.st_ino)
            if entry is None:
                entry = self._open_block(b, path)
            return entry
        except FileNotFoundError:
            failed.append(self._miss(b, "missing", f"block {b} not found", drop=True))
        except BlockFormatError as err:
            failed.append(self._miss(b, err.reason, str(err), drop=True))
        except OSError as err:
            failed.append(self.fail_read(b, err))
        return None

    def _open_block(self, b: BlockId, path: str) -> OpenBlock:
        lo = self.layout
        fd = os.open(path, os.O_RDONLY)
        try:
            st = os.fstat(fd)
            if st.st_size != lo.file_bytes:
                raise BlockFormatError(
                    "truncated", f"block {b}: {st.st_size} bytes, expected {lo.file_bytes}"
                )
            header = decode_header(os.pread(fd, lo.header_bytes, 0), lo, b)
        except BaseException:
            os.close(fd)
            raise
        return self._files.add(OpenBlock(b, fd, st.st_dev, st.st_ino, header))

    def check(self, ids: Sequence[BlockId]) -> tuple[int, list[BlockFailure]]:
        """Validate headers and sizes: (length of the valid prefix, the failure ending it)."""
        with self.open_run(ids) as run:
            return run.valid_blocks, run.failed

    def open_run(self, ids: Sequence[BlockId]) -> OpenRun:
        """Validate `ids` (sizes, headers) and hold the valid prefix open for reads
        (`read_run_layer`); the caller closes it."""
        opened, failed = self._acquire(ids)
        return OpenRun(self._files, list(ids), opened, failed)

    def fail_read(self, block_id: BlockId, err: BaseException) -> BlockFailure:
        """An I/O error reading `block_id` (the file is left alone): a miss by its reason."""
        reason = errors.error_reason(err)
        return self._miss(block_id, reason, f"block {block_id}: {err}", drop=False)

    def _miss(self, block_id: BlockId, reason: str, message: str, drop: bool) -> BlockFailure:
        if drop:  # a bad block: each is its own event, and it is gone after this
            log.warning("KV miss (%s): %s", reason, message)
        else:  # an I/O error can repeat on every request: logged once in a while
            self._warn.warning(f"miss:{reason}", "KV miss (%s): %s", reason, message)
        metrics.MISSES.labels(reason=reason).inc()
        if drop:
            with self._lock:
                if reason == "missing":
                    size = self._lru.pop(block_id, None)
                    if size is not None:
                        self._used -= size
                    self._files.invalidate(block_id)
                    if self.events is not None:  # gone: the index must stop offering it
                        self.events.removed_ids((block_id,))
                else:  # a bad block: remove it so the next turn rewrites it
                    self._drop_locked(block_id)
                    metrics.EVICTIONS.inc()
                metrics.USED_BYTES.set(self._used)
        return BlockFailure(block_id, reason)

    def read_layer(
        self,
        ids: Sequence[BlockId],
        layer: int,
        k_out: torch.Tensor | None = None,
        v_out: torch.Tensor | None = None,
    ) -> LayerRead:
        """Layer `layer` of `ids` (one range read per block): K, V of the valid prefix."""
        k_out, v_out = self._layer_out(len(ids), layer, k_out, v_out)
        with self.open_run(ids) as run:
            return self._read_layer(run, 0, run.valid_blocks, layer, k_out, v_out, run.failed)

    def read_run_layer(
        self,
        run: OpenRun,
        layer: int,
        a: int = 0,
        b: int | None = None,
        k_out: torch.Tensor | None = None,
        v_out: torch.Tensor | None = None,
    ) -> LayerRead:
        """Layer `layer` of blocks [a, b) of an open run's valid prefix (a read queue's
        chunk): validated once per run instead of once per layer."""
        b = run.valid_blocks if b is None else b
        if not 0 <= a <= b <= run.valid_blocks:
            raise ValueError(f"blocks [{a}, {b}) outside the run's {run.valid_blocks}")
        k_out, v_out = self._layer_out(b - a, layer, k_out, v_out)
        return self._read_layer(run, a, b, layer, k_out, v_out, [])

    def read_run_layers_into(
        self,
        run: OpenRun,
        l0: int,
        l1: int,
        a: int,
        b: int,
        dests: Sequence[tuple[torch.Tensor, torch.Tensor]],
    ) -> tuple[int, list[BlockFailure]]:
        """Layers [l0, l1) of blocks [a, b) of an open run (the read queue's hot path):
        dests[j] = flat uint8 (K, V) destinations of layer l0+j, blocks back to back.
        (valid blocks, failures); a block is valid when all its layers here are."""
        lo = self.layout
        lo.layer_offset(l0)
        if not l0 < l1 <= lo.layers or len(dests) != l1 - l0:
            raise ValueError(f"layers [{l0}, {l1}) with {len(dests)} destinations")
        if not 0 <= a <= b <= run.valid_blocks:
            raise ValueError(f"blocks [{a}, {b}) outside the run's {run.valid_blocks}")
        if any(
            k.numel() < (b - a) * lo.k_bytes or v.numel() < (b - a) * lo.v_bytes for k, v in dests
        ):
            raise ValueError(f"a K/V destination is too small for {b - a} blocks")
        failed: list[BlockFailure] = []
        entries, ids = run.entries[a:b], run.ids[a:b]
        if reads_runs(self.backend):
            valid = self._read_layers_runs(ids, entries, l0, dests, failed)
        else:
            fds = np.fromiter((e.fd for e in entries), dtype=np.int64, count=len(entries))
            batch = ReadBatch([t for kv in dests for t in kv], layers_segments(lo, fds, l0, l1))
            valid = self._read_verified(ids, batch, entries, list(range(l0, l1)), failed)
        if l0 == 0:
            self._touch(ids[:valid])
        return valid, failed

    def _layer_out(
        self, n: int, layer: int, k_out: torch.Tensor | None, v_out: torch.Tensor | None
    ) -> LayerKV:
        lo = self.layout
        lo.layer_offset(layer)  # refuse a bad layer before any I/O
        dtype = TORCH_DTYPES[lo.dtype]
        n_tok = n * lo.block_tokens
        if k_out is None:
            k_out = torch.empty((n_tok, lo.k_heads, lo.k_dim), dtype=dtype)
        if v_out is None:
            v_out = torch.empty((n_tok, lo.v_heads, lo.v_dim), dtype=dtype)
        if k_out.shape[0] < n_tok or v_out.shape[0] < n_tok:
            raise ValueError(f"k_out/v_out need {n_tok} token rows for {n} blocks")
        return k_out, v_out

    def _read_layer(
        self,
        run: OpenRun,
        a: int,
        b: int,
        layer: int,
        k_out: torch.Tensor,
        v_out: torch.Tensor,
        failed: list[BlockFailure],
    ) -> LayerRead:
        dests = [(_dest(k_out, "k_out"), _dest(v_out, "v_out"))]
        valid, more = self.read_run_layers_into(run, layer, layer + 1, a, b, dests)
        failed.extend(more)
        t = valid * self.layout.block_tokens
        return LayerRead(k_out[:t], v_out[:t], valid, failed)

    def read_blocks(self, ids: Sequence[BlockId], out: torch.Tensor | None = None) -> BlockRead:
        """Every layer of `ids` into a layer-major request buffer (one range read per block)."""
        lo = self.layout
        n = len(ids)
        need = request_buffer_bytes(lo, n)
        if out is None:
            out = torch.empty(need, dtype=torch.uint8)
        out = out.reshape(-1).view(torch.uint8)
        if out.numel() < need:
            raise ValueError(f"out holds {out.numel()} bytes; {n} blocks need {need}")
        with self.open_run(ids) as run:
            failed = run.failed
            if reads_runs(self.backend):  # one read_run per block, all its layers
                dests = [request_layer_bytes(out, lo, n, layer) for layer in range(lo.layers)]
                valid = self._read_layers_runs(run.ids, run.entries, 0, dests, failed)
            else:
                fds = np.fromiter(
                    (e.fd for e in run.entries), dtype=np.int64, count=len(run.entries)
                )
                batch = ReadBatch([out], block_segments(lo, fds))
                valid = self._read_verified(
                    run.ids, batch, run.entries, list(range(lo.layers)), failed
                )
        self._touch(ids[:valid])
        return BlockRead(out, lo, n, valid, failed)

    def _read_verified(
        self,
        ids: Sequence[BlockId],
        batch: ReadBatch,
        opened: list[OpenBlock],
        layers: list[int],
        failed: list[BlockFailure],
    ) -> int:
        """Read the batch (rows: per block, per layer, K then V) and verify every layer's
        checksum; the length of the verified prefix.

        Blocks are read and verified a few MiB at a time, so the checksum reads bytes the
        read just left in the CPU cache instead of fetching them from memory again."""
        if not opened:
            return 0
        rows_per_block = 2 * len(layers)
        step = max(1, _VERIFY_STEP_BYTES // (len(layers) * self.layout.layer_bytes))
        views = [memoryview(d.numpy()) for d in batch.dests]
        segments = batch.segments
        rows = segments.tolist()
        for i0 in range(0, len(opened), step):
            i1 = min(len(opened), i0 + step)
            part = ReadBatch(batch.dests, segments[i0 * rows_per_block : i1 * rows_per_block])
            t0 = time.perf_counter()
            try:
                self.backend.read(part)
            except OSError as err:
                failed.insert(0, self.fail_read(ids[i0], err))
                return i0
            self._read_seconds.observe(time.perf_counter() - t0)
            self._read_bytes.inc(int(part.segments[:, NBYTES].sum()))
            r = i0 * rows_per_block
            for i in range(i0, i1):
                checksums = opened[i].header.checksums
                for layer in layers:
                    _, _, kn, kd, ko = rows[r]
                    _, _, vn, vd, vo = rows[r + 1]
                    r += 2
                    k, v = views[kd][ko : ko + kn], views[vd][vo : vo + vn]
                    if layer_checksum(k, v) != checksums[layer]:
                        failed.insert(0, self._checksum_miss(ids[i], layer))
                        return i
        return len(opened)

    def _read_layers_runs(
        self,
        ids: Sequence[BlockId],
        entries: list[OpenBlock],
        l0: int,
        dests: Sequence[tuple[torch.Tensor, torch.Tensor]],
        failed: list[BlockFailure],
    ) -> int:
        """The hot path on a syscall backend: layers l0.. of each block (one contiguous run of
        its file) in one `read_run` (preadv), each layer checked right after, while its bytes
        are in L2. Kept to a few Python steps per block on purpose: the read workers share the
        GIL, and every bytecode one runs between its syscalls is time the other waits for."""
        lo = self.layout
        off, kb, vb = lo.layer_offset(l0), lo.k_bytes, lo.v_bytes
        mvs = [(memoryview(k.numpy()), memoryview(v.numpy())) for k, v in dests]
        layers = list(enumerate(range(l0, l0 + len(dests))))
        read_run = self.backend.read_run  # type: ignore[attr-defined]
        t0 = time.perf_counter()
        for i, entry in enumerate(entries):
            iov = []
            for km, vm in mvs:
                iov.append(km[i * kb : (i + 1) * kb])
                iov.append(vm[i * vb : (i + 1) * vb])
            try:
                read_run(entry.fd, iov, off)
            except OSError as err:
                failed.insert(0, self.fail_read(ids[i], err))
                return i
            sums = entry.header.checksums
            for j, layer in layers:
                if layer_checksum(iov[2 * j], iov[2 * j + 1]) != sums[layer]:
                    failed.insert(0, self._checksum_miss(ids[i], layer))
                    return i
        self._read_seconds.observe(time.perf_counter() - t0)
        self._read_bytes.inc(len(entries) * len(dests) * (kb + vb))
        return len(entries)

    def _checksum_miss(self, block_id: BlockId, layer: int) -> BlockFailure:
        msg = f"block {block_id} layer {layer}: checksum mismatch"
        return self._miss(block_id, "checksum", msg, drop=True)

    def close(self) -> None:
        self._files.close()
        self.backend.close()


def _open_files_limit(wanted: int) -> int:
    """At most a quarter of the process's fd limit goes to cached block files."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return max(1, wanted)
    if soft == resource.RLIM_INFINITY:
        return max(1, wanted)
    return max(1, min(wanted, soft // 4))


def _write_all(fd: int, view: memoryview) -> None:
    view = view.cast("B")
    while view:
        n = os.write(fd, view)
        if n <= 0:
            raise OSError(errno.EIO, "write returned 0")
        view = view[n:]


def random_layers(layout: BlockLayout, gen: torch.Generator | None = None) -> list[LayerKV]:
    """Random K, V for one block (tests and the benchmark); bit patterns, not just values."""
    dtype = TORCH_DTYPES[layout.dtype]
    out = []
    for _ in range(layout.layers):
        kv = []
        for shape in (layout.k_shape, layout.v_shape):
            n = int(np.prod(shape)) * layout.dtype_bytes
            raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
            kv.append(raw.view(dtype).view(shape))
        out.append((kv[0], kv[1]))
    return out
