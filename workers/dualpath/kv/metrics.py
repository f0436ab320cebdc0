"""Prometheus metrics of the KV block store and its read queues (one definition per process)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

READ_BYTES = Counter(
    "dualpath_kv_read_bytes_total", "KV payload bytes read from storage", ["backend"]
)
WRITE_BYTES = Counter("dualpath_kv_write_bytes_total", "KV block bytes written to storage")
BLOCKS_WRITTEN = Counter("dualpath_kv_blocks_written_total", "KV blocks written")
MISSES = Counter(
    "dualpath_kv_misses_total",
    "hit blocks that could not be used, by reason (missing, truncated, bad_header, "
    "foreign_model, checksum, read_only, permission, no_space, short_read, io_error, timeout); "
    "each ends a hit there and the rest is recomputed, never bad data",
    ["reason"],
)
WRITE_FAILURES = Counter(
    "dualpath_kv_write_failures_total",
    "store writes that failed, by op (block: a block file; touch: a recency update; evict: a "
    "removal) and reason (read_only, permission, no_space, missing, io_error, timeout); the "
    "store goes without, the answer does not",
    ["op", "reason"],
)
LOOKUP_BLOCKS = Counter("dualpath_kv_lookup_blocks_total", "block ids asked about in lookups")
LOOKUP_HITS = Counter("dualpath_kv_lookup_hit_blocks_total", "block ids found by lookups")
EVICTIONS = Counter("dualpath_kv_evictions_total", "blocks evicted (LRU) or dropped as bad")
USED_BYTES = Gauge("dualpath_kv_store_used_bytes", "bytes of blocks this store process indexes")
BACKEND_FALLBACKS = Counter(
    "dualpath_kv_backend_fallback_total",
    "times backend 'auto' could not start NIXL and used preadv instead",
    ["reason"],
)
QUEUE_PENDING = Gauge(
    "dualpath_kv_read_queue_pending_bytes",
    "bytes submitted to a read queue, not yet read",
    ["queue"],
)
QUEUE_INFLIGHT = Gauge(
    "dualpath_kv_read_queue_inflight", "read jobs running in a read queue", ["queue"]
)
QUEUE_CAPACITY = Gauge(
    "dualpath_kv_read_queue_capacity_bytes_per_second",
    "the SNIC bandwidth a read queue is capped at (storage.snicGbps); 0: uncapped",
    ["queue"],
)
QUEUE_THROTTLE = Counter(
    "dualpath_kv_read_queue_throttle_seconds_total",
    "seconds read jobs waited on the SNIC token bucket",
    ["queue"],
)
READ_SECONDS = Histogram(
    "dualpath_kv_read_seconds",
    "duration of one batched range read (one layer of many blocks)",
    ["backend"],
    buckets=(1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1, 5),
)
