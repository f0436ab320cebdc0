"""Block reads and their verification (docs/design.md section 2).

A run of blocks is opened first (`open_run`): each block's path is stat'ed, its fd reused from
the open-file cache (`kv/files.py`) while the path still names the inode it was opened on, and
its header (magic, version, model fingerprint, shape) validated; the first bad block ends the
valid prefix. Reads then fill caller buffers with one range read per block (a `read_run` per
block on a syscall backend, a segment table per batch on NIXL) and verify the checksum of every
layer they read while its bytes are still in the CPU cache. A bad block is a miss, logged and
counted by reason, and dropped from the store so it is rewritten; a block gone is forgotten; an
I/O error is a miss by its reason (`kv/errors.py`) that leaves the file alone. Reads return the
valid prefix and the failures as data.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence

import numpy as np
import torch

from dualpath.kv import errors, metrics
from dualpath.kv.backend import NBYTES, ReadBackend, ReadBatch
from dualpath.kv.buffers import (
    TORCH_DTYPES,
    BlockFailure,
    BlockRead,
    LayerKV,
    LayerRead,
    check_layers_read,
    dest_bytes,
    request_buffer_bytes,
    request_layer_bytes,
)
from dualpath.kv.files import OpenBlock, OpenBlocks
from dualpath.kv.format import BlockFormatError, BlockLayout, decode_header, layer_checksum
from dualpath.kv.ids import BlockId
from dualpath.kv.index import BlockIndex

log = logging.getLogger(__name__)

_VERIFY_STEP_BYTES = 4 << 20  # read then checksum this much at a time: stays in L2/L3


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


class BlockReader:
    """Reads and verifies the blocks of one store directory, keeping its index."""

    def __init__(
        self,
        layout: BlockLayout,
        backend: ReadBackend,
        files: OpenBlocks,
        index: BlockIndex,
        warn: errors.LogLimiter,
    ) -> None:
        self.layout = layout
        self.backend = backend
        self.files = files
        self.index = index
        self._warn = warn
        self._read_seconds = metrics.READ_SECONDS.labels(backend=backend.name)
        self._read_bytes = metrics.READ_BYTES.labels(backend=backend.name)

    def _acquire(self, ids: Sequence[BlockId]) -> tuple[list[OpenBlock], list[BlockFailure]]:
        """Open (or reuse) the longest valid prefix of `ids`; the first failure ends it.
        The caller releases the entries (`self.files.release`)."""
        got: list[OpenBlock] = []
        failed: list[BlockFailure] = []
        try:
            for b in ids:
                entry = self._acquire_one(b, failed)
                if entry is None:
                    break
                got.append(entry)
        except BaseException:
            self.files.release(got)
            raise
        return got, failed

    def _acquire_one(self, b: BlockId, failed: list[BlockFailure]) -> OpenBlock | None:
        path = self.index.file(b)
        lo = self.layout
        try:
            st = os.stat(path)  # the path must still name the inode a cached fd was opened on
            if st.st_size != lo.file_bytes:
                raise BlockFormatError(
                    "truncated", f"block {b}: {st.st_size} bytes, expected {lo.file_bytes}"
                )
            entry = self.files.acquire(b, st.st_dev, st.st_ino)
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
        return self.files.add(OpenBlock(b, fd, st.st_dev, st.st_ino, header))

    def check(self, ids: Sequence[BlockId]) -> tuple[int, list[BlockFailure]]:
        """Validate headers and sizes: (length of the valid prefix, the failure ending it)."""
        with self.open_run(ids) as run:
            return run.valid_blocks, run.failed

    def open_run(self, ids: Sequence[BlockId]) -> OpenRun:
        """Validate `ids` (sizes, headers) and hold the valid prefix open for reads
        (`read_run_layer`); the caller closes it."""
        opened, failed = self._acquire(ids)
        return OpenRun(self.files, list(ids), opened, failed)

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
        if drop and reason == "missing":
            self.index.forget_missing(block_id)
        elif drop:  # a bad block: remove it so the next turn rewrites it
            self.index.drop_bad(block_id)
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
        check_layers_read(lo, run.valid_blocks, l0, l1, a, b, dests)
        failed: list[BlockFailure] = []
        entries, ids = run.entries[a:b], run.ids[a:b]
        if self.backend.reads_runs:
            valid = self._read_layers_runs(ids, entries, l0, dests, failed)
        else:
            fds = np.fromiter((e.fd for e in entries), dtype=np.int64, count=len(entries))
            batch = ReadBatch([t for kv in dests for t in kv], layers_segments(lo, fds, l0, l1))
            valid = self._read_verified(ids, batch, entries, list(range(l0, l1)), failed)
        if l0 == 0:
            self.index.touch(ids[:valid])
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
        dests = [(dest_bytes(k_out, "k_out"), dest_bytes(v_out, "v_out"))]
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
            if self.backend.reads_runs:  # one read_run per block, all its layers
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
        self.index.touch(ids[:valid])
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
        read_run = self.backend.read_run
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


def open_files_limit(wanted: int) -> int:
    """At most a quarter of the process's fd limit goes to cached block files."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return max(1, wanted)
    if soft == resource.RLIM_INFINITY:
        return max(1, wanted)
    return max(1, min(wanted, soft // 4))
