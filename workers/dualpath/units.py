"""Units every process shares. Network speeds are gigabits per second (`_gbps`, a "400 Gbps
SNIC"); the queues, token buckets and the policy count bytes per second."""

from __future__ import annotations


def gbps_to_bytes_per_s(gbps: float) -> float:
    """Gigabits per second -> bytes per second."""
    return gbps * 1e9 / 8
