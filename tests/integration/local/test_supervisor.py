"""The supervisor: health-gated start, prefixed logs, and no process left after stop."""

from __future__ import annotations

import io
import os
import re
import socket
import sys
import time
from pathlib import Path

import pytest
from dualpath.local.supervisor import ProcSpec, StartError, Supervisor, free_port

SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a): pass
print("serving", flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""

# Ignores SIGTERM and has a grandchild in its group: only SIGKILL of the group ends both.
STUBBORN = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print("grandchild", child.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _wait_for(pred, timeout_s: float = 10.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.05)
    return False


def test_start_health_logs_and_clean_stop() -> None:
    sink = io.StringIO()
    port = free_port()
    sup = Supervisor(grace_s=0.5, sink=sink)
    with sup:
        sup.start(
            [
                ProcSpec(
                    "web",
                    [sys.executable, "-c", SERVER, str(port)],
                    health_url=f"http://127.0.0.1:{port}/health",
                    ready_timeout_s=20,
                )
            ]
        )
        sup.spawn(ProcSpec("stubborn", [sys.executable, "-c", STUBBORN]))
        assert _wait_for(lambda: "grandchild" in sink.getvalue())
        gpid = int(sink.getvalue().split("grandchild")[1].split()[0])
        pids = [c.proc.pid for c in sup.children] + [gpid]
        assert all(_alive(p) for p in pids)
    assert "[web]" in sink.getvalue() and "serving" in sink.getvalue()
    assert _wait_for(lambda: not any(_alive(p) for p in pids), 5)


def test_child_that_dies_before_ready_is_reported() -> None:
    sup = Supervisor(grace_s=0.5, sink=io.StringIO())
    with sup, pytest.raises(StartError, match="exited with code 3"):
        sup.start(
            [
                ProcSpec(
                    "bad",
                    [sys.executable, "-c", "raise SystemExit(3)"],
                    health_url=f"http://127.0.0.1:{free_port()}/",
                    ready_timeout_s=20,
                )
            ]
        )


def test_free_ports_are_distinct_bindable_and_outside_the_ephemeral_range():
    from dualpath.local.supervisor import _ephemeral_range

    lo, hi = _ephemeral_range()
    ports = [free_port() for _ in range(40)]
    assert len(set(ports)) == len(ports)
    assert not any(lo <= p <= hi for p in ports)  # no outgoing connection can take them
    for p in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


# On SIGTERM: note the time, take `delay` seconds to finish, note the time again, exit.
GRACEFUL = """
import signal, sys, time
out, delay = sys.argv[1], float(sys.argv[2])
def term(*_):
    with open(out, "a") as f:
        f.write(f"term {time.time()}\\n")
    time.sleep(delay)
    with open(out, "a") as f:
        f.write(f"exit {time.time()}\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, term)
print("up", flush=True)
time.sleep(600)
"""


def test_stop_goes_wave_by_wave(tmp_path) -> None:
    sink = io.StringIO()
    sup = Supervisor(grace_s=10, sink=sink)
    logs = {name: tmp_path / name for name in ("scheduler", "worker", "frontend")}
    with sup:
        for name, wave in (("scheduler", 0), ("worker", 1), ("frontend", 2)):
            argv = [sys.executable, "-c", GRACEFUL, str(logs[name]), "0.3"]
            sup.spawn(ProcSpec(name, argv, stop_wave=wave))
        assert _wait_for(lambda: sink.getvalue().count("up") == 3)

    def times(name):
        return {
            k: float(v)
            for k, v in (line.split() for line in logs[name].read_text().split("\n") if line)
        }

    fe, wk, sc = times("frontend"), times("worker"), times("scheduler")
    assert fe["exit"] <= wk["term"] and wk["exit"] <= sc["term"]  # each wave gone first


def test_each_wave_has_its_own_grace(tmp_path) -> None:
    """A frontend that uses (or overruns) its whole grace leaves the workers theirs to drain."""
    sink = io.StringIO()
    sup = Supervisor(grace_s=1.5, sink=sink)
    logs = {name: tmp_path / name for name in ("worker", "frontend", "stuck")}
    with sup:
        for name, wave, delay, grace in (
            ("worker", 1, 1.0, None),  # within the supervisor's grace, from its own SIGTERM
            ("stuck", 2, 30.0, 0.5),  # overruns its own grace: killed, the next wave unharmed
            ("frontend", 2, 1.2, None),
        ):
            argv = [sys.executable, "-c", GRACEFUL, str(logs[name]), str(delay)]
            sup.spawn(ProcSpec(name, argv, stop_wave=wave, grace_s=grace))
        assert _wait_for(lambda: sink.getvalue().count("up") == 3)
        t0 = time.monotonic()
    took = time.monotonic() - t0
    assert "exit" in logs["frontend"].read_text()
    assert "exit" in logs["worker"].read_text()  # drained, not SIGKILLed at a shared deadline
    assert "exit" not in logs["stuck"].read_text()
    assert took < 1.5 + 1.5 + 2  # two waves, each within its own grace


# Exits with code 3 on its first run (no marker file yet), then serves.
CRASH_ONCE = """
import os, sys, time
marker = sys.argv[1]
if not os.path.exists(marker):
    open(marker, "w").close()
    print("crashing", flush=True)
    raise SystemExit(3)
print("serving again", flush=True)
time.sleep(600)
"""


def test_a_crashed_child_is_restarted_with_backoff_and_the_rest_serve_on(tmp_path) -> None:
    from dualpath.local.supervisor import RestartPolicy

    sink = io.StringIO()
    sup = Supervisor(grace_s=1, sink=sink, restart=RestartPolicy(base_s=0.3))
    with sup:
        steady = sup.spawn(
            ProcSpec("steady", [sys.executable, "-c", "import time; time.sleep(600)"])
        )
        flaky = sup.spawn(
            ProcSpec("flaky", [sys.executable, "-c", CRASH_ONCE, str(tmp_path / "m")])
        )
        assert _wait_for(lambda: flaky.poll() == 3)
        t0 = time.monotonic()
        assert sup.heal() == []  # scheduled, not yet due
        assert sup.children[1].proc is flaky
        assert _wait_for(lambda: sup.heal() == [] and sup.restarts.get("flaky") == 1)
        assert time.monotonic() - t0 >= 0.3  # after its backoff
        assert _wait_for(lambda: "serving again" in sink.getvalue())
        assert sup.children[1].proc.poll() is None and sup.children[0].proc is steady
        assert steady.poll() is None  # never touched
        assert "steady" not in sup.restarts


def test_a_child_that_keeps_crashing_is_given_up_after_bounded_restarts() -> None:
    from dualpath.local.supervisor import RestartPolicy

    policy = RestartPolicy(max_restarts=2, base_s=0.05)
    assert [policy.delay_s(n) for n in (1, 2, 3)] == [0.05, 0.1, 0.2]
    assert RestartPolicy(base_s=1, max_s=4).delay_s(10) == 4
    sup = Supervisor(grace_s=1, sink=io.StringIO(), restart=policy)
    with sup:
        sup.spawn(ProcSpec("doomed", [sys.executable, "-c", "raise SystemExit(7)"]))
        gave_up: list = []
        assert _wait_for(lambda: bool(gave_up.extend(sup.heal()) or gave_up), 20)
        assert gave_up == [("doomed", 7)] and sup.restarts["doomed"] == 2


def test_a_restart_forks_from_the_zygote_with_its_imports_done_and_stops_clean() -> None:
    """A crashed `dualpath.cli` process is restarted as a fork of the warm zygote (no import
    time), serves again, is signalled and reaped like a child, and stop() leaves nothing."""
    from dualpath.local.supervisor import RestartPolicy
    from dualpath.local.zygote import Zygote, ZygoteProc

    port, metrics = free_port(), free_port()
    argv = [sys.executable, "-m", "dualpath.cli", "--log-level=INFO", "scheduler"]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--metrics-port", str(metrics)]
    spec = ProcSpec(
        "scheduler",
        argv,
        health_url=f"http://127.0.0.1:{metrics}/readyz",
        ready_timeout_s=120,
        fork_restart=True,
    )
    sink = io.StringIO()
    sup = Supervisor(grace_s=5, sink=sink, restart=RestartPolicy(base_s=0.05))
    with sup:
        sup.start([spec])
        sup.zygote = zygote = Zygote()
        assert zygote.ready(180), "zygote did not finish its imports"
        first = sup.children[0].proc
        os.killpg(first.pid, 9)
        assert _wait_for(lambda: not sup.heal() and sup.restarts.get("scheduler") == 1, 20)
        forked = sup.children[0].proc
        assert isinstance(forked, ZygoteProc) and forked.pid != first.pid
        t0 = time.monotonic()
        sup.wait_ready(["scheduler"])
        took = time.monotonic() - t0
        assert took < 30, took  # no import: the fork only starts the server
        relayed = sink.getvalue().split("scheduler serving")[-1]
        assert "ready scheduler" in relayed  # relayed lower-case: the one READY is the command's
        assert not re.search(r"^\[scheduler\]\s+READY", relayed, re.M)
        # the fork says what it is (its command line was the zygote's)
        assert _cmdline(forked.pid).startswith("dualpath scheduler"), _cmdline(forked.pid)
        assert "dualpath.local.zygote" in _cmdline(zygote.proc.pid)
        os.kill(forked.pid, 9)  # its exit is reported through the zygote
        assert _wait_for(lambda: forked.poll() == -9, 10)
        assert not sup.heal()
        assert _wait_for(lambda: not sup.heal() and sup.restarts.get("scheduler") == 2, 20)
        again = sup.children[0].proc
        sup.wait_ready(["scheduler"])
        pids = [again.pid, zygote.proc.pid]
    assert again.poll() is not None  # stopped by SIGTERM through the zygote's report
    assert _wait_for(lambda: not any(_alive(p) for p in pids), 10)


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
