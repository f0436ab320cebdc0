"""Prometheus metrics of the scheduler (`dualpath_scheduler_*`)."""

from prometheus_client import Counter, Gauge, Histogram

DECISIONS = Counter("dualpath_scheduler_decisions_total", "Routing decisions", ["policy", "path"])
WAITS = Counter(
    "dualpath_scheduler_route_waits_total",
    "Route calls that found no eligible node at first and waited",
)
REFUSED = Counter(
    "dualpath_scheduler_route_refused_total", "Route calls refused after their queue timeout"
)
UNPAIRED = Counter(
    "dualpath_scheduler_route_unpaired_total",
    "Route calls refused because no available prefill and decode node share a config hash",
)
DECISION_LATENCY = Histogram(
    "dualpath_scheduler_decision_seconds",
    "Policy decision latency (in process)",
    buckets=(5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 5e-3),
)
NODE_READ_PENDING = Gauge(
    "dualpath_scheduler_node_read_pending_bytes", "Read-queue pending bytes per node", ["node"]
)
NODE_TOKENS = Gauge("dualpath_scheduler_node_tokens", "Tokens queued+running per node", ["node"])
NODE_HEALTHY = Gauge("dualpath_scheduler_node_healthy", "1 if the node is in the pool", ["node"])
IN_FLIGHT = Gauge("dualpath_scheduler_in_flight_requests", "Routed, not yet completed")
