"""Every way of stopping stops everything: SIGINT and SIGTERM to `dualpath up`, `dualpath demo`
and `dualpath bench local` (each a real process running a tiny cluster) end every process it
started, within the drain bound, and an interrupted benchmark prints what it measured so far.

A survivor is found however it was reparented: every process of the command's tree carries a
tag in its environment (the supervisor and the zygote pass the environment on), and /proc is
searched for it once the command has exited.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from dualpath.local.supervisor import process_tree
from tiny_configs import tiny_local, write_config

pytestmark = pytest.mark.slow

TAG = "DUALPATH_SIGNAL_TEST"
# the drain bound of the tiny config (spec.workers.drainSeconds + the stop margin), generous
STOP_BOUND_S = 150.0
CLUSTER = 5  # scheduler, 1 prefill, 2 decode, frontend


def _tagged(tag: str) -> list[int]:
    """Live processes whose environment holds TAG=tag (zombies have no environment)."""
    needle = f"{TAG}={tag}".encode()
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if needle in (d / "environ").read_bytes().split(b"\0"):
                    found.append(int(d.name))
            except OSError:
                continue
    return found


def _wait(cond, timeout_s: float, what: str, proc: subprocess.Popen, err: Path) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        if proc.poll() is not None:
            pytest.fail(f"{what}: exited {proc.returncode} first\n{err.read_text()[-3000:]}")
        if time.monotonic() > end:
            pytest.fail(f"{what}: not within {timeout_s:.0f}s\n{err.read_text()[-3000:]}")
        time.sleep(0.2)


def _progress(err: Path, phase: str) -> int:
    """Turns done in `phase`'s progress line so far (0: none yet)."""
    done = re.findall(rf"\] {re.escape(phase)}\s+\[#* *\] (\d+)/", err.read_text(errors="replace"))
    return int(done[-1]) if done else 0


COMMANDS = {
    # (argv after -f, exit code on SIGINT / SIGTERM (None: 128 + the signal), when to signal)
    "up": (["up", "--run-dir", "{out}/run", "--storage-dir", "{out}/kv"], 0, "ready"),
    "demo": (["demo", "--out", "{out}/demo"], None, "warm-up"),
    "bench": (
        ["bench", "local", "--out", "{out}/bench", "--kv-dir", "{out}/kv"]
        + ["--agents", "6", "--turns", "12", "--first-tokens", "96", "--snic-gbps", "0.02"],
        None,
        "measuring",
    ),
}


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_stop_signal_leaves_no_process(tmp_path: Path, command: str, sig: int) -> None:
    argv, code, when = COMMANDS[command]
    cfg = write_config(tiny_local(buffer_bytes=16 << 20), tmp_path / "c.yaml")
    tag = uuid.uuid4().hex
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    args = [a.format(out=tmp_path) for a in argv]
    pos = 2 if command == "bench" else 1  # -f goes after the (sub)command
    args[pos:pos] = ["-f", str(cfg)]
    with out.open("w") as so, err.open("w") as se:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dualpath.cli", *args],
            stdout=so,
            stderr=se,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, TAG: tag, "OMP_NUM_THREADS": "1"},
        )
    try:
        _wait(lambda: len(process_tree(proc.pid)) >= CLUSTER, 180, "cluster up", proc, err)
        if when == "ready":
            _wait(lambda: "READY up" in out.read_text(), 180, "READY", proc, err)
        elif when == "warm-up":
            _wait(lambda: _progress(err, "warm-up") > 0, 180, "warm-up", proc, err)
        else:  # past the warm-up turns of prefill-read's run: some turns measured
            _wait(lambda: _progress(err, "prefill-read") >= 12, 240, "measuring", proc, err)
        tree = process_tree(proc.pid)
        assert len(tree) >= CLUSTER
        t0 = time.monotonic()
        proc.send_signal(sig)
        rc = proc.wait(timeout=STOP_BOUND_S)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    time.sleep(0.5)  # a process killed just now is gone from /proc (its parent reaped it)
    left = _tagged(tag)
    assert left == [], f"{command} left {left} after {signal.Signals(sig).name} ({took:.1f}s)"
    assert rc == (128 + sig if code is None else code), err.read_text()[-3000:]
    if command == "bench" and sig == signal.SIGINT:  # what it measured so far, as a table
        text = out.read_text()
        assert "interrupted (SIGINT)" in text and "prefill-read" in text, text
    if command != "up":  # a stop is an outcome, not a crash; its scratch KV is gone
        assert "Traceback" not in err.read_text(), err.read_text()[-3000:]
        assert not (tmp_path / "kv").exists() and not (tmp_path / "demo" / "kv").exists()
