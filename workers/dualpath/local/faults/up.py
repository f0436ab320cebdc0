"""The suite's cluster: `dualpath up` as a subprocess on a small config, its processes found,
killed and waited for."""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from dualpath import config
from dualpath.local.supervisor import process_tree

log = logging.getLogger(__name__)


def fault_config(storage: Path, capacity_bytes: int = 64 << 20) -> dict:
    """The suite's DualPathCluster: the tiny model (fast on a CPU), 1 prefill + 2 decode; the
    store at `storage` made absolute (the config's storage.path is every pod's mount path)."""
    res = config.local_default().to_resource()
    spec = res["spec"]
    spec["model"] = {"name": "dualpath-tiny", "preset": "tiny", "blockTokens": 16}
    spec["prefill"]["kvBufferBytes"] = 32 << 20
    spec["decode"]["kvBufferBytes"] = 32 << 20
    spec["storage"].update(path=str(storage.resolve()), capacityBytes=capacity_bytes, snicGbps=1)
    spec.setdefault("workers", {})["drainSeconds"] = 20
    # admission: at most 24 turns in flight per node (the one prefill node: the cluster); an
    # overload burst beyond is refused with a 429 after the scheduler's queue timeout
    spec.setdefault("scheduler", {})["maxInFlightPerNode"] = 24
    # slow HTTP clients are dropped after 3 s (the slow-clients row waits that long)
    spec.setdefault("frontend", {})["headerTimeoutSeconds"] = 3
    return res


RESTART_DELAY_S = 2.0


class Cluster:
    """`dualpath up -f CONFIG` in its own process group; its children found by their
    command lines (each runs in its own group too, so a SIGKILL takes one process)."""

    def __init__(self, run_dir: Path, cfg_file: Path, storage: Path, log_file: Path) -> None:
        self.run_dir, self.cfg_file, self.storage, self.log_file = (
            run_dir,
            cfg_file,
            storage,
            log_file,
        )
        self.proc: subprocess.Popen | None = None
        self.frontend = self.scheduler = ""

    def start(self, timeout_s: float = 240.0) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self._log = open(self.log_file, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dualpath.cli", "up", "-f", str(self.cfg_file)]
            + ["--run-dir", str(self.run_dir), "--storage-dir", str(self.storage)]
            # a kill is answered by a restart within RESTART_DELAY_S, however many came
            # before: the rows measure the cluster's answer to a kill, not the crash-loop backoff
            + ["--max-restarts", "100", "--max-restart-delay", str(RESTART_DELAY_S)],
            stdout=subprocess.PIPE,
            stderr=self._log,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout_s
        assert self.proc.stdout is not None
        os.set_blocking(self.proc.stdout.fileno(), False)
        buf = b""
        while time.monotonic() < deadline:
            chunk = self.proc.stdout.read() or b""
            buf += chunk
            m = re.search(rb"READY up frontend=(\S+) scheduler=(\S+)", buf)
            if m:
                self.frontend, self.scheduler = m.group(1).decode(), m.group(2).decode()
                return
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"dualpath up exited with {self.proc.returncode}: see {self.log_file}"
                )
            time.sleep(0.1)
        raise RuntimeError(f"dualpath up not ready within {timeout_s:.0f}s: see {self.log_file}")

    def wait_zygote(self, timeout_s: float = 180.0) -> bool:
        """Wait until the supervisor's zygote has done its imports (restarts fork from it)."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if "zygote (pid" in self.log_file.read_text(errors="replace"):
                return True
            time.sleep(0.2)
        log.warning("the zygote is not ready after %.0fs: restarts start afresh", timeout_s)
        return False

    def pids(self) -> dict[str, int]:
        """name (scheduler, frontend, prefill-0, decode-1, ...) -> pid of its latest process,
        from the supervisor's log lines (a restart forked from the zygote has the zygote's
        command line, so /proc cannot name it)."""
        text = self.log_file.read_text(errors="replace")
        found = re.finditer(r"(?:started|forked from the zygote) (\S+) \(pid (\d+)\)", text)
        return {m.group(1): int(m.group(2)) for m in found}

    def pid(self, name: str) -> int | None:
        pid = self.pids().get(name)
        return pid if pid is not None and alive(pid) else None

    def descendants(self) -> list[int]:
        """Every live process under `dualpath up` (its children, the zygote's children)."""
        return [] if self.proc is None else process_tree(self.proc.pid)

    def ready_url(self, name: str) -> str:
        """From the process's own READY line (its command line is its title: `dualpath
        decode:decode-0`; a restart keeps the port)."""
        text = self.log_file.read_text(errors="replace")
        ports = re.findall(rf"\[{re.escape(name)}\]\s+ready .*\bmetrics=(\d+)", text)
        if not ports:
            raise RuntimeError(f"{name} has said no READY line with its metrics port")
        return f"http://127.0.0.1:{ports[-1]}/readyz"

    def kill(self, name: str) -> int:
        pid = self.pid(name)
        if pid is None:
            raise RuntimeError(f"no process {name}")
        os.killpg(pid, signal.SIGKILL)
        return pid

    def wait_restarted(self, name: str, old_pid: int, timeout_s: float = 30.0) -> float | None:
        """Monotonic time at which a new process of `name` was seen (None: not within)."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            pid = self.pid(name)
            if pid is not None and pid != old_pid:
                return time.monotonic()
            time.sleep(0.02)
        return None

    def stop(self, sig: int = signal.SIGINT, timeout_s: float = 60.0) -> float:
        """Signal `dualpath up` and wait for it; seconds it took."""
        t0 = time.monotonic()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if getattr(self, "_log", None):
            self._log.close()
        return time.monotonic() - t0


def http_ok(url: str, timeout_s: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:  # noqa: S310 (loopback)
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


# ---- clients ---------------------------------------------------------------------------------


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# ---- running it ------------------------------------------------------------------------------


def mount_tmpfs(path: Path, size_bytes: int) -> bool:
    """A tmpfs of `size_bytes` at `path` (root only): a store whose filesystem can really be
    filled (ENOSPC) and remounted read-only (EROFS). False when this process cannot mount."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)],
        capture_output=True,
    )
    return proc.returncode == 0
