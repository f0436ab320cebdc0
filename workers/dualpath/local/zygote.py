"""A warm process that forks restarted children with their heavy imports already done.

A worker process spends most of its start importing torch and the engine (3-4 s of CPU, far
more on a busy machine); a crashed worker restarted by `dualpath up` forked from here starts
serving in about a second instead. The zygote itself never creates a thread, an event loop,
a gRPC channel or a tensor (what a fork must not copy half-way): it imports modules, then
waits on its control socket.

Protocol over a Unix socket pair (`Zygote` is the supervisor's side): the supervisor sends one
JSON request `{"argv": [...], "env": {...}}` with the write end of the child's output pipe as
an attached descriptor; the zygote forks, the child starts a new session, takes the pipe as
stdout and stderr and runs `dualpath.cli.main(argv)` under `env`; the zygote answers
`{"pid": N}` and, when a child exits, `{"exit": N, "code": C}` (C as `Popen.returncode`:
negative for a signal). Only children of this module's `dualpath.cli` entry point can be forked.
"""

from __future__ import annotations

import array
import contextlib
import importlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO

log = logging.getLogger(__name__)

# What a worker or scheduler imports before it does anything (cli.py imports per command).
PRELOAD = (
    "torch",
    "numpy",
    "grpc",
    "yaml",
    "pydantic",
    "prometheus_client",
    "dualpath.cli",
    "dualpath.config",
    "dualpath.engine",
    "dualpath.kv",
    "dualpath.worker.cli",
    "dualpath.worker.node",
    "dualpath.worker.parts",
    "dualpath.worker.service",
    "dualpath.worker.decode",
    "dualpath.worker.prefill",
    "dualpath.scheduler.cli",
    "dualpath.scheduler.service",
    "dualpath.scheduler.client",
)
MAX_MSG = 1 << 20


def _child(sock: socket.socket, req: dict, out_fd: int) -> None:
    """In the forked child: never returns."""
    code = 1
    try:
        sock.close()
        os.setsid()  # its own process group, as Popen(start_new_session=True)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        os.close(out_fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        # fresh stream objects: the zygote's may hold buffered bytes or a lock
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        os.environ.clear()
        os.environ.update(req["env"])
        argv = list(req["argv"])
        sys.argv = ["dualpath", *argv]
        # The child runs a command line as exec'ing the `dualpath` console script would: the
        # entry point is a process boundary, not a dependency of the local cluster, so it is
        # loaded by name like the console script loads it (the layer contracts stay true).
        main = importlib.import_module("dualpath.cli").main
        code = int(main(argv) or 0)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 (the child's last word goes to its own output)
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve(sock: socket.socket) -> None:
    """The zygote's loop: fork on request, report exits; returns when the socket closes."""
    for name in PRELOAD:
        importlib.import_module(name)
    # setproctitle finds the argv memory it rewrites on first use, checking it against
    # sys.argv: here, before a child replaces sys.argv, so each child can say what it is
    with contextlib.suppress(ImportError):  # a dependency; without it, only the thread name
        importlib.import_module("setproctitle").getproctitle()
    sock.sendall(b'{"ready": true}\n')
    while True:
        while True:  # reap
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            code = os.waitstatus_to_exitcode(status)
            sock.sendall(json.dumps({"exit": pid, "code": code}).encode() + b"\n")
        ready, _, _ = select.select([sock], [], [], 0.05)
        if not ready:
            continue
        fds = array.array("i")
        msg, anc, _, _ = sock.recvmsg(MAX_MSG, socket.CMSG_LEN(fds.itemsize))
        if not msg:
            return  # the supervisor is gone: so are we (children live on in their sessions)
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(data[: len(data) - (len(data) % fds.itemsize)])
        req = json.loads(msg)
        pid = os.fork()
        if pid == 0:
            _child(sock, req, fds[0])
        os.close(fds[0])
        sock.sendall(json.dumps({"pid": pid}).encode() + b"\n")


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
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dualpath.local.zygote", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            env={**os.environ, **(env or {})},
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


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor stops us, not a Ctrl-C
    serve(socket.socket(fileno=int(sys.argv[1])))


if __name__ == "__main__":
    main()
