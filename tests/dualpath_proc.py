"""A `dualpath` command as a child process, waited for until it prints its READY line: how the
integration tests start a scheduler or a worker of their own. Importable from every test
(`pythonpath = ["tests"]`)."""

from __future__ import annotations

import os
import subprocess
import sys
import time


def spawn_ready(
    args: list[str], marker: str = "READY", timeout_s: float = 120.0
) -> tuple[subprocess.Popen, str]:
    """`python -m dualpath.cli ARGS` in a session of its own (one thread per op: two cores are
    shared), stdout piped; returns once a line holds `marker` (that line), fails if it exits
    or takes longer than `timeout_s` (then it is killed)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "dualpath.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    deadline = time.monotonic() + timeout_s
    line = ""
    try:
        while marker not in line:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, f"{args[0]} exited"
            assert time.monotonic() < deadline, f"{args[0]} did not start"
    except BaseException:
        proc.kill()
        proc.wait(10)
        raise
    return proc, line
