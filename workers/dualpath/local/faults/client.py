"""The suite's clients: turns sent to the frontend, each answer classified (ok, failed
cleanly, lost, hung, wrong against a healthy recompute)."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from dualpath.local.openai_client import stream_completion

log = logging.getLogger(__name__)


PROMPT_TOKENS = 96  # 6 blocks of 16 tokens
GEN_TOKENS = 8
STREAM_DEADLINES = 4


@dataclass(slots=True)
class Result:
    kind: str  # ok | failed | lost | hung | cancelled
    status: int = 0
    start_s: float = 0.0
    end_s: float = 0.0
    retry_after: bool = False
    empty: bool = False
    wrong: bool = False
    cached: int = 0
    decode_node: str = ""
    error: str = ""
    # a wrong answer's whole story (`wrong_answer`): what one occurrence is diagnosed from
    evidence: dict[str, Any] | None = None


def wrong_answer(
    i: int,
    ids: list[int] | None,
    ref: tuple[list[int], str],
    cached: int,
    dualpath: dict[str, Any],
    text: str | None = None,
) -> tuple[str, dict[str, Any]]:
    """A wrong answer to prompt `i` against its reference (token ids, text): the one-line
    error (the first differing token, the turn's cached tokens, read path and nodes) and the
    evidence kept with the row (both answers' token ids and texts too)."""
    ref_ids, ref_text = ref
    at = None
    if ids is not None:
        at = next((k for k, (a, b) in enumerate(zip(ids, ref_ids, strict=False)) if a != b), None)
        if at is None and len(ids) != len(ref_ids):
            at = min(len(ids), len(ref_ids))
    where = (
        f"{cached} cached tokens read via path {dualpath.get('read_path')}, prefill "
        f"{dualpath.get('prefill_node')}, decode {dualpath.get('decode_node')}"
    )
    if at is not None:
        assert ids is not None
        error = (
            f"prompt {i}: token {at} differs (got {ids[at : at + 3]}, reference "
            f"{ref_ids[at : at + 3]}); {where}"
        )
    else:
        error = f"prompt {i}: text {text!r}, reference {ref_text!r} (same token ids); {where}"
    evidence = {
        "prompt": i,
        "first_differing_token": at,
        "cached_tokens": cached,
        "read_path": dualpath.get("read_path"),
        "prefill_node": dualpath.get("prefill_node"),
        "decode_node": dualpath.get("decode_node"),
        "policy": dualpath.get("policy"),
        "session_id": dualpath.get("session_id"),
        "token_ids": ids,
        "reference_token_ids": ref_ids,
        "text": text,
        "reference_text": ref_text,
    }
    return error, evidence


def prompt_ids(i: int, n: int = PROMPT_TOKENS) -> list[int]:
    rng = random.Random(1000 + i)
    return [rng.randrange(3, 500) for _ in range(n)]


class Client:
    """Sends turns to the frontend and classifies each answer; `refs` (prompt index ->
    (token ids, text)) are the healthy recomputes wrong answers are judged against."""

    def __init__(self, base: str, model: str, deadline_s: float) -> None:
        self.base, self.model, self.deadline_s = base, model, deadline_s
        self.refs: dict[int, tuple[list[int], str]] = {}
        self.http = httpx.AsyncClient(
            base_url=base,
            timeout=httpx.Timeout(deadline_s, connect=5.0),
            # a connection per request: no reuse of one the server is closing as idle (a
            # keep-alive race of the client's, not a fault of the cluster's)
            limits=httpx.Limits(max_connections=400, max_keepalive_connections=0),
        )

    async def close(self) -> None:
        await self.http.aclose()

    def body(self, i: int, max_tokens: int = GEN_TOKENS, stream: bool = False) -> dict:
        body = {
            "model": self.model,
            "prompt": prompt_ids(i),
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": stream,
        }
        if stream:  # the usage chunk: a streamed turn's cached tokens, for its evidence
            body["stream_options"] = {"include_usage": True}
        return body

    async def turn(
        self,
        i: int,
        max_tokens: int = GEN_TOKENS,
        stream: bool = False,
        on_chunk: Callable[[], None] | None = None,
        cut_after_first: bool = False,
    ) -> Result:
        res = Result("lost", start_s=time.monotonic())
        # a turn is hung when nothing comes for the deadline (httpx's read timeout); a whole
        # answer may take longer while it streams, up to STREAM_DEADLINES deadlines
        limit = self.deadline_s * (STREAM_DEADLINES if stream else 1)
        try:
            await asyncio.wait_for(
                self._turn(res, i, max_tokens, stream, on_chunk, cut_after_first), limit
            )
        except (TimeoutError, httpx.TimeoutException):
            res.kind, res.error = "hung", f"no answer within {self.deadline_s:.0f}s"
        except httpx.ConnectError as err:
            res.kind, res.error = "failed", f"connection refused: {err}"  # known at once
        except (httpx.TransportError, json.JSONDecodeError) as err:
            res.kind, res.error = "lost", f"{type(err).__name__}: {err}"
        res.end_s = time.monotonic()
        return res

    async def _turn(self, res, i, max_tokens, stream, on_chunk, cut_after_first) -> None:  # noqa: ANN001
        body = self.body(i, max_tokens, stream)
        if not stream:
            r = await self.http.post("/v1/completions", json=body)
            self._status(res, r)
            if r.status_code != 200:
                return
            obj = r.json()
            choice = obj["choices"][0]
            ids = obj["dualpath"]["token_ids"]
            res.cached = obj["usage"]["prompt_tokens_details"]["cached_tokens"]
            res.decode_node = obj["dualpath"].get("decode_node", "")
            res.kind = "ok"
            res.empty = not choice.get("finish_reason") or (
                not ids and choice.get("finish_reason") == "length"
            )
            ref = self.refs.get(i)  # judged when asked for as many tokens as the reference
            res.wrong = ref is not None and max_tokens == GEN_TOKENS and ids != ref[0]
            if res.wrong:
                assert ref is not None
                res.error, res.evidence = wrong_answer(
                    i, ids, ref, res.cached, obj["dualpath"], choice.get("text")
                )
                log.warning("wrong answer: %s; got %s, reference %s", res.error, ids, ref[0])
            return
        st = await stream_completion(
            self.http, body, on_chunk=on_chunk, cut_after_first=cut_after_first
        )
        if st.response is not None:
            self._status(res, st.response)
            return
        res.status = st.status
        if st.cut:
            res.kind = "cancelled"
        elif st.error:
            res.kind, res.error = "failed", st.error
        elif st.done:
            res.kind = "ok"
            res.empty = not st.finish_reason or (not st.text and st.finish_reason == "length")
            dp = (st.final or {}).get("dualpath") or {}
            ids = dp.get("token_ids")
            res.cached = ((st.usage or {}).get("prompt_tokens_details") or {}).get(
                "cached_tokens", 0
            )
            res.decode_node = dp.get("decode_node", "")
            ref = self.refs.get(i)
            res.wrong = (
                ref is not None
                and max_tokens == GEN_TOKENS
                and (ref[1] != st.text or (ids is not None and ids != ref[0]))
            )
            if res.wrong:
                assert ref is not None
                res.error, res.evidence = wrong_answer(i, ids, ref, res.cached, dp, st.text)
                log.warning(
                    "wrong streamed answer: %s; got %s, reference %s", res.error, ids, ref[0]
                )
        else:
            res.kind, res.error = "lost", "stream ended without [DONE] or an error event"

    def _status(self, res: Result, r: httpx.Response) -> None:
        res.status = r.status_code
        res.retry_after = "retry-after" in r.headers
        if r.status_code != 200:
            res.kind = "failed"
            try:
                res.error = r.json()["error"]["message"]
            except Exception:  # noqa: BLE001 (a body that is not our JSON error: still refused)
                res.error = f"HTTP {r.status_code}"

    async def learn(self, ids: range) -> None:
        """Reference answers: each prompt's first turn (GEN_TOKENS), a recompute (nothing
        read)."""
        for i in ids:
            r = await self.http.post("/v1/completions", json=self.body(i, GEN_TOKENS))
            r.raise_for_status()
            obj = r.json()
            if obj["usage"]["prompt_tokens_details"]["cached_tokens"]:
                raise RuntimeError(f"prompt {i} was a hit on a fresh store: no reference")
            self.refs[i] = (obj["dualpath"]["token_ids"], obj["choices"][0]["text"])

    async def loop(
        self, prompts: list[int], stop: asyncio.Event, out: list[Result], gap_s: float = 0.02
    ) -> None:
        """Turns one after another (a prompt from `prompts` each) until `stop`."""
        k = 0
        while not stop.is_set():
            res = await self.turn(prompts[k % len(prompts)])
            out.append(res)
            k += 1
            if res.kind != "ok":
                await asyncio.sleep(0.2)  # a client backs off a little after an error
            else:
                await asyncio.sleep(gap_s)


# ---- rows ------------------------------------------------------------------------------------
