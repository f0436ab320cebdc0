"""A child process ends with the local supervisor that started it, however that one ends.

`dualpath up`, `dualpath demo` and `dualpath bench local` stop their children on SIGINT and
SIGTERM themselves (`local/supervisor.py`); this covers the rest: the parent killed outright
(SIGKILL, the OOM killer, a crash). The supervisor names itself in `DUALPATH_PARENT_PID`, and
the child asks the kernel for SIGTERM when that parent dies (Linux `PR_SET_PDEATHSIG`), so a
worker still drains as in its pod, bounded by `spec.workers.drainSeconds`. Pods never set the
variable (the kubelet owns their lifetime). Pure standard library: it runs before any import
of the command. It also carries make's SIGINT to a command that make started (make forwards
SIGTERM only).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping

log = logging.getLogger(__name__)

PARENT_PID_ENV = "DUALPATH_PARENT_PID"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(
    env: Mapping[str, str] | None = None, sig: int = signal.SIGTERM, parent: int | None = None
) -> bool:
    """Get `sig` when the parent dies: the parent named in `env[PARENT_PID_ENV]` (default
    os.environ), or `parent` when given. Returns whether it is armed. If that parent is already
    gone (it died before this call), the signal is sent now. The kernel ties the signal to the
    parent *thread* that forked: supervisors start children from their main thread only."""
    want = parent
    if want is None:
        value = (os.environ if env is None else env).get(PARENT_PID_ENV, "")
        if not value.isdigit():
            return False
        want = int(value)
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    except (OSError, AttributeError) as err:
        log.warning("cannot tie this process to its parent's life: %s", err)
        return False
    if os.getppid() != want:  # the parent died before prctl: nobody will send it
        os.kill(os.getpid(), sig)
    return True


# --- a `make` parent interrupted -------------------------------------------------------------
# GNU make forwards SIGTERM to its children but not SIGINT: a SIGINT sent to make's process alone
# (a script's `kill -INT`, a CI runner stopping its top process) makes it wait for the recipe to
# end on its own, minutes for `make demo`. The one trace it leaves is its own signal table: its
# handler sets SIGINT back to the default disposition before it waits. A command started by make
# (MAKELEVEL in its environment) watches that and takes the SIGINT itself.
MAKE_ENV = "MAKELEVEL"
_SIGINT_BIT = 1 << (signal.SIGINT - 1)


def caught_signals(pid: int) -> int | None:
    """The process's caught-signal mask (`SigCgt` of /proc/PID/status); None if it is gone."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("SigCgt:"):
                    return int(line.split()[1], 16)
    except (OSError, ValueError):
        return None
    return None


def make_ancestor(pid: int | None = None, depth: int = 4) -> int | None:
    """The nearest `make` among this process's parents (a recipe may run through a shell)."""
    pid = os.getppid() if pid is None else pid
    for _ in range(depth):
        try:
            with open(f"/proc/{pid}/comm", encoding="utf-8") as comm:
                if comm.read().strip() in ("make", "gmake"):
                    return pid
            with open(f"/proc/{pid}/stat", encoding="utf-8") as stat:
                pid = int(stat.read().rsplit(")", 1)[1].split()[1])  # the field after the state
        except (OSError, ValueError, IndexError):
            return None
        if pid <= 1:
            return None
    return None


def follow_make_interrupt(
    env: Mapping[str, str] | None = None, poll_s: float = 0.5, make_pid: int | None = None
) -> threading.Thread | None:
    """Under make (MAKELEVEL set), send this process SIGINT once make has handled one.
    Returns the watching thread (a daemon), or None when not under make or nothing to watch."""
    if MAKE_ENV not in (os.environ if env is None else env):
        return None
    make_pid = make_ancestor() if make_pid is None else make_pid
    mask = None if make_pid is None else caught_signals(make_pid)
    if mask is None or not mask & _SIGINT_BIT:  # no make that catches SIGINT
        return None

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            mask = caught_signals(make_pid)
            if mask is None:  # make is gone (PR_SET_PDEATHSIG and the supervisor cover that)
                return
            if not mask & _SIGINT_BIT:
                log.warning("make (pid %d) was interrupted: stopping as on SIGINT", make_pid)
                os.kill(os.getpid(), signal.SIGINT)
                return

    thread = threading.Thread(target=watch, name="make-interrupt", daemon=True)
    thread.start()
    return thread
