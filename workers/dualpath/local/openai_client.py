"""The local tools' client of one streamed `/v1/completions` turn (the bench's replay, the
fault suite): the SSE chunks read into one `StreamedTurn` (text, finish reason, the finish
chunk with its `dualpath` object, the usage chunk, an error event, `[DONE]`, time to the first
chunk). Transport errors (httpx's) and a chunk that is not JSON are raised to the caller, which
judges them."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx


@dataclass(slots=True)
class StreamedTurn:
    status: int = 0
    response: httpx.Response | None = None  # its body read when refused (status != 200)
    text: str = ""
    finish_reason: str = ""
    final: dict[str, Any] | None = None  # the chunk that carried the finish reason
    usage: dict[str, Any] | None = None  # the usage chunk (`stream_options.include_usage`)
    error: str = ""  # an SSE error event's message (a failure after the stream started)
    done: bool = False  # `data: [DONE]` arrived
    ttft_s: float | None = None  # from the request to the first chunk with a choice
    cut: bool = False  # the client left after the first chunk (`cut_after_first`)


async def stream_completion(
    client: httpx.AsyncClient,
    body: dict[str, Any],
    *,
    timeout_s: float | None = None,
    on_chunk: Callable[[], None] | None = None,
    cut_after_first: bool = False,
) -> StreamedTurn:
    """POST `body` (with `"stream": true`) to `/v1/completions` and read the stream to its
    end, or to its first chunk with `cut_after_first` (leaving closes the connection).
    `timeout_s`: httpx's timeouts for this request (None: the client's)."""
    t0 = time.perf_counter()
    out = StreamedTurn()
    timeout = httpx.USE_CLIENT_DEFAULT if timeout_s is None else timeout_s
    async with client.stream("POST", "/v1/completions", json=body, timeout=timeout) as r:
        out.status = r.status_code
        if r.status_code != 200:
            await r.aread()
            out.response = r
            return out
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                out.done = True
                break
            ev = json.loads(data)
            if "error" in ev:
                out.error = str(ev["error"].get("message", ev["error"]))
                break
            if not ev["choices"]:  # the usage chunk, after the finish
                out.usage = ev["usage"]
                continue
            if out.ttft_s is None:
                out.ttft_s = time.perf_counter() - t0
            choice = ev["choices"][0]
            out.text += choice.get("text", "")
            if choice.get("finish_reason"):
                out.finish_reason, out.final = choice["finish_reason"], ev
            if on_chunk is not None:
                on_chunk()
            if cut_after_first:
                out.cut = True
                break
    return out
