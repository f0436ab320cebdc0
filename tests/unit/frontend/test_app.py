"""The HTTP surface over the in-memory FakeBackend (no cluster)."""

from __future__ import annotations

import json

import httpx
import pytest
from asgi_client import serving
from dualpath.config import local_default
from dualpath.frontend.app import create_app
from dualpath.frontend.backend import FakeBackend
from dualpath.frontend.tokenizer import ByteTokenizer, StreamDecoder

CFG = local_default()
MODEL = CFG.spec.model.name


@pytest.fixture
def fake() -> FakeBackend:
    return FakeBackend(CFG.spec.model)


@pytest.fixture
async def client(fake: FakeBackend):
    async with serving(create_app(CFG, fake)) as c:
        yield c


def test_tokenizer_roundtrip_and_stream() -> None:
    tok = ByteTokenizer(CFG.spec.model.vocab_size)
    text = "héllo wörld ✓"
    assert tok.decode(tok.encode(text)) == text
    dec = StreamDecoder(tok)
    out = "".join(dec.push([i]) for i in tok.encode(text)) + dec.flush()
    assert out == text
    with pytest.raises(ValueError, match="vocabSize"):
        ByteTokenizer(100)


async def test_completion_non_streaming(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 5}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["usage"]["completion_tokens"] == 5
    assert body["usage"]["prompt_tokens"] == 5


async def test_streaming_equals_non_streaming(client: httpx.AsyncClient) -> None:
    req = {"model": MODEL, "prompt": "abc" * 30, "max_tokens": 12}
    plain = (await client.post("/v1/completions", json=req)).json()["choices"][0]["text"]
    r = await client.post("/v1/completions", json={**req, "stream": True})
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert text == plain


async def test_chat_streaming_and_not(client: httpx.AsyncClient) -> None:
    req = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}
    plain = (await client.post("/v1/chat/completions", json=req)).json()
    content = plain["choices"][0]["message"]["content"]
    r = await client.post("/v1/chat/completions", json={**req, "stream": True})
    events = [
        json.loads(ln[6:])
        for ln in r.text.splitlines()
        if ln.startswith("data: ") and ln != "data: [DONE]"
    ]
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    streamed = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    assert streamed == content


async def test_second_turn_of_session_hits_store(
    client: httpx.AsyncClient, fake: FakeBackend
) -> None:
    bt = CFG.spec.model.block_tokens
    first = "x" * (3 * bt)
    r1 = (
        await client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": first, "max_tokens": 4, "session_id": "s1"},
        )
    ).json()
    assert r1["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    second = first + r1["choices"][0]["text"] + "more " * 20
    r2 = (
        await client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": second, "max_tokens": 4, "session_id": "s1"},
        )
    ).json()
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] >= 3 * bt
    assert r2["dualpath"]["read_path"] in ("prefill", "decode")


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (b"{not json", 400, "invalid_json"),
        (b"[1, 2]", 400, "invalid_json"),
        (json.dumps({"model": "gpt-5", "prompt": "x"}).encode(), 404, "model_not_found"),
        (
            json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 0}).encode(),
            400,
            "invalid_parameter",
        ),
        (
            json.dumps({"model": MODEL, "prompt": "x", "temperature": 9}).encode(),
            400,
            "invalid_parameter",
        ),
        (
            json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 10**6}).encode(),
            400,
            "invalid_parameter",
        ),
        (json.dumps({"model": MODEL, "prompt": [1, 99999]}).encode(), 400, "invalid_parameter"),
        (json.dumps({"model": MODEL}).encode(), 400, "invalid_parameter"),
        (
            json.dumps(
                {"model": MODEL, "prompt": "y" * (CFG.spec.frontend.max_context_tokens + 1)}
            ).encode(),
            400,
            "context_length_exceeded",
        ),
        (
            b'{"model": "' + b"z" * (CFG.spec.frontend.max_request_bytes + 10) + b'"}',
            413,
            "request_too_large",
        ),
    ],
)
async def test_bad_requests_get_openai_errors_and_server_keeps_serving(
    client: httpx.AsyncClient, body: bytes, status: int, code: str
) -> None:
    r = await client.post(
        "/v1/completions", content=body, headers={"content-type": "application/json"}
    )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["message"]
    ok = await client.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 1})
    assert ok.status_code == 200


async def test_health_and_metrics(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    assert (await client.get("/health")).status_code == 200
    await client.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 2})
    m = (await client.get("/metrics")).text
    assert 'dualpath_frontend_requests_total{code="200",endpoint="completions"}' in m
    fake.healthy = False
    assert (await client.get("/health")).status_code == 503
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "a"})
    assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
