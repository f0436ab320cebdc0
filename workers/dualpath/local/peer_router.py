"""The router in front of a peer's vLLM instances (`bench local --peers`): an httpx transport,
so the bench's own replay (`bench.replay`) drives any peer unchanged.

A turn the replay sends to `/v1/completions` goes to one instance, chosen by its session
(sticky: an agent's turns meet the prefix cache that holds its context), or, for vLLM's own
P/D, first to a prefill instance with `max_tokens` 1 and `kv_transfer_params.do_remote_decode`
and then to the session's decode instance with the `kv_transfer_params` the prefill returned
(the protocol of vLLM's toy proxy for its NixlConnector, which is not in the wheel). The
answer's SSE stream is passed through with the one thing the replay reads that vLLM does not
send: the finish chunk's `dualpath` object (the generated token ids, the peer as its path).
"""

from __future__ import annotations

import copy
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx

COMPLETIONS = "/v1/completions"
# the toy proxy's first request: prefill here, the decode pulls the KV (NIXL READ)
REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def upstream_body(body: dict[str, Any]) -> dict[str, Any]:
    """The replay's request as vLLM takes it: no `session_id` (the router's, not vLLM's), and
    the generated token ids in the stream (`return_token_ids`)."""
    out = {k: v for k, v in body.items() if k != "session_id"}
    out["return_token_ids"] = True
    return out


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The P/D prefill request: the prompt, one token, not streamed, the KV kept for the
    decode instance to pull."""
    out = copy.deepcopy(upstream_body(body))
    out.update(stream=False, max_tokens=1, kv_transfer_params=dict(REMOTE_DECODE))
    out.pop("stream_options", None)
    out.pop("min_tokens", None)
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def decode_body(body: dict[str, Any], kv_transfer_params: dict[str, Any] | None) -> dict[str, Any]:
    """The P/D decode request: the whole request, with where its prompt's KV is."""
    out = upstream_body(body)
    if kv_transfer_params:
        out["kv_transfer_params"] = kv_transfer_params
    return out


class Sticky:
    """Each session on one of `n` instances: new sessions round-robin, a known one stays."""

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError("a peer needs at least one instance")
        self.n, self.of = n, {}

    def pick(self, session: str) -> int:
        if session not in self.of:
            self.of[session] = len(self.of) % self.n
        return self.of[session]


class AnswerStream(httpx.AsyncByteStream):
    """vLLM's SSE answer, line by line, its finish chunk given the `dualpath` object the
    replay reads (`token_ids`: every chunk's delta so far; `read_path`: `path`)."""

    def __init__(self, upstream: httpx.Response, path: str) -> None:
        self.upstream, self.path = upstream, path

    async def lines(self) -> AsyncIterator[str]:
        """The upstream's lines, split on b"\n" only: vLLM writes generated text unescaped
        in its JSON, and text may hold U+2028 or U+0085, which httpx's `aiter_lines` (like
        `str.splitlines`) would split a JSON string on."""
        buf = b""
        async for chunk in self.upstream.aiter_bytes():
            buf += chunk
            *whole, buf = buf.split(b"\n")
            for raw in whole:
                yield raw.rstrip(b"\r").decode()
        if buf:
            yield buf.decode()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        ids: list[int] = []
        async for line in self.lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ev = json.loads(line[6:])
                for choice in ev.get("choices") or ():
                    ids.extend(choice.get("token_ids") or ())
                    if choice.get("finish_reason"):
                        ev["dualpath"] = {"token_ids": list(ids), "read_path": self.path}
                line = "data: " + json.dumps(ev)
            yield (line + "\n").encode()

    async def aclose(self) -> None:
        await self.upstream.aclose()


class PeerRouter(httpx.AsyncBaseTransport):
    """Route the replay's turns to a peer's instances (URLs): `serve` answer the turns (the
    decode instances under P/D); with `prefill`, each turn is prefilled there first
    (round-robin) and its KV handed on by `kv_transfer_params`. `upstream`: the transport
    to the instances (tests pass a fake)."""

    def __init__(
        self,
        serve: list[str],
        prefill: list[str] | None = None,
        path: str = "peer",
        timeout_s: float = 600.0,
        upstream: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.serve, self.prefill, self.path = serve, prefill or [], path
        self.sticky = Sticky(len(serve))
        self.turns = 0
        self.client = httpx.AsyncClient(
            timeout=timeout_s,
            transport=upstream,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method != "POST" or request.url.path != COMPLETIONS:
            return httpx.Response(404, json={"error": {"message": f"no route {request.url.path}"}})
        body = json.loads(await request.aread())
        target = self.serve[self.sticky.pick(str(body.get("session_id", "")))]
        self.turns += 1
        if self.prefill:
            pre = await self.client.post(
                self.prefill[self.turns % len(self.prefill)] + COMPLETIONS, json=prefill_body(body)
            )
            if pre.status_code != 200:
                return httpx.Response(pre.status_code, content=pre.content)
            body = decode_body(body, pre.json().get("kv_transfer_params"))
        else:
            body = upstream_body(body)
        up = await self.client.send(
            self.client.build_request("POST", target + COMPLETIONS, json=body), stream=True
        )
        if up.status_code != 200:
            content = await up.aread()
            await up.aclose()
            return httpx.Response(up.status_code, content=content)
        return httpx.Response(
            200, headers={"content-type": "text/event-stream"}, stream=AnswerStream(up, self.path)
        )

    async def aclose(self) -> None:
        await self.client.aclose()
