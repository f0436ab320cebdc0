"""FastAPI app factory: `/v1/completions`, `/v1/chat/completions` (SSE or not), `/health`,
`/metrics`. The lifespan owns the backend (its gRPC clients): started on startup, closed on
shutdown. Errors use OpenAI's shape `{"error": {"message", "type", "param", "code"}}`.
With API keys (`frontend.auth`, `--api-keys`), every /v1 call needs `Authorization: Bearer`
(401 without a current key, 429 over the key's rate); `/health` and `/metrics` stay open.
Each request's block ids are salted with its key's tenant (`frontend.auth.isolateTenants`) and
its optional `cache_salt` field (`auth.cache_salt`), so tenants never share cached KV.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import secrets
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dualpath.config import ClusterConfig
from dualpath.frontend.auth import ApiKeys, TokenBuckets, cache_salt
from dualpath.frontend.backend import Backend, BackendError, Finished, Routed, Tokens, TurnRequest
from dualpath.frontend.tokenizer import ByteTokenizer, HfTokenizer, load_tokenizer

log = logging.getLogger(__name__)


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type_: str = "invalid_request_error",
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status,
            message,
            param,
            code,
            type_,
        )
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        if self.retry_after_s is not None:
            headers = {"Retry-After": str(max(1, math.ceil(self.retry_after_s))), **(headers or {})}
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


# Deepest JSON a request may nest: the API's own shapes need 3 (messages[i].content).
MAX_JSON_DEPTH = 32
# Most chat messages in one request.
MAX_MESSAGES = 4096


def check_json(obj: Any, path: str = "", depth: int = 0) -> None:
    """Refuse what JSON can carry but the cluster cannot serve: absurd nesting and text that is
    not encodable as UTF-8 (a lone UTF-16 surrogate such as "\\ud800"), naming the field."""
    if depth > MAX_JSON_DEPTH:
        raise ApiError(
            400,
            f"request body nests deeper than {MAX_JSON_DEPTH} levels (at {path or 'the top'})",
            param=path or None,
            code="invalid_json",
        )
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError as err:
            raise ApiError(
                400,
                f"{path or 'body'}: text is not valid Unicode (lone surrogate "
                f"{ascii(err.object[err.start : err.end])} at character {err.start}); "
                "send UTF-8 text or a valid surrogate pair",
                param=path or None,
                code="invalid_text",
            ) from None
    elif isinstance(obj, dict):
        for key, value in obj.items():
            check_json(key, f"{path}.<key>" if path else "<key>", depth + 1)
            check_json(value, f"{path}.{key}" if path else key, depth + 1)
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            check_json(value, f"{path}.{i}" if path else str(i), depth + 1)


def error_of(err: Exception) -> ApiError:
    """The API's answer to a turn's failure: an ApiError as is, a cluster refusal with its
    status (429 for overload, with Retry-After), anything else a logged 500."""
    if isinstance(err, ApiError):
        return err
    if isinstance(err, BackendError):
        return ApiError(
            err.status,
            f"cluster {'overloaded' if err.status == 429 else 'unavailable'}: {err}",
            code="overloaded" if err.status == 429 else "unavailable",
            type_="rate_limit_error" if err.status == 429 else "server_error",
            retry_after_s=err.retry_after_s,
        )
    log.error("turn failed: %s", err, exc_info=err)
    return ApiError(
        500, f"internal error: {type(err).__name__}", code="internal_error", type_="server_error"
    )


class AuthError(ApiError):
    """A refused API key or an exhausted rate limit: the response carries `headers`."""

    def __init__(self, status: int, message: str, code: str, type_: str, headers: dict) -> None:
        super().__init__(status, message, code=code, type_=type_)
        self.headers = headers
        self.retry_after_s = None  # the Retry-After of a rate limit is in `headers`

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return super().response({**self.headers, **(headers or {})})


# Most stop strings and stop token ids in one request.
MAX_STOPS = 16


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    """A last chunk with `choices: []` and the usage, before `[DONE]` (OpenAI's)."""
    continuous_usage_stats: bool = False
    """The usage so far on every chunk too (vLLM's)."""


class _Req(BaseModel):
    """What a request may carry. A field not listed is refused (400 naming it), never
    ignored; a listed field the cluster does not serve is refused unless at its neutral value
    (`NOT_SERVED`)."""

    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    # greedy unless asked (bit-exact answers); OpenAI's default would be 1
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # -1 or 0: off (vLLM's)
    seed: int | None = Field(default=None, ge=-(1 << 63), lt=1 << 63)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOPS)
    session_id: str | None = None
    user: str | None = None
    # as vLLM's: partitions the caller's (its tenant's) cache further; never crosses tenants
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    # not served: accepted only at their neutral value (NOT_SERVED)
    n: int | None = None
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None


class CompletionRequest(_Req):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = None
    best_of: int | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatRequest(_Req):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)


# Fields clients send that this cluster does not serve, with the values that ask for nothing.
NOT_SERVED: dict[str, tuple[Any, ...]] = {
    "n": (1,),
    "best_of": (1,),
    "echo": (False,),
    "logprobs": (False, 0),
    "top_logprobs": (0,),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "repetition_penalty": (1,),
    "logit_bias": ({},),
}


def refuse_not_served(req: _Req) -> None:
    for name, neutral in NOT_SERVED.items():
        value = getattr(req, name, None)
        if value is None or value in neutral:
            continue
        raise ApiError(
            400,
            f"{name}={json.dumps(value)} is not served by this cluster (one greedy or sampled "
            f"choice, no log probabilities, no penalties); omit {name} or send "
            f"{json.dumps(neutral[0])}",
            param=name,
            code="unsupported_parameter",
        )


def _session_key(sid: str | None, salt: bytes) -> str | None:
    """Sessions are per cache salt: one tenant's session id never reaches another's history."""
    return f"{salt.hex()}/{sid}" if sid and salt else sid


@dataclass(slots=True)
class _Session:
    text: str
    ids: list[int]


class Sessions:
    """Token history per session (LRU-bounded): a prompt extending the session's text reuses
    its exact token ids, so the prefix's block ids match what the store holds."""

    def __init__(self, capacity: int = 4096) -> None:
        self._s: OrderedDict[str, _Session] = OrderedDict()
        self.capacity = capacity

    def prompt_ids(self, sid: str | None, text: str, tok: ByteTokenizer | HfTokenizer) -> list[int]:
        s = self._s.get(sid) if sid else None
        if s is not None and text.startswith(s.text):
            self._s.move_to_end(sid)  # type: ignore[arg-type]
            return s.ids + tok.encode(text[len(s.text) :])
        return tok.encode(text)

    def remember(self, sid: str | None, text: str, ids: list[int]) -> None:
        if not sid:
            return
        self._s[sid] = _Session(text, ids)
        self._s.move_to_end(sid)
        while len(self._s) > self.capacity:
            self._s.popitem(last=False)


class _Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "dualpath_frontend_requests_total",
            "HTTP API requests",
            ["endpoint", "code"],
            registry=registry,
        )
        self.outcomes = Counter(
            "dualpath_frontend_request_outcomes_total",
            "HTTP API requests by final outcome: the finish reason (stop, length) or the "
            "error code (invalid_parameter, overloaded, unavailable, cancelled, ...)",
            ["endpoint", "outcome"],
            registry=registry,
        )
        self.tokens = Counter(
            "dualpath_frontend_tokens_total", "tokens by kind", ["kind"], registry=registry
        )
        self.turns = Counter(
            "dualpath_frontend_turns_total", "turns by read path", ["path"], registry=registry
        )
        self.ttft = Histogram(
            "dualpath_frontend_ttft_seconds",
            "time to first token",
            registry=registry,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        self.auth_refused = Counter(
            "dualpath_frontend_auth_refused_total",
            "requests refused by API-key checks, by reason (missing, invalid, rate_limited)",
            ["reason"],
            registry=registry,
        )
        self.latency = Histogram(
            "dualpath_frontend_request_seconds",
            "request latency",
            registry=registry,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )


def create_app(
    config: ClusterConfig,
    backend: Backend,
    registry: CollectorRegistry | None = None,
    api_keys: ApiKeys | None = None,
) -> FastAPI:
    """`api_keys`: the keys every /v1 call must present (`Authorization: Bearer`); None: the
    API is open. Per-key rate limits come from `spec.frontend.auth`."""
    spec = config.spec
    fe = spec.frontend
    auth = fe.auth
    buckets = (
        TokenBuckets(auth.requests_per_second, auth.burst)
        if api_keys is not None and auth.requests_per_second > 0
        else None
    )
    tok = load_tokenizer(spec.model)
    vocab_size = spec.model.vocab_size
    registry = registry or CollectorRegistry()
    metrics = _Metrics(registry)
    for collector in getattr(backend, "collectors", ()):  # the backend's own (retries, ...)
        registry.register(collector)
    sessions = Sessions()
    model_name = spec.model.name
    started_at = int(time.time())
    buffer_tokens = spec.pool("decode").kv_buffer_bytes // spec.model.kv_bytes_per_token
    isolate = api_keys is not None and auth.isolate_tenants

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await backend.start()
        log.info("frontend ready: model %s, max context %d", model_name, fe.max_context_tokens)
        try:
            yield
        finally:
            await backend.close()

    app = FastAPI(title="DualPath", lifespan=lifespan)
    app.state.backend = backend
    app.state.sessions = sessions
    app.state.tokenizer = tok

    def authorize(request: Request) -> str:
        """The caller's tenant ("" without keys or tenant isolation); raises AuthError unless
        the request carries a current key within its rate."""
        if api_keys is None:
            return ""
        scheme, _, presented = request.headers.get("authorization", "").partition(" ")
        presented = presented.strip()
        if scheme.lower() != "bearer" or not presented:
            metrics.auth_refused.labels("missing").inc()
            raise AuthError(
                401,
                "no API key: send it as 'Authorization: Bearer <key>'",
                code="missing_api_key",
                type_="invalid_request_error",
                headers={"WWW-Authenticate": "Bearer"},
            )
        found = api_keys.identify(presented)
        if found is None:
            metrics.auth_refused.labels("invalid").inc()
            raise AuthError(
                401,
                "invalid API key",
                code="invalid_api_key",
                type_="authentication_error",
                headers={"WWW-Authenticate": 'Bearer error="invalid_token"'},
            )
        kid, tenant = found
        if buckets is not None and (wait := buckets.take(kid)) > 0:
            metrics.auth_refused.labels("rate_limited").inc()
            raise AuthError(
                429,
                f"rate limit of {auth.requests_per_second:g} requests/s for this key exceeded "
                f"(spec.frontend.auth.requestsPerSecond); retry in {wait:.2f} s",
                code="rate_limit_exceeded",
                type_="rate_limit_error",
                headers={"Retry-After": str(max(1, math.ceil(wait)))},
            )
        return tenant if isolate else ""

    async def read_json(request: Request) -> Any:
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > fe.max_request_bytes:
            raise ApiError(
                413,
                f"request body is {declared} bytes; the limit is "
                f"{fe.max_request_bytes} (spec.frontend.maxRequestBytes)",
                code="request_too_large",
            )
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > fe.max_request_bytes:
                raise ApiError(
                    413,
                    f"request body exceeds {fe.max_request_bytes} bytes "
                    "(spec.frontend.maxRequestBytes)",
                    code="request_too_large",
                )
        try:
            obj = json.loads(body)
        except RecursionError:
            raise ApiError(
                400, "request body is not valid JSON: nested too deeply", code="invalid_json"
            ) from None
        except ValueError as err:  # bad JSON or UTF-8, an integer of over 4300 digits
            raise ApiError(
                400, f"request body is not valid JSON: {err}", code="invalid_json"
            ) from None
        check_json(obj)
        return obj

    def parse(model: type[_Req], obj: Any) -> Any:
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
            raise ApiError(
                400, f"{param}: {e['msg']}", param=param, code="invalid_parameter"
            ) from None
        refuse_not_served(req)
        if req.stream_options is not None and not req.stream:
            raise ApiError(
                400,
                "stream_options: only allowed with stream: true",
                param="stream_options",
                code="invalid_parameter",
            )
        if req.model != model_name:
            raise ApiError(
                404,
                f"model {req.model!r} does not exist; this cluster serves {model_name!r}",
                param="model",
                code="model_not_found",
            )
        return req

    def turn_for(
        req: _Req, text: str | None, ids: list[int] | None, request: Request, tenant: str
    ) -> tuple[TurnRequest, str]:
        sid = req.session_id or request.headers.get("x-session-id") or req.user
        salt = cache_salt(tenant, req.cache_salt)
        if ids is None:
            ids = sessions.prompt_ids(_session_key(sid, salt), text or "", tok)
        if not ids:
            raise ApiError(400, "prompt is empty", param="prompt", code="invalid_parameter")
        if any(i < 0 or i >= vocab_size for i in ids):
            raise ApiError(
                400,
                f"prompt token ids must be in [0, {vocab_size})",
                param="prompt",
                code="invalid_parameter",
            )
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
                f"{limit} {max_new} exceeds the limit {fe.max_new_tokens} "
                "(spec.frontend.maxNewTokens)",
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
        if any(i < 0 or i >= vocab_size for i in stop_ids):
            raise ApiError(
                400,
                f"stop_token_ids must be in [0, {vocab_size})",
                param="stop_token_ids",
                code="invalid_parameter",
            )
        if not req.ignore_eos:
            stop_ids.append(tok.eos_id)
        if len(ids) + max_new > fe.max_context_tokens:
            raise ApiError(
                400,
                f"prompt ({len(ids)} tokens) + max_tokens ({max_new}) exceeds "
                f"the context limit {fe.max_context_tokens} tokens",
                param="prompt",
                code="context_length_exceeded",
            )
        if len(ids) > buffer_tokens:  # no decode node could ever take it: not a retryable 503
            raise ApiError(
                400,
                f"prompt ({len(ids)} tokens) exceeds the {buffer_tokens} tokens a decode "
                "node's KV buffer holds (spec.decode.kvBufferBytes)",
                param="prompt",
                code="context_length_exceeded",
            )
        rid = f"{'chatcmpl' if isinstance(req, ChatRequest) else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        temperature = req.temperature or 0.0
        seed = req.seed if req.seed is not None else secrets.randbits(62) if temperature else 0
        turn = TurnRequest(
            rid,
            sid or "",
            ids,
            max_new,
            temperature,
            tuple(dict.fromkeys(stop_ids)),
            salt,
            seed=seed,
            top_p=req.top_p or 1.0,
            top_k=max(0, req.top_k or 0),
            min_tokens=req.min_tokens,
        )
        return turn, sid or ""

    async def run_turn(
        turn: TurnRequest,
        sid: str,
        text: str | None,
        stops: list[str],
        on_text=None,
        on_start=None,
    ) -> dict[str, Any]:
        """Drive a turn to the end; `on_text(str, usage)` gets each text delta and the usage
        so far (streaming),
        `on_start()` is called once the backend has started serving it (its first event)."""
        t0 = time.perf_counter()
        dec = tok.stream()
        out_ids: list[int] = []
        out_text = ""
        routed: Routed | None = None
        finish = "length"
        first = True
        agen = backend.generate(turn)
        try:
            async for ev in agen:
                if on_start is not None:
                    on_start()
                if isinstance(ev, Routed):
                    routed = ev
                    metrics.turns.labels(ev.read_path).inc()
                elif isinstance(ev, Tokens):
                    if first:
                        metrics.ttft.observe(time.perf_counter() - t0)
                        first = False
                    ids = [i for i in ev.ids if i not in turn.stop_ids]
                    out_ids.extend(ev.ids)
                    delta = dec.push(ids)
                    out_text += delta
                    hit_stop = next((s for s in stops if s in out_text), None)
                    if hit_stop is not None:
                        cut = out_text.index(hit_stop)
                        delta = delta[: max(0, len(delta) - (len(out_text) - cut))]
                        out_text = out_text[:cut]
                        if on_text and delta:
                            await on_text(delta, usage_of(turn, out_ids, routed))
                        finish = "stop"
                        break
                    if on_text and delta:
                        await on_text(delta, usage_of(turn, out_ids, routed))
                elif isinstance(ev, Finished):
                    finish = ev.reason
        finally:
            await agen.aclose()
        tail = dec.flush()
        if tail and finish != "stop":
            out_text += tail
            if on_text:
                await on_text(tail, usage_of(turn, out_ids, routed))
        metrics.tokens.labels("prompt").inc(len(turn.prompt_ids))
        metrics.tokens.labels("generated").inc(len(out_ids))
        if routed:
            metrics.tokens.labels("hit").inc(routed.hit_tokens)
        metrics.latency.observe(time.perf_counter() - t0)
        if text is not None:
            sessions.remember(
                _session_key(sid, turn.cache_salt), text + out_text, turn.prompt_ids + out_ids
            )
        return {
            "text": out_text,
            "finish_reason": finish,
            "usage": usage_of(turn, out_ids, routed),
            "dualpath": {
                "read_path": routed.read_path if routed else "none",
                "prefill_node": routed.prefill_node if routed else "",
                "decode_node": routed.decode_node if routed else "",
                "policy": routed.policy if routed else "",
                "session_id": sid,
                "token_ids": out_ids,
            },
        }

    def usage_of(turn: TurnRequest, out_ids: list[int], routed: Routed | None) -> dict:
        return {
            "prompt_tokens": len(turn.prompt_ids),
            "completion_tokens": len(out_ids),
            "total_tokens": len(turn.prompt_ids) + len(out_ids),
            "prompt_tokens_details": {"cached_tokens": routed.hit_tokens if routed else 0},
        }

    def count(endpoint: str, status: int, outcome: str) -> None:
        metrics.requests.labels(endpoint, str(status)).inc()
        metrics.outcomes.labels(endpoint, outcome).inc()

    async def serve(request: Request, chat: bool) -> Response:
        endpoint = "chat" if chat else "completions"
        try:
            tenant = authorize(request)
            obj = await read_json(request)
            req = parse(ChatRequest if chat else CompletionRequest, obj)
            text, ids = prompt_of(req)
            turn, sid = turn_for(req, text, ids, request, tenant)
            stops = stops_of(req)
            created = int(time.time())
            if req.stream:
                return await start_stream(
                    endpoint, turn, sid, text, stops, chat, created, req.stream_options
                )
            res = await run_turn(turn, sid, text, stops)
        except Exception as exc:  # noqa: BLE001 (every failure gets a status and is counted)
            err = error_of(exc)
            count(endpoint, err.status, err.code or "error")
            return err.response()
        count(endpoint, 200, res["finish_reason"])
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
                "model": model_name,
                "choices": [choice],
                "usage": res["usage"],
                "dualpath": res["dualpath"],
            },
            headers={"x-request-id": turn.request_id},
        )

    def prompt_of(req: _Req) -> tuple[str | None, list[int] | None]:
        """The prompt as text (to tokenize, remembered per session) or as token ids."""
        if isinstance(req, ChatRequest):
            return tok.chat([{"role": m.role, "content": m.text()} for m in req.messages]), None
        prompt = req.prompt
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

    def stops_of(req: _Req) -> list[str]:
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stops) > MAX_STOPS or any(not s for s in stops):
            raise ApiError(
                400,
                f"stop: at most {MAX_STOPS} non-empty strings",
                param="stop",
                code="invalid_parameter",
            )
        return stops

    async def start_stream(
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
        failure before that is a real 4xx/5xx (raised to `serve`); one after it is an SSE error
        event with no finish chunk and no `[DONE]`, never an empty success."""
        queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        started = asyncio.Event()
        include_usage = bool(options and options.include_usage)
        continuous = include_usage and bool(options and options.continuous_usage_stats)
        obj = "chat.completion.chunk" if chat else "text_completion"

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
                "model": model_name,
                "choices": choices,
                **({"usage": None} if include_usage else {}),
                **(extra or {}),
            }
            return f"data: {json.dumps(body)}\n\n".encode()

        async def on_text(delta: str, usage: dict) -> None:
            await queue.put(chunk(delta, None, {"usage": usage} if continuous else None))

        async def drive() -> None:
            try:
                res = await run_turn(turn, sid, text, stops, on_text, started.set)
            except asyncio.CancelledError:
                if started.is_set():  # the client went away mid-stream
                    count(endpoint, 499, "cancelled")
                raise
            except Exception as exc:
                if not started.is_set():
                    raise  # `serve` answers with the status
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

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve(request, chat=True)

    @app.get("/v1/models")
    async def models(request: Request) -> Any:
        try:
            authorize(request)
        except ApiError as err:
            metrics.requests.labels("models", str(err.status)).inc()
            return err.response()
        model = {"id": model_name, "object": "model", "created": started_at, "owned_by": "dualpath"}
        return {"object": "list", "data": [{**model, "max_model_len": fe.max_context_tokens}]}

    @app.get("/health")
    async def health() -> Response:
        ok, msg = await backend.health()
        return JSONResponse(
            {"status": "ok" if ok else "unavailable", "detail": msg}, status_code=200 if ok else 503
        )

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(404)
    async def not_found(request: Request, exc: Exception) -> Response:
        return ApiError(404, f"no route {request.url.path}", code="not_found").response()

    @app.exception_handler(405)
    async def bad_method(request: Request, exc: Exception) -> Response:
        return ApiError(
            405,
            f"method {request.method} not allowed on {request.url.path}",
            code="method_not_allowed",
        ).response()

    return app
