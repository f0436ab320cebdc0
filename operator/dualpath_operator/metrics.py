"""The operator's Prometheus metrics, served on `/metrics` by `dualpath operator`."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

# result: ok (applied; Ready or rolling out), apply_failed, invalid_spec, gone, error (retried)
RECONCILES = Counter(
    "dualpath_operator_reconciles_total", "DualPathCluster reconcile passes by result", ["result"]
)
RECONCILE_SECONDS = Histogram(
    "dualpath_operator_reconcile_duration_seconds",
    "Latency of one DualPathCluster reconcile by result",
    ["result"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
# reason: the API's reason (Invalid, BadRequest, InternalError, Conflict, ...) or the exception
API_ERRORS = Counter(
    "dualpath_operator_api_errors_total",
    "Kubernetes API errors met while reconciling, by reason and whether they are retried",
    ["reason", "retryable"],
)
CONFLICTS = Counter(
    "dualpath_operator_conflicts_total",
    "Writes refused by a resourceVersion precondition (409); the pass is redone from fresh reads",
)
SCALES = Counter(
    "dualpath_operator_scales_total",
    "Worker StatefulSet replica counts changed to their DualPathPool's count",
)
SCALES_REFUSED = Counter(
    "dualpath_operator_scales_refused_total",
    "Pool scales refused as unsafe (decode 0, prefill > 0)",
)
PRUNED = Counter(
    "dualpath_operator_pruned_total", "Children deleted as no longer desired, by kind", ["kind"]
)
