"""`spec.frontend`: the OpenAI-compatible HTTP frontend's pods, port and request bounds, and its
API keys with their rate limits."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from dualpath.config.common import _Model, not_metrics_port


class FrontendAuthSpec(_Model):
    """API keys of the frontend: `Authorization: Bearer <key>` on every /v1 call."""

    secret_name: str | None = Field(default=None, min_length=1, max_length=253)
    """Secret (in the cluster's namespace) holding the API keys: each data entry a key, or
    several keys one per line; mounted into the frontend pods, rotated without a restart.
    Unset: the API is open (to whom the NetworkPolicy lets in)."""
    requests_per_second: float = Field(default=0.0, ge=0.0)
    """Per-key rate limit (a token bucket; over it: 429 with Retry-After); 0: unlimited."""
    burst: int = Field(default=0, ge=0, le=100_000)
    """Requests a key may make at once above the rate; 0: one second's worth (at least 1)."""
    isolate_tenants: bool = True
    """With API keys: each key's tenant (its Secret data entry) gets its own KV cache (a salt
    seeds its block ids), so tenants never share or probe each other's cached prefixes; a
    prefix common to several tenants (a shared system prompt) is stored once per tenant.
    false: one shared cache for every key (a single-tenant cluster). No effect without keys;
    a request's `cache_salt` partitions the cache further either way."""


class FrontendSpec(_Model):
    """The OpenAI-compatible HTTP frontend."""

    replicas: int = Field(default=1, ge=0, le=256)
    """Frontend pods; 0: none."""
    service_type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    """Type of the frontend Service."""
    port: int = Field(default=8000, ge=1, le=65535)
    """HTTP port (not the metrics port 9090)."""
    max_request_bytes: int = Field(default=4 << 20, ge=1024)
    """Largest request body accepted."""
    max_context_tokens: int = Field(default=65536, ge=16)
    """Longest prompt plus completion accepted."""
    max_new_tokens: int = Field(default=1024, ge=1)
    """Longest completion; at most maxContextTokens."""
    auth: FrontendAuthSpec = FrontendAuthSpec()
    """API keys and per-key rate limits; unset secretName: no keys required."""
    header_timeout_seconds: int = Field(default=10, ge=1, le=3600)
    """Time a client has to send a request's whole header (from its first byte): slower is
    answered 408 and closed (a client cannot hold the front open with a slow header)."""
    body_timeout_seconds: int = Field(default=60, ge=1, le=3600)
    """Time a client has to send a request's whole body once its header is in: slower is
    closed."""
    max_connections: int = Field(default=4096, ge=1, le=1_000_000)
    """Open HTTP connections per frontend process; one more is answered 503 and closed."""

    @field_validator("port")
    @classmethod
    def _not_metrics(cls, port: int) -> int:
        return not_metrics_port("frontend", port)

    @model_validator(mode="after")
    def _new_tokens_fit(self) -> FrontendSpec:
        if self.max_new_tokens > self.max_context_tokens:
            raise ValueError("frontend.maxNewTokens must be at most frontend.maxContextTokens")
        return self
