"""Prometheus metrics of the KV transfer engine and the emulated compute link."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

BYTES = Counter(
    "dualpath_transfer_bytes_total", "bytes written to peers by NIXL WRITEs", ["traffic_class"]
)
FAILURES = Counter(
    "dualpath_transfer_failures_total", "NIXL transfers that failed or missed their deadline"
)
WRITE_SECONDS = Histogram(
    "dualpath_transfer_write_seconds",
    "duration of one NIXL WRITE (post to completion)",
    buckets=(1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1, 5),
)
BUFFER_BYTES = Gauge(
    "dualpath_transfer_buffer_bytes", "registered KV buffer bytes by state", ["state"]
)

# The emulated compute link (link.py); `link` is the node name, one per emulated node.
LINK_BYTES = Counter(
    "dualpath_transfer_link_bytes_total",
    "bytes granted on the emulated compute link",
    ["link", "traffic_class"],
)
LINK_WAIT = Counter(
    "dualpath_transfer_link_wait_seconds_total",
    "seconds acquires waited for their slot on the emulated compute link",
    ["link", "traffic_class"],
)
LINK_CAPACITY = Gauge(
    "dualpath_transfer_link_capacity_bytes_per_second",
    "rate of the emulated compute link (network.cnicGbps)",
    ["link"],
)
