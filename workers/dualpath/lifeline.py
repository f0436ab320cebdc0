"""A child process ends with the local supervisor that started it, however that one ends.

`dualpath up`, `dualpath demo` and `dualpath bench local` stop their children on SIGINT and
SIGTERM themselves (`local/supervisor.py`); this covers the rest: the parent killed outright
(SIGKILL, the OOM killer, a crash). The supervisor names itself in `DUALPATH_PARENT_PID`, and
the child asks the kernel for SIGTERM when that parent dies (Linux `PR_SET_PDEATHSIG`), so a
worker still drains as in its pod, bounded by `spec.workers.drainSeconds`. Pods never set the
variable (the kubelet owns their lifetime). Pure standard library: it runs before any import
of the command.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
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
