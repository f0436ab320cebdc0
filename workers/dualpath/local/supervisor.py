"""A small process supervisor: each child in its own process group, health-checked start,
log lines forwarded with a `[name]` prefix, restarts of a crashed child with exponential
backoff (as a kubelet restarts a container; `heal()`), and a clean stop (SIGTERM to the group,
SIGKILL after each wave's grace) that leaves no process behind.

However the supervisor's process ends, its children end with it: a stop interrupted by a signal
finishes (SIGKILL at once) before the signal's exception goes on; `hurry_all()` (a second Ctrl-C)
turns every running stop's grace into SIGKILL now; and a child started from the main thread is
tied to this process's life (`dualpath.lifeline`: SIGTERM when it dies, even by SIGKILL).
"""

from __future__ import annotations

import logging
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from dualpath.lifeline import PARENT_PID_ENV

log = logging.getLogger(__name__)


class StartError(RuntimeError):
    pass


_handed_out: set[int] = set()
_ports_lock = threading.Lock()


def free_port() -> int:
    """A loopback port free now, for a child to listen on later.

    Drawn below the kernel's ephemeral range (bind-tested), because a port from that range
    can be taken between now and the child's bind by any outgoing connection (gRPC clients,
    UCX) of the processes started meanwhile; and never one this process handed out before,
    since bind(0) may return a just-closed port twice. Falls back to bind(0)."""
    lo, _ = _ephemeral_range()
    start = max(1024, lo - 12000)
    rng = random.Random()
    for _ in range(200 if start < lo else 0):
        port = rng.randrange(start, lo)
        if port not in _handed_out and _bindable(port):
            with _ports_lock:
                if port not in _handed_out:
                    _handed_out.add(port)
                    return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


@dataclass(slots=True)
class ProcSpec:
    name: str
    argv: list[str]
    health_url: str | None = None  # GET must answer 200 when the process is ready
    env: dict[str, str] = field(default_factory=dict)
    ready_timeout_s: float = 60.0
    # stop order: higher waves get SIGTERM first and are waited for before the next wave
    # (the frontend, then the workers, which tell the scheduler they drain, then the scheduler)
    stop_wave: int = 0
    # SIGTERM to SIGKILL for this process, counted from its own wave's SIGTERM (None: the
    # supervisor's grace); a slow wave never eats the grace of the next one
    grace_s: float | None = None
    # a restart is forked from the supervisor's zygote (its imports done) when it has one;
    # only for `python -m dualpath.cli ...` commands
    fork_restart: bool = False


@dataclass
class _Child:
    spec: ProcSpec
    proc: subprocess.Popen
    pump: threading.Thread
    started_s: float = 0.0  # monotonic time of the current process's start
    crashes: int = 0  # exits in a row without a stable run between them
    restart_at_s: float | None = None  # a restart is due at this monotonic time


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """Restart a crashed child after `base_s * 2**n` (at most `max_s`) for its n-th crash in a
    row, up to `max_restarts` in a row; a run of `stable_s` or more resets the count."""

    max_restarts: int = 5
    base_s: float = 0.5
    max_s: float = 30.0
    stable_s: float = 60.0

    def delay_s(self, crashes: int) -> float:
        return min(self.base_s * 2 ** max(0, crashes - 1), self.max_s)


def _http_ok(url: str, timeout_s: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:  # noqa: S310 (local URL)
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


_supervisors: weakref.WeakSet[Supervisor] = weakref.WeakSet()


def hurry_all() -> None:
    """Every supervisor of this process stops without grace: SIGKILL what is left now (safe
    from a signal handler: it only sets events)."""
    for sup in list(_supervisors):
        sup.hurry.set()


def process_tree(root: int) -> list[int]:
    """The live descendants of `root` (children, their children, ...), from /proc."""
    parent_of: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if stat[0] != "Z":  # a zombie has ended: only its exit status is left
            parent_of[int(d.name)] = int(stat[1])
    tree, todo = [], [root]
    while todo:
        parent = todo.pop()
        kids = [pid for pid, ppid in parent_of.items() if ppid == parent]
        tree += kids
        todo += kids
    return tree


CHILD_READY = "READY "
RELAYED_READY = "ready "


class Supervisor:
    """Owns its children: `stop()` (or leaving the `with` block) ends every one of them."""

    def __init__(
        self,
        grace_s: float = 5.0,
        sink: IO[str] | None = None,
        prefix_width: int = 10,
        restart: RestartPolicy | None = None,
    ) -> None:
        self.grace_s = grace_s
        self.restart = restart or RestartPolicy()
        self.restarts: dict[str, int] = {}  # restarts done, per child name
        self.sink = sink or sys.stderr
        self.prefix_width = prefix_width
        self.children: list[_Child] = []
        self._lock = threading.Lock()
        self._stopping = False
        self.abort = threading.Event()  # set (e.g. from a signal handler) to abandon a start
        self.hurry = threading.Event()  # set (hurry_all): a stop SIGKILLs without grace
        self.zygote = None  # a dualpath.local.zygote.Zygote: restarts fork from it
        _supervisors.add(self)

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _pump(self, name: str, stream: IO[bytes]) -> None:
        tag = f"[{name}]".ljust(self.prefix_width + 2)
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\n")
            # a child's READY handshake is relayed as `ready`: the one READY line of the output
            # is the supervising command's own (`READY up ...`), which scripts wait for
            if line.startswith(CHILD_READY):
                line = RELAYED_READY + line[len(CHILD_READY) :]
            with self._lock:
                try:
                    self.sink.write(f"{tag} {line}\n")
                    self.sink.flush()
                except ValueError:  # sink closed during shutdown
                    pass
        stream.close()

    def spawn(self, spec: ProcSpec) -> subprocess.Popen:
        proc, pump = self._launch(spec)
        self.children.append(_Child(spec, proc, pump, time.monotonic()))
        return proc

    def _launch(
        self, spec: ProcSpec, restart: bool = False
    ) -> tuple[subprocess.Popen, threading.Thread]:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **spec.env}
        # the kernel ties a child's parent-death signal to the thread that forked it
        if threading.current_thread() is threading.main_thread():
            env[PARENT_PID_ENV] = str(os.getpid())
        else:
            env.pop(PARENT_PID_ENV, None)
        proc = None
        entry = spec.argv[1:3] == ["-m", "dualpath.cli"]
        if restart and spec.fork_restart and entry and self.zygote is not None:
            try:
                proc = self.zygote.fork(spec.argv[3:], env)
            except OSError as err:
                log.warning("%s: no fork from the zygote (%s): starting it afresh", spec.name, err)
        how = "forked from the zygote" if proc is not None else "started"
        if proc is None:
            proc = subprocess.Popen(
                spec.argv,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,  # own process group: signals reach its children
            )
        pump = threading.Thread(
            target=self._pump, args=(spec.name, proc.stdout), name=f"log-{spec.name}", daemon=True
        )
        pump.start()
        log.info("%s %s (pid %d)", how, spec.name, proc.pid)
        return proc, pump

    def heal(self) -> list[tuple[str, int]]:
        """Restart children that exited, each after its backoff, the others serving on; call
        it periodically. Returns the children given up on (name, exit code): they crashed
        `restart.max_restarts` times in a row."""
        if self._stopping:
            return []
        now = time.monotonic()
        gave_up: list[tuple[str, int]] = []
        for c in self.children:
            rc = c.proc.poll()
            if rc is None:
                if c.crashes and now - c.started_s >= self.restart.stable_s:
                    c.crashes = 0  # a stable run: the next crash starts a new streak
                continue
            if c.restart_at_s is None:  # a new exit
                if now - c.started_s >= self.restart.stable_s:
                    c.crashes = 0
                c.crashes += 1
                if c.crashes > self.restart.max_restarts:
                    gave_up.append((c.spec.name, rc))
                    continue
                delay = self.restart.delay_s(c.crashes)
                c.restart_at_s = now + delay
                log.error(
                    "%s exited with code %d: restarting in %.1fs (%d of %d in a row)",
                    c.spec.name,
                    rc,
                    delay,
                    c.crashes,
                    self.restart.max_restarts,
                )
            elif now >= c.restart_at_s:
                _signal_group(c.proc, signal.SIGKILL)  # what it left in its group
                c.pump.join(timeout=1)
                c.proc, c.pump = self._launch(c.spec, restart=True)
                c.started_s, c.restart_at_s = now, None
                self.restarts[c.spec.name] = self.restarts.get(c.spec.name, 0) + 1
        return gave_up

    def wait_ready(self, names: list[str] | None = None) -> None:
        """Poll every named child's health URL until 200; raise if one exits or times out."""
        todo = [
            c
            for c in self.children
            if c.spec.health_url and (names is None or c.spec.name in names)
        ]
        deadline = {c.spec.name: time.monotonic() + c.spec.ready_timeout_s for c in todo}
        while todo:
            if self.abort.is_set():
                raise StartError("start aborted")
            for c in list(todo):
                rc = c.proc.poll()
                if rc is not None:
                    raise StartError(
                        f"{c.spec.name} exited with code {rc} before it was ready "
                        "(see its log lines above)"
                    )
                if _http_ok(c.spec.health_url or ""):
                    log.info("%s ready", c.spec.name)
                    todo.remove(c)
                elif time.monotonic() > deadline[c.spec.name]:
                    raise StartError(
                        f"{c.spec.name} not healthy at {c.spec.health_url} after "
                        f"{c.spec.ready_timeout_s:.0f}s"
                    )
            if todo:
                time.sleep(0.1)

    def start(self, specs: list[ProcSpec]) -> None:
        """Spawn in order, waiting for each one's health before the next (dependencies first)."""
        for spec in specs:
            self.spawn(spec)
            self.wait_ready([spec.name])

    def exited(self) -> list[tuple[str, int]]:
        return [
            (c.spec.name, c.proc.returncode) for c in self.children if c.proc.poll() is not None
        ]

    def stop(self, grace_s: float | None = None) -> None:
        """SIGTERM the groups wave by wave (highest `stop_wave` first, last started first
        within a wave), SIGKILL what is left of a wave after its own grace (each process's
        `grace_s`, counted from that wave's SIGTERM; at most `grace_s` when given), then the
        next wave. A signal's exception (KeyboardInterrupt) during the stop does not cut it
        short: the rest is SIGKILLed at once, then the exception goes on."""
        if self._stopping:
            return
        self._stopping = True
        pending: BaseException | None = None
        while True:
            try:
                self._stop_waves(grace_s)
                break
            except KeyboardInterrupt as stop:
                pending = stop
                self.hurry.set()  # the second pass kills what is left without waiting
        if pending is not None:
            raise pending

    def _stop_waves(self, grace_s: float | None) -> None:
        for wave in sorted({c.spec.stop_wave for c in self.children}, reverse=True):
            group = [c for c in reversed(self.children) if c.spec.stop_wave == wave]
            t0 = time.monotonic()
            for c in group:
                _signal_group(c.proc, signal.SIGKILL if self.hurry.is_set() else signal.SIGTERM)
            for c in group:
                grace = self.grace_s if c.spec.grace_s is None else c.spec.grace_s
                if grace_s is not None:
                    grace = min(grace, grace_s)
                if not self._wait(c.proc, t0 + grace):
                    log.warning(
                        "%s ignored SIGTERM for %.1fs: SIGKILL",
                        c.spec.name,
                        time.monotonic() - t0,
                    )
                    _signal_group(c.proc, signal.SIGKILL)
        for c in self.children:
            # The group may hold grandchildren even when the leader is gone.
            _signal_group(c.proc, signal.SIGKILL)
            try:
                c.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                log.error("%s (pid %d) survived SIGKILL", c.spec.name, c.proc.pid)
            c.pump.join(timeout=2)
        if self.zygote is not None:
            self.zygote.close()
        log.info("stopped %d processes", len(self.children))

    def _wait(self, proc: subprocess.Popen, until_s: float) -> bool:
        """Whether `proc` exited by monotonic `until_s`; False at once when hurried."""
        while proc.poll() is None:
            left = until_s - time.monotonic()
            if left <= 0 or self.hurry.is_set():
                return False
            time.sleep(min(0.05, left))
        return True


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # pgid == pid: start_new_session
    except (ProcessLookupError, PermissionError):
        pass
