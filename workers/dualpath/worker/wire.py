"""proto <-> domain for the worker's messages, in one place (as `scheduler/wire.py` is for the
scheduler's): the roles (`decode.py`, `prefill.py`) see only the types here, never protobuf.

- `Turn` (a `GenerateRequest`): what a decode worker serves, with one `SamplingParams` that
  travels whole from the frontend's admission to the engine (`sampling_fields` /
  `sampling_from_pb` are the only places its fields meet the wire);
- `TurnChunk` (a `GenerateChunk`), `PrefillOrder` (a `PrefillRequest`), `Accepted` and `Done`
  (the `PrefillMessage`s).

A field a worker cannot serve is refused here by name (`BadField`, answered INVALID_ARGUMENT and
counted by the servicer) before any buffer is taken or any transfer posted. The lengths of every
string, bytes and repeated field are bounded before this, by `grpc_bounds` on the server.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dualpath.config import ModelSpec
from dualpath.grpc_bounds import MAX_PROMPT_TOKENS
from dualpath.kv.ids import MAX_SALT_BYTES
from dualpath.log import clip
from dualpath.sampling import SamplingError, SamplingParams
from dualpath.v1 import scheduler_pb2 as spb
from dualpath.v1 import worker_pb2 as wpb
from dualpath.worker.sizes import RequestSizes

PATH_FROM_PB = {spb.READ_PATH_PREFILL: "prefill", spb.READ_PATH_DECODE: "decode"}
PATH_TO_PB = {"prefill": spb.READ_PATH_PREFILL, "decode": spb.READ_PATH_DECODE, "none": 0}


# SamplingParams' names that the wire spells otherwise
_SAMPLING_WIRE_NAMES = {"max_tokens": "max_new_tokens"}


class BadField(ValueError):
    """A request field no worker can serve; the message names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True, slots=True)
class Region:
    """A region of a worker's registered KV buffer, addressable by its peer's agent."""

    address: int
    length: int


@dataclass(frozen=True, slots=True)
class Turn:
    request_id: str
    session_id: str
    prompt: tuple[int, ...]
    hit_tokens: int  # whole blocks the scheduler's index found (the worker verifies them)
    read_path: str  # "prefill" | "decode": which node reads the hit
    prefill_node: str
    prefill_address: str
    cache_salt: bytes
    sampling: SamplingParams


@dataclass(frozen=True, slots=True)
class TurnChunk:
    tokens: tuple[int, ...]
    finish_reason: str = ""  # on the last chunk: "stop" | "length"
    # on the first chunk: what served the turn (a bad block may have shortened the hit)
    hit_tokens: int = 0
    read_path: str = "none"
    prefill_s: float = 0.0


@dataclass(frozen=True, slots=True)
class PrefillOrder:
    request_id: str
    prompt: tuple[int, ...]
    hit_tokens: int
    read_path: str  # "prefill" | "decode" | "none"
    decode_node: str
    decode_agent: str
    decode_agent_metadata: bytes
    decode_hit: Region | None  # path P: the prefill writes the hit KV here
    # the prefill writes the new tokens' KV here; None: the KV goes through the store instead
    # (engine vllm, `via_store`), no NIXL agent or region is named
    decode_new: Region | None
    cache_salt: bytes
    # engine vllm: the decode vLLM's cache over NIXL (`decode_agent` names its agent)
    decode_vllm: VllmKvTarget | None = None


@dataclass(frozen=True, slots=True)
class VllmKvTarget:
    """A decode vLLM's paged KV cache (PrefillRequest.decode_vllm, worker.proto)."""

    layer_addresses: tuple[int, ...]
    block_bytes: int
    block_ids: tuple[int, ...]
    deadline_unix: float
    xfer_id: str
    progress_address: int = 0  # path D: the decode's hit read so far (0: all of it)


MAX_XFER_ID_CHARS = 256
MAX_VLLM_LAYERS = 1024
MAX_VLLM_BLOCKS = 1 << 20


@dataclass(frozen=True, slots=True)
class Accepted:
    agent: str
    metadata: bytes
    hit: Region | None  # path D: where the decode node writes the hit KV


@dataclass(frozen=True, slots=True)
class Done:
    last_logits: bytes  # float32 logits of the last prompt token
    vocab_size: int
    compute_s: float
    wait_s: float


# ---- sampling -------------------------------------------------------------------------------


def sampling_fields(p: SamplingParams) -> dict:
    """The wire fields of `p` (a `GenerateRequest`'s)."""
    return {
        "max_new_tokens": p.max_tokens,
        "stop_tokens": list(p.stop_tokens),
        "temperature": p.temperature,
        "seed": p.seed,
        "top_p": p.top_p,
        "top_k": p.top_k,
        "min_tokens": p.min_tokens,
    }


def sampling_from_pb(msg: wpb.GenerateRequest, vocab_size: int) -> SamplingParams:
    """The request's sampling, refused under the wire's field names (`SamplingParams` checks
    the ranges). A field left out (0) is off: top_p 0 is 1."""
    _in_vocab("stop_tokens", msg.stop_tokens, vocab_size)
    try:
        return SamplingParams(
            temperature=msg.temperature,
            max_tokens=msg.max_new_tokens,
            stop_tokens=tuple(msg.stop_tokens),
            seed=msg.seed,
            top_p=msg.top_p or 1.0,
            top_k=msg.top_k,
            min_tokens=msg.min_tokens,
        )
    except SamplingError as err:
        raise BadField(_SAMPLING_WIRE_NAMES.get(err.field, err.field), err.reason) from None


# ---- Generate -------------------------------------------------------------------------------


def generate_to_pb(turn: Turn) -> wpb.GenerateRequest:
    return wpb.GenerateRequest(
        request_id=turn.request_id,
        session_id=turn.session_id,
        prompt_tokens=turn.prompt,
        hit_tokens=turn.hit_tokens,
        read_path=PATH_TO_PB[turn.read_path],
        prefill_node=turn.prefill_node,
        prefill_address=turn.prefill_address,
        cache_salt=turn.cache_salt,
        **sampling_fields(turn.sampling),
    )


def generate_from_pb(msg: wpb.GenerateRequest, model: ModelSpec) -> Turn:
    prompt = tuple(msg.prompt_tokens)
    _prompt("prompt_tokens", prompt, model.vocab_size)
    if msg.hit_tokens < 0:
        raise BadField("hit_tokens", f"must be >= 0; got {msg.hit_tokens}")
    _salt("cache_salt", msg.cache_salt)
    _address("prefill_address", msg.prefill_address)
    return Turn(
        request_id=msg.request_id,
        session_id=msg.session_id,
        prompt=prompt,
        hit_tokens=msg.hit_tokens,
        read_path=_path(msg.read_path),
        prefill_node=msg.prefill_node,
        prefill_address=msg.prefill_address,
        cache_salt=bytes(msg.cache_salt),
        sampling=sampling_from_pb(msg, model.vocab_size),
    )


def chunk_to_pb(c: TurnChunk) -> wpb.GenerateChunk:
    return wpb.GenerateChunk(
        tokens=c.tokens,
        finish_reason=c.finish_reason,
        hit_tokens=c.hit_tokens,
        read_path=PATH_TO_PB[c.read_path],
        prefill_seconds=c.prefill_s,
    )


def chunk_from_pb(msg: wpb.GenerateChunk) -> TurnChunk:
    hit = int(msg.hit_tokens)
    return TurnChunk(
        tokens=tuple(msg.tokens),
        finish_reason=msg.finish_reason,
        hit_tokens=hit,
        read_path=PATH_FROM_PB.get(msg.read_path, "none") if hit else "none",
        prefill_s=msg.prefill_seconds,
    )


# ---- Prefill --------------------------------------------------------------------------------


def _region_to_pb(r: Region | None) -> wpb.Region | None:
    return None if r is None else wpb.Region(address=r.address, length=r.length)


def prefill_to_pb(o: PrefillOrder) -> wpb.PrefillRequest:
    return wpb.PrefillRequest(
        request_id=o.request_id,
        prompt_tokens=o.prompt,
        hit_tokens=o.hit_tokens,
        read_path=PATH_TO_PB[o.read_path],
        decode_node=o.decode_node,
        decode_agent=o.decode_agent,
        decode_agent_metadata=o.decode_agent_metadata,
        decode_hit=_region_to_pb(o.decode_hit),
        decode_new=_region_to_pb(o.decode_new),
        cache_salt=o.cache_salt,
        decode_vllm=_vllm_target_to_pb(o.decode_vllm),
    )


def _vllm_target_to_pb(t: VllmKvTarget | None) -> wpb.VllmKvTarget | None:
    if t is None:
        return None
    return wpb.VllmKvTarget(
        layer_addresses=t.layer_addresses,
        block_bytes=t.block_bytes,
        block_ids=t.block_ids,
        deadline_unix=t.deadline_unix,
        xfer_id=t.xfer_id,
        progress_address=t.progress_address,
    )


def _vllm_target(msg: wpb.PrefillRequest) -> VllmKvTarget | None:
    """The decode vLLM's cache of an engine-vllm order (absent: no NIXL, the store path)."""
    if not msg.HasField("decode_vllm"):
        return None
    t = msg.decode_vllm
    if not msg.decode_agent or not msg.decode_agent_metadata:
        raise BadField("decode_agent", "and decode_agent_metadata are required with decode_vllm")
    if not 0 < len(t.layer_addresses) <= MAX_VLLM_LAYERS:
        raise BadField("decode_vllm.layer_addresses", f"must hold 1..{MAX_VLLM_LAYERS} layers")
    if any(a == 0 for a in t.layer_addresses):
        raise BadField("decode_vllm.layer_addresses", "holds a null address")
    if t.block_bytes <= 0:
        raise BadField("decode_vllm.block_bytes", "must be > 0")
    if not 0 < len(t.block_ids) <= MAX_VLLM_BLOCKS or any(b < 0 for b in t.block_ids):
        raise BadField("decode_vllm.block_ids", f"must hold 1..{MAX_VLLM_BLOCKS} ids >= 0")
    if not t.deadline_unix > 0:
        raise BadField("decode_vllm.deadline_unix", "must be > 0")
    if not 0 < len(t.xfer_id) <= MAX_XFER_ID_CHARS:
        raise BadField("decode_vllm.xfer_id", f"must be 1..{MAX_XFER_ID_CHARS} characters")
    return VllmKvTarget(
        tuple(t.layer_addresses),
        t.block_bytes,
        tuple(t.block_ids),
        t.deadline_unix,
        t.xfer_id,
        t.progress_address,
    )


def prefill_from_pb(
    msg: wpb.PrefillRequest, model: ModelSpec, via_store: bool = False
) -> PrefillOrder:
    """The order, its fields checked (the regions against the request's own layout; whether
    they lie in the decode agent's buffer is the role's to check, with its transfer engine).
    `via_store` (engine vllm): the decode node names its vLLM's cache (`decode_vllm`, with its
    agent) or nothing (the KV goes through the store); the regions are neither needed nor
    read."""
    prompt = tuple(msg.prompt_tokens)
    _prompt("prompt_tokens", prompt, model.vocab_size)
    _salt("cache_salt", msg.cache_salt)
    if not msg.request_id:
        raise BadField("request_id", "is required")
    try:
        layout = RequestSizes.of(model, int(msg.hit_tokens), len(prompt))
    except ValueError as err:
        raise BadField("hit_tokens", str(err)) from None
    path = _path(msg.read_path) if layout.hit_blocks else "none"
    agent, metadata, hit, new, vllm = "", b"", None, None, None
    if via_store:
        vllm = _vllm_target(msg)
        if vllm is not None:
            agent, metadata = msg.decode_agent, bytes(msg.decode_agent_metadata)
    else:
        if not msg.decode_agent:
            raise BadField("decode_agent", "is required (the decode worker's NIXL agent)")
        agent, metadata = msg.decode_agent, bytes(msg.decode_agent_metadata)
        new = _region("decode_new", msg, layout.new_bytes)
        hit = _region("decode_hit", msg, layout.hit_bytes) if path == "prefill" else None
    return PrefillOrder(
        request_id=msg.request_id,
        prompt=prompt,
        hit_tokens=int(msg.hit_tokens),
        read_path=path,
        decode_node=msg.decode_node,
        decode_agent=agent,
        decode_agent_metadata=metadata,
        decode_hit=hit,
        decode_new=new,
        cache_salt=bytes(msg.cache_salt),
        decode_vllm=vllm,
    )


def prefill_message_to_pb(m: Accepted | Done) -> wpb.PrefillMessage:
    if isinstance(m, Accepted):
        return wpb.PrefillMessage(
            accepted=wpb.PrefillAccepted(
                prefill_agent=m.agent,
                prefill_agent_metadata=m.metadata,
                prefill_hit=_region_to_pb(m.hit),
            )
        )
    return wpb.PrefillMessage(
        done=wpb.PrefillDone(
            last_logits=m.last_logits,
            vocab_size=m.vocab_size,
            compute_seconds=m.compute_s,
            wait_seconds=m.wait_s,
        )
    )


def prefill_message_from_pb(msg: wpb.PrefillMessage) -> Accepted | Done:
    kind = msg.WhichOneof("kind")
    if kind == "accepted":
        a = msg.accepted
        hit = (
            Region(a.prefill_hit.address, a.prefill_hit.length)
            if a.HasField("prefill_hit")
            else None
        )
        return Accepted(a.prefill_agent, bytes(a.prefill_agent_metadata), hit)
    if kind == "done":
        d = msg.done
        return Done(bytes(d.last_logits), d.vocab_size, d.compute_seconds, d.wait_seconds)
    raise ValueError(f"a PrefillMessage with neither accepted nor done: {msg}")


# ---- checks ---------------------------------------------------------------------------------


def _in_vocab(field: str, ids, vocab_size: int) -> None:  # noqa: ANN001
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise BadField(field, f"token id {bad} outside the vocabulary (0..{vocab_size - 1})")


def _prompt(field: str, prompt: tuple[int, ...], vocab_size: int) -> None:
    if not prompt:
        raise BadField(field, "is empty")
    if len(prompt) > MAX_PROMPT_TOKENS:
        raise BadField(field, f"has {len(prompt)} tokens; at most {MAX_PROMPT_TOKENS}")
    _in_vocab(field, prompt, vocab_size)


def _salt(field: str, salt: bytes) -> None:
    if len(salt) > MAX_SALT_BYTES:
        raise BadField(field, f"is {len(salt)} bytes; at most {MAX_SALT_BYTES}")


# host:port, the host a name, IPv4 or [IPv6]: what a node registers (`advertised_address`)
_ADDRESS = re.compile(r"(?:[A-Za-z0-9_.-]+|\[[0-9A-Fa-f:.]+\]):(\d{1,5})")


def _address(field: str, address: str) -> None:
    """A node's gRPC address as a decode worker dials it: a malformed one can never work
    (INVALID_ARGUMENT, not the UNAVAILABLE a client would retry)."""
    m = _ADDRESS.fullmatch(address)
    if m is None or not 0 < int(m.group(1)) < 65536:
        shown = clip(address) if address else "empty"
        raise BadField(field, f"must be a node's host:port; got {shown}")


def _path(value: int) -> str:
    if value == spb.READ_PATH_UNSPECIFIED:
        return "prefill"  # a hit whose reader is not said: the prefill node reads it
    if value not in PATH_FROM_PB:
        raise BadField("read_path", f"unknown read path {value}")
    return PATH_FROM_PB[value]


def _region(field: str, msg: wpb.PrefillRequest, need_bytes: int) -> Region:
    if not msg.HasField(field):
        raise BadField(field, f"is required ({need_bytes} bytes of the decode worker's buffer)")
    r = getattr(msg, field)
    if r.length < need_bytes:
        raise BadField(field, f"is {r.length} bytes; the request's KV needs {need_bytes}")
    if r.address == 0 or r.address + r.length >= 1 << 64:
        raise BadField(field, f"[{r.address:#x}, +{r.length}) is no buffer address")
    return Region(r.address, r.length)
