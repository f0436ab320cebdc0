"""The fault suite's judge: how `dualpath faults` classifies an answer (against a mock
frontend, no cluster), and how a row is held to the bars."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from dualpath.local.faults.client import GEN_TOKENS, Client, Result
from dualpath.local.faults.report import RECOVER_BAR_S, Row, table


def _client(handler, deadline_s: float = 2.0) -> Client:
    c = Client("http://frontend", "dualpath-tiny", deadline_s)
    c.http = httpx.AsyncClient(base_url="http://frontend", transport=httpx.MockTransport(handler))
    c.refs = {1: ([5, 6, 7], "abc")}
    return c


def _answer(ids, finish="length"):
    return httpx.Response(
        200,
        json={
            "choices": [{"text": "abc", "finish_reason": finish}],
            "usage": {"prompt_tokens_details": {"cached_tokens": 32}},
            "dualpath": {"token_ids": ids, "decode_node": "decode-1"},
        },
    )


def _sse(*events: str) -> httpx.Response:
    body = "".join(f"data: {e}\n\n" for e in events)
    return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})


CHUNK = json.dumps({"choices": [{"text": "abc", "finish_reason": "length"}]})


@pytest.mark.parametrize(
    ("response", "stream", "kind", "wrong", "empty"),
    [
        (_answer([5, 6, 7]), False, "ok", False, False),
        (_answer([5, 6, 8]), False, "ok", True, False),  # greedy tokens differ: wrong
        (_answer([], "length"), False, "ok", True, True),  # nothing: empty (and wrong)
        (_sse(CHUNK, "[DONE]"), True, "ok", False, False),
        (_sse(json.dumps({"choices": [{"text": "abd"}]}), "[DONE]"), True, "ok", True, True),
        (_sse(CHUNK), True, "lost", False, False),  # neither [DONE] nor an error event
        (_sse(json.dumps({"error": {"message": "decode-0 gone"}})), True, "failed", False, False),
        (
            httpx.Response(503, json={"error": {"message": "no pair"}}),
            False,
            "failed",
            False,
            False,
        ),
    ],
)
async def test_answers_are_classified(response, stream, kind, wrong, empty) -> None:
    c = _client(lambda request: response)
    res = await c.turn(1, max_tokens=GEN_TOKENS, stream=stream)
    await c.close()
    assert (res.kind, res.wrong, res.empty) == (kind, wrong, empty), res


async def test_a_turn_without_an_answer_within_its_deadline_is_hung() -> None:
    async def slow(request):
        await asyncio.sleep(5)
        return _answer([5, 6, 7])

    c = _client(slow, deadline_s=0.2)
    res = await c.turn(1)
    await c.close()
    assert res.kind == "hung"


async def test_a_refusal_records_its_status_and_retry_after() -> None:
    c = _client(
        lambda r: httpx.Response(
            429, json={"error": {"message": "full"}}, headers={"Retry-After": "1"}
        )
    )
    res = await c.turn(1)
    await c.close()
    assert (res.kind, res.status, res.retry_after, res.error) == ("failed", 429, True, "full")


def test_a_row_misses_its_bars_on_any_loss_or_a_slow_recovery() -> None:
    row = Row("scheduler-kill", recover_s=RECOVER_BAR_S["scheduler-kill"] - 1)
    row.add([Result("ok"), Result("failed", status=503)])
    row.judge()
    assert row.bars == [] and (row.sent, row.succeeded, row.failed_clean) == (2, 1, 1)
    bad = Row("decode-kill", recover_s=9.0)
    bad.add(
        [Result("lost"), Result("hung"), Result("ok", wrong=True), Result("failed", status=500)],
        bad_input=True,
    )
    bad.judge()
    assert bad.bars == ["lost=1", "hung=1", "wrong=1", "bad_input_5xx=1", "recover_s>5"]
    assert "MISSED" in table([bad]) and "| ok |" in table([row])


def test_a_503_is_counted_and_a_bar_where_a_restarted_worker_must_be_waited_for() -> None:
    # a scheduler down answers 503 with Retry-After, as it should; a worker's restart must not
    sched = Row("scheduler-kill", recover_s=1.0)
    sched.add([Result("failed", status=503)])
    sched.judge()
    assert sched.unavailable == 1 and sched.bars == []
    for fault in ("prefill-kill", "prefill-kills", "decode-kill"):
        row = Row(fault, recover_s=1.0)
        row.add([Result("ok"), Result("failed", status=503), Result("failed", status=429)])
        row.judge()
        assert (row.failed_clean, row.unavailable) == (2, 1) and row.bars == ["503=1"], fault
    assert "| 503 |" in table([sched])


async def test_a_wrong_answer_names_where_it_differs_and_what_served_it() -> None:
    c = _client(lambda request: _answer([5, 9, 7]))
    res = await c.turn(1)
    await c.close()
    assert res.wrong
    assert res.error.startswith("prompt 1: token 1 differs (got [9, 7], reference [6, 7]); 32")
    assert "decode decode-1" in res.error
    row = Row("disconnects")
    row.add([Result("ok"), res])
    row.judge()
    assert row.bars == ["wrong=1"] and "first wrong: prompt 1: token 1 differs" in row.note


def test_the_default_run_directory_gives_a_config_the_workers_accept(tmp_path, monkeypatch):
    """`dualpath faults` runs in out/faults by default, a relative path: the store in its
    config must be absolute (a pod's mount path), or `dualpath up` refuses the config."""
    from pathlib import Path

    from dualpath import config
    from dualpath.local.faults.up import fault_config

    monkeypatch.chdir(tmp_path)
    res = fault_config(Path("out/faults/kv"))
    cfg = config.from_resource(res)
    assert cfg.spec.storage.path == str(tmp_path / "out/faults/kv")


def _streamed(ids, text="abc"):
    final = {
        "choices": [{"text": text, "finish_reason": "length"}],
        "dualpath": {
            "token_ids": ids,
            "read_path": "decode",
            "prefill_node": "prefill-0",
            "decode_node": "decode-1",
        },
    }
    usage = {"choices": [], "usage": {"prompt_tokens_details": {"cached_tokens": 48}}}
    return _sse(json.dumps(final), json.dumps(usage), "[DONE]")


async def test_a_wrong_streamed_answer_keeps_its_whole_story(tmp_path) -> None:
    """A streamed turn is judged on its token ids too (the same text from other ids is
    wrong), asks for the usage chunk, and a wrong one records its cached tokens, read path,
    nodes and both answers' token ids; a failed run keeps that evidence with the cluster log."""
    from dualpath.local.faults.report import keep_evidence

    asked = []

    def handler(request):
        asked.append(json.loads(request.content))
        return _streamed([5, 6, 9])

    c = _client(handler)
    res = await c.turn(1, stream=True)
    await c.close()
    assert asked[0]["stream_options"] == {"include_usage": True}
    assert res.kind == "ok" and res.wrong and res.cached == 48
    assert res.error.startswith("prompt 1: token 2 differs (got [9], reference [7]); 48 cached")
    assert "path decode, prefill prefill-0, decode decode-1" in res.error
    ev = res.evidence
    assert ev["token_ids"] == [5, 6, 9] and ev["reference_token_ids"] == [5, 6, 7]
    assert (ev["first_differing_token"], ev["cached_tokens"], ev["read_path"]) == (2, 48, "decode")
    c = _client(lambda request: _streamed([5, 6, 7]))
    assert not (await c.turn(1, stream=True)).wrong  # the same ids and text: right
    await c.close()

    row = Row("decode-kill")
    row.add([Result("ok"), res, Result("lost", error="cut")])
    row.judge()
    assert [e["kind"] for e in row.evidence] == ["wrong", "lost"]
    (tmp_path / "cluster.log").write_text("decode-1: KV read ...\n")
    dest = keep_evidence(tmp_path, [row, Row("overload")])
    assert (dest / "cluster.log").read_text() == "decode-1: KV read ...\n"
    (kept,) = json.loads((dest / "evidence.json").read_text())
    assert kept["fault"] == "decode-kill" and kept["evidence"][0]["token_ids"] == [5, 6, 9]
