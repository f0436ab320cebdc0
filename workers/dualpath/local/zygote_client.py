"""The supervisor's side of the zygote (`zygote.py`, the warm process it starts by module name):
`Zygote` starts it and asks it for children over their socket pair, `ZygoteProc` is one forked
child as the supervisor sees it. Apart from the warm process, so that the local cluster imports
the handle and never the module that loads `dualpath.cli` (the zygote's one arrow up)."""

from __future__ import annotations

import array
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO

from dualpath.lifeline import PARENT_PID_ENV

log = logging.getLogger("dualpath.local.zygote")  # its lines, as before the split


class ZygoteProc:
    """A forked child as the supervisor sees it: the part of `subprocess.Popen` it uses."""

    def __init__(self, pid: int, stdout: IO[bytes], zygote: Zygote) -> None:
        self.pid, self.stdout, self._zygote = pid, stdout, zygote
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            if end is not None and time.monotonic() >= end:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            if not self._zygote.alive():  # its parent is gone: it is reaped by init
                if not _exists(self.pid):
                    self.returncode = -signal.SIGKILL
                    break
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class Zygote:
    """The supervisor's side: starts the zygote process, asks it for children."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        full_env = {**os.environ, **(env or {})}
        full_env.pop(PARENT_PID_ENV, None)
        if threading.current_thread() is threading.main_thread():  # as Supervisor._launch
            full_env[PARENT_PID_ENV] = str(os.getpid())
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dualpath.local.zygote", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            env=full_env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        theirs.close()
        self._lock = threading.Lock()  # one fork request at a time
        self._ready = threading.Event()
        self._pids: list[int] = []  # answers to fork requests, in order
        self._answered = threading.Condition()
        self._procs: dict[int, ZygoteProc] = {}
        self._early_exits: dict[int, int] = {}
        self._reader = threading.Thread(target=self._read, name="zygote", daemon=True)
        self._reader.start()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def ready(self, timeout_s: float = 0.0) -> bool:
        return self._ready.wait(timeout_s) and self.alive()

    def _read(self) -> None:
        buf = b""
        while True:
            try:
                data = self._sock.recv(65536)
            except OSError:
                data = b""
            if not data:
                with self._answered:
                    self._answered.notify_all()
                return
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                msg = json.loads(line)
                if msg.get("ready"):
                    log.info(
                        "zygote (pid %d) ready: a restarted worker or scheduler forks from it, "
                        "its imports done",
                        self.proc.pid,
                    )
                    self._ready.set()
                elif "pid" in msg:
                    with self._answered:
                        self._pids.append(msg["pid"])
                        self._answered.notify_all()
                elif "exit" in msg:
                    with self._answered:
                        proc = self._procs.pop(msg["exit"], None)
                        if proc is None:
                            self._early_exits[msg["exit"]] = msg["code"]
                        else:
                            proc.returncode = msg["code"]

    def fork(self, argv: list[str], env: dict[str, str], timeout_s: float = 10.0) -> ZygoteProc:
        """A child running `dualpath.cli.main(argv)` under `env`; raises OSError if the zygote
        cannot make one."""
        if not self.ready():
            raise OSError("zygote not ready")
        r, w = os.pipe()
        try:
            with self._lock:
                payload = json.dumps({"argv": argv, "env": env}).encode()
                self._sock.sendmsg(
                    [payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [w]))]
                )
                end = time.monotonic() + timeout_s
                with self._answered:
                    while not self._pids:
                        left = end - time.monotonic()
                        if left <= 0 or not self.alive():
                            raise OSError("zygote did not answer")
                        self._answered.wait(left)
                    pid = self._pids.pop(0)
                    proc = ZygoteProc(pid, os.fdopen(r, "rb"), self)
                    if pid in self._early_exits:
                        proc.returncode = self._early_exits.pop(pid)
                    else:
                        self._procs[pid] = proc
        except BaseException:
            os.close(r)
            raise
        finally:
            os.close(w)
        return proc

    def close(self) -> None:
        try:
            self._sock.close()
        finally:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
