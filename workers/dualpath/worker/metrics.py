"""Prometheus metrics of the worker processes (prefill and decode roles)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

REQUESTS = Counter(
    "dualpath_worker_requests_total",
    "requests served, by role, read path (prefill, decode, none) and outcome",
    ["role", "path", "outcome"],
)
HIT_BYTES = Counter(
    "dualpath_worker_hit_bytes_total",
    "hit KV bytes loaded for prefills, by the path that read them from storage",
    ["path"],
)
FALLBACKS = Counter(
    "dualpath_worker_recompute_fallbacks_total",
    "requests whose hit KV could not be loaded and were recomputed from scratch",
    ["reason"],
)
PREFILL_SECONDS = Histogram(
    "dualpath_worker_prefill_seconds",
    "prefill duration on the prefill worker (admission to last layer written)",
    ["path"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
WRITES_IN_FLIGHT = Counter(
    "dualpath_worker_writes_in_flight_total",
    "failed prefills with a KV WRITE to the decode node that may still land (its handle not "
    "released): the decode node holds the request's regions for a transfer deadline",
)
TPOT_SECONDS = Histogram(
    "dualpath_worker_tpot_seconds",
    "time per output token of a finished turn on the decode worker (first token to last, "
    "over the tokens after the first)",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
PREFILL_BATCH_REQUESTS = Histogram(
    "dualpath_worker_prefill_batch_requests",
    "requests per prefill batch (workers.prefillBatchQuotaMs > 0)",
    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64),
)
PREFILL_BATCH_COMPUTE_SECONDS = Histogram(
    "dualpath_worker_prefill_batch_compute_seconds",
    "compute-thread time of one prefill batch (its spread is what the quota bounds)",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)
PREFILL_WAIT_SECONDS = Counter(
    "dualpath_worker_prefill_kv_wait_seconds_total",
    "seconds the prefill compute thread waited for hit KV layers to arrive",
    ["path"],
)
TOKENS = Counter(
    "dualpath_worker_tokens_total", "tokens processed, by kind (prefill, decode)", ["kind"]
)
INFO = Gauge(
    "dualpath_worker_info",
    "1 per worker process: its role and node id (join on the scrape target's labels to split "
    "a metric by role)",
    ["role", "node"],
)
LOAD = Gauge(
    "dualpath_worker_load",
    "the load a worker reports to the scheduler, by field",
    ["field"],
)
DRAINS = Counter(
    "dualpath_worker_drains_total",
    "drains on SIGTERM, by outcome (clean: nothing left in flight; timed_out: calls cut off "
    "at spec.workers.drainSeconds)",
    ["outcome"],
)
