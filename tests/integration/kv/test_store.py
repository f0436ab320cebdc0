"""The block store on a real directory: round trips, bad blocks, atomicity, eviction."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from dualpath.config import ModelSpec
from dualpath.kv import block_ids, split_blocks
from dualpath.kv.buffers import random_layers
from prometheus_client import REGISTRY


def misses(reason):
    return REGISTRY.get_sample_value("dualpath_kv_misses_total", {"reason": reason}) or 0.0


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float8"])
def test_round_trip_bit_exact(make_store, dtype, kvh):
    fill, u8 = kvh.fill, kvh.u8
    store = make_store(model=ModelSpec(preset="tiny", dtype=dtype))
    ids, blocks = fill(store, 3)
    assert store.lookup(ids) == 3
    for layer in range(store.layout.layers):
        r = store.read_layer(ids, layer)
        assert r.valid_blocks == 3 and not r.failed
        assert r.k.dtype == blocks[0][0][0].dtype and r.k.shape == (3 * 64, 2, 16)
        for i in range(3):
            s = slice(i * 64, (i + 1) * 64)
            assert torch.equal(u8(r.k[s]), u8(blocks[i][layer][0]))
            assert torch.equal(u8(r.v[s]), u8(blocks[i][layer][1]))
    whole = store.read_blocks(ids)
    assert whole.valid_blocks == 3
    for layer in range(store.layout.layers):
        k, v = whole.layer(layer)
        assert torch.equal(u8(k), u8(torch.cat([b[layer][0] for b in blocks])))
        assert torch.equal(u8(v), u8(torch.cat([b[layer][1] for b in blocks])))


def test_nixl_and_preadv_give_identical_bytes(make_store, tmp_path, kvh):
    fill, u8 = kvh.fill, kvh.u8
    pytest.importorskip("nixl_cu12")
    a = make_store(backend="preadv")
    ids, blocks = fill(a, 4, seed=5)
    b = make_store(backend="nixl", root=a.root)
    assert b.backend.name == "nixl"
    for layer in (0, 3):
        ra, rb = a.read_layer(ids, layer), b.read_layer(ids, layer)
        assert rb.valid_blocks == 4
        assert torch.equal(u8(ra.k), u8(rb.k)) and torch.equal(u8(ra.v), u8(rb.v))
        assert torch.equal(u8(rb.k[64:128]), u8(blocks[1][layer][0]))
    wa, wb = a.read_blocks(ids), b.read_blocks(ids)
    assert wb.valid_blocks == 4 and torch.equal(wa.buffer, wb.buffer)


def test_lookup_is_longest_prefix(make_store, kvh):
    fill = kvh.fill
    store = make_store()
    ids, _ = fill(store, 4)
    store.evict(ids[2])
    assert store.lookup(ids) == 2
    assert store.lookup(block_ids(list(range(9, 300)), store.model)) == 0


def test_flipped_byte_is_a_checksum_miss(make_store, kvh):
    fill, u8 = kvh.fill, kvh.u8
    store = make_store()
    ids, blocks = fill(store, 3)
    path = store.path_of(ids[1])
    with open(path, "r+b") as f:  # one byte inside layer 2's payload of block 1
        f.seek(store.layout.layer_offset(2) + 100)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    before = misses("checksum")
    assert store.read_layer(ids, 0).valid_blocks == 3  # layer 0 of block 1 is intact
    r = store.read_layer(ids, 2)
    assert r.valid_blocks == 1 and r.failed[0].block_id == ids[1]
    assert r.failed[0].reason == "checksum" and misses("checksum") == before + 1
    assert torch.equal(u8(r.k), u8(blocks[0][2][0]))  # the valid prefix is real data
    assert store.lookup(ids) == 1  # the bad block is gone: next turn rewrites it


def test_truncated_file_is_a_miss(make_store, kvh):
    fill = kvh.fill
    store = make_store()
    ids, _ = fill(store, 2)
    os.truncate(store.path_of(ids[0]), store.layout.file_bytes - 10)
    before = misses("truncated")
    r = store.read_blocks(ids)
    assert r.valid_blocks == 0 and r.failed[0].reason == "truncated"
    assert misses("truncated") == before + 1


def test_block_of_another_model_is_a_miss(make_store, tmp_path, kvh):
    fill = kvh.fill
    ours = make_store()
    other = make_store(model=ModelSpec(preset="tiny", seed=9), root=tmp_path / "other")
    ids, _ = fill(ours, 2)
    foreign_ids, _ = fill(other, 2)
    assert ours.read_layer(ids, 1).valid_blocks == 2  # our fds and headers are now cached
    # a foreign block placed under our id (e.g. a shared dir written by another deployment):
    # the path names a new inode, so the cached fd of the old file must not be used
    os.replace(other.path_of(foreign_ids[0]), ours.path_of(ids[1]))
    before = misses("foreign_model")
    r = ours.read_layer(ids, 1)
    assert r.valid_blocks == 1 and r.failed[0].reason == "foreign_model"
    assert misses("foreign_model") == before + 1


def test_missing_file_is_a_miss(make_store, kvh):
    fill = kvh.fill
    store = make_store()
    ids, _ = fill(store, 2)
    os.unlink(store.path_of(ids[1]))  # e.g. evicted by another process sharing the directory
    r = store.read_layer(ids, 0)
    assert r.valid_blocks == 1 and r.failed[0].reason == "missing"


_WRITER = """
import sys, torch
from dualpath.config import ModelSpec
from dualpath.kv import KVStore, block_ids
from dualpath.kv import buffers, writer as st
m = ModelSpec(preset="llama3-8b")
s = KVStore(sys.argv[1], m, 1 << 34, backend="preadv")
real = st._write_all
done = [0]
def slow(fd, view):  # write part of the block, announce, then hang so the kill lands mid-block
    real(fd, view)
    done[0] += len(view)
    if done[0] > 1 << 20:
        print("writing", flush=True)
        import time; time.sleep(30)
st._write_all = slow
bid = block_ids(list(range(64)), m)[0]
s.put(bid, buffers.random_layers(s.layout))
"""


def test_writer_killed_mid_write_leaves_no_block(tmp_path):
    root = tmp_path / "kv"
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(root)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "writing"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    model = ModelSpec(preset="llama3-8b")
    bid = block_ids(list(range(64)), model)[0]
    from dualpath.kv import KVStore

    store = KVStore(root, model, 1 << 34, backend="preadv")
    assert list((root / "tmp").iterdir())  # the partial temp file exists ...
    assert store.lookup([bid]) == 0 and len(store) == 0  # ... but no visible block
    assert not store.path_of(bid).exists()


def test_concurrent_readers_and_writers_never_see_partial_blocks(make_store, kvh):
    u8 = kvh.u8
    store = make_store()
    reader_store = make_store(root=store.root)  # a second process's view of the directory
    tokens = list(range(64 * 12))
    ids = block_ids(tokens, store.model)
    gen = torch.Generator().manual_seed(1)
    blocks = [random_layers(store.layout, gen) for _ in ids]
    errors, stop = [], threading.Event()

    def writer():
        for b, layers in zip(ids, blocks, strict=True):
            store.put(b, layers)

    def reader():
        while not stop.is_set():
            n = reader_store.lookup(ids)
            r = reader_store.read_blocks(ids[:n])
            if r.failed or r.valid_blocks != n:
                errors.append(r.failed)
            for layer in range(reader_store.layout.layers):
                k, _ = r.layer(layer)
                want = torch.cat([u8(b[layer][0]) for b in blocks[:n]]) if n else u8(k)
                if not torch.equal(u8(k), want):
                    errors.append(("data", layer, n))

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    w = threading.Thread(target=writer)
    w.start()
    w.join(timeout=60)
    time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    assert reader_store.lookup(ids) == len(ids)


def test_eviction_keeps_under_capacity_in_lru_order(make_store, tiny, kvh):
    fill = kvh.fill
    probe = make_store()
    per_block = probe.layout.file_bytes
    store = make_store(capacity_bytes=4 * per_block, root=probe.root.parent / "small")
    ids, _ = fill(store, 4)
    assert store.used_bytes == 4 * per_block
    store.lookup(ids[:1])  # block 0 becomes most recently used
    more, _ = fill(store, 2, seed=3)
    assert store.used_bytes <= 4 * per_block
    assert set(store.lru_order()) == {ids[3], ids[0], *more}
    assert not store.path_of(ids[1]).exists() and not store.path_of(ids[2]).exists()
    # the order survives a restart: the index is rebuilt from the files' mtimes
    order = [more[1], ids[3], more[0], ids[0]]
    for t, b in enumerate(order):
        os.utime(store.path_of(b), ns=(10**18 + t * 10**9, 10**18 + t * 10**9))
    again = make_store(capacity_bytes=4 * per_block, root=store.root)
    assert again.lru_order() == order


def test_eviction_takes_chains_from_their_tails(make_store, tiny, kvh):
    # plain LRU evicted a chain's first blocks first: every later block became unreachable
    probe = make_store()
    per_block = probe.layout.file_bytes
    store = make_store(capacity_bytes=4 * per_block, root=probe.root.parent / "tails")
    bt = store.layout.block_tokens

    def turn(tokens):
        kv = [(torch.randn(len(tokens), 2, 16), torch.randn(len(tokens), 2, 16))] * 4
        return store.put_tokens(tokens, kv)

    a = turn(list(range(3 * bt)))
    b = turn([500 - i for i in range(2 * bt)])
    assert store.lookup(a) == 2 and not store.path_of(a[2]).exists()  # A lost its tail only
    assert store.lookup(b) == 2
    store.lookup(a)  # A read after B: B's tail goes first, then its head
    c = turn([7] * (2 * bt))
    assert store.lookup(a) == 2 and store.lookup(c) == 2 and store.lookup(b) == 0


def test_put_tokens_writes_only_covered_full_blocks(make_store):
    store = make_store()
    lo = store.layout
    tokens = list(range(64 * 3 + 10))
    kv = [
        (torch.randn(len(tokens) - 64, 2, 16), torch.randn(len(tokens) - 64, 2, 16))
        for _ in range(lo.layers)
    ]
    written = store.put_tokens(tokens, kv, kv_start_token=64)
    ids = block_ids(tokens, store.model)
    assert written == ids[1:3]
    r = store.read_layer(ids[1:3], 2)
    assert torch.equal(r.k, kv[2][0][:128])
    assert len(split_blocks(kv, 64)) == 2


def test_put_refuses_wrong_shapes(make_store):
    store = make_store()
    bid = block_ids(list(range(64)), store.model)[0]
    with pytest.raises(ValueError, match="layer 0 K"):
        store.put(bid, [(torch.zeros(64, 2, 8), torch.zeros(64, 2, 16))] * 4)


def _fds_of(store):
    return [e.fd for e in store._files._open.values()]


@pytest.mark.parametrize("backend", ["preadv", "nixl"])
def test_cached_fds_never_serve_a_deleted_or_rewritten_block(make_store, kvh, backend):
    fill, u8 = kvh.fill, kvh.u8
    if backend == "nixl":
        pytest.importorskip("nixl_cu12")
    store = make_store(backend=backend)
    other = make_store(root=store.root)  # another process sharing the directory
    ids, blocks = fill(store, 3)
    assert store.read_layer(ids, 0).valid_blocks == 3 and len(_fds_of(store)) == 3
    os.unlink(store.path_of(ids[2]))  # evicted elsewhere: the cached fd still reads the inode
    r = store.read_layer(ids, 1)
    assert r.valid_blocks == 2 and r.failed[0].reason == "missing"
    # rewritten elsewhere with other bytes for the same id (e.g. recomputed KV)
    fresh = random_layers(store.layout, torch.Generator().manual_seed(42))
    os.unlink(store.path_of(ids[1]))
    assert other.put(ids[1], fresh)
    r = store.read_layer(ids[:2], 3)
    assert r.valid_blocks == 2 and not r.failed
    assert torch.equal(u8(r.k[64:]), u8(fresh[3][0]))  # the new file, checked against its header
    assert torch.equal(u8(r.k[:64]), u8(blocks[0][3][0]))


def test_evict_and_close_release_cached_fds(make_store, kvh):
    store = make_store(backend="preadv")
    ids, _ = kvh.fill(store, 3)
    store.read_blocks(ids)
    fds = _fds_of(store)
    assert len(fds) == 3
    store.evict(ids[0])
    assert len(_fds_of(store)) == 2
    with pytest.raises(OSError):
        os.fstat(fds[0])
    assert store.read_layer(ids, 0).valid_blocks == 0  # evicted: a miss, not the old fd
    store.close()
    assert not _fds_of(store)
    for fd in fds[1:]:
        with pytest.raises(OSError):
            os.fstat(fd)


def test_open_run_reads_chunks_and_holds_fds_until_closed(make_store, kvh):
    fill, u8 = kvh.fill, kvh.u8
    store = make_store()
    ids, blocks = fill(store, 4)
    run = store.open_run(ids)
    assert run.valid_blocks == 4 and not run.failed
    r = store.read_run_layer(run, 2, 1, 3)
    assert r.valid_blocks == 2
    assert torch.equal(u8(r.v), u8(torch.cat([blocks[1][2][1], blocks[2][2][1]])))
    held = run.entries[0].fd
    store.evict(ids[0])  # evicted while a request reads it: its run keeps the inode open
    assert os.fstat(held)
    assert store.read_run_layer(run, 0, 0, 1).valid_blocks == 1
    run.close()
    run.close()  # idempotent
    with pytest.raises(OSError):
        os.fstat(held)
    with pytest.raises(ValueError, match="outside"):
        store.read_run_layer(run, 0, 0, 5)


def test_open_files_cache_is_bounded(make_store, tmp_path, kvh):
    from dualpath.kv import KVStore

    store = KVStore(tmp_path / "bounded", make_store().model, 1 << 30, "preadv", open_files=2)
    try:
        ids, blocks = kvh.fill(store, 5)
        r = store.read_layer(ids, 1)
        assert r.valid_blocks == 5 and len(_fds_of(store)) == 2
        assert torch.equal(kvh.u8(r.k[256:]), kvh.u8(blocks[4][1][0]))
    finally:
        store.close()


def test_read_failure_keeps_the_verified_prefix(tmp_path, tiny, kvh, monkeypatch):
    from dualpath.kv import KVStore
    from dualpath.kv import reader as reader_mod
    from dualpath.kv.backend import PreadvBackend

    class FailThird(PreadvBackend):  # the third block read fails (both read paths)
        calls = 0

        def _fail_third(self):
            FailThird.calls += 1
            if FailThird.calls == 3:
                raise OSError("EIO (test)")

        def read(self, batch):
            self._fail_third()
            super().read(batch)

        def read_run(self, fd, views, offset):
            self._fail_third()
            super().read_run(fd, views, offset)

    store = KVStore(tmp_path / "kv", tiny, 1 << 30, backend=FailThird())
    ids, blocks = kvh.fill(store, 4)
    monkeypatch.setattr(reader_mod, "_VERIFY_STEP_BYTES", 1)  # read + verify one block at a time
    before = misses("io_error")
    r = store.read_layer(ids, 1)
    assert r.valid_blocks == 2 and r.failed[0].block_id == ids[2]
    assert r.failed[0].reason == "io_error" and misses("io_error") == before + 1
    assert torch.equal(kvh.u8(r.k), kvh.u8(torch.cat([b[1][0] for b in blocks[:2]])))
    assert store.lookup(ids) == 4  # an I/O error is not the block's fault: nothing dropped
    store.close()
