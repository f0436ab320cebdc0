"""Admission that says what it means: every bad input is a 4xx naming the field (never a 5xx),
a failure before a stream starts is a real status, one after it an SSE error event, and
requests are counted by their final outcome."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import pytest
from asgi_client import serving
from dualpath.config import local_default
from dualpath.frontend.app import create_app
from dualpath.frontend.backend import BackendError, Event, FakeBackend, TurnRequest
from dualpath.frontend.schema import MAX_JSON_DEPTH

CFG = local_default()
MODEL = CFG.spec.model.name
LONE = "\ud800"  # a lone UTF-16 surrogate: valid JSON ("\\ud800"), not encodable as UTF-8


class FailingBackend(FakeBackend):
    """Fails with `error` after `after` events of a normal turn (0: before the first)."""

    error: Exception = BackendError("decode gone")
    after: int = 0

    async def generate(self, req: TurnRequest) -> AsyncIterator[Event]:
        n = 0
        async for ev in super().generate(req):
            if n == self.after:
                raise self.error
            n += 1
            yield ev


@pytest.fixture
def backend() -> FailingBackend:
    b = FailingBackend(CFG.spec.model)
    b.after = 10**9  # serves normally unless a test says otherwise
    return b


@pytest.fixture
async def client(backend: FailingBackend):
    async with serving(create_app(CFG, backend)) as c:
        yield c


def _raw(obj: object) -> bytes:
    # json.dumps escapes a lone surrogate as "\ud800", exactly what a client would send
    return json.dumps(obj).encode()


COMPLETION = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
NEST = "[" * 1000 + "]" * 1000

# (endpoint, body bytes, the field the error must name or None)
CASES: list[tuple[str, bytes, str | None]] = [
    ("completions", _raw({**COMPLETION, "prompt": "a" + LONE}), "prompt"),
    ("completions", _raw({**COMPLETION, "session_id": LONE}), "session_id"),
    ("completions", _raw({**COMPLETION, "user": "u" + LONE}), "user"),
    ("completions", _raw({**COMPLETION, "cache_salt": LONE}), "cache_salt"),
    ("completions", _raw({**COMPLETION, "stop": LONE}), "stop"),
    ("completions", _raw({**COMPLETION, "stop": ["ok", LONE]}), "stop.1"),
    ("completions", _raw({**COMPLETION, "model": LONE}), "model"),
    ("completions", _raw({**COMPLETION, LONE: 1}), "<key>"),
    ("chat", _raw({**CHAT, "messages": [{"role": "user", "content": LONE}]}), "messages.0.content"),
    ("chat", _raw({**CHAT, "messages": [{"role": LONE, "content": "x"}]}), "messages.0.role"),
    ("chat", _raw({**CHAT, "messages": [{"role": "wizard", "content": "x"}]}), "messages.0.role"),
    ("chat", _raw({**CHAT, "messages": [{"role": "user", "content": 5}]}), "messages.0.content"),
    ("chat", _raw({**CHAT, "messages": []}), "messages"),
    ("chat", _raw({**CHAT, "messages": [{"role": "user", "content": "x"}] * 5000}), "messages"),
    ("chat", _raw({**CHAT, "messages": "hi"}), "messages"),
    ("completions", f'{{"model": "{MODEL}", "prompt": {NEST}}}'.encode(), None),
    ("completions", NEST.encode(), None),
    ("completions", ("[" * 100_000).encode(), None),
    ("completions", _raw({**COMPLETION, "x": json.loads("[" * 40 + "]" * 40)}), None),
    (
        "completions",
        f'{{"model": "{MODEL}", "prompt": "a", "max_tokens": {"9" * 5000}}}'.encode(),
        None,
    ),
    ("completions", _raw({**COMPLETION, "max_tokens": 2**63}), "max_tokens"),
    ("completions", _raw({**COMPLETION, "max_tokens": -1}), "max_tokens"),
    ("completions", _raw({**COMPLETION, "max_tokens": "many"}), "max_tokens"),
    ("completions", b'{"model": "m", "prompt": "a", "temperature": 1e999}', "temperature"),
    ("completions", b'{"model": "m", "prompt": "a", "temperature": NaN}', "temperature"),
    ("completions", _raw({**COMPLETION, "prompt": [2**70]}), "prompt"),
    ("completions", _raw({**COMPLETION, "prompt": [-1]}), "prompt"),
    ("completions", _raw({**COMPLETION, "prompt": {"a": 1}}), "prompt"),
    ("completions", _raw({**COMPLETION, "prompt": None}), "prompt"),
    ("completions", _raw({**COMPLETION, "stream": "maybe"}), "stream"),
    ("completions", _raw({**COMPLETION, "session_id": 7}), "session_id"),
    ("completions", _raw({**COMPLETION, "n": 3}), "n"),
    ("completions", _raw([COMPLETION]), None),
    ("completions", b"\xff\xfe", None),
    ("completions", b"", None),
    # can never fit: more than a decode node's KV buffer holds, or than the context limit
    ("completions", _raw({**COMPLETION, "prompt": "a" * 40_000}), "prompt"),
    ("completions", _raw({**COMPLETION, "prompt": "a" * 10, "max_tokens": 10**6}), "max_tokens"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("endpoint", "body", "param"), CASES)
async def test_bad_input_is_a_4xx_naming_the_field(
    client: httpx.AsyncClient, endpoint: str, body: bytes, param: str | None, stream: bool
) -> None:
    if stream and body.startswith(b"{") and len(body) < 1 << 20:
        try:
            obj = json.loads(body)
        except (ValueError, RecursionError):
            obj = None
        if isinstance(obj, dict) and "stream" not in obj:
            obj["stream"] = True
            body = json.dumps(obj).encode()
    r = await client.post(
        f"/v1/{'chat/' if endpoint == 'chat' else ''}completions",
        content=body,
        headers={"content-type": "application/json"},
    )
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert err["message"] and err["code"]
    if param is not None and err["code"] != "model_not_found":
        # a union's branch may follow the field ("prompt.str")
        assert err["param"] == param or err["param"].startswith(param + "."), err
    ok = await client.post("/v1/completions", json=COMPLETION)
    assert ok.status_code == 200


async def test_nesting_bound_is_generous_for_the_api_shapes(client: httpx.AsyncClient) -> None:
    deep = json.loads("[" * (MAX_JSON_DEPTH - 2) + "]" * (MAX_JSON_DEPTH - 2))
    r = await client.post("/v1/completions", json={**COMPLETION, "metadata": deep})
    # past the nesting check: refused only as a field this server does not know
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "unknown_parameter"
    assert r.json()["error"]["param"] == "metadata"


async def test_surrogate_pair_is_text_not_an_error(client: httpx.AsyncClient) -> None:
    body = b'{"model": "%s", "prompt": "\\ud83d\\ude00", "max_tokens": 1}' % MODEL.encode()
    r = await client.post(
        "/v1/completions", content=body, headers={"content-type": "application/json"}
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 4  # the emoji's UTF-8 bytes


def _events(r: httpx.Response) -> list[str]:
    return [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]


@pytest.mark.parametrize(
    ("error", "status", "retry_after"),
    [
        (BackendError("no decode buffer", 429, 1.0), 429, "1"),
        (BackendError("scheduler down", 503, 2.5), 503, "3"),
        (BackendError("bad pair"), 503, None),
        (ValueError("a bug"), 500, None),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
async def test_failure_before_the_first_token_is_a_real_status(
    client: httpx.AsyncClient,
    backend: FailingBackend,
    error: Exception,
    status: int,
    retry_after: str | None,
    stream: bool,
) -> None:
    backend.error, backend.after = error, 0
    r = await client.post("/v1/completions", json={**COMPLETION, "stream": stream})
    assert r.status_code == status, r.text
    assert r.headers.get("retry-after") == retry_after
    assert r.json()["error"]["type"] in ("server_error", "rate_limit_error")
    m = (await client.get("/metrics")).text
    assert f'dualpath_frontend_requests_total{{code="{status}",endpoint="completions"}} 1.0' in m
    assert 'code="200"' not in m


async def test_failure_mid_stream_is_an_error_event_never_a_success(
    client: httpx.AsyncClient, backend: FailingBackend
) -> None:
    backend.after = 3  # Routed and two tokens, then the decode node dies
    r = await client.post("/v1/completions", json={**COMPLETION, "max_tokens": 8, "stream": True})
    assert r.status_code == 200  # already sent with the first token
    events = _events(r)
    assert "[DONE]" not in events
    last = json.loads(events[-1])
    assert last["error"]["code"] == "unavailable" and "decode gone" in last["error"]["message"]
    finishes = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1]]
    assert set(finishes) == {None}  # tokens, but no finish reason: not a success
    m = (await client.get("/metrics")).text
    assert (
        'dualpath_frontend_request_outcomes_total{endpoint="completions",outcome="unavailable"} 1.0'
        in m
    )
    assert 'code="200"' not in m


async def test_requests_counted_by_final_outcome(client: httpx.AsyncClient) -> None:
    await client.post("/v1/completions", json={**COMPLETION, "stream": True})
    await client.post("/v1/completions", json=COMPLETION)
    await client.post("/v1/completions", json={**COMPLETION, "max_tokens": -1})
    m = (await client.get("/metrics")).text
    assert 'dualpath_frontend_requests_total{code="200",endpoint="completions"} 2.0' in m
    assert 'dualpath_frontend_requests_total{code="400",endpoint="completions"} 1.0' in m
    assert 'outcomes_total{endpoint="completions",outcome="length"} 2.0' in m
    assert 'outcomes_total{endpoint="completions",outcome="invalid_parameter"} 1.0' in m


async def test_fuzz_never_answers_5xx(client: httpx.AsyncClient) -> None:
    seen: dict[int, int] = {}
    from dualpath.local.fuzz import http_cases  # the cases `dualpath faults` sends too

    for endpoint, body in http_cases(320, MODEL):
        r = await client.post(
            f"/v1/{'chat/' if endpoint == 'chat' else ''}completions",
            content=body,
            headers={"content-type": "application/json"},
        )
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code < 500, (body[:200], r.text[:300])
        if r.status_code >= 400:
            assert r.json()["error"]["message"]
        elif r.headers["content-type"].startswith("text/event-stream"):
            assert _events(r)[-1] == "[DONE]"
        else:
            assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert seen.get(200) and seen.get(400)  # the fuzz reaches both sides
