"""Storage errors: one bounded reason per error, and a log that does not repeat per request."""

import errno
import logging

import pytest
from dualpath.kv.errors import READ_REASONS, WRITE_REASONS, LogLimiter, ShortReadError, error_reason


@pytest.mark.parametrize(
    ("err", "reason"),
    [
        (OSError(errno.EROFS, "ro"), "read_only"),
        (PermissionError(errno.EACCES, "denied"), "permission"),
        (OSError(errno.EPERM, "not permitted"), "permission"),
        (OSError(errno.ENOSPC, "full"), "no_space"),
        (OSError(errno.EDQUOT, "quota"), "no_space"),
        (FileNotFoundError(errno.ENOENT, "gone"), "missing"),
        (OSError(errno.EIO, "eio"), "io_error"),
        (OSError("no errno at all"), "io_error"),
        (ShortReadError("short"), "short_read"),
        (TimeoutError("layer 3 not read within 1s"), "timeout"),
        (RuntimeError("a bug"), "io_error"),
    ],
)
def test_error_reason_is_one_bounded_label(err, reason):
    assert error_reason(err) == reason
    assert reason in READ_REASONS
    assert reason in WRITE_REASONS or reason in ("short_read",)


def test_short_read_is_an_eio_oserror():
    err = ShortReadError("short read at offset 4096")
    assert isinstance(err, OSError) and err.errno == errno.EIO


def test_log_limiter_says_each_key_once_per_interval_with_the_count_left_out(caplog):
    now = [0.0]
    limiter = LogLimiter(logging.getLogger("test.limiter"), interval_s=10, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="test.limiter"):
        assert limiter.warning("touch:read_only", "touch failed: %s", "a")
        assert not limiter.warning("touch:read_only", "touch failed: %s", "b")
        assert not limiter.warning("touch:read_only", "touch failed: %s", "c")
        assert limiter.warning("miss:io_error", "miss: %s", "x")  # another key: its own budget
        now[0] = 10.5
        assert limiter.warning("touch:read_only", "touch failed: %s", "d")
        now[0] = 30.0
        assert limiter.warning("touch:read_only", "touch failed: %s", "e")
    assert [r.getMessage() for r in caplog.records] == [
        "touch failed: a",
        "miss: x",
        "touch failed: d (2 more like it since the last report)",
        "touch failed: e",
    ]
