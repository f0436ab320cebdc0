"""How the KV store names its I/O errors and tells about them.

Storage is a best-effort cache: a read that fails ends the hit at that block (the rest is
recomputed), a write that fails leaves the block out. Each failure gets one reason from a
bounded set (a Prometheus label), is counted, and is logged; a failure that can repeat on every
request (a read-only or full store) is logged the first time and then at most once per
interval, with how many were left out.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Callable


class ShortReadError(OSError):
    """A read returned fewer bytes than the file should hold (truncated under the reader)."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.EIO, message)


# every reason label a read miss or a write failure can carry
READ_REASONS = (
    "missing",
    "truncated",
    "bad_header",
    "foreign_model",
    "checksum",
    "read_only",
    "permission",
    "no_space",
    "short_read",
    "io_error",
    "timeout",
)
WRITE_REASONS = ("read_only", "permission", "no_space", "missing", "io_error", "timeout")

_ERRNO_REASONS = {
    errno.ENOENT: "missing",
    errno.EROFS: "read_only",
    errno.EACCES: "permission",
    errno.EPERM: "permission",
    errno.ENOSPC: "no_space",
    errno.EDQUOT: "no_space",
    errno.ETIMEDOUT: "timeout",
}


def error_reason(err: BaseException) -> str:
    """The bounded reason label of an I/O error (anything unknown is `io_error`)."""
    if isinstance(err, ShortReadError):
        return "short_read"
    if isinstance(err, OSError):
        return _ERRNO_REASONS.get(
            err.errno, "timeout" if isinstance(err, TimeoutError) else "io_error"
        )
    return "io_error"


class LogLimiter:
    """Warn once per key, then at most once per `interval_s` with the count left out."""

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[str, tuple[float, int]] = {}  # key -> (time logged, left out since)

    def warning(self, key: str, msg: str, *args: object) -> bool:
        """Log `msg % args` unless `key` was logged less than `interval_s` ago; True if logged."""
        now = self._clock()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last[0] < self.interval_s:
                self._last[key] = (last[0], last[1] + 1)
                return False
            left_out = last[1] if last is not None else 0
            self._last[key] = (now, 0)
        if left_out:
            msg += " (%d more like it since the last report)"
            args = (*args, left_out)
        self.logger.warning(msg, *args, stacklevel=2)  # the line that saw the error
        return True
