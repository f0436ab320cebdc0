"""Read backends: how a batch of range reads lands in host memory.

A batch is a list of `RangeRead(fd, offset, buffers)`: read `sum(len(b))` contiguous file bytes
at `offset` and scatter them into `buffers` (contiguous uint8 CPU tensors), in order.
`nixl` issues one NIXL POSIX-backend READ (FILE_SEG -> DRAM_SEG) per batch; `preadv` calls
os.preadv per range. `make_backend` picks one by name; `auto` tries nixl and, when it cannot
start, logs a warning, counts it (dualpath_kv_backend_fallback_total) and uses preadv.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Protocol

import torch

from dualpath.kv import metrics

log = logging.getLogger(__name__)

BACKENDS = ("auto", "nixl", "preadv")


@dataclass
class RangeRead:
    fd: int
    offset: int
    buffers: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers)


class ReadBackend(Protocol):
    name: str

    def read(self, batch: list[RangeRead]) -> None:
        """Fill every buffer of the batch; raises OSError on any failure."""

    def close(self) -> None: ...


class PreadvBackend:
    name = "preadv"

    def read(self, batch: list[RangeRead]) -> None:
        for r in batch:
            views = [memoryview(b.numpy()) for b in r.buffers]
            offset, want = r.offset, r.nbytes
            while views:
                got = os.preadv(r.fd, views, offset)
                if got <= 0:
                    raise OSError(f"short read at offset {offset} ({want} bytes wanted)")
                offset += got
                # Drop what was filled; a short read mid-buffer continues inside that buffer.
                while views and got >= len(views[0]):
                    got -= len(views[0])
                    views.pop(0)
                if got:
                    views[0] = views[0][got:]

    def close(self) -> None:
        pass


class NixlUnavailable(RuntimeError):
    pass


class NixlBackend:
    """NIXL agent with the POSIX backend; one agent per thread (agents are not shared)."""

    name = "nixl"

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
        _route_nixl_logs()
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

    def read(self, batch: list[RangeRead]) -> None:
        if not batch:
            return
        agent = self._agent()
        files, file_descs, mem_regs, mem_descs = {}, [], [], []
        for r in batch:
            files.setdefault(r.fd, (0, 0, r.fd, ""))
            off = r.offset
            for b in r.buffers:
                n = b.numel()
                file_descs.append((off, n, r.fd))
                mem_regs.append((b.data_ptr(), n, 0, ""))
                mem_descs.append((b.data_ptr(), n, 0))
                off += n
        try:
            freg = agent.register_memory(list(files.values()), "FILE", backends=["POSIX"])
            mreg = agent.register_memory(mem_regs, "DRAM", backends=["POSIX"])
        except Exception as err:
            raise OSError(f"NIXL registration failed: {err}") from err
        try:
            local = agent.get_xfer_descs(mem_descs, "DRAM")
            remote = agent.get_xfer_descs(file_descs, "FILE")
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

    def close(self) -> None:
        with self._lock:
            self._agents.clear()
        self._local = threading.local()


def _route_nixl_logs() -> None:
    """NIXL logs INFO lines to stdout, which would corrupt `--json` output: send them through
    our (stderr) logging at WARNING unless NIXL_LOG_LEVEL asks for more."""
    nixl_log = logging.getLogger("nixl")
    for h in list(nixl_log.handlers):
        nixl_log.removeHandler(h)
    nixl_log.propagate = True
    if not os.environ.get("NIXL_LOG_LEVEL"):
        nixl_log.setLevel(logging.WARNING)


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
