"""The open-fd cache: bounded, inode-keyed, never closes an fd a read still uses."""

import os

import pytest
from dualpath.kv.files import OpenBlock, OpenBlocks
from dualpath.kv.format import BlockHeader


def _open(tmp_path, name: str) -> OpenBlock:
    path = tmp_path / name
    path.write_bytes(b"x")
    fd = os.open(path, os.O_RDONLY)
    st = os.fstat(fd)
    return OpenBlock(name, fd, st.st_dev, st.st_ino, BlockHeader(name, "fp", ()))


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def test_reuse_only_for_the_same_inode(tmp_path):
    cache = OpenBlocks(4)
    e = cache.add(_open(tmp_path, "a"))
    cache.release([e])
    again = cache.acquire("a", e.dev, e.ino)
    assert again is e and e.refs == 1
    cache.release([again])
    assert cache.acquire("a", e.dev, e.ino + 1) is None  # the path names another inode now
    assert not _is_open(e.fd) and len(cache) == 0


def test_invalidate_waits_for_the_last_reader(tmp_path):
    cache = OpenBlocks(4)
    e = cache.add(_open(tmp_path, "a"))  # held by a read
    cache.invalidate("a")
    assert _is_open(e.fd) and cache.acquire("a", e.dev, e.ino) is None
    cache.release([e])
    assert not _is_open(e.fd)


def test_bounded_lru_and_close(tmp_path):
    cache = OpenBlocks(2)
    entries = []
    for name in "abc":
        e = cache.add(_open(tmp_path, name))
        cache.release([e])
        entries.append(e)
    assert len(cache) == 2 and not _is_open(entries[0].fd)  # least recently used went first
    cache.close()
    assert len(cache) == 0 and not any(_is_open(e.fd) for e in entries)


def test_racing_open_of_the_same_inode_keeps_one_fd(tmp_path):
    cache = OpenBlocks(4)
    first = cache.add(_open(tmp_path, "a"))
    path = tmp_path / "a"
    fd = os.open(path, os.O_RDONLY)
    dup = OpenBlock("a", fd, first.dev, first.ino, first.header)
    assert cache.add(dup) is first and first.refs == 2 and not _is_open(fd)


def test_max_open_must_be_positive():
    with pytest.raises(ValueError):
        OpenBlocks(0)
