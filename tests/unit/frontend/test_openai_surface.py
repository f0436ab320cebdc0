"""The OpenAI request and response shapes clients rely on, over the in-memory FakeBackend:
usage with `prompt_tokens_details.cached_tokens`, the separate usage chunk, the token limits
and sampling fields reaching the turn, and every unknown or unserved field refused by name."""

from __future__ import annotations

import json

import httpx
import pytest
from asgi_client import serving
from dualpath.config import local_default
from dualpath.frontend.app import create_app
from dualpath.frontend.backend import FakeBackend, TurnRequest
from dualpath.frontend.tokenizer import EOS

CFG = local_default()
MODEL = CFG.spec.model.name
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}]}
COMPLETION = {"model": MODEL, "prompt": "hello there"}


class RecordingBackend(FakeBackend):
    """The fake cluster, keeping each turn's request as the app built it."""

    def __init__(self) -> None:
        super().__init__(CFG.spec.model)
        self.requests: list[TurnRequest] = []

    def generate(self, req: TurnRequest):  # noqa: ANN201
        self.requests.append(req)
        return super().generate(req)


@pytest.fixture
def fake() -> RecordingBackend:
    return RecordingBackend()


@pytest.fixture
async def client(fake: RecordingBackend):
    async with serving(create_app(CFG, fake)) as c:
        yield c


def sse(r: httpx.Response) -> list[dict | str]:
    assert r.status_code == 200, r.text
    out: list[dict | str] = []
    for line in r.text.splitlines():
        if line.startswith("data: "):
            out.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
    return out


@pytest.mark.parametrize(
    ("path", "body"), [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)]
)
async def test_usage_names_cached_tokens_as_openai_does(client, path: str, body: dict) -> None:
    r = await client.post(path, json={**body, "max_tokens": 3})
    usage = r.json()["usage"]
    assert set(usage) == {
        "prompt_tokens",
        "completion_tokens",
        "total_tokens",
        "prompt_tokens_details",
    }
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
    assert r.json()["choices"][0]["logprobs"] is None
    assert r.headers["x-request-id"] == r.json()["id"]


@pytest.mark.parametrize(
    ("path", "body"), [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)]
)
async def test_include_usage_sends_one_last_chunk_without_choices(
    client, path: str, body: dict
) -> None:
    req = {**body, "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}}
    events = sse(await client.post(path, json=req))
    assert events[-1] == "[DONE]"
    last, finish = events[-2], events[-3]
    assert last["choices"] == []
    assert last["usage"]["completion_tokens"] == 5
    assert "cached_tokens" in last["usage"]["prompt_tokens_details"]
    assert finish["choices"][0]["finish_reason"] == "length"
    assert all(e["usage"] is None for e in events[:-2])  # null on every other chunk
    # without it: no usage anywhere, as OpenAI
    plain = sse(await client.post(path, json={**body, "max_tokens": 5, "stream": True}))
    assert all("usage" not in e for e in plain[:-1])
    assert all(e["choices"] for e in plain[:-1])


async def test_continuous_usage_counts_tokens_on_every_chunk(client) -> None:
    opts = {"include_usage": True, "continuous_usage_stats": True}
    req = {**COMPLETION, "max_tokens": 6, "stream": True, "stream_options": opts}
    events = sse(await client.post("/v1/completions", json=req))[:-1]
    counts = [e["usage"]["completion_tokens"] for e in events if e["choices"]]
    assert counts == sorted(counts) and counts[-1] == 6


async def test_max_completion_tokens_ignore_eos_min_tokens_reach_the_turn(client, fake) -> None:
    body = {**CHAT, "max_completion_tokens": 40, "ignore_eos": True, "min_tokens": 7}
    r = await client.post("/v1/chat/completions", json=body)
    assert r.json()["usage"]["completion_tokens"] == 40
    turn = fake.requests[-1]
    assert (turn.sampling.max_tokens, turn.sampling.min_tokens, turn.sampling.stop_tokens) == (
        40,
        7,
        (),
    )
    await client.post("/v1/chat/completions", json={**CHAT, "stop_token_ids": [7, 9]})
    assert fake.requests[-1].sampling.stop_tokens == (7, 9, EOS)
    assert fake.requests[-1].sampling.max_tokens == 16  # the default


async def test_min_tokens_holds_back_a_stop_token(client) -> None:
    first = (await client.post("/v1/completions", json={**COMPLETION, "max_tokens": 1})).json()
    stop = first["dualpath"]["token_ids"][0]
    body = {**COMPLETION, "max_tokens": 5, "stop_token_ids": [stop]}
    r = (await client.post("/v1/completions", json=body)).json()
    assert (r["usage"]["completion_tokens"], r["choices"][0]["finish_reason"]) == (1, "stop")
    r = (await client.post("/v1/completions", json={**body, "min_tokens": 3})).json()
    assert r["usage"]["completion_tokens"] >= 3


async def test_sampling_fields_reach_the_turn(client, fake) -> None:
    body = {**CHAT, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "seed": 42}
    assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
    t = fake.requests[-1].sampling
    assert (t.temperature, t.top_p, t.top_k, t.seed) == (0.7, 0.9, 20, 42)
    await client.post("/v1/chat/completions", json={**CHAT, "temperature": 0.7})
    assert fake.requests[-1].sampling.seed != 0  # unseeded sampling draws its own seed
    await client.post("/v1/chat/completions", json={**CHAT, "top_k": -1})
    t = fake.requests[-1].sampling
    assert (t.temperature, t.top_p, t.top_k) == (0.0, 1.0, 0)  # greedy unless asked


async def test_stop_strings_cut_the_text(client) -> None:
    full = (await client.post("/v1/completions", json={**COMPLETION, "max_tokens": 12})).json()
    text = full["choices"][0]["text"]
    stop = text[3:5]
    cut = (
        await client.post("/v1/completions", json={**COMPLETION, "max_tokens": 12, "stop": [stop]})
    ).json()
    assert cut["choices"][0]["text"] == text[: text.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"


async def test_text_parts_and_developer_role_are_chat_content(client) -> None:
    parts = [{"type": "text", "text": "hello "}, {"type": "text", "text": "there"}]
    msgs = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": parts}]
    a = await client.post("/v1/chat/completions", json={**CHAT, "messages": msgs})
    msgs[1]["content"] = "hello there"
    b = await client.post("/v1/chat/completions", json={**CHAT, "messages": msgs})
    assert a.status_code == 200 and a.json()["choices"] == b.json()["choices"]


async def test_one_prompt_in_a_list_is_served(client) -> None:
    a = (
        await client.post("/v1/completions", json={**COMPLETION, "prompt": ["hello there"]})
    ).json()
    b = (await client.post("/v1/completions", json=COMPLETION)).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"]


@pytest.mark.parametrize(
    ("path", "extra", "param", "code"),
    [
        ("/v1/completions", {"foo": 1}, "foo", "unknown_parameter"),
        ("/v1/chat/completions", {"tools": []}, "tools", "unknown_parameter"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "tool", "content": "ok", "tool_call_id": "c1"}]},
            "messages.0.tool_call_id",
            "unknown_parameter",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x", "x": 1}]},
            "messages.0.x",
            "unknown_parameter",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages.0.content",
            None,
        ),
        (
            "/v1/chat/completions",
            {"stream": True, "stream_options": {"bogus": True}},
            "stream_options.bogus",
            "unknown_parameter",
        ),
        (
            "/v1/chat/completions",
            {"stream_options": {"include_usage": True}},
            "stream_options",
            "invalid_parameter",
        ),
        ("/v1/chat/completions", {"n": 2}, "n", "unsupported_parameter"),
        ("/v1/chat/completions", {"logprobs": True}, "logprobs", "unsupported_parameter"),
        ("/v1/chat/completions", {"top_logprobs": 3}, "top_logprobs", "unsupported_parameter"),
        ("/v1/completions", {"logprobs": 2}, "logprobs", "unsupported_parameter"),
        ("/v1/completions", {"best_of": 3}, "best_of", "unsupported_parameter"),
        ("/v1/completions", {"echo": True}, "echo", "unsupported_parameter"),
        (
            "/v1/chat/completions",
            {"presence_penalty": 0.5},
            "presence_penalty",
            "unsupported_parameter",
        ),
        (
            "/v1/chat/completions",
            {"max_tokens": 4, "max_completion_tokens": 5},
            "max_completion_tokens",
            "invalid_parameter",
        ),
        (
            "/v1/chat/completions",
            {"max_completion_tokens": 4, "min_tokens": 5},
            "min_tokens",
            "invalid_parameter",
        ),
        (
            "/v1/chat/completions",
            {"max_completion_tokens": 10**6},
            "max_completion_tokens",
            "invalid_parameter",
        ),
        (
            "/v1/chat/completions",
            {"stop_token_ids": [10**6]},
            "stop_token_ids",
            "invalid_parameter",
        ),
        ("/v1/chat/completions", {"top_p": 0}, "top_p", "invalid_parameter"),
        ("/v1/chat/completions", {"stop": [""]}, "stop", "invalid_parameter"),
        ("/v1/completions", {"prompt": ["a", "b"]}, "prompt", "unsupported_parameter"),
    ],
)
async def test_unknown_and_unserved_fields_are_refused_by_name(
    client, path: str, extra: dict, param: str, code: str | None
) -> None:
    base = CHAT if "chat" in path else COMPLETION
    r = await client.post(path, json={**base, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param or err["param"].startswith(param + "."), err
    assert param.split(".")[0] in err["message"]
    if code:
        assert err["code"] == code


async def test_neutral_values_of_unserved_fields_are_accepted(client) -> None:
    neutral = {
        "n": 1,
        "logprobs": False,
        "top_logprobs": 0,
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "logit_bias": {},
        "user": "agent-7",
        "seed": 1,
        "stop": None,
    }
    r = await client.post("/v1/chat/completions", json={**CHAT, **neutral})
    assert r.status_code == 200, r.text


async def test_models_lists_the_served_model_in_openai_shape(client) -> None:
    m = (await client.get("/v1/models")).json()["data"][0]
    assert (m["id"], m["object"], m["owned_by"]) == (MODEL, "model", "dualpath")
    assert isinstance(m["created"], int) and m["max_model_len"] > 0
