"""From an HTTP request to a `TurnRequest`: read the body within `spec.frontend.maxRequestBytes`,
validate it against the request models (`schema`), and check the prompt and the limits against
the served model and `spec.frontend`. Every refusal is an `ApiError` naming the field."""

from __future__ import annotations

import json
import secrets
import uuid
from typing import Any

from fastapi import Request
from pydantic import ValidationError

from dualpath.frontend.auth import cache_salt
from dualpath.frontend.backend import TurnRequest
from dualpath.frontend.deps import Frontend
from dualpath.frontend.errors import ApiError
from dualpath.frontend.schema import (
    MAX_STOPS,
    ChatRequest,
    GenerationRequest,
    check_json,
    refuse_not_served,
)
from dualpath.frontend.sessions import session_key
from dualpath.grpc_bounds import MAX_ID_CHARS
from dualpath.sampling import SamplingParams


async def read_json(fr: Frontend, request: Request) -> Any:
    limit = fr.fe.max_request_bytes
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise ApiError(
            413,
            f"request body is {declared} bytes; the limit is "
            f"{limit} (spec.frontend.maxRequestBytes)",
            code="request_too_large",
        )
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(
                413,
                f"request body exceeds {limit} bytes (spec.frontend.maxRequestBytes)",
                code="request_too_large",
            )
    try:
        obj = json.loads(body)
    except RecursionError:
        raise ApiError(
            400, "request body is not valid JSON: nested too deeply", code="invalid_json"
        ) from None
    except ValueError as err:  # bad JSON or UTF-8, an integer of over 4300 digits
        raise ApiError(400, f"request body is not valid JSON: {err}", code="invalid_json") from None
    check_json(obj)
    return obj


def parse(fr: Frontend, model: type[GenerationRequest], obj: Any) -> Any:
    if not isinstance(obj, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_json")
    try:
        req = model.model_validate(obj)
    except ValidationError as err:
        e = err.errors()[0]
        param = ".".join(str(p) for p in e["loc"]) or None
        if e["type"] == "extra_forbidden":
            raise ApiError(
                400,
                f"{param}: unknown field; this server does not serve it, so it refuses "
                "it rather than ignore it (remove it; docs/frontend.md lists the fields)",
                param=param,
                code="unknown_parameter",
            ) from None
        raise ApiError(400, f"{param}: {e['msg']}", param=param, code="invalid_parameter") from None
    refuse_not_served(req)
    if req.stream_options is not None and not req.stream:
        raise ApiError(
            400,
            "stream_options: only allowed with stream: true",
            param="stream_options",
            code="invalid_parameter",
        )
    if req.model != fr.model_name:
        raise ApiError(
            404,
            f"model {req.model!r} does not exist; this cluster serves {fr.model_name!r}",
            param="model",
            code="model_not_found",
        )
    return req


def prompt_of(fr: Frontend, req: GenerationRequest) -> tuple[str | None, list[int] | None]:
    """The prompt as text (to tokenize, remembered per session) or as token ids."""
    if isinstance(req, ChatRequest):
        return fr.tok.chat([{"role": m.role, "content": m.text()} for m in req.messages]), None
    prompt = req.prompt  # type: ignore[attr-defined]
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:  # a batch of prompts
            raise ApiError(
                400,
                f"prompt: {len(prompt)} prompts in one request; this server serves one "
                "prompt per request (send them as separate requests)",
                param="prompt",
                code="unsupported_parameter",
            )
        prompt = prompt[0]
    return (None, list(prompt)) if isinstance(prompt, list) else (prompt, None)


def stops_of(req: GenerationRequest) -> list[str]:
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > MAX_STOPS or any(not s for s in stops):
        raise ApiError(
            400,
            f"stop: at most {MAX_STOPS} non-empty strings",
            param="stop",
            code="invalid_parameter",
        )
    return stops


def _refuse_out_of_vocab(ids: list[int], vocab_size: int, param: str, what: str) -> None:
    if any(i < 0 or i >= vocab_size for i in ids):
        raise ApiError(
            400, f"{what} must be in [0, {vocab_size})", param=param, code="invalid_parameter"
        )


def turn_for(
    fr: Frontend,
    req: GenerationRequest,
    text: str | None,
    ids: list[int] | None,
    request: Request,
    tenant: str,
) -> tuple[TurnRequest, str]:
    """The turn the backend serves, and its session id ("" without one)."""
    fe, vocab_size = fr.fe, fr.vocab_size
    sid = req.session_id or request.headers.get("x-session-id") or req.user
    if sid and len(sid) > MAX_ID_CHARS:  # the header's (the body's is bounded by the schema)
        raise ApiError(
            400,
            f"session id is {len(sid)} characters; at most {MAX_ID_CHARS}",
            param="session_id",
            code="invalid_parameter",
        )
    salt = cache_salt(tenant, req.cache_salt)
    if ids is None:
        ids = fr.sessions.prompt_ids(session_key(sid, salt), text or "", fr.tok)
    if not ids:
        raise ApiError(400, "prompt is empty", param="prompt", code="invalid_parameter")
    _refuse_out_of_vocab(ids, vocab_size, "prompt", "prompt token ids")
    if (
        req.max_tokens
        and req.max_completion_tokens
        and (req.max_tokens != req.max_completion_tokens)
    ):
        raise ApiError(
            400,
            f"max_tokens ({req.max_tokens}) and max_completion_tokens "
            f"({req.max_completion_tokens}) disagree; send one of them",
            param="max_completion_tokens",
            code="invalid_parameter",
        )
    limit = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
    max_new = req.max_completion_tokens or req.max_tokens or min(16, fe.max_new_tokens)
    if max_new > fe.max_new_tokens:
        raise ApiError(
            400,
            f"{limit} {max_new} exceeds the limit {fe.max_new_tokens} (spec.frontend.maxNewTokens)",
            param=limit,
            code="invalid_parameter",
        )
    if req.min_tokens > max_new:
        raise ApiError(
            400,
            f"min_tokens ({req.min_tokens}) exceeds {limit} ({max_new})",
            param="min_tokens",
            code="invalid_parameter",
        )
    stop_ids = list(req.stop_token_ids or ())
    _refuse_out_of_vocab(stop_ids, vocab_size, "stop_token_ids", "stop_token_ids")
    if not req.ignore_eos:
        stop_ids.append(fr.tok.eos_id)
    if len(ids) + max_new > fe.max_context_tokens:
        raise ApiError(
            400,
            f"prompt ({len(ids)} tokens) + max_tokens ({max_new}) exceeds "
            f"the context limit {fe.max_context_tokens} tokens",
            param="prompt",
            code="context_length_exceeded",
        )
    if len(ids) > fr.buffer_tokens:  # no decode node could ever take it: not a retryable 503
        raise ApiError(
            400,
            f"prompt ({len(ids)} tokens) exceeds the {fr.buffer_tokens} tokens a decode "
            "node's KV buffer holds (spec.decode.kvBufferBytes)",
            param="prompt",
            code="context_length_exceeded",
        )
    rid = f"{'chatcmpl' if isinstance(req, ChatRequest) else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    temperature = req.temperature or 0.0
    seed = req.seed if req.seed is not None else secrets.randbits(62) if temperature else 0
    sampling = SamplingParams(
        temperature=temperature,
        max_tokens=max_new,
        stop_tokens=tuple(dict.fromkeys(stop_ids)),
        seed=seed,
        top_p=req.top_p or 1.0,
        top_k=max(0, req.top_k or 0),
        min_tokens=req.min_tokens,
    )
    turn = TurnRequest(rid, sid or "", ids, sampling, salt)
    return turn, sid or ""
