"""A row of the fault suite: what its clients saw, the bars it missed, its evidence; the
table of rows, and a failed run's evidence kept."""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dualpath.local.faults.client import Result

log = logging.getLogger(__name__)


RECOVER_BAR_S = {"decode-kill": 5.0, "prefill-kill": 5.0, "scheduler-kill": 10.0}

MAX_EVIDENCE = 20  # bad answers kept per row
# Rows where a client must see no 503: a restarted worker is waited for or another taken (a
# scheduler down or an overload answers 503 with Retry-After, as it should)
NO_503_ROWS = frozenset({"decode-kill", "prefill-kill", "prefill-kills"})


@dataclass
class Row:
    fault: str
    sent: int = 0
    succeeded: int = 0
    failed_clean: int = 0
    unavailable: int = 0  # of failed_clean: answered 503
    lost: int = 0
    hung: int = 0
    wrong: int = 0
    empty: int = 0
    bad_input_5xx: int = 0
    recover_s: float | None = None
    note: str = ""
    bars: list[str] = field(default_factory=list)  # bars this row missed (empty: all held)
    first_bad: str = ""  # the first lost, hung or wrong answer's error, for the note
    # each lost, hung or wrong answer (the first MAX_EVIDENCE): kept with the run's logs
    evidence: list[dict[str, Any]] = field(default_factory=list)

    def add(self, results: list[Result], bad_input: bool = False) -> None:
        for r in results:
            bad_5xx = bad_input and r.status >= 500
            if r.kind in ("lost", "hung") or r.wrong or bad_5xx:
                kind = "wrong" if r.wrong else "5xx" if bad_5xx else r.kind
                if not self.first_bad:
                    self.first_bad = f"first {kind}: {r.error[:160]}"
                if len(self.evidence) < MAX_EVIDENCE:
                    self.evidence.append(
                        {"kind": kind, "error": r.error, "status": r.status, **(r.evidence or {})}
                    )
            self.sent += 1
            if r.kind == "ok":
                self.succeeded += 1
                self.empty += r.empty
                self.wrong += r.wrong
            elif r.kind == "failed":
                self.failed_clean += 1
                self.unavailable += r.status == 503
            elif r.kind == "lost":
                self.lost += 1
            elif r.kind == "hung":
                self.hung += 1
            if bad_input and r.status >= 500:
                self.bad_input_5xx += 1

    def judge(self) -> None:
        if self.first_bad:
            self.note = f"{self.note}; {self.first_bad}" if self.note else self.first_bad
        for name in ("lost", "hung", "wrong", "empty", "bad_input_5xx"):
            if getattr(self, name):
                self.bars.append(f"{name}={getattr(self, name)}")
        if self.fault in NO_503_ROWS and self.unavailable:
            self.bars.append(f"503={self.unavailable}")
        bar = RECOVER_BAR_S.get(self.fault)
        if bar is not None and (self.recover_s is None or self.recover_s > bar):
            self.bars.append(f"recover_s>{bar:g}")


def keep_evidence(out: Path, rows: list[Row]) -> Path:
    """A failed run's evidence, where the next run does not overwrite it:
    `out/failures/<UTC time>/` with the cluster log, the config, the run directory's
    `cluster.yaml` and `evidence.json` (each failed row's bars, note and bad answers)."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dest = out / "failures" / stamp
    dest.mkdir(parents=True, exist_ok=True)
    for src in (out / "cluster.log", out / "faults.yaml", out / "run" / "cluster.yaml"):
        if src.exists():
            shutil.copy2(src, dest / src.name)
    failed = [asdict(r) for r in rows if r.bars]
    (dest / "evidence.json").write_text(json.dumps(failed, indent=2))
    log.warning("a row failed: its evidence and the cluster log are kept in %s", dest)
    return dest


COLUMNS = (
    ("fault", "fault"),
    ("sent", "sent"),
    ("ok", "succeeded"),
    ("failed clean", "failed_clean"),
    ("503", "unavailable"),
    ("lost", "lost"),
    ("hung", "hung"),
    ("wrong", "wrong"),
    ("empty", "empty"),
    ("5xx bad input", "bad_input_5xx"),
    ("recover s", "recover_s"),
)


def table(rows: list[Row]) -> str:
    def cell(row: Row, key: str) -> str:
        v = getattr(row, key)
        if key == "recover_s":
            return "-" if v is None else f"{v:.1f}"
        return str(v)

    head = "| " + " | ".join(h for h, _ in COLUMNS) + " | bars | note |"
    sep = "|" + "---|" * (len(COLUMNS) + 2)
    lines = [head, sep]
    for r in rows:
        bars = "ok" if not r.bars else "MISSED " + ", ".join(r.bars)
        lines.append("| " + " | ".join(cell(r, k) for _, k in COLUMNS) + f" | {bars} | {r.note} |")
    return "\n".join(lines)
