"""The store as a best-effort cache: I/O errors, short reads and stuck reads end the hit (the
rest is recomputed) within a bounded wait; a full store makes room; every failure is counted."""

import asyncio
import contextlib
import errno
import os
import threading
import time

import pytest
import torch
from dualpath.kv import KVLoadError, KVStore, ReadQueue
from dualpath.kv import writer as writer_mod
from dualpath.kv.backend import PreadvBackend
from dualpath.kv.buffers import BlockFailure
from dualpath.kv.errors import ShortReadError
from dualpath.kv.format import BlockLayout
from prometheus_client import REGISTRY

# a hang must fail the test, not the suite
BOUND_S = 0.3
HANG_S = 20


def misses(reason):
    return REGISTRY.get_sample_value("dualpath_kv_misses_total", {"reason": reason}) or 0.0


def write_failures(op, reason):
    labels = {"op": op, "reason": reason}
    return REGISTRY.get_sample_value("dualpath_kv_write_failures_total", labels) or 0.0


def evictions():
    return REGISTRY.get_sample_value("dualpath_kv_evictions_total") or 0.0


class FailingBackend(PreadvBackend):
    """preadv whose block reads raise `err` once `armed` is set."""

    def __init__(self, err: OSError) -> None:
        self.err = err
        self.armed = threading.Event()

    def read(self, batch):
        if self.armed.is_set():
            raise self.err
        super().read(batch)

    def read_run(self, fd, views, offset):
        if self.armed.is_set():
            raise self.err
        super().read_run(fd, views, offset)


class GatedBackend(PreadvBackend):
    """preadv that waits for `gate` (a store that never answers until the test lets it)."""

    def __init__(self) -> None:
        self.gate = threading.Event()

    def read(self, batch):
        assert self.gate.wait(timeout=60)
        super().read(batch)

    def read_run(self, fd, views, offset):
        assert self.gate.wait(timeout=60)
        super().read_run(fd, views, offset)


async def drained(q, store):
    """Wait (bounded) until reads still running in the pool have finished and let go."""
    for _ in range(200):
        if q.pending_bytes == 0 and all(e.refs == 0 for e in store._files._open.values()):
            return True
        await asyncio.sleep(0.05)
    return False


def _store(tmp_path, tiny, kvh, backend, n=4):
    store = KVStore(tmp_path / "kv", tiny, 1 << 30, backend=backend)
    ids, blocks = kvh.fill(store, n)
    return store, ids, blocks


@pytest.fixture
def read_only_utime(monkeypatch):
    """Recency updates fail as on a read-only mount (root ignores chmod, so inject it)."""
    real = os.utime

    def utime(path, *a, **kw):
        if "/blocks/" in str(path):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real(path, *a, **kw)

    monkeypatch.setattr(os, "utime", utime)


async def test_read_only_store_serves_hits_and_counts_the_touch(
    tmp_path, tiny, kvh, read_only_utime
):
    # the hang: the utime EROFS escaped the read job and no layer ever resolved
    store, ids, blocks = _store(tmp_path, tiny, kvh, PreadvBackend())
    before = write_failures("touch", "read_only")
    with ReadQueue(store, concurrency=2, chunk_blocks=2, read_timeout_s=BOUND_S) as q:
        h = q.submit(ids)
        r = await asyncio.wait_for(h.done(), HANG_S)
        assert r.valid_blocks == 4 and not r.failed
        k, v = r.layer(2)
        assert torch.equal(kvh.u8(k), kvh.u8(torch.cat([b[2][0] for b in blocks])))
        h.close()
    assert write_failures("touch", "read_only") > before  # the data is fine; recency is not
    assert store.lookup(ids) == 4
    store.close()


@pytest.mark.parametrize(
    ("err", "reason"),
    [
        (OSError(errno.EIO, "Input/output error"), "io_error"),
        (PermissionError(errno.EACCES, "Permission denied"), "permission"),
        (OSError(errno.EROFS, "Read-only file system"), "read_only"),
        (OSError(errno.ENOSPC, "No space left on device"), "no_space"),
        (ShortReadError("short read (test)"), "short_read"),
    ],
)
async def test_a_read_error_ends_the_hit_with_its_reason(tmp_path, tiny, kvh, err, reason):
    store, ids, _ = _store(tmp_path, tiny, kvh, FailingBackend(err))
    before = misses(reason)
    with ReadQueue(store, concurrency=2, chunk_blocks=2, read_timeout_s=HANG_S) as q:
        store.backend.armed.set()
        h = q.submit(ids)
        assert await h.ready() == 4  # headers read fine: the data reads fail
        with pytest.raises(KVLoadError) as e:
            await asyncio.wait_for(h.layer(0), HANG_S)
        assert e.value.failed[0].reason == reason and e.value.valid_blocks in (0, 2)
        assert e.value.failed[0].block_id == ids[e.value.valid_blocks]
        # every other layer fails the same way (the caller recomputes), none hangs
        for layer in range(store.layout.layers):
            with pytest.raises(KVLoadError):
                await asyncio.wait_for(h.layer(layer), HANG_S)
        h.close()
        assert await drained(q, store)
    assert misses(reason) >= before + 1
    # an I/O error is not the block's fault: nothing was dropped
    store.backend.armed.clear()
    assert store.check(ids) == (4, [])
    store.close()


async def test_a_real_short_read_ends_the_hit(tmp_path, tiny, kvh):
    # the file shrinks under a validated run (same inode): preadv comes back short
    backend = GatedBackend()
    store, ids, _ = _store(tmp_path, tiny, kvh, backend)
    before = misses("short_read")
    with ReadQueue(store, concurrency=1, chunk_blocks=4, read_timeout_s=HANG_S) as q:
        h = q.submit(ids)
        assert await h.ready() == 4
        os.truncate(store.path_of(ids[2]), store.layout.layer_offset(0) + 10)
        backend.gate.set()
        with pytest.raises(KVLoadError) as e:
            await asyncio.wait_for(h.layer(0), HANG_S)
        assert e.value.valid_blocks == 2
        assert e.value.failed[0] == BlockFailure(ids[2], "short_read")
        h.close()
    assert misses("short_read") == before + 1
    store.close()


async def test_validation_errors_shorten_the_prefix_by_reason(tmp_path, tiny, kvh, monkeypatch):
    store, ids, _ = _store(tmp_path, tiny, kvh, PreadvBackend())
    store._files.close()  # no cached fds: the next read opens the files again
    real = os.open
    third = str(store.path_of(ids[2]))

    def deny(path, flags, *a, **kw):
        if str(path) == third:
            raise PermissionError(errno.EACCES, "Permission denied", third)
        return real(path, flags, *a, **kw)

    monkeypatch.setattr(os, "open", deny)
    before = misses("permission")
    with ReadQueue(store, concurrency=2, read_timeout_s=HANG_S) as q:
        h = q.submit(ids)
        assert await asyncio.wait_for(h.ready(), HANG_S) == 2
        assert h.failed[0].reason == "permission"
        r = await asyncio.wait_for(h.done(), HANG_S)
        assert r.valid_blocks == 2
    assert misses("permission") == before + 1
    monkeypatch.setattr(os, "open", real)
    assert store.check(ids) == (4, [])  # left in place: the next reader may have the right
    store.close()


async def test_a_read_that_never_returns_is_bounded_and_counted(tmp_path, tiny, kvh):
    backend = GatedBackend()
    store, ids, blocks = _store(tmp_path, tiny, kvh, backend)
    before = misses("timeout")
    q = ReadQueue(store, concurrency=2, chunk_blocks=2, read_timeout_s=BOUND_S)
    try:
        h = q.submit(ids)
        assert await h.ready() == 4
        t0 = time.monotonic()
        with pytest.raises(KVLoadError) as e:
            await asyncio.wait_for(h.layer(0), HANG_S)
        waited = time.monotonic() - t0
        assert e.value.failed[0].reason == "timeout" and e.value.valid_blocks == 0
        assert "not read within 0.3s" in str(e.value)
        assert waited < HANG_S / 2  # the bound, not the store, ended the wait
        # the whole hit ends there: the other layers fail at once, the sync waits too
        with pytest.raises(KVLoadError):
            await asyncio.wait_for(h.layer(3), 1)
        with pytest.raises(KVLoadError):
            h.layer_sync(1)
        r = h.wait()  # the whole-request wait reports it as data
        assert r.valid_blocks == 0 and r.failed[0].reason == "timeout"
        assert misses("timeout") == before + 1  # one event, counted once
        h.close()
        assert h.busy  # the stuck reads may still write into the request's buffer
        backend.gate.set()  # the stuck reads come back: nothing is left pending or open
        assert await drained(q, store)
        assert not h.busy
        # and the queue still serves the next request
        h2 = q.submit(ids)
        r = await asyncio.wait_for(h2.done(), HANG_S)
        assert r.valid_blocks == 4
        assert torch.equal(kvh.u8(r.layer(1)[0]), kvh.u8(torch.cat([b[1][0] for b in blocks])))
    finally:
        backend.gate.set()
        q.close()
        store.close()


def test_sync_waits_are_bounded_too(tmp_path, tiny, kvh):
    backend = GatedBackend()
    store, ids, _ = _store(tmp_path, tiny, kvh, backend)
    q = ReadQueue(store, concurrency=1, chunk_blocks=4, read_timeout_s=BOUND_S)
    try:
        h = q.submit(ids)
        t0 = time.monotonic()
        r = h.wait()
        assert r.valid_blocks == 0 and r.failed[0].reason == "timeout"
        assert time.monotonic() - t0 < HANG_S / 2
        with pytest.raises(KVLoadError):
            h.layer_sync(0)
    finally:
        backend.gate.set()
        q.close()
        store.close()


async def test_stuck_validation_is_bounded_and_a_late_answer_ignored(tmp_path, tiny, kvh):
    store, ids, _ = _store(tmp_path, tiny, kvh, PreadvBackend())
    gate = threading.Event()
    real_open_run = store.open_run

    def stuck_open_run(block_ids):
        assert gate.wait(timeout=60)
        return real_open_run(block_ids)

    store.open_run = stuck_open_run
    before = misses("timeout")
    q = ReadQueue(store, concurrency=1, read_timeout_s=BOUND_S)
    try:
        h = q.submit(ids)
        assert await asyncio.wait_for(h.ready(), HANG_S) == 0  # no hit: recompute it all
        assert h.failed[0].reason == "timeout" and h.hit_tokens == 0
        assert (await h.layer(2))[0].shape[0] == 0
        assert misses("timeout") == before + 1
        gate.set()  # validation finishes late: it must not revive the handle
        assert await drained(q, store)
        assert h.valid_blocks == 0
    finally:
        gate.set()
        q.close()
        store.close()


async def test_no_exception_is_lost_in_the_read_pool(tmp_path, tiny, kvh, monkeypatch):
    store, ids, _ = _store(tmp_path, tiny, kvh, PreadvBackend())

    def boom(*a, **kw):
        raise RuntimeError("a bug in the read path (test)")

    monkeypatch.setattr(store, "read_run_layers_into", boom)
    before = misses("io_error")
    with ReadQueue(store, concurrency=2, chunk_blocks=2, read_timeout_s=HANG_S) as q:
        h = q.submit(ids)
        with pytest.raises(KVLoadError) as e:
            await asyncio.wait_for(h.layer(1), HANG_S)
        assert e.value.failed[0].reason == "io_error"
        h.close()
        assert await drained(q, store)
    assert misses("io_error") >= before + 1

    def boom_open(block_ids):
        raise RuntimeError("a bug in validation (test)")

    monkeypatch.setattr(store, "open_run", boom_open)
    with ReadQueue(store, concurrency=1, read_timeout_s=HANG_S) as q:
        h = q.submit(ids)
        assert await asyncio.wait_for(h.ready(), HANG_S) == 0
        assert h.failed[0].reason == "io_error" and q.pending_bytes == 0
    store.close()


def test_a_bad_block_on_a_read_only_store_is_a_miss_not_an_error(tmp_path, tiny, kvh, monkeypatch):
    store, ids, _ = _store(tmp_path, tiny, kvh, PreadvBackend())
    with open(store.path_of(ids[1]), "r+b") as f:  # flip a payload byte of block 1, layer 0
        f.seek(store.layout.layer_offset(0) + 3)
        f.write(b"\xff\xfe")
    real = os.unlink

    def erofs(path, *a, **kw):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(os, "unlink", erofs)
    before = write_failures("evict", "read_only")
    r = store.read_layer(ids, 0)  # the drop cannot remove the file: counted, read goes on
    assert r.valid_blocks == 1 and r.failed[0].reason == "checksum"
    assert write_failures("evict", "read_only") == before + 1
    monkeypatch.setattr(os, "unlink", real)
    store.close()


def test_full_disk_evicts_lru_blocks_and_retries_once(tmp_path, tiny, kvh, monkeypatch):
    store, ids, _ = _store(tmp_path, tiny, kvh, PreadvBackend())
    store.lookup(ids[:1])  # block 0 used last: block 1 is now the least recently used
    real = writer_mod._write_all
    full = {"left": 1}

    def enospc_once(fd, view):
        if full["left"]:
            full["left"] -= 1
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, view)

    monkeypatch.setattr(writer_mod, "_write_all", enospc_once)
    evicted = evictions()
    failures = write_failures("block", "no_space")
    new_ids, _ = kvh.fill(store, 1, seed=9)
    assert new_ids[0] in store
    assert store.lru_order() == [ids[2], ids[3], ids[0], new_ids[0]]  # one block's room
    assert not store.path_of(ids[1]).exists()
    assert evictions() == evicted + 1
    assert write_failures("block", "no_space") == failures  # the retry wrote it
    assert not list((tmp_path / "kv" / "tmp").iterdir())  # the failed attempt left nothing

    # still full after evicting: counted, raised (once), the caller goes without
    full["left"] = 2
    with pytest.raises(OSError):
        kvh.fill(store, 1, seed=10)
    assert write_failures("block", "no_space") == failures + 1
    assert not list((tmp_path / "kv" / "tmp").iterdir())
    store.close()


def test_a_read_only_store_refuses_writes_without_evicting(tmp_path, tiny, kvh, monkeypatch):
    store, ids, _ = _store(tmp_path, tiny, kvh, PreadvBackend())
    real = os.open

    def erofs(path, flags, *a, **kw):
        if flags & os.O_CREAT:
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real(path, flags, *a, **kw)

    monkeypatch.setattr(os, "open", erofs)
    before = write_failures("block", "read_only")
    evicted = evictions()
    with pytest.raises(OSError):
        kvh.fill(store, 2, seed=11)
    assert write_failures("block", "read_only") == before + 1
    assert evictions() == evicted and len(store) == 4
    store.close()


def test_capacity_is_made_before_the_write(make_store, tiny, kvh):
    file_bytes = BlockLayout.from_model(tiny).file_bytes
    store = make_store(capacity_bytes=3 * file_bytes)
    ids, _ = kvh.fill(store, 3)
    seen = []
    real = store.writer._write_file

    def spy(block_id, header, bufs):
        seen.append(store.used_bytes)  # what the store holds while the new block is written
        real(block_id, header, bufs)

    store.writer._write_file = spy
    kvh.fill(store, 1, seed=12)
    assert seen == [2 * file_bytes] and store.used_bytes == 3 * file_bytes
    assert ids[0] not in store.lru_order()


class SlowBackend(PreadvBackend):
    """Every block read takes `delay_s`: a slow store that still moves."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def read_run(self, fd, views, offset):
        time.sleep(self.delay_s)
        super().read_run(fd, views, offset)


async def test_a_slow_store_that_moves_is_waited_for(tmp_path, tiny, kvh):
    # 12 block reads of 50 ms before layer 0 is whole: 0.6 s, twice the bound, never a stall
    store, ids, blocks = _store(tmp_path, tiny, kvh, SlowBackend(0.05), n=12)
    before = misses("timeout")
    with ReadQueue(store, concurrency=1, chunk_blocks=1, read_timeout_s=BOUND_S) as q:
        h = q.submit(ids)
        t0 = time.monotonic()
        k, _ = await asyncio.wait_for(h.layer(0), HANG_S)
        assert time.monotonic() - t0 > BOUND_S  # longer than the bound, and still served
        assert torch.equal(kvh.u8(k), kvh.u8(torch.cat([b[0][0] for b in blocks])))
        h.close()
    assert misses("timeout") == before
    store.close()


async def test_a_request_behind_a_stuck_read_is_bounded_too(tmp_path, tiny, kvh):
    backend = GatedBackend()
    store, ids, _ = _store(tmp_path, tiny, kvh, backend)
    q = ReadQueue(store, concurrency=1, chunk_blocks=4, read_timeout_s=BOUND_S)
    try:
        stuck = q.submit(ids)
        behind = q.submit(ids[:2])  # queued behind it: the queue has stopped moving
        # its validation may or may not have run before the stuck read: either way no hit
        with contextlib.suppress(KVLoadError):
            k, _ = await asyncio.wait_for(behind.layer(0), HANG_S)
            assert k.shape[0] == 0
        r = behind.result()
        assert r.valid_blocks == 0 and r.failed[0].reason == "timeout"
        with pytest.raises(KVLoadError):
            await asyncio.wait_for(stuck.layer(0), HANG_S)
        stuck.close()
        behind.close()
    finally:
        backend.gate.set()
        q.close()
        store.close()


@pytest.fixture
def read_only_mount(tmp_path):
    """(writable dir, the same dir bind-mounted read-only): a real EROFS; skipped where this
    process may not mount (not root, no CAP_SYS_ADMIN)."""
    import subprocess

    src, ro = tmp_path / "src", tmp_path / "ro"
    src.mkdir()
    ro.mkdir()
    if subprocess.run(["mount", "--bind", str(src), str(ro)], capture_output=True).returncode:
        pytest.skip("cannot bind-mount here")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], check=True)
        yield src, ro
    finally:
        subprocess.run(["umount", "-l", str(ro)], check=False)


async def test_a_real_read_only_mount_serves_hits_and_refuses_writes(tiny, kvh, read_only_mount):
    src, ro = read_only_mount
    writer = KVStore(src, tiny, 1 << 30, backend="preadv")
    ids, blocks = kvh.fill(writer, 3)
    writer.close()
    touch, block = write_failures("touch", "read_only"), write_failures("block", "read_only")
    store = KVStore(ro, tiny, 1 << 30, backend="preadv")  # starts on a read-only directory
    try:
        assert store.lookup(ids) == 3
        with ReadQueue(store, concurrency=2, read_timeout_s=HANG_S) as q:
            r = await asyncio.wait_for(q.read_into(ids), HANG_S)
        assert r.valid_blocks == 3
        assert torch.equal(kvh.u8(r.layer(1)[1]), kvh.u8(torch.cat([b[1][1] for b in blocks])))
        assert write_failures("touch", "read_only") > touch
        with pytest.raises(OSError) as e:
            kvh.fill(store, 1, seed=5)
        assert e.value.errno == errno.EROFS
        assert write_failures("block", "read_only") == block + 1
    finally:
        store.close()
