"""Logging set-up shared by every process: one line per meaningful event."""

from __future__ import annotations

import logging
import os
import sys


def setup_logging(level: str = "INFO", component: str | None = None) -> None:
    name = component or os.environ.get("DUALPATH_COMPONENT", "dualpath")
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s %(levelname).1s {name} %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )


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
