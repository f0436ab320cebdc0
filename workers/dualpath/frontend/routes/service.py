"""`GET /v1/models` (behind the API keys), `GET /health` and `GET /metrics` (open)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from dualpath.frontend.deps import FrontendDep, authorize
from dualpath.frontend.errors import ApiError

router = APIRouter()


@router.get("/v1/models")
async def models(request: Request, fr: FrontendDep) -> Any:
    try:
        authorize(fr, request)
    except ApiError as err:
        fr.metrics.requests.labels("models", str(err.status)).inc()
        return err.response()
    model = {
        "id": fr.model_name,
        "object": "model",
        "created": fr.started_at,
        "owned_by": "dualpath",
    }
    return {"object": "list", "data": [{**model, "max_model_len": fr.fe.max_context_tokens}]}


@router.get("/health")
async def health(fr: FrontendDep) -> Response:
    ok, msg = await fr.backend.health()
    return JSONResponse(
        {"status": "ok" if ok else "unavailable", "detail": msg}, status_code=200 if ok else 503
    )


@router.get("/metrics")
async def metrics_endpoint(fr: FrontendDep) -> Response:
    return Response(generate_latest(fr.registry), media_type=CONTENT_TYPE_LATEST)
