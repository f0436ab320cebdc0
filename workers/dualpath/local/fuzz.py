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
    method: str  # Route, Register, Heartbeats, Complete, KvEvents, KvSnapshot, Drain, ... (below)
    request: Any  # the message (Heartbeats, KvSnapshot: a list of messages, streamed)
    service: str = "Scheduler"  # or "Worker": Generate (a decode node), Prefill (a prefill node)


# Worker RPCs and the node role that serves each.
WORKER_METHODS = {"Generate": "decode", "Prefill": "prefill", "GetTransferInfo": "decode"}


def grpc_cases(
    n: int, seed: int = 19, decode_agent: tuple[str, bytes] | None = None
) -> list[GrpcCase]:
    """`n` seeded Scheduler and Worker calls with out-of-range or malformed fields. No case is a
    valid registration (that would add a real, addressless node to a cluster under test) or a
    valid turn; heartbeats, drains and snapshots name nodes that are not registered, Complete
    ids that were never routed. `decode_agent`: a real decode node's agent (name, metadata), so
    some Prefill calls name a known agent and fail on their regions instead (a region outside
    its buffer: what NIXL would fail with NIXL_ERR_NOT_FOUND)."""
    from dualpath.v1 import scheduler_pb2 as pb
    from dualpath.v1 import worker_pb2 as wpb

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

    def drain() -> Any:
        return pb.DrainRequest(node_id=f"fuzz-ghost-{rng.randrange(9)}" + rng.choice(ODD_STRINGS))

    def cluster_view() -> Any:
        return pb.ClusterViewRequest()

    def bad_tokens() -> list[int]:
        return rng.choice(([], [-1], [2**31 - 1], [5] * rng.randrange(1, 40) + [10**6]))

    def generate() -> Any:
        # a bad prompt, or a sampling field out of range: never a turn a node would serve
        fields = dict(
            request_id=rng.choice(ODD_STRINGS),
            session_id=rng.choice(ODD_STRINGS),
            prompt_tokens=[5] * rng.randrange(1, 40),
            hit_tokens=rng.choice(ODD_INTS),
            max_new_tokens=rng.choice((1, 4)),
            read_path=rng.choice((0, 1, 2, 9)),
            prefill_node=rng.choice(ODD_STRINGS),
            prefill_address=rng.choice(ODD_STRINGS),
            cache_salt=rng.choice((*ODD_BYTES, b"s" * 65)),
            seed=rng.choice(ODD_INTS),
            stop_tokens=rng.choice(([], [-1], [2**31 - 1], [3])),
        )
        bad = rng.choice(("prompt_tokens", "max_new_tokens", "temperature", "top_p", "top_k"))
        fields[bad] = {
            "prompt_tokens": bad_tokens(),
            "max_new_tokens": rng.choice(ODD_INT32[:3]),
            "temperature": rng.choice((math.nan, math.inf, -1.0)),
            "top_p": rng.choice((math.nan, 1.5, -0.5)),
            "top_k": rng.choice((-1, -(2**31))),
        }[bad]
        return wpb.GenerateRequest(**fields)

    def region() -> Any:
        return wpb.Region(
            address=rng.choice(ODD_UINT64[1:] + (8, 4096)),
            length=rng.choice(ODD_UINT64 + (1 << 20,)),
        )

    def prefill() -> Any:
        agent, metadata = rng.choice(
            (("fuzz-agent", rng.choice(ODD_BYTES + (b"junk" * 100,))), decode_agent or ("", b""))
        )
        return wpb.PrefillRequest(
            request_id=rng.choice(ODD_STRINGS) + "-fuzz",
            prompt_tokens=rng.choice((bad_tokens(), [5] * rng.randrange(1, 60))),
            hit_tokens=rng.choice((0, 16, 7, *ODD_INTS)),
            read_path=rng.choice((0, 1, 2, 9)),
            decode_node=rng.choice(ODD_STRINGS),
            decode_agent=agent,
            decode_agent_metadata=metadata,
            decode_hit=region() if rng.random() < 0.7 else None,
            decode_new=region() if rng.random() < 0.9 else None,
            cache_salt=rng.choice(ODD_BYTES),
        )

    def transfer_info() -> Any:
        return wpb.TransferInfoRequest()

    makers: dict[str, Callable[[], Any]] = {
        "Route": route,
        "Register": register,
        "Heartbeats": heartbeats,
        "Complete": complete,
        "KvEvents": kv_events,
        "KvSnapshot": kv_snapshot,
        "Drain": drain,
        "ClusterView": cluster_view,
        "Generate": generate,
        "Prefill": prefill,
        "GetTransferInfo": transfer_info,
    }
    names = sorted(makers)
    return [
        GrpcCase(m, makers[m](), "Worker" if m in WORKER_METHODS else "Scheduler")
        for m in (rng.choice(names) for _ in range(n))
    ]
