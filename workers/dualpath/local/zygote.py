"""A warm process that forks restarted children with their heavy imports already done.

A worker process spends most of its start importing torch and the engine (3-4 s of CPU, far
more on a busy machine); a crashed worker restarted by `dualpath up` forked from here starts
serving in about a second instead. The zygote itself never creates a thread, an event loop,
a gRPC channel or a tensor (what a fork must not copy half-way): it imports modules, then
waits on its control socket.

Protocol over a Unix socket pair (`zygote_client.Zygote` is the supervisor's side, which starts
this module as `python -m dualpath.local.zygote`; nothing imports it): the supervisor sends one
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
import os
import select
import signal
import socket
import sys

from dualpath.lifeline import PARENT_PID_ENV, die_with_parent

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
        # its parent is this zygote: it ends with it (and the zygote with the supervisor)
        die_with_parent(parent=os.getppid())
        os.environ.clear()
        os.environ.update({**req["env"], PARENT_PID_ENV: str(os.getppid())})
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


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor stops us, not a Ctrl-C
    die_with_parent()
    serve(socket.socket(fileno=int(sys.argv[1])))


if __name__ == "__main__":
    main()
