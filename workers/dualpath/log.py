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
