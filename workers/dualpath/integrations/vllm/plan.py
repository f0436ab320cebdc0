"""What the connector's two halves say to each other each step (pure data, pickled by vLLM from
the scheduler process to the worker process), and the route's fields a request carries.

A request carries its route in `kv_transfer_params["dualpath"]` (the worker adapter or any
router sets it from `Scheduler.Route`): the hit in whole store blocks from the scheduler's block
index, the read path, the peer node and the tenant's cache salt. The connector never probes
the store for a hit: a request without a route has none (it still saves its blocks).

Between two vLLM instances (docs/vllm.md, "the NIXL flow") a route also says who moves KV:
- a decode instance's request is a *receiver* (`receive`): vLLM parks it until the prompt's
  KV (but its last token) has arrived over NIXL, named by `xfer_id`, or `deadline_unix` passed
  (then it recomputes);
- a prefill instance's request is a *sender* (`send_to`, a `KvTarget`): on path D it reads
  the hit from the decode's cache, and it writes the blocks the decode lacks into the decode's
  blocks, the last transfer followed by the notification `xfer_id`; nothing after
  `deadline_unix - SEND_MARGIN_S` (the decode may have given up and reused its blocks by then).
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, field
from typing import Any

PARAMS_KEY = "dualpath"
PATHS = ("prefill", "decode")  # the route's read path: P or D (the `path` metric label)
# a sender stops writing this long before the receiver's deadline, so no WRITE can land in
# blocks a receiver that gave up has handed back to vLLM
SEND_MARGIN_S = 5.0


def _field(name: str) -> str:
    return f"kv_transfer_params.{PARAMS_KEY}.{name}"


@dataclass(frozen=True)
class KvTarget:
    """A decode instance's KV cache as a sender sees it: its NIXL agent (name, metadata), the
    base address of each layer's cache tensor, the bytes of one vLLM block of a layer, and
    the receiving request's vLLM block ids (block b of layer l: address[l] + b * block_bytes);
    path D: the address of the receiver's progress word (`nixl.progress_word`: the layers of
    its hit read from the store so far; 0: the whole hit is in its cache already)."""

    agent: str
    metadata: bytes
    layer_addresses: tuple[int, ...]
    block_bytes: int
    block_ids: tuple[int, ...]
    progress_address: int = 0

    def params(self) -> dict[str, Any]:
        return {
            "agent": self.agent,
            "metadata": base64.b64encode(self.metadata).decode(),
            "layer_addresses": list(self.layer_addresses),
            "block_bytes": self.block_bytes,
            "block_ids": list(self.block_ids),
            "progress_address": self.progress_address,
        }

    @classmethod
    def of(cls, raw: Any, name: str = "send_to") -> KvTarget:
        if not isinstance(raw, dict):
            raise ValueError(f"{_field(name)} must be an object")
        agent = raw.get("agent")
        if not isinstance(agent, str) or not agent:
            raise ValueError(f"{_field(name)}.agent must be a non-empty string")
        try:
            metadata = base64.b64decode(raw.get("metadata", ""), validate=True)
        except (TypeError, ValueError, binascii.Error):
            raise ValueError(f"{_field(name)}.metadata must be base64") from None
        if not metadata:
            raise ValueError(f"{_field(name)}.metadata must not be empty")
        out = {}
        for key in ("layer_addresses", "block_ids"):
            vals = raw.get(key)
            if (
                not isinstance(vals, list)
                or not vals
                or not all(isinstance(v, int) and v >= 0 for v in vals)
            ):
                raise ValueError(f"{_field(name)}.{key} must be a non-empty list of ints >= 0")
            out[key] = tuple(vals)
        block_bytes = raw.get("block_bytes")
        if not isinstance(block_bytes, int) or block_bytes <= 0:
            raise ValueError(f"{_field(name)}.block_bytes must be an int > 0")
        progress = raw.get("progress_address", 0)
        if not isinstance(progress, int) or progress < 0:
            raise ValueError(f"{_field(name)}.progress_address must be an int >= 0")
        return cls(agent, metadata, out["layer_addresses"], block_bytes, out["block_ids"], progress)


@dataclass(frozen=True)
class Route:
    """The route fields of one request (`kv_transfer_params["dualpath"]`)."""

    hit_tokens: int = 0
    read_path: str = "prefill"
    peer: str = ""  # the other node of the pair (path D: the decode node that reads)
    cache_salt: bytes = b""
    request_id: str = ""  # the scheduler's id of the turn
    xfer_id: str = ""  # names one prefill -> decode transfer (the NIXL notification)
    receive: bool = False  # decode: the prompt's KV arrives over NIXL (vLLM parks the request)
    deadline_unix: float = 0.0  # receive: wait until then; send: write nothing after it
    send_to: KvTarget | None = None  # prefill: the decode cache it reads (path D) and writes

    @classmethod
    def of(cls, kv_transfer_params: dict[str, Any] | None) -> Route:
        """The route of a request's params; refuses a malformed one naming the field."""
        raw = (kv_transfer_params or {}).get(PARAMS_KEY)
        if not raw:
            return cls()
        if not isinstance(raw, dict):
            raise ValueError(f"kv_transfer_params.{PARAMS_KEY} must be an object")
        hit = raw.get("hit_tokens", 0)
        if not isinstance(hit, int) or hit < 0:
            raise ValueError(f"kv_transfer_params.{PARAMS_KEY}.hit_tokens must be an int >= 0")
        path = raw.get("read_path", "prefill")
        if path not in PATHS:
            raise ValueError(f"kv_transfer_params.{PARAMS_KEY}.read_path must be one of {PATHS}")
        salt = raw.get("cache_salt", "")
        try:
            salt_bytes = bytes.fromhex(salt)
        except (TypeError, ValueError):
            raise ValueError(
                f"kv_transfer_params.{PARAMS_KEY}.cache_salt must be a hex string"
            ) from None
        xfer_id = raw.get("xfer_id", "")
        if not isinstance(xfer_id, str):
            raise ValueError(f"{_field('xfer_id')} must be a string")
        receive = raw.get("receive", False)
        if not isinstance(receive, bool):
            raise ValueError(f"{_field('receive')} must be a bool")
        deadline = raw.get("deadline_unix", 0.0)
        if not isinstance(deadline, int | float) or isinstance(deadline, bool) or deadline < 0:
            raise ValueError(f"{_field('deadline_unix')} must be a number >= 0")
        send_to = KvTarget.of(raw["send_to"]) if raw.get("send_to") is not None else None
        if receive and send_to is not None:
            raise ValueError(f"{_field('receive')} and {_field('send_to')} exclude each other")
        if (receive or send_to is not None) and not (xfer_id and deadline > 0):
            raise ValueError(
                f"{_field('xfer_id')} and {_field('deadline_unix')} are required with "
                f"{_field('receive' if receive else 'send_to')}"
            )
        return cls(
            hit,
            path,
            str(raw.get("peer", "")),
            salt_bytes,
            str(raw.get("request_id", "")),
            xfer_id,
            receive,
            float(deadline),
            send_to,
        )

    def params(self) -> dict[str, Any]:
        """The inverse of `of`: what a router puts in `kv_transfer_params`."""
        return {
            PARAMS_KEY: {
                "hit_tokens": self.hit_tokens,
                "read_path": self.read_path,
                "peer": self.peer,
                "cache_salt": self.cache_salt.hex(),
                "request_id": self.request_id,
                "xfer_id": self.xfer_id,
                "receive": self.receive,
                "deadline_unix": self.deadline_unix,
                "send_to": self.send_to.params() if self.send_to is not None else None,
            }
        }


@dataclass
class LoadPlan:
    """Load store blocks `block_ids` (tokens [start, end) of the request) into vLLM's cache."""

    req_id: str
    path: str
    block_ids: list[str]
    start: int
    end: int
    slots: list[int]  # cache slots of tokens [start, end)
    block_table: list[int]  # the request's vLLM blocks (to name the failed ones)
    # path D on a prefill instance: read the hit from the decode's cache over NIXL (its blocks
    # `remote_blocks` into this request's `local_blocks`) instead of from the store
    source: KvTarget | None = None
    local_blocks: list[int] = field(default_factory=list)
    remote_blocks: list[int] = field(default_factory=list)
    deadline_unix: float = 0.0


@dataclass
class RecvPlan:
    """A decode instance's receiver, now that vLLM allocated its blocks: it is ready (the
    rendezvous may answer) once its own hit, tokens [0, hit.end), is in its cache (path D:
    `hit`, read through this node's read queue; None: nothing to read); then it waits for the
    notification `xfer_id` until `deadline_unix`."""

    req_id: str
    xfer_id: str
    path: str
    block_table: list[int]  # vLLM blocks of tokens [0, tokens)
    tokens: int  # prompt tokens the sender provides (all but the last)
    deadline_unix: float
    hit: LoadPlan | None = None


@dataclass
class SendPlan:
    """Write this request's vLLM blocks `local_blocks` (every layer, layer by layer) into the
    decode's `remote_blocks`, then notify `xfer_id`."""

    req_id: str
    xfer_id: str
    path: str
    target: KvTarget
    local_blocks: list[int]
    remote_blocks: list[int]
    deadline_unix: float


@dataclass
class SavePlan:
    """Write the store blocks of tokens [start, len(tokens)) from vLLM's cache."""

    req_id: str
    tokens: list[int]  # the chain: every token up to the last block saved
    start: int
    slots: list[int]  # cache slots of tokens [start, len(tokens))
    salt: bytes


@dataclass
class StepPlan:
    loads: list[LoadPlan] = field(default_factory=list)
    # hits of requests vLLM parked (`hit_load` async): moved while other requests compute,
    # each reported received (`get_transfer_results`) when its last layer is in the cache
    async_loads: list[LoadPlan] = field(default_factory=list)
    saves: list[SavePlan] = field(default_factory=list)
    recvs: list[RecvPlan] = field(default_factory=list)
    sends: list[SendPlan] = field(default_factory=list)
