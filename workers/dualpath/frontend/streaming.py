"""Server-sent events of one turn: OpenAI's chunks (chat's role delta first, one chunk per text
delta, the finish chunk, the usage chunk with `stream_options.include_usage`, `[DONE]`), and a
failure after the stream started as an SSE error event."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import Response, StreamingResponse

from dualpath.frontend.backend import TurnRequest
from dualpath.frontend.deps import Frontend
from dualpath.frontend.errors import error_of
from dualpath.frontend.schema import StreamOptions
from dualpath.frontend.turns import run_turn

log = logging.getLogger(__name__)


async def start_stream(
    fr: Frontend,
    endpoint: str,
    turn: TurnRequest,
    sid: str,
    text: str | None,
    stops: list[str],
    chat: bool,
    created: int,
    options: StreamOptions | None,
) -> Response:
    """SSE: the status is sent only once the backend has started serving the turn, so a
    failure before that is a real 4xx/5xx (raised to the caller); one after it is an SSE error
    event with no finish chunk and no `[DONE]`, never an empty success."""
    queue: asyncio.Queue[bytes | None] = asyncio.Queue()
    started = asyncio.Event()
    include_usage = bool(options and options.include_usage)
    continuous = include_usage and bool(options and options.continuous_usage_stats)
    obj = "chat.completion.chunk" if chat else "text_completion"
    count = fr.metrics.count

    def chunk(delta: str | None, finish: str | None, extra: dict | None = None) -> bytes:
        c: dict[str, Any] = {"index": 0}
        if chat:
            c["delta"] = {"content": delta} if delta is not None else {}
        else:
            c["text"] = delta or ""
        c.update(logprobs=None, finish_reason=finish)
        return event([c], extra)

    def event(choices: list[dict], extra: dict | None = None) -> bytes:
        body = {
            "id": turn.request_id,
            "object": obj,
            "created": created,
            "model": fr.model_name,
            "choices": choices,
            **({"usage": None} if include_usage else {}),
            **(extra or {}),
        }
        return f"data: {json.dumps(body)}\n\n".encode()

    async def on_text(delta: str, usage: dict) -> None:
        await queue.put(chunk(delta, None, {"usage": usage} if continuous else None))

    async def drive() -> None:
        try:
            res = await run_turn(fr, turn, sid, text, stops, on_text, started.set)
        except asyncio.CancelledError:
            if started.is_set():  # the client went away mid-stream
                count(endpoint, 499, "cancelled")
            raise
        except Exception as exc:
            if not started.is_set():
                raise  # the caller answers with the status
            err = error_of(exc)
            count(endpoint, err.status, err.code or "error")
            log.warning("turn %s failed mid-stream: %s", turn.request_id, err.message)
            await queue.put(f"data: {json.dumps(err.body())}\n\n".encode())
            await queue.put(None)
            return
        started.set()
        count(endpoint, 200, res["finish_reason"])
        extra = {"dualpath": res["dualpath"], **({"usage": res["usage"]} if continuous else {})}
        await queue.put(chunk(None, res["finish_reason"], extra))
        if include_usage:  # OpenAI's: a chunk of its own, after the finish reason
            await queue.put(event([], {"usage": res["usage"]}))
        await queue.put(b"data: [DONE]\n\n")
        await queue.put(None)

    task = asyncio.create_task(drive(), name=f"turn-{turn.request_id}")
    waiter = asyncio.create_task(started.wait())
    try:
        await asyncio.wait((task, waiter), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        waiter.cancel()
    if task.done() and not started.is_set():
        task.result()  # raises the turn's failure

    async def events() -> AsyncIterator[bytes]:
        try:
            if chat:
                role = {"index": 0, "delta": {"role": "assistant", "content": ""}}
                yield event([{**role, "logprobs": None, "finish_reason": None}])
            while (item := await queue.get()) is not None:
                yield item
        finally:
            if not task.done():
                task.cancel()

    return StreamingResponse(
        events(), media_type="text/event-stream", headers={"x-request-id": turn.request_id}
    )
