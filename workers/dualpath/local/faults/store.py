"""Rows that damage the KV store: corrupt or truncated blocks, a read-only or full store."""

from __future__ import annotations

import os
import random
import subprocess
from collections.abc import Callable

from dualpath.local.faults.report import Row
from dualpath.local.faults.suite import Suite


async def store_row(s: Suite, fault: str) -> Row:
    row = Row(fault)
    files = sorted(s.block_files())[::2]  # every other block: some hits only shortened
    rng = random.Random(7)
    if fault == "corrupt-blocks":
        for p in files:
            size = p.stat().st_size
            with open(p, "r+b") as f:
                f.seek(size // 2)
                f.write(bytes(rng.randrange(256) for _ in range(64)))
    else:
        for p in files:
            os.truncate(p, p.stat().st_size // 2)
    results = [await s.c.turn(i) for i in s.ref_ids]
    row.add(results)
    hits = sum(1 for r in results if r.cached)
    row.note = (
        f"{len(files)} block files {fault.split('-')[0]}; {hits} turns still read a (shortened) hit"
    )
    return row


async def read_only_row(s: Suite) -> Row:
    row = Row("read-only-store")
    undo = read_only(s)
    try:
        results = [await s.c.turn(i) for i in s.ref_ids]
        results += [await s.c.turn(s.new_prompt()) for _ in range(4)]  # writes fail
    finally:
        undo()
    row.add(results)
    if s.mounted:
        how = "EROFS (read-only bind mount)"
    elif os.geteuid() == 0:
        how = "chmod a-w, which root ignores: NOT a read-only store here (no mount allowed)"
    else:
        how = "EACCES (chmod a-w, not root)"
    hits = sum(1 for r in results if r.cached)
    row.note = f"{how}; {hits} turns read hits, new blocks not written"
    return row


def read_only(s: Suite) -> Callable[[], None]:
    root = s.cl.storage
    if s.mounted:
        # a read-only bind mount over the store: EROFS for every write through its path,
        # while the tmpfs itself stays writable (a remount of the tmpfs is refused while a
        # worker holds a deleted block file open)
        subprocess.run(["mount", "--bind", str(root), str(root)], check=True)
        try:
            subprocess.run(["mount", "-o", "remount,bind,ro", str(root)], check=True)
        except subprocess.CalledProcessError:
            subprocess.run(["umount", str(root)], check=False)
            raise
        # lazily: workers hold block files open through it; those keep working
        return lambda: subprocess.run(["umount", "-l", str(root)], check=True)
    modes = {p: p.stat().st_mode for p in [root, *root.rglob("*")]}
    for p, mode in modes.items():
        p.chmod(mode & ~0o222)
    return lambda: [p.chmod(mode) for p, mode in modes.items()]


async def full_store_row(s: Suite) -> Row:
    row = Row("full-store")
    if not s.mounted:
        row.note = "skipped: filling a filesystem needs the store on a tmpfs (root)"
        return row
    filler = s.cl.storage / ".filler"
    st = os.statvfs(s.cl.storage)
    free = st.f_bavail * st.f_frsize
    with open(filler, "wb") as f:  # leave about 8 blocks' room
        try:
            f.write(b"\0" * max(0, free - 8 * 17 * 1024))
        except OSError:
            pass
    try:
        results = [await s.c.turn(s.new_prompt()) for _ in range(12 if s.quick else 30)]
        results += [await s.c.turn(i) for i in s.ref_ids]
    finally:
        filler.unlink()
    row.add(results)
    row.note = "real ENOSPC: tmpfs filled but for ~8 blocks; the store evicts to make room"
    return row
