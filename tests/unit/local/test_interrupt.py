"""A stop signal while an event loop runs (`run_interruptible`): the loop's tasks unwind by
cancellation and `Interrupted` is raised after the loop closes, never inside whichever task
happened to run (which logged a traceback as that task's unretrieved exception)."""

import asyncio
import gc
import logging
import os
import signal

import pytest
from dualpath.local.interrupt import Interrupted, interruptible, run_interruptible


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_in_the_loop_cancels_its_tasks_then_raises_interrupted(sig, caplog):
    cancelled: list[str] = []

    async def busy() -> None:
        async def kill_soon() -> None:
            await asyncio.sleep(0.05)
            os.kill(os.getpid(), sig)

        async def agent(name: str) -> None:
            try:
                while True:
                    await asyncio.sleep(0)
                    sum(range(200))
            except asyncio.CancelledError:
                cancelled.append(name)
                raise

        await asyncio.gather(*(agent(f"a{i}") for i in range(4)), kill_soon())

    with caplog.at_level(logging.ERROR, logger="asyncio"), interruptible():
        with pytest.raises(Interrupted) as stop:
            run_interruptible(busy())
        # the block's own handler is back (not SIG_DFL, which a loop's removal leaves)
        assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN)
        gc.collect()
    assert stop.value.signum == sig and stop.value.exit_code == 128 + sig
    assert sorted(cancelled) == ["a0", "a1", "a2", "a3"]
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]


def test_a_second_signal_hurries_instead_of_raising_again(monkeypatch):
    hurried: list[bool] = []
    monkeypatch.setattr("dualpath.local.interrupt.hurry_all", lambda: hurried.append(True))

    async def two_signals() -> None:
        os.kill(os.getpid(), signal.SIGINT)
        try:
            await asyncio.sleep(10)  # cancelled by the first signal
        finally:  # a cluster stopping on the way out gets the second one: it hurries
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.shield(asyncio.sleep(0.05))

    with interruptible():
        with pytest.raises(Interrupted) as stop:
            run_interruptible(two_signals())
    assert stop.value.signum == signal.SIGINT
    assert hurried == [True]


def test_outside_an_interruptible_block_it_is_plain_asyncio_run():
    async def answer() -> int:
        await asyncio.sleep(0)
        return 42

    assert run_interruptible(answer()) == 42


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_dualpath_faults_stops_its_rows_by_cancellation_on_a_stop_signal(
    sig, monkeypatch, tmp_path
):
    import argparse

    from dualpath.local import faults
    from dualpath.local.faults import runner

    stopped: list[str] = []

    async def rows_then_signal(rows, out, quick, deadline_s):
        try:
            os.kill(os.getpid(), sig)
            await asyncio.sleep(10)  # a row under way: cancelled by the signal
        finally:  # where run_rows stops its cluster
            stopped.append(",".join(rows))

    monkeypatch.setattr(runner, "run_rows", rows_then_signal)
    args = argparse.Namespace(
        rows="decode-kill", quick=False, json=True, out=str(tmp_path), deadline=30.0
    )

    def not_routed(signum, _frame):  # the command did not take the signal: fail, not die
        raise RuntimeError(f"{signal.Signals(signum).name} reached the test's own handler")

    before = {s: signal.signal(s, not_routed) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pytest.raises(Interrupted) as stop:  # `dualpath.cli.main` exits 128 + the signal
            faults.run(args)
        assert signal.getsignal(sig) is not_routed  # the command's own handlers are gone
    finally:
        for s, h in before.items():
            signal.signal(s, h)
    assert stop.value.signum == sig and stopped == ["decode-kill"]
