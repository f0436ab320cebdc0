"""SIGINT and SIGTERM for the local commands that run clusters (`dualpath demo`, `dualpath bench
local`, `dualpath faults`): the first raises `Interrupted` in the main thread, so every `with
LocalCluster` block on the way out stops its processes (with a short grace: nothing is waited
for) and the command reports what it measured so far; a second one hurries every stop under way
(SIGKILL now).
While an event loop runs (`run_interruptible`), the first signal cancels its main task instead,
and `Interrupted` is raised once the loop has closed: raised from a signal handler, it would land
in whichever task happened to run and be logged as that task's unretrieved exception.
`dualpath up` keeps its own handler (a stop there drains, as a pod's does).
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from dualpath.local.supervisor import hurry_all

T = TypeVar("T")

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


# the stop signals seen inside the innermost `interruptible()` block (None: outside one)
_seen: list[int] | None = None


@contextmanager
def interruptible() -> Iterator[None]:
    """Within the block, SIGINT and SIGTERM raise `Interrupted` once; later ones hurry the
    stops (`hurry_all`). Outside the main thread (where Python runs no handler) a no-op."""
    global _seen
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
    outer, _seen = _seen, seen
    try:
        yield
    finally:
        _seen = outer
        for sig, h in old.items():
            signal.signal(sig, h)


def run_interruptible(coro: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(coro)`; inside an `interruptible()` block a first stop signal cancels the
    coroutine (its tasks unwind by cancellation) and raises `Interrupted` after the loop has
    closed; a later one hurries the stops. Outside such a block, plain `asyncio.run`."""
    seen = _seen
    if seen is None or threading.current_thread() is not threading.main_thread():
        return asyncio.run(coro)

    async def main() -> T:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None

        def on_signal(signum: int) -> None:
            if seen:
                hurry_all()
                return
            seen.append(signum)
            task.cancel()

        handlers = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, on_signal, sig)
        try:
            return await coro
        finally:
            for sig, h in handlers.items():  # back to interruptible()'s handler, not SIG_DFL
                loop.remove_signal_handler(sig)
                signal.signal(sig, h)

    try:
        return asyncio.run(main())
    except asyncio.CancelledError:
        if seen:
            raise Interrupted(seen[0]) from None
        raise
