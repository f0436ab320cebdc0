"""FastAPI app factory: `create_app` builds the app's `Frontend` (deps) and assembles the
routers (`routes.completions`: `/v1/completions`, `/v1/chat/completions`, SSE or not;
`routes.service`: `/v1/models`, `/health`, `/metrics`). The lifespan owns the backend (its gRPC
clients): started on startup, closed on shutdown. Errors use OpenAI's shape
`{"error": {"message", "type", "param", "code"}}` (`errors`).
With API keys (`frontend.auth`, `--api-keys`), every /v1 call needs `Authorization: Bearer`
(401 without a current key, 429 over the key's rate); `/health` and `/metrics` stay open.
Each request's block ids are salted with its key's tenant (`frontend.auth.isolateTenants`) and
its optional `cache_salt` field (`auth.cache_salt`), so tenants never share cached KV.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from dualpath.config import ClusterConfig
from dualpath.frontend.auth import ApiKeys
from dualpath.frontend.backend import Backend
from dualpath.frontend.deps import Frontend
from dualpath.frontend.errors import bad_method, not_found
from dualpath.frontend.routes import completions, service

log = logging.getLogger(__name__)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    fr: Frontend = app.state.frontend
    await fr.backend.start()
    log.info("frontend ready: model %s, max context %d", fr.model_name, fr.fe.max_context_tokens)
    try:
        yield
    finally:
        await fr.backend.close()


def create_app(
    config: ClusterConfig,
    backend: Backend,
    registry: CollectorRegistry | None = None,
    api_keys: ApiKeys | None = None,
) -> FastAPI:
    """`api_keys`: the keys every /v1 call must present (`Authorization: Bearer`); None: the
    API is open. Per-key rate limits come from `spec.frontend.auth`."""
    fr = Frontend.build(config, backend, registry, api_keys)
    app = FastAPI(title="DualPath", lifespan=lifespan)
    app.state.frontend = fr  # what `deps.get_frontend` hands every route
    app.state.sessions = fr.sessions
    app.include_router(completions.router)
    app.include_router(service.router)
    app.add_exception_handler(404, not_found)
    app.add_exception_handler(405, bad_method)
    return app
