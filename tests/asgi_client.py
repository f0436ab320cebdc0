"""An HTTP client to a FastAPI app in this process, its lifespan running: how the frontend's
tests talk to `create_app(...)`. Importable from every test (`pythonpath = ["tests"]`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI


@asynccontextmanager
async def serving(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """The app started (its lifespan: the backend's start), a client to it, then closed."""
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            yield c
