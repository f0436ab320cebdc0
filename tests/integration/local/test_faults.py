"""`dualpath faults`, short: a few rows of the fault suite on a real local cluster (`dualpath
up` as a subprocess), with issue 19's bars: nothing lost, hung, wrong or empty, no 5xx from
bad input, the scheduler serving again within 10 s of its restart, a decode crash failing
only the streams on it, no 503 burst after client disconnects."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from dualpath.local.faults import QUICK_ROWS, RECOVER_BAR_S, run_rows, table

pytestmark = pytest.mark.slow


async def test_quick_fault_rows_hold_the_bars(tmp_path: Path) -> None:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    rows = await run_rows(list(QUICK_ROWS), tmp_path, quick=True, deadline_s=30.0)
    shown = table(rows)
    assert [r.fault for r in rows] == list(QUICK_ROWS), shown
    for r in rows:
        assert r.sent > 0, shown
        assert (r.lost, r.hung, r.wrong, r.empty, r.bad_input_5xx) == (0, 0, 0, 0, 0), shown
        assert not r.bars, shown
    by = {r.fault: r for r in rows}
    assert by["scheduler-kill"].recover_s <= RECOVER_BAR_S["scheduler-kill"], shown
    assert by["corrupt-blocks"].succeeded == by["corrupt-blocks"].sent, shown
    assert by["disconnects"].failed_clean == 0, shown  # no 503 burst after the cancels
    assert by["http-fuzz"].failed_clean > 0 and by["http-fuzz"].succeeded > 0, shown
