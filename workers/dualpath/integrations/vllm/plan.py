"""What the connector's two halves say to each other each step (pure data, pickled by vLLM from
the scheduler process to the worker process), and the route's fields a request carries.

A request carries its route in `kv_transfer_params["dualpath"]` (the worker adapter or any
router sets it from `Scheduler.Route`): the hit in whole store blocks from the scheduler's block
index, the read path, the peer node and the tenant's cache salt. The connector never probes
the store for a hit: a request without a route has none (it still saves its blocks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PARAMS_KEY = "dualpath"
PATHS = ("prefill", "decode")  # the route's read path: P or D (the `path` metric label)


@dataclass(frozen=True)
class Route:
    """The route fields of one request (`kv_transfer_params["dualpath"]`)."""

    hit_tokens: int = 0
    read_path: str = "prefill"
    peer: str = ""  # the other node of the pair (path D: the decode node that reads)
    cache_salt: bytes = b""
    request_id: str = ""  # the scheduler's id of the turn

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
        return cls(hit, path, str(raw.get("peer", "")), salt_bytes, str(raw.get("request_id", "")))

    def params(self) -> dict[str, Any]:
        """The inverse of `of`: what a router puts in `kv_transfer_params`."""
        return {
            PARAMS_KEY: {
                "hit_tokens": self.hit_tokens,
                "read_path": self.read_path,
                "peer": self.peer,
                "cache_salt": self.cache_salt.hex(),
                "request_id": self.request_id,
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
    saves: list[SavePlan] = field(default_factory=list)
