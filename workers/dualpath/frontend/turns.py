"""Driving one turn through the backend to its end: the text (cut at a stop string), the finish
reason, OpenAI's usage and the `dualpath` facts of the answer; the session remembers it."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from dualpath.frontend.backend import Finished, Routed, Tokens, TurnRequest
from dualpath.frontend.deps import Frontend
from dualpath.frontend.sessions import session_key

OnText = Callable[[str, dict], Awaitable[None]]


def usage_of(turn: TurnRequest, out_ids: list[int], routed: Routed | None) -> dict:
    return {
        "prompt_tokens": len(turn.prompt_ids),
        "completion_tokens": len(out_ids),
        "total_tokens": len(turn.prompt_ids) + len(out_ids),
        "prompt_tokens_details": {"cached_tokens": routed.hit_tokens if routed else 0},
    }


async def run_turn(
    fr: Frontend,
    turn: TurnRequest,
    sid: str,
    text: str | None,
    stops: list[str],
    on_text: OnText | None = None,
    on_start: Callable[[], Any] | None = None,
) -> dict[str, Any]:
    """Drive a turn to the end; `on_text(str, usage)` gets each text delta and the usage
    so far (streaming),
    `on_start()` is called once the backend has started serving it (its first event)."""
    metrics = fr.metrics
    t0 = time.perf_counter()
    dec = fr.tok.stream()
    out_ids: list[int] = []
    out_text = ""
    routed: Routed | None = None
    finish = "length"
    first = True
    agen = fr.backend.generate(turn)
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
                ids = [i for i in ev.ids if i not in turn.sampling.stop_tokens]
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
        fr.sessions.remember(
            session_key(sid, turn.cache_salt), text + out_text, turn.prompt_ids + out_ids
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
