"""The one fake clock of the test suite: a callable the code under test reads (`clock=`),
moved by hand (`clock.t += 1.5`) or by the code's own `sleep` (`clock.sleep(0.2)`).
Importable from every test (`pythonpath = ["tests"]` in pyproject.toml); `fake_clock` is
also a fixture (tests/conftest.py)."""

from __future__ import annotations

import threading


class FakeClock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t
        self._lock = threading.Lock()  # sleep() may be called from several threads

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        with self._lock:
            self.t += s
