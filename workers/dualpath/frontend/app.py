"""FastAPI app factory: `/v1/completions`, `/v1/chat/completions` (SSE or not), `/health`,
`/metrics`. The lifespan owns the backend (its gRPC clients): started on startup, closed on
shutdown. Errors use OpenAI's shape `{"error": {"message", "type", "param", "code"}}`.
With API keys (`frontend.auth`, `--api-keys`), every /v1 call needs `Authorization: Bearer`
(401 without a current key, 429 over the key's rate); `/health` and `/metrics` stay open.
Each request's block ids are salted with its key's tenant (`frontend.auth.isolateTenants`) and
its optional `cache_salt` field (`auth.cache_salt`), so tenants never share cached KV.
"""

from __future__ import annotations

import json
import logging
import math
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
from dualpath.frontend.tokenizer import ByteTokenizer, StreamDecoder

log = logging.getLogger(__name__)


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type_: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status,
            message,
            param,
            code,
            type_,
        )

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        body = {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }
        return JSONResponse(body, status_code=self.status, headers=headers)


class AuthError(ApiError):
    """A refused API key or an exhausted rate limit: the response carries `headers`."""

    def __init__(self, status: int, message: str, code: str, type_: str, headers: dict) -> None:
        super().__init__(status, message, code=code, type_=type_)
        self.headers = headers

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return super().response({**self.headers, **(headers or {})})


class _Req(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    stream: bool = False
    stop: str | list[str] | None = None
    session_id: str | None = None
    user: str | None = None
    n: int = Field(default=1, ge=1, le=1)
    # as vLLM's: partitions the caller's (its tenant's) cache further; never crosses tenants
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)


class CompletionRequest(_Req):
    prompt: str | list[int]


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str


class ChatRequest(_Req):
    messages: list[ChatMessage] = Field(min_length=1)


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

    def prompt_ids(self, sid: str | None, text: str, tok: ByteTokenizer) -> list[int]:
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
    tok = ByteTokenizer(spec.model.vocab_size)
    registry = registry or CollectorRegistry()
    metrics = _Metrics(registry)
    for collector in getattr(backend, "collectors", ()):  # the backend's own (retries, ...)
        registry.register(collector)
    sessions = Sessions()
    model_name = spec.model.name
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
            return json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ApiError(
                400, f"request body is not valid JSON: {err}", code="invalid_json"
            ) from None

    def parse(model: type[_Req], obj: Any) -> Any:
        if not isinstance(obj, dict):
            raise ApiError(400, "request body must be a JSON object", code="invalid_json")
        try:
            req = model.model_validate(obj)
        except ValidationError as err:
            e = err.errors()[0]
            param = ".".join(str(p) for p in e["loc"]) or None
            raise ApiError(
                400, f"{param}: {e['msg']}", param=param, code="invalid_parameter"
            ) from None
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
        if any(i < 0 or i >= tok.vocab_size for i in ids):
            raise ApiError(
                400,
                f"prompt token ids must be in [0, {tok.vocab_size})",
                param="prompt",
                code="invalid_parameter",
            )
        max_new = req.max_tokens or min(16, fe.max_new_tokens)
        if max_new > fe.max_new_tokens:
            raise ApiError(
                400,
                f"max_tokens {max_new} exceeds the limit {fe.max_new_tokens} "
                "(spec.frontend.maxNewTokens)",
                param="max_tokens",
                code="invalid_parameter",
            )
        if len(ids) + max_new > fe.max_context_tokens:
            raise ApiError(
                400,
                f"prompt ({len(ids)} tokens) + max_tokens ({max_new}) exceeds "
                f"the context limit {fe.max_context_tokens} tokens",
                param="prompt",
                code="context_length_exceeded",
            )
        rid = f"cmpl-{uuid.uuid4().hex[:24]}"
        turn = TurnRequest(rid, sid or "", ids, max_new, req.temperature, (tok.eos_id,), salt)
        return turn, sid or ""

    async def run_turn(
        turn: TurnRequest, sid: str, text: str | None, stops: list[str], on_text=None
    ) -> dict[str, Any]:
        """Drive a turn to the end; `on_text(str)` gets each text delta (streaming)."""
        t0 = time.perf_counter()
        dec = StreamDecoder(tok)
        out_ids: list[int] = []
        out_text = ""
        routed: Routed | None = None
        finish = "length"
        first = True
        agen = backend.generate(turn)
        try:
            async for ev in agen:
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
                            await on_text(delta)
                        finish = "stop"
                        break
                    if on_text and delta:
                        await on_text(delta)
                elif isinstance(ev, Finished):
                    finish = ev.reason
        finally:
            await agen.aclose()
        tail = dec.flush()
        if tail and finish != "stop":
            out_text += tail
            if on_text:
                await on_text(tail)
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
            "usage": {
                "prompt_tokens": len(turn.prompt_ids),
                "completion_tokens": len(out_ids),
                "total_tokens": len(turn.prompt_ids) + len(out_ids),
                "cached_tokens": routed.hit_tokens if routed else 0,
            },
            "dualpath": {
                "read_path": routed.read_path if routed else "none",
                "prefill_node": routed.prefill_node if routed else "",
                "decode_node": routed.decode_node if routed else "",
                "policy": routed.policy if routed else "",
                "session_id": sid,
                "token_ids": out_ids,
            },
        }

    async def serve(request: Request, chat: bool) -> Response:
        endpoint = "chat" if chat else "completions"
        try:
            tenant = authorize(request)
            obj = await read_json(request)
            req = parse(ChatRequest if chat else CompletionRequest, obj)
            if chat:
                text: str | None = tok.chat([m.model_dump() for m in req.messages])
                ids = None
            elif isinstance(req.prompt, list):
                text, ids = None, list(req.prompt)
            else:
                text, ids = req.prompt, None
            turn, sid = turn_for(req, text, ids, request, tenant)
            stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
            created = int(time.time())
            if req.stream:
                metrics.requests.labels(endpoint, "200").inc()
                return StreamingResponse(
                    _sse(turn, sid, text, stops, chat, created),
                    media_type="text/event-stream",
                    headers={"x-request-id": turn.request_id},
                )
            res = await run_turn(turn, sid, text, stops)
        except ApiError as err:
            metrics.requests.labels(endpoint, str(err.status)).inc()
            return err.response()
        except BackendError as err:
            metrics.requests.labels(endpoint, str(err.status)).inc()
            return ApiError(
                err.status, f"cluster unavailable: {err}", code="unavailable", type_="server_error"
            ).response()
        metrics.requests.labels(endpoint, "200").inc()
        choice: dict[str, Any] = {"index": 0, "finish_reason": res["finish_reason"]}
        if chat:
            choice["message"] = {"role": "assistant", "content": res["text"]}
        else:
            choice["text"] = res["text"]
        return JSONResponse(
            {
                "id": turn.request_id,
                "object": "chat.completion" if chat else "text_completion",
                "created": created,
                "model": model_name,
                "choices": [choice],
                "usage": res["usage"],
                "dualpath": res["dualpath"],
            }
        )

    async def _sse(
        turn: TurnRequest, sid: str, text: str | None, stops: list[str], chat: bool, created: int
    ) -> AsyncIterator[bytes]:
        import asyncio

        queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: str | None, finish: str | None, extra: dict | None = None) -> bytes:
            c: dict[str, Any] = {"index": 0, "finish_reason": finish}
            if chat:
                c["delta"] = {"content": delta} if delta is not None else {}
            else:
                c["text"] = delta or ""
            body = {
                "id": turn.request_id,
                "object": obj,
                "created": created,
                "model": model_name,
                "choices": [c],
                **(extra or {}),
            }
            return f"data: {json.dumps(body)}\n\n".encode()

        async def on_text(delta: str) -> None:
            await queue.put(chunk(delta, None))

        async def drive() -> None:
            try:
                res = await run_turn(turn, sid, text, stops, on_text)
                await queue.put(
                    chunk(
                        None,
                        res["finish_reason"],
                        {"usage": res["usage"], "dualpath": res["dualpath"]},
                    )
                )
            except BackendError as err:
                e = {
                    "error": {
                        "message": f"cluster unavailable: {err}",
                        "type": "server_error",
                        "param": None,
                        "code": "unavailable",
                    }
                }
                await queue.put(f"data: {json.dumps(e)}\n\n".encode())
            finally:
                await queue.put(None)

        if chat:
            yield f"data: {json.dumps({'id': turn.request_id, 'object': obj, 'created': created, 'model': model_name, 'choices': [{'index': 0, 'delta': {'role': 'assistant'}, 'finish_reason': None}]})}\n\n".encode()  # noqa: E501
        task = asyncio.create_task(drive())
        try:
            while (item := await queue.get()) is not None:
                yield item
            yield b"data: [DONE]\n\n"
        finally:
            if not task.done():
                task.cancel()

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
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "owned_by": "dualpath"}],
        }

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
