"""The local tools' streaming client (bench replay, fault suite) against the real app over the
in-memory fake cluster: a whole stream, a refusal, a cut stream and a failure mid-stream."""

from __future__ import annotations

from collections.abc import AsyncIterator

from asgi_client import serving
from dualpath.config import local_default
from dualpath.frontend.app import create_app
from dualpath.frontend.backend import BackendError, Event, FakeBackend, TurnRequest
from dualpath.local.openai_client import stream_completion

CFG = local_default()
BODY = {"model": CFG.spec.model.name, "prompt": "hello there", "max_tokens": 5, "stream": True}


class DiesAfter(FakeBackend):
    """Serves `after` events of a turn, then loses its decode node."""

    after: int = 3

    async def generate(self, req: TurnRequest) -> AsyncIterator[Event]:
        n = 0
        async for ev in super().generate(req):
            if n == self.after:
                raise BackendError("decode gone")
            n += 1
            yield ev


async def test_a_whole_stream_reads_text_finish_usage_and_done() -> None:
    async with serving(create_app(CFG, FakeBackend(CFG.spec.model))) as c:
        plain = (await c.post("/v1/completions", json={**BODY, "stream": False})).json()
        body = {**BODY, "stream_options": {"include_usage": True}}
        st = await stream_completion(c, body, timeout_s=30)
    assert st.status == 200 and st.response is None and st.done and not st.error
    assert st.text == plain["choices"][0]["text"]
    assert st.finish_reason == plain["choices"][0]["finish_reason"]
    assert st.final is not None
    assert st.final["dualpath"]["token_ids"] == plain["dualpath"]["token_ids"]
    assert st.usage is not None and st.usage["completion_tokens"] == 5
    assert st.ttft_s is not None and st.ttft_s > 0


async def test_a_refusal_keeps_the_response_and_reads_no_stream() -> None:
    async with serving(create_app(CFG, FakeBackend(CFG.spec.model))) as c:
        st = await stream_completion(c, {**BODY, "model": "nope"})
    assert st.status == 404 and not st.done and st.final is None
    assert st.response is not None
    assert st.response.json()["error"]["code"] == "model_not_found"


async def test_cut_after_the_first_chunk() -> None:
    chunks: list[int] = []
    async with serving(create_app(CFG, FakeBackend(CFG.spec.model))) as c:
        st = await stream_completion(
            c, {**BODY, "max_tokens": 50}, on_chunk=lambda: chunks.append(1), cut_after_first=True
        )
    assert st.cut and not st.done and st.finish_reason == "" and chunks == [1]


async def test_a_failure_mid_stream_is_its_error_event_without_done() -> None:
    async with serving(create_app(CFG, DiesAfter(CFG.spec.model))) as c:
        st = await stream_completion(c, BODY)
    assert st.status == 200 and not st.done and st.final is None
    assert "decode gone" in st.error
