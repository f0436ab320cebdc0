"""Seeded bad input for the frontend (HTTP bodies) and the scheduler (gRPC messages).

One generator each, used by the unit tests (in process) and by `dualpath faults` (against the
processes of a local cluster): every case must be answered with a 4xx (HTTP) or a definite
refusal (gRPC INVALID_ARGUMENT and the like), never a 5xx / INTERNAL / UNKNOWN or a hang.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

LONE = "\ud800"  # a lone UTF-16 surrogate: valid JSON ("\\ud800"), not encodable as UTF-8

# Odd JSON values: undecodable text, absurd numbers, wrong types, deep nesting.
ODD_VALUES: tuple[Any, ...] = (
    LONE,
    "ok" + LONE + "ok",
    "\udfff",
    "",
    "x" * 5000,
    "héllo ✓ 😀",
    None,
    True,
    0,
    -1,
    2**31,
    2**63,
    -(2**63),
    10**30,
    1.5,
    -0.0,
    float("nan"),
    float("inf"),
    [],
    [1, 2, 3],
    [LONE],
    [[[[[]]]]],
    {},
    {"a": LONE},
    json.loads("[" * 60 + "]" * 60),
    [{"role": "user", "content": LONE}],
    [{"role": "robot", "content": "x"}],
    [{"role": "user"}],
    [{"role": "user", "content": ["x"]}],
)
HTTP_FIELDS = (
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "temperature",
    "stream",
    "stop",
    "session_id",
    "user",
    "n",
    "cache_salt",
    LONE,
    "extra",
)


def valid_bodies(model: str) -> tuple[dict, dict]:
    """A valid completion and a valid chat body (2 new tokens each)."""
    completion = {"model": model, "prompt": "hello", "max_tokens": 2}
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return completion, chat


def http_cases(n: int, model: str, seed: int = 19) -> list[tuple[str, bytes]]:
    """`n` seeded mutations of valid requests, as (endpoint "chat"|"completions", body): one
    field (or an unknown one) set to an odd value, sometimes two, half of them streamed."""
    rng = random.Random(seed)
    completion, chat = valid_bodies(model)
    out = []
    for _ in range(n):
        is_chat = rng.random() < 0.5
        body: dict = dict(chat if is_chat else completion)
        body[rng.choice(HTTP_FIELDS)] = rng.choice(ODD_VALUES)
        if rng.random() < 0.3:
            body[rng.choice(HTTP_FIELDS)] = rng.choice(ODD_VALUES)
        if rng.random() < 0.5:
            body.setdefault("stream", True)
        out.append(("chat" if is_chat else "completions", json.dumps(body).encode()))
    return out


# ---- gRPC ---------------------------------------------------------------------------------

ODD_INTS = (0, -1, -(2**63), 2**63 - 1, 2**41, 1 << 50, 7)
ODD_INT32 = (0, -1, -(2**31), 2**31 - 1, 7)
ODD_UINT64 = (0, 2**63, 2**64 - 1)  # never a small id a live snapshot or seq could have
ODD_FLOATS = (math.nan, math.inf, -math.inf, -1.0, 1e300, 0.0, 2.5)
ODD_STRINGS = ("", "x" * 10_000, "a:b:c", "127.0.0.1:0", "127.0.0.1:99999", "nohost", "é✓")
ODD_BYTES = (b"", b"\x01", b"\x00" * 7, b"\xff" * 9, b"\x00" * 8 * 3)


@dataclass(frozen=True, slots=True)
class GrpcCase:
    method: str  # Scheduler method: Route, Register, Heartbeats, Complete, KvEvents, KvSnapshot
    request: Any  # the message (Heartbeats, KvSnapshot: a list of messages, streamed)


def grpc_cases(n: int, seed: int = 19) -> list[GrpcCase]:
    """`n` seeded Scheduler calls with out-of-range or malformed fields. No case is a valid
    registration (that would add a real, addressless node to a cluster under test); heartbeats
    name nodes that are not registered, Complete ids that were never routed."""
    from dualpath.v1 import scheduler_pb2 as pb

    rng = random.Random(seed)

    def load() -> Any:
        return pb.NodeLoad(
            read_pending_bytes=rng.choice(ODD_INTS),
            tokens_queued=rng.choice(ODD_INTS),
            tokens_running=rng.choice(ODD_INTS),
            requests_running=rng.choice(ODD_INT32),
            buffer_free_bytes=rng.choice(ODD_INTS),
            draining=rng.random() < 0.5,
        )

    def route() -> Any:
        return pb.RouteRequest(
            request_id=rng.choice(ODD_STRINGS),
            session_id=rng.choice(ODD_STRINGS),
            prompt_tokens=rng.choice(ODD_INTS),
            context_bytes=rng.choice(ODD_INTS),
            max_new_tokens=rng.choice(ODD_INTS),
            queue_timeout_s=rng.choice(ODD_FLOATS),
            block_keys=rng.choice(ODD_BYTES),
            exclude_nodes=[rng.choice(ODD_STRINGS)],
        )

    def register() -> Any:
        bad = rng.randrange(4)  # at least one field out of range: never a valid registration
        return pb.RegisterRequest(
            node_id=rng.choice(("", "fuzz-node")) if bad == 0 else "fuzz-node",
            role=rng.choice((0, 1, 2, 7)) if bad != 1 else 0,
            address=rng.choice(("", "nohost", "127.0.0.1:0", "127.0.0.1:99999")),
            snic_bytes_per_s=rng.choice(ODD_FLOATS),
            prefill_tokens_per_s=rng.choice(ODD_FLOATS),
            load=load(),
            incarnation=rng.choice(ODD_STRINGS),
        )

    def heartbeats() -> list[Any]:
        return [
            pb.Heartbeat(node_id=f"fuzz-ghost-{rng.randrange(9)}", load=load())
            for _ in range(rng.randrange(1, 4))
        ]

    def complete() -> Any:
        return pb.CompleteRequest(
            request_id=rng.choice(ODD_STRINGS) + "-fuzz",
            generated_tokens=rng.choice(ODD_INTS),
            ok=rng.random() < 0.5,
            cancelled=rng.random() < 0.5,
            failed_node=rng.choice(ODD_STRINGS),
        )

    def kv_events() -> Any:
        return pb.KvEventBatch(
            node_id=rng.choice(("", "fuzz-node")),
            epoch=rng.choice(ODD_STRINGS),
            seq=rng.choice(ODD_UINT64),
            stored_keys=rng.choice(ODD_BYTES),
            stored_parents=rng.choice(ODD_BYTES),
            stored_depths=rng.choice(ODD_BYTES),
            removed_keys=rng.choice(ODD_BYTES),
        )

    def kv_snapshot() -> list[Any]:
        return [
            pb.KvSnapshotChunk(
                node_id="fuzz-node",
                snapshot_id=rng.choice(ODD_UINT64),
                keys=rng.choice(ODD_BYTES),
            )
        ]

    makers: dict[str, Callable[[], Any]] = {
        "Route": route,
        "Register": register,
        "Heartbeats": heartbeats,
        "Complete": complete,
        "KvEvents": kv_events,
        "KvSnapshot": kv_snapshot,
    }
    names = sorted(makers)
    return [GrpcCase(m, makers[m]()) for m in (rng.choice(names) for _ in range(n))]
