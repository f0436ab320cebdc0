"""Read backends: how a batch of range reads lands in host memory.

A `ReadBatch` is a set of destination buffers (contiguous uint8 CPU tensors) and a table of
segments, one row each: read `nbytes` of file `fd` at `file_offset` into `dests[dest]` at
`dest_offset`. The store builds the table with numpy (one row per K or V of a block-layer), so
a batch of many ranges costs a few array operations, not Python objects per range.
`nixl` issues one NIXL POSIX-backend READ (FILE_SEG -> DRAM_SEG) per batch; `preadv` calls
os.preadv per run of file-contiguous segments. `make_backend` picks one by name; `auto` tries
nixl and, when it cannot start, logs a warning, counts it (dualpath_kv_backend_fallback_total)
and uses preadv.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from dualpath.kv import metrics
from dualpath.kv.errors import ShortReadError
from dualpath.log import quiet_nixl_logs

log = logging.getLogger(__name__)

BACKENDS = ("auto", "nixl", "preadv")
# segment table columns
FD, FILE_OFFSET, NBYTES, DEST, DEST_OFFSET = range(5)
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


@dataclass
class ReadBatch:
    dests: list[torch.Tensor]  # contiguous 1-D uint8 CPU tensors
    segments: np.ndarray  # int64 (n, 5): fd, file_offset, nbytes, dest, dest_offset

    @property
    def nbytes(self) -> int:
        return int(self.segments[:, NBYTES].sum())


class ReadBackend(Protocol):
    name: str
    # True for a backend whose per-call cost is a syscall: the store then reads each block's
    # run with `read_run` and verifies it at once, instead of batching (NIXL: ~110 us a call)
    reads_runs: bool

    def read(self, batch: ReadBatch) -> None:
        """Fill every segment of the batch; raises OSError on any failure."""

    def read_run(self, fd: int, views: list[memoryview], offset: int) -> None:
        """Fill `views` from one contiguous range of `fd` at `offset` (where `reads_runs`)."""

    def close(self) -> None: ...


class PreadvBackend:
    name = "preadv"
    reads_runs = True

    def read(self, batch: ReadBatch) -> None:
        views = [memoryview(d.numpy()) for d in batch.dests]
        rows = batch.segments.tolist()
        i, n = 0, len(rows)
        while i < n:
            fd, offset, nbytes, dest, dest_off = rows[i]
            iov = [views[dest][dest_off : dest_off + nbytes]]
            end = offset + nbytes
            i += 1
            # one preadv per run of segments that are contiguous in the same file
            while i < n and rows[i][0] == fd and rows[i][1] == end and len(iov) < _IOV_MAX:
                _, _, nbytes, dest, dest_off = rows[i]
                iov.append(views[dest][dest_off : dest_off + nbytes])
                end += nbytes
                i += 1
            _preadv_all(fd, iov, offset)

    def read_run(self, fd: int, views: list[memoryview], offset: int) -> None:
        """Fill `views` from one contiguous range of `fd` at `offset` (the store's hot path:
        one call per block run, no segment table); raises OSError on failure."""
        if os.preadv(fd, views, offset) != sum(map(len, views)):
            _preadv_all(fd, views, offset)  # a short read: finish it or raise

    def close(self) -> None:
        pass


def _preadv_all(fd: int, views: list[memoryview], offset: int) -> None:
    want = sum(len(v) for v in views)
    views = [v for v in views if len(v)]
    while views:
        got = os.preadv(fd, views, offset)
        if got <= 0:
            raise ShortReadError(f"short read at offset {offset} ({want} bytes wanted)")
        offset += got
        # Drop what was filled; a short read mid-buffer continues inside that buffer.
        while views and got >= len(views[0]):
            got -= len(views[0])
            views.pop(0)
        if got:
            views[0] = views[0][got:]


class NixlUnavailable(RuntimeError):
    pass


class NixlBackend:
    """NIXL agent with the POSIX backend; one agent per thread (agents are not shared)."""

    name = "nixl"
    reads_runs = False  # one call per batch: each costs ~110 us, not a syscall

    def __init__(self, timeout_s: float = 30.0) -> None:
        self.timeout_s = timeout_s
        self._local = threading.local()
        self._agents: list[object] = []
        self._lock = threading.Lock()
        self._agent()  # fail now, not on the first read, when NIXL cannot start

    def _agent(self):  # noqa: ANN202 (nixl_agent, imported lazily)
        agent = getattr(self._local, "agent", None)
        if agent is not None:
            return agent
        try:
            from nixl_cu12._api import nixl_agent, nixl_agent_config
        except ImportError as err:
            raise NixlUnavailable(f"nixl_cu12 not importable: {err}") from err
        quiet_nixl_logs()
        name = f"dualpath-kv-{os.getpid()}-{threading.get_ident()}"
        try:
            agent = nixl_agent(
                name, nixl_agent_config(enable_prog_thread=False, backends=["POSIX"])
            )
        except Exception as err:  # the bindings raise plain exceptions
            raise NixlUnavailable(f"NIXL agent failed to start: {err}") from err
        if "POSIX" not in agent.backends:
            raise NixlUnavailable("NIXL has no POSIX backend plugin")
        self._local.agent = agent
        with self._lock:
            self._agents.append(agent)
        return agent

    def read(self, batch: ReadBatch) -> None:
        seg = batch.segments
        seg = seg[seg[:, NBYTES] > 0]  # e.g. MLA's empty V
        if not len(seg):
            return
        agent = self._agent()
        # Vectorized descriptors: (addr, len, dev) for memory, (offset, len, fd) for files.
        bases = np.array([d.data_ptr() for d in batch.dests], dtype=np.int64)
        mem = np.empty((len(seg), 3), dtype=np.uint64)
        mem[:, 0] = bases[seg[:, DEST]] + seg[:, DEST_OFFSET]
        mem[:, 1] = seg[:, NBYTES]
        mem[:, 2] = 0
        files = np.ascontiguousarray(seg[:, [FILE_OFFSET, NBYTES, FD]], dtype=np.uint64)
        # Registration is per batch: two registerMem calls (every fd of the batch, every dest
        # buffer) are ~1% of a layer read here, and a registration never outlives the fds the
        # store keeps open for this read.
        file_regs = [(0, 0, fd, "") for fd in np.unique(seg[:, FD]).tolist()]
        mem_regs = [(d.data_ptr(), d.numel(), 0, "") for d in batch.dests if d.numel()]
        try:
            freg = agent.register_memory(file_regs, "FILE", backends=["POSIX"])
        except Exception as err:
            raise OSError(f"NIXL registration failed: {err}") from err
        try:
            mreg = agent.register_memory(mem_regs, "DRAM", backends=["POSIX"])
        except Exception as err:
            agent.deregister_memory(freg, backends=["POSIX"])
            raise OSError(f"NIXL registration failed: {err}") from err
        try:
            local = agent.get_xfer_descs(mem, "DRAM")
            remote = agent.get_xfer_descs(files, "FILE")
            handle = agent.initialize_xfer("READ", local, remote, agent.name, backends=["POSIX"])
            try:
                state = agent.transfer(handle)
                deadline = time.monotonic() + self.timeout_s
                spins = 0
                while state == "PROC":
                    if time.monotonic() > deadline:
                        raise OSError(f"NIXL READ did not finish within {self.timeout_s}s")
                    spins += 1
                    if spins > 64:
                        time.sleep(2e-5)
                    state = agent.check_xfer_state(handle)
                if state != "DONE":
                    raise OSError(f"NIXL READ failed (state {state})")
            finally:
                agent.release_xfer_handle(handle)
        except OSError:
            raise
        except Exception as err:
            raise OSError(f"NIXL READ failed: {err}") from err
        finally:
            agent.deregister_memory(mreg, backends=["POSIX"])
            agent.deregister_memory(freg, backends=["POSIX"])

    def read_run(self, fd: int, views: list[memoryview], offset: int) -> None:
        raise NotImplementedError("the NIXL backend reads batches (reads_runs is False)")

    def close(self) -> None:
        with self._lock:
            self._agents.clear()
        self._local = threading.local()


def make_backend(name: str = "auto") -> ReadBackend:
    """The one factory: `nixl`, `preadv`, or `auto` (nixl if it starts, else counted preadv)."""
    if name == "preadv":
        return PreadvBackend()
    if name == "nixl":
        return NixlBackend()
    if name == "auto":
        try:
            return NixlBackend()
        except NixlUnavailable as err:
            log.warning("KV store backend auto: NIXL unavailable (%s); using preadv", err)
            metrics.BACKEND_FALLBACKS.labels(reason="nixl_unavailable").inc()
            return PreadvBackend()
    raise ValueError(f"storage backend {name!r} unknown; choose one of {', '.join(BACKENDS)}")
