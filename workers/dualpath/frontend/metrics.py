"""The frontend's `dualpath_frontend_*` metrics, in the app's own registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram


class FrontendMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "dualpath_frontend_requests_total",
            "HTTP API requests",
            ["endpoint", "code"],
            registry=registry,
        )
        self.outcomes = Counter(
            "dualpath_frontend_request_outcomes_total",
            "HTTP API requests by final outcome: the finish reason (stop, length) or the "
            "error code (invalid_parameter, overloaded, unavailable, cancelled, ...)",
            ["endpoint", "outcome"],
            registry=registry,
        )
        self.tokens = Counter(
            "dualpath_frontend_tokens_total", "tokens by kind", ["kind"], registry=registry
        )
        self.turns = Counter(
            "dualpath_frontend_turns_total", "turns by read path", ["path"], registry=registry
        )
        self.ttft = Histogram(
            "dualpath_frontend_ttft_seconds",
            "time to first token",
            registry=registry,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        self.auth_refused = Counter(
            "dualpath_frontend_auth_refused_total",
            "requests refused by API-key checks, by reason (missing, invalid, rate_limited)",
            ["reason"],
            registry=registry,
        )
        self.latency = Histogram(
            "dualpath_frontend_request_seconds",
            "request latency",
            registry=registry,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )

    def count(self, endpoint: str, status: int, outcome: str) -> None:
        """A finished /v1 request: its status and its final outcome."""
        self.requests.labels(endpoint, str(status)).inc()
        self.outcomes.labels(endpoint, outcome).inc()
