"""SIGINT and SIGTERM for the local commands that run clusters (`dualpath demo`, `dualpath bench
local`): the first raises `Interrupted` in the main thread, so every `with LocalCluster` block
on the way out stops its processes (with a short grace: nothing is waited for) and the command
reports what it measured so far; a second one hurries every stop under way (SIGKILL now).
`dualpath up` keeps its own handler (a stop there drains, as a pod's does).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from dualpath.local.supervisor import hurry_all

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# SIGTERM to SIGKILL for a cluster left because of an interrupt: its turns are abandoned, so
# nothing is drained, but an idle worker still gets to close its NIXL agent and files.
INTERRUPT_GRACE_S = 5.0


class Interrupted(KeyboardInterrupt):
    """A stop signal arrived; a KeyboardInterrupt so every handler of Ctrl-C handles it too."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.reported = False  # the command has said so already (with what it measured)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # as a shell reports a process ended by the signal


@contextmanager
def interruptible() -> Iterator[None]:
    """Within the block, SIGINT and SIGTERM raise `Interrupted` once; later ones hurry the
    stops (`hurry_all`). Outside the main thread (where Python runs no handler) a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    seen: list[int] = []

    def handler(signum: int, _frame: object) -> None:
        if seen:
            hurry_all()
            return
        seen.append(signum)
        raise Interrupted(signum)

    old = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
