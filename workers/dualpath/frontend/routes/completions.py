"""`POST /v1/completions` and `POST /v1/chat/completions`: authorize, admit the request
(`admission`), run the turn (`turns`) or stream it (`streaming`), count its outcome."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from dualpath.frontend.admission import parse, prompt_of, read_json, stops_of, turn_for
from dualpath.frontend.deps import Frontend, FrontendDep, authorize
from dualpath.frontend.errors import error_of
from dualpath.frontend.schema import ChatRequest, CompletionRequest
from dualpath.frontend.streaming import start_stream
from dualpath.frontend.turns import run_turn

router = APIRouter()


async def serve(fr: Frontend, request: Request, chat: bool) -> Response:
    endpoint = "chat" if chat else "completions"
    try:
        tenant = authorize(fr, request)
        obj = await read_json(fr, request)
        req = parse(fr, ChatRequest if chat else CompletionRequest, obj)
        text, ids = prompt_of(fr, req)
        turn, sid = turn_for(fr, req, text, ids, request, tenant)
        stops = stops_of(req)
        created = int(time.time())
        if req.stream:
            return await start_stream(
                fr, endpoint, turn, sid, text, stops, chat, created, req.stream_options
            )
        res = await run_turn(fr, turn, sid, text, stops)
    except Exception as exc:  # noqa: BLE001 (every failure gets a status and is counted)
        err = error_of(exc)
        fr.metrics.count(endpoint, err.status, err.code or "error")
        return err.response()
    fr.metrics.count(endpoint, 200, res["finish_reason"])
    choice: dict[str, Any] = {"index": 0}
    if chat:
        choice["message"] = {"role": "assistant", "content": res["text"]}
    else:
        choice["text"] = res["text"]
    choice.update(logprobs=None, finish_reason=res["finish_reason"])
    return JSONResponse(
        {
            "id": turn.request_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": fr.model_name,
            "choices": [choice],
            "usage": res["usage"],
            "dualpath": res["dualpath"],
        },
        headers={"x-request-id": turn.request_id},
    )


@router.post("/v1/completions")
async def completions(request: Request, fr: FrontendDep) -> Response:
    return await serve(fr, request, chat=False)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, fr: FrontendDep) -> Response:
    return await serve(fr, request, chat=True)
