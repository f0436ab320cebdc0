"""A supervisor's child ends when the supervisor dies outright (`dualpath.lifeline`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from dualpath.lifeline import PARENT_PID_ENV

CHILD = """
import sys, time
from dualpath.lifeline import die_with_parent
print("armed" if die_with_parent() else "unarmed", flush=True)
time.sleep(120)
"""

PARENT = f"""
import os, subprocess, sys, time
env = {{**os.environ, {PARENT_PID_ENV!r}: str(os.getpid())}}
child = subprocess.Popen([sys.executable, "-c", {CHILD!r}], env=env, stdout=subprocess.PIPE, text=True)
print(child.pid, child.stdout.readline().strip(), flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_child_ends_when_its_supervisor_is_killed() -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        pid, state = parent.stdout.readline().split()
        child = int(pid)
        assert state == "armed" and _alive(child)
        parent.kill()  # SIGKILL: no handler, no stop of its own
        parent.wait()
        end = time.monotonic() + 30
        while _alive(child) and time.monotonic() < end:
            time.sleep(0.05)
        assert not _alive(child), "the child outlived its supervisor"
    finally:
        os.killpg(parent.pid, signal.SIGKILL)  # the group holds the child too


def test_a_child_whose_supervisor_is_already_gone_ends_at_once() -> None:
    # the named parent is not this child's parent (it died before the child armed itself)
    env = {**os.environ, PARENT_PID_ENV: "1"}
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, timeout=60, capture_output=True)
    assert proc.returncode == -signal.SIGTERM


def test_without_a_supervisor_nothing_is_armed() -> None:
    env = {k: v for k, v in os.environ.items() if k != PARENT_PID_ENV}
    out = subprocess.run(
        [sys.executable, "-c", "from dualpath.lifeline import die_with_parent as d; print(d())"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.stdout.strip() == "False"


def test_a_command_under_make_stops_when_make_alone_gets_sigint(tmp_path: Path) -> None:
    """GNU make forwards SIGTERM to its recipe but waits out SIGINT: the command follows make's
    signal table instead (`follow_make_interrupt`), as `make demo` does through `dualpath`."""
    child = (
        "import time; from dualpath.lifeline import follow_make_interrupt; "
        "print('watching' if follow_make_interrupt(poll_s=0.1) else 'not', flush=True); "
        "time.sleep(120)"
    )
    makefile = tmp_path / "Makefile"
    # through a shell (the `;`), as many recipes run: make is the command's grandparent
    makefile.write_text(f'run:\n\t@true; exec_me=1 {sys.executable} -c "{child}"\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    make = subprocess.Popen(
        ["make", "-s", "-f", str(makefile), "run"],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert make.stdout.readline().strip() == "watching"
        make.send_signal(signal.SIGINT)  # make's process alone, not its group
        assert make.wait(timeout=30) != 0
        time.sleep(0.2)
        assert subprocess.run(["pgrep", "-g", str(make.pid)], capture_output=True).stdout == b""
    finally:
        if make.poll() is None:
            os.killpg(make.pid, signal.SIGKILL)
            make.wait()


def test_no_watch_outside_make_or_of_a_parent_that_does_not_catch_sigint() -> None:
    from dualpath.lifeline import MAKE_ENV, follow_make_interrupt

    assert follow_make_interrupt(env={}) is None
    sleeper = subprocess.Popen(["sleep", "30"])  # SIGINT at its default: nothing to follow
    try:
        time.sleep(0.1)
        assert follow_make_interrupt(env={MAKE_ENV: "1"}, make_pid=sleeper.pid) is None
    finally:
        sleeper.kill()
        sleeper.wait()
