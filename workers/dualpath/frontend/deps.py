"""What every route depends on: the `Frontend` (the backend, the tokenizer, the sessions, the
metrics and the limits of `spec.frontend`, built once by `create_app` and kept on
`app.state.frontend`), injected as `FrontendDep`, and `authorize`, the API-key check of every
/v1 call."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request
from prometheus_client import CollectorRegistry

from dualpath.config import ClusterConfig, FrontendSpec
from dualpath.frontend.auth import ApiKeys, TokenBuckets
from dualpath.frontend.backend import Backend
from dualpath.frontend.errors import AuthError
from dualpath.frontend.metrics import FrontendMetrics
from dualpath.frontend.sessions import Sessions
from dualpath.frontend.tokenizer import ByteTokenizer, HfTokenizer, load_tokenizer


@dataclass
class Frontend:
    """One app's state. `api_keys`: the keys every /v1 call must present; None: open."""

    backend: Backend
    fe: FrontendSpec
    model_name: str
    vocab_size: int
    buffer_tokens: int  # the most prompt tokens a decode node's KV buffer holds
    tok: ByteTokenizer | HfTokenizer
    registry: CollectorRegistry
    metrics: FrontendMetrics
    api_keys: ApiKeys | None = None
    buckets: TokenBuckets | None = None
    isolate: bool = False  # salt each request's block ids with its key's tenant
    sessions: Sessions = field(default_factory=Sessions)
    started_at: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def build(
        cls,
        config: ClusterConfig,
        backend: Backend,
        registry: CollectorRegistry | None = None,
        api_keys: ApiKeys | None = None,
    ) -> Frontend:
        """Per-key rate limits and tenant isolation come from `spec.frontend.auth`."""
        spec = config.spec
        auth = spec.frontend.auth
        tok = load_tokenizer(spec.model)
        registry = registry or CollectorRegistry()
        metrics = FrontendMetrics(registry)
        for collector in backend.collectors:  # the backend's own (retries, ...)
            registry.register(collector)
        return cls(
            backend=backend,
            fe=spec.frontend,
            model_name=spec.model.name,
            vocab_size=spec.model.vocab_size,
            buffer_tokens=spec.pool("decode").kv_buffer_bytes // spec.model.kv_bytes_per_token,
            tok=tok,
            registry=registry,
            metrics=metrics,
            api_keys=api_keys,
            buckets=(
                TokenBuckets(auth.requests_per_second, auth.burst)
                if api_keys is not None and auth.requests_per_second > 0
                else None
            ),
            isolate=api_keys is not None and auth.isolate_tenants,
        )


def get_frontend(request: Request) -> Frontend:
    return request.app.state.frontend


FrontendDep = Annotated[Frontend, Depends(get_frontend)]


def authorize(fr: Frontend, request: Request) -> str:
    """The caller's tenant ("" without keys or tenant isolation); raises AuthError unless
    the request carries a current key within its rate."""
    if fr.api_keys is None:
        return ""
    refused = fr.metrics.auth_refused
    scheme, _, presented = request.headers.get("authorization", "").partition(" ")
    presented = presented.strip()
    if scheme.lower() != "bearer" or not presented:
        refused.labels("missing").inc()
        raise AuthError(
            401,
            "no API key: send it as 'Authorization: Bearer <key>'",
            code="missing_api_key",
            type_="invalid_request_error",
            headers={"WWW-Authenticate": "Bearer"},
        )
    found = fr.api_keys.identify(presented)
    if found is None:
        refused.labels("invalid").inc()
        raise AuthError(
            401,
            "invalid API key",
            code="invalid_api_key",
            type_="authentication_error",
            headers={"WWW-Authenticate": 'Bearer error="invalid_token"'},
        )
    kid, tenant = found
    if fr.buckets is not None and (wait := fr.buckets.take(kid)) > 0:
        refused.labels("rate_limited").inc()
        raise AuthError(
            429,
            f"rate limit of {fr.fe.auth.requests_per_second:g} requests/s for this key exceeded "
            f"(spec.frontend.auth.requestsPerSecond); retry in {wait:.2f} s",
            code="rate_limit_exceeded",
            type_="rate_limit_error",
            headers={"Retry-After": str(max(1, math.ceil(wait)))},
        )
    return tenant if fr.isolate else ""
