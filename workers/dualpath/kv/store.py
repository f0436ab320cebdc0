"""The KV block store: content-addressed blocks in a POSIX directory (DESIGN section 2).

Files live at `<root>/blocks/<id[:2]>/<id>`; writes go to `<root>/tmp/` first and are renamed
into place after fsync, so a reader sees a whole block or none. The store keeps an LRU index
(rebuilt from the directory's mtimes on start; lookups and reads refresh a block's mtime) and
evicts the least recently used blocks beyond `capacity_bytes`. Several processes may share a
directory: each indexes what it sees; a block another process evicted is a `missing` miss.

Every read verifies the block's header (magic, version, model fingerprint, shape) and the
checksum of each layer it reads. A bad block is a miss, logged and counted by reason, and
dropped from the store so it is rewritten; reads return the valid prefix and the failed ids.
"""

from __future__ import annotations

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
from dualpath.kv import metrics
from dualpath.kv.backend import RangeRead, ReadBackend, make_backend
from dualpath.kv.format import (
    BlockFormatError,
    BlockHeader,
    BlockLayout,
    decode_header,
    encode_header,
    layer_checksum,
)
from dualpath.kv.ids import BlockId, block_ids, is_block_id

log = logging.getLogger(__name__)

TORCH_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float8": torch.float8_e4m3fn,
}
_STALE_TMP_S = 600.0
_HEADER_CACHE = 1 << 16

LayerKV = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class BlockFailure:
    block_id: BlockId
    reason: str  # metric label: missing, truncated, bad_header, foreign_model, checksum, io_error


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


def request_layer_views(
    buffer: torch.Tensor, layout: BlockLayout, blocks: int, layer: int, valid: int | None = None
) -> LayerKV:
    """K, V views of `layer` in a request buffer sized for `blocks` blocks (first `valid`)."""
    valid = blocks if valid is None else valid
    dtype = TORCH_DTYPES[layout.dtype]
    base = layer * blocks * layout.layer_bytes
    k_end = base + valid * layout.k_bytes
    v_base = base + blocks * layout.k_bytes
    v_end = v_base + valid * layout.v_bytes
    tokens = valid * layout.block_tokens
    k = buffer[base:k_end].view(dtype).view(tokens, layout.k_heads, layout.k_dim)
    v = buffer[v_base:v_end].view(dtype).view(tokens, layout.v_heads, layout.v_dim)
    return k, v


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


class KVStore:
    """Thread-safe block store of one model in one directory."""

    def __init__(
        self,
        root: str | Path,
        model: ModelSpec,
        capacity_bytes: int,
        backend: str | ReadBackend = "auto",
        durable: bool = True,
    ) -> None:
        self.root = Path(root)
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
        self._lock = threading.Lock()
        self._lru: OrderedDict[BlockId, int] = OrderedDict()  # id -> file bytes, oldest first
        self._headers: OrderedDict[BlockId, BlockHeader] = OrderedDict()
        self._used = 0
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
                    except FileNotFoundError:
                        continue
                    found.append((st.st_mtime_ns, f.name, st.st_size))
        now = time.time()
        for f in (self.root / "tmp").iterdir():
            try:  # temp files of writers that died; live writers finish well within this age
                if now - f.stat().st_mtime > _STALE_TMP_S:
                    f.unlink()
            except FileNotFoundError:
                pass
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
        except FileNotFoundError:
            return False
        with self._lock:
            if block_id not in self._lru:
                self._lru[block_id] = size
                self._used += size
                self._evict_locked(keep=block_id)
                metrics.USED_BYTES.set(self._used)
        return True

    def _touch(self, ids: Sequence[BlockId]) -> None:
        with self._lock:
            for b in ids:
                if b in self._lru:
                    self._lru.move_to_end(b)
        for b in ids:  # persist recency for the next start's rebuild
            try:
                os.utime(self._file(b))
            except FileNotFoundError:
                pass

    def _evict_locked(self, keep: BlockId | None) -> None:
        while self._used > self.capacity_bytes and self._lru:
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
        self._headers.pop(block_id, None)
        try:
            self.path_of(block_id).unlink()
        except FileNotFoundError:
            pass

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

    def put(self, block_id: BlockId, layers: Sequence[LayerKV]) -> bool:
        """Write one block (per layer K, V of (block_tokens, heads, dim)); False if present."""
        self._check_block(block_id, layers)
        if self._present(block_id):
            self._touch([block_id])
            return False
        bufs = []
        checksums = []
        for k, v in layers:
            kb, vb = _u8(k.detach().cpu().contiguous()), _u8(v.detach().cpu().contiguous())
            checksums.append(layer_checksum(kb.numpy().data, vb.numpy().data))
            bufs += [kb, vb]
        header = encode_header(self.layout, block_id, checksums)
        final = self.path_of(block_id)
        tmp = self.root / "tmp" / f"{block_id}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _write_all(fd, memoryview(header))
            for b in bufs:
                _write_all(fd, memoryview(b.numpy()))
            if self.durable:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        final.parent.mkdir(exist_ok=True)
        os.rename(tmp, final)
        if self.durable:
            dfd = os.open(final.parent, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
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

    def put_tokens(
        self, tokens: Sequence[int], kv_layers: Sequence[LayerKV], kv_start_token: int = 0
    ) -> list[BlockId]:
        """Write the full blocks of `tokens` whose KV `kv_layers` covers; returns written ids.

        `kv_layers[l]` = (K, V) of shape (tokens covered, heads, dim) for tokens
        `tokens[kv_start_token:]` (e.g. a turn's new tokens). Blocks not fully covered are
        skipped; blocks already present are not rewritten.
        """
        bt = self.layout.block_tokens
        ids = block_ids(tokens, self.model)
        written = []
        for i, bid in enumerate(ids):
            start = i * bt - kv_start_token
            if start < 0:
                continue
            if start + bt > kv_layers[0][0].shape[0]:
                break
            blk = [(k[start : start + bt], v[start : start + bt]) for k, v in kv_layers]
            if self.put(bid, blk):
                written.append(bid)
        return written

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

    def _open_valid(self, ids: Sequence[BlockId]) -> tuple[list[tuple[int, BlockHeader]], list]:
        """Open the longest valid prefix: (fd, header) each; the first failure ends it."""
        opened: list[tuple[int, BlockHeader]] = []
        failed: list[BlockFailure] = []
        for b in ids:
            try:
                fd = os.open(self._file(b), os.O_RDONLY)
            except FileNotFoundError:
                failed.append(self._miss(b, "missing", f"block {b} not found", drop=True))
                break
            except OSError as err:
                failed.append(self._miss(b, "io_error", f"block {b}: {err}", drop=False))
                break
            try:
                if os.fstat(fd).st_size != self.layout.file_bytes:
                    raise BlockFormatError(
                        "truncated",
                        f"block {b}: {os.fstat(fd).st_size} bytes, "
                        f"expected {self.layout.file_bytes}",
                    )
                header = self._header(b, fd)
            except BlockFormatError as err:
                os.close(fd)
                failed.append(self._miss(b, err.reason, str(err), drop=True))
                break
            except OSError as err:
                os.close(fd)
                failed.append(self._miss(b, "io_error", f"block {b}: {err}", drop=False))
                break
            opened.append((fd, header))
        return opened, failed

    def check(self, ids: Sequence[BlockId]) -> tuple[int, list[BlockFailure]]:
        """Validate headers and sizes: (length of the valid prefix, the failure ending it)."""
        opened, failed = self._open_valid(ids)
        for fd, _ in opened:
            os.close(fd)
        return len(opened), failed

    def _header(self, block_id: BlockId, fd: int) -> BlockHeader:
        with self._lock:
            h = self._headers.get(block_id)
            if h is not None:
                self._headers.move_to_end(block_id)
                return h
        h = decode_header(os.pread(fd, self.layout.header_bytes, 0), self.layout, block_id)
        with self._lock:
            self._headers[block_id] = h
            if len(self._headers) > _HEADER_CACHE:
                self._headers.popitem(last=False)
        return h

    def _miss(self, block_id: BlockId, reason: str, message: str, drop: bool) -> BlockFailure:
        log.warning("KV miss (%s): %s", reason, message)
        metrics.MISSES.labels(reason=reason).inc()
        if drop:
            with self._lock:
                if reason == "missing":
                    size = self._lru.pop(block_id, None)
                    if size is not None:
                        self._used -= size
                    self._headers.pop(block_id, None)
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
        lo = self.layout
        offset = lo.layer_offset(layer)
        dtype = TORCH_DTYPES[lo.dtype]
        n_tok = len(ids) * lo.block_tokens
        if k_out is None:
            k_out = torch.empty((n_tok, lo.k_heads, lo.k_dim), dtype=dtype)
        if v_out is None:
            v_out = torch.empty((n_tok, lo.v_heads, lo.v_dim), dtype=dtype)
        if k_out.shape[0] < n_tok or v_out.shape[0] < n_tok:
            raise ValueError(f"k_out/v_out need {n_tok} token rows for {len(ids)} blocks")
        k8, v8 = _u8(k_out), _u8(v_out)
        opened, failed = self._open_valid(ids)
        try:
            batch = [
                RangeRead(
                    fd,
                    offset,
                    [
                        k8[i * lo.k_bytes : (i + 1) * lo.k_bytes],
                        v8[i * lo.v_bytes : (i + 1) * lo.v_bytes],
                    ],
                )
                for i, (fd, _) in enumerate(opened)
            ]
            valid = self._read_verified(ids, batch, [h for _, h in opened], [layer], failed)
        finally:
            for fd, _ in opened:
                os.close(fd)
        if layer == 0:
            self._touch(ids[:valid])
        t = valid * lo.block_tokens
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
        opened, failed = self._open_valid(ids)
        try:
            batch = []
            for i, (fd, _) in enumerate(opened):
                bufs = []
                for layer in range(lo.layers):
                    base = layer * n * lo.layer_bytes
                    k0 = base + i * lo.k_bytes
                    v0 = base + n * lo.k_bytes + i * lo.v_bytes
                    bufs += [out[k0 : k0 + lo.k_bytes], out[v0 : v0 + lo.v_bytes]]
                batch.append(RangeRead(fd, lo.header_bytes, bufs))
            valid = self._read_verified(
                ids, batch, [h for _, h in opened], list(range(lo.layers)), failed
            )
        finally:
            for fd, _ in opened:
                os.close(fd)
        self._touch(ids[:valid])
        return BlockRead(out, lo, n, valid, failed)

    def _read_verified(
        self,
        ids: Sequence[BlockId],
        batch: list[RangeRead],
        headers: list[BlockHeader],
        layers: list[int],
        failed: list[BlockFailure],
    ) -> int:
        if not batch:
            return 0
        t0 = time.perf_counter()
        try:
            self.backend.read(batch)
        except OSError as err:
            failed.insert(0, self._miss(ids[0], "io_error", f"read failed: {err}", drop=False))
            return 0
        metrics.READ_SECONDS.labels(backend=self.backend.name).observe(time.perf_counter() - t0)
        metrics.READ_BYTES.labels(backend=self.backend.name).inc(sum(r.nbytes for r in batch))
        for i, (r, h) in enumerate(zip(batch, headers, strict=True)):
            for j, layer in enumerate(layers):
                k, v = r.buffers[2 * j], r.buffers[2 * j + 1]
                if layer_checksum(k.numpy().data, v.numpy().data) != h.checksums[layer]:
                    failed.insert(
                        0,
                        self._miss(
                            ids[i],
                            "checksum",
                            f"block {ids[i]} layer {layer}: checksum mismatch",
                            drop=True,
                        ),
                    )
                    return i
        return len(batch)

    def close(self) -> None:
        self.backend.close()


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
