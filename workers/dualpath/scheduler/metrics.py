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
INDEX_BLOCKS = Gauge("dualpath_scheduler_index_blocks", "Block keys in the block index")
INDEX_HOLES = Gauge(
    "dualpath_scheduler_index_holes", "Absent blocks with present descendants (a hit ends there)"
)
INDEX_READY = Gauge(
    "dualpath_scheduler_index_ready", "1 when the block index answers hits (0: being rebuilt)"
)
INDEX_EVENTS = Counter(
    "dualpath_scheduler_index_events_total", "KV events applied to the block index", ["op"]
)
INDEX_GAPS = Counter(
    "dualpath_scheduler_index_gaps_total", "KV event batches that showed a lost batch before them"
)
INDEX_REBUILDS = Counter(
    "dualpath_scheduler_index_snapshot_rebuilds_total", "Store scans installed into the index"
)
INDEX_LOOKUPS = Counter(
    "dualpath_scheduler_index_lookups_total",
    "Hit lookups by outcome (hit, miss, unready: answered 0 while rebuilding)",
    ["outcome"],
)
INDEX_HIT_BLOCKS = Counter(
    "dualpath_scheduler_index_hit_blocks_total", "Blocks found by hit lookups"
)
COMPLETIONS = Counter(
    "dualpath_scheduler_completions_total",
    "Completed requests by outcome (failed ones count against their nodes' breakers)",
    ["outcome"],
)
BREAKER_OPENS = Counter(
    "dualpath_scheduler_breaker_opens_total",
    "Node circuit breakers opened by consecutive failed requests",
)
BREAKERS_OPEN = Gauge(
    "dualpath_scheduler_breakers_open", "Nodes whose circuit breaker is open or half-open"
)
REGISTRATIONS_REFUSED = Counter(
    "dualpath_scheduler_registrations_refused_total",
    "Registrations refused: the node id is alive under another incarnation",
)
NODES_FORGOTTEN = Counter(
    "dualpath_scheduler_nodes_forgotten_total",
    "Nodes dropped from the view after staying silent (ghosts of processes gone for good)",
)
HEARTBEATS_REFUSED = Counter(
    "dualpath_scheduler_heartbeats_refused_total",
    "Heartbeat streams ended with INVALID_ARGUMENT (a load field out of range)",
)
ROUTES_RELEASED = Counter(
    "dualpath_scheduler_routes_released_total",
    "Routed requests released because no worker claimed them within spec.scheduler."
    "routeLeaseSeconds (their call never reached a worker)",
)
