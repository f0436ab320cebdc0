"""Fixtures shared by every test."""

from __future__ import annotations

import pytest
from fake_clock import FakeClock


@pytest.fixture
def fake_clock() -> FakeClock:
    return FakeClock()
