"""Logging set-up shared by every process: one line per meaningful event; and what a process
says it is (`name_process`: its title in ps and pgrep, and its log prefix)."""

from __future__ import annotations

import ctypes
import logging
import os
import sys

PR_SET_NAME = 15  # prctl(2): the thread's 15-byte name (what ps -o comm shows)


def _format(name: str) -> str:
    return f"%(asctime)s %(levelname).1s {name} %(name)s: %(message)s"


def setup_logging(level: str = "INFO", component: str | None = None) -> None:
    name = component or os.environ.get("DUALPATH_COMPONENT", "dualpath")
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=_format(name),
        stream=sys.stderr,
        force=True,
    )


def name_process(name: str) -> str:
    """Say what this process is: its title becomes `dualpath <name>` (ps, top, pgrep -f: a
    worker restarted by `dualpath up` is forked from the zygote, whose command line would
    otherwise read `python -m dualpath.local.zygote N` for every role) and its log lines carry
    `name` (`decode:decode-1`, `scheduler`). Returns the title."""
    title = f"dualpath {name}"
    try:
        import setproctitle

        setproctitle.setproctitle(title)
    except ImportError:  # the thread name at least (15 bytes): ps -o comm, pgrep without -f
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_NAME, ctypes.c_char_p(title.encode()[:15]), 0, 0, 0)
    for handler in logging.getLogger().handlers:
        handler.setFormatter(logging.Formatter(_format(name)))
    return title


def quiet_nixl_logs() -> None:
    """NIXL logs INFO lines to stdout, which would corrupt `--json` output: send them through
    our (stderr) logging at WARNING unless NIXL_LOG_LEVEL asks for more. Call it after
    importing nixl_cu12 (its import installs the stdout handler)."""
    nixl_log = logging.getLogger("nixl")
    for h in list(nixl_log.handlers):
        nixl_log.removeHandler(h)
    nixl_log.propagate = True
    if not os.environ.get("NIXL_LOG_LEVEL"):
        nixl_log.setLevel(logging.WARNING)


CLIP_CHARS = 64  # of a caller's value echoed in a refusal or a log line


def clip(value: object, limit: int = CLIP_CHARS) -> str:
    """A caller's value as a refusal or a log line may echo it: its repr cut to `limit`
    characters with its size stated (`'decode-0xxxx'... (3900000 characters)`), so what a
    caller sends never sizes what is logged or sent back."""
    text = repr(value)
    if len(text) <= limit:
        return text
    size = len(value) if isinstance(value, str | bytes) else len(text)
    unit = "bytes" if isinstance(value, bytes) else "characters"
    return f"{text[:limit]}... ({size} {unit})"
