"""`spec.scheduler`: the policy by name and its thresholds, heartbeats and timeouts, the circuit
breaker, the in-flight cap and the route lease."""

from __future__ import annotations

from enum import Enum

from pydantic import Field, field_validator, model_validator

from dualpath.config.common import _Model, not_metrics_port


# The one list of policy names (the CRD's enum); the scheduler's registry
# (`scheduler.policy.POLICIES`) maps each to its class and fails to import if one is missing.
class PolicyName(str, Enum):
    DUALPATH = "dualpath"
    PREFILL_READ = "prefill-read"
    DECODE_READ = "decode-read"
    ROUND_ROBIN = "round-robin"


class SchedulerSpec(_Model):
    """The scheduler: picks a prefill and a decode node and the KV read path per request."""

    policy: PolicyName = PolicyName.DUALPATH
    """dualpath (read path chosen per request), prefill-read, decode-read or round-robin."""
    replicas: int = Field(default=1, ge=1, le=1)
    """Always 1: one active scheduler; its state rebuilds on restart."""
    short_read_queue_seconds: float = Field(default=3.0, gt=0)
    """alpha: a read queue is short while it holds less than this many seconds of reading."""
    overloaded_prefill_seconds: float = Field(default=5.0, gt=0)
    """beta: a prefill node is overloaded above this many seconds of queued prefill tokens."""
    heartbeat_interval_ms: int = Field(default=20, ge=1, le=10_000)
    """How often each worker reports its load."""
    node_timeout_ms: int = Field(default=2000, ge=10, le=600_000)
    """A worker silent this long leaves the pool (gets no requests); more than twice
    heartbeatIntervalMs. Silent five times this long, it is forgotten: dropped from the view
    until its process registers again."""
    breaker_failures: int = Field(default=3, ge=1, le=1000)
    """Failed requests in a row (client cancels never count) that open a node's circuit
    breaker: no requests are routed to it (never to the last available node of its role)."""
    max_in_flight_per_node: int = Field(default=0, ge=0, le=1_000_000)
    """Requests routed to one node and not completed yet, at most (0: no cap). A request that
    finds every node at the cap waits in the scheduler's queue and is then refused (HTTP 429
    with Retry-After): an overload burst is shed instead of queued past clients' deadlines."""
    breaker_open_seconds: float = Field(default=5.0, gt=0, le=3600)
    """How long an open breaker keeps its node out before one probe request may go there
    (half-open): a success closes it, a failure opens it for this long again."""
    port: int = Field(default=50051, ge=1, le=65535)
    """gRPC port of the scheduler (not the metrics port 9090)."""
    route_lease_seconds: float = Field(default=10.0, gt=0, le=3600)
    """A routed request that no worker claims (its Generate or Prefill never arrives: the
    client or frontend went away between Route and the call) is released after this long:
    counted, out of the in-flight count and of a draining worker's wait."""

    @model_validator(mode="after")
    def _timeouts(self) -> SchedulerSpec:
        if self.node_timeout_ms <= 2 * self.heartbeat_interval_ms:
            raise ValueError("nodeTimeoutMs must exceed twice heartbeatIntervalMs")
        return self

    @field_validator("port")
    @classmethod
    def _not_metrics(cls, port: int) -> int:
        return not_metrics_port("scheduler", port)
