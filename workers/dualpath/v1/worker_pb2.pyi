from dualpath.v1 import scheduler_pb2 as _scheduler_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "session_id", "prompt_tokens", "hit_tokens", "max_new_tokens", "read_path", "prefill_node", "prefill_address", "stop_tokens", "temperature", "seed", "cache_salt", "top_p", "top_k", "min_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    READ_PATH_FIELD_NUMBER: _ClassVar[int]
    PREFILL_NODE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    session_id: str
    prompt_tokens: _containers.RepeatedScalarFieldContainer[int]
    hit_tokens: int
    max_new_tokens: int
    read_path: _scheduler_pb2.ReadPath
    prefill_node: str
    prefill_address: str
    stop_tokens: _containers.RepeatedScalarFieldContainer[int]
    temperature: float
    seed: int
    cache_salt: bytes
    top_p: float
    top_k: int
    min_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., session_id: _Optional[str] = ..., prompt_tokens: _Optional[_Iterable[int]] = ..., hit_tokens: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., read_path: _Optional[_Union[_scheduler_pb2.ReadPath, str]] = ..., prefill_node: _Optional[str] = ..., prefill_address: _Optional[str] = ..., stop_tokens: _Optional[_Iterable[int]] = ..., temperature: _Optional[float] = ..., seed: _Optional[int] = ..., cache_salt: _Optional[bytes] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_tokens: _Optional[int] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("tokens", "finish_reason", "hit_tokens", "read_path", "prefill_seconds")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    READ_PATH_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    hit_tokens: int
    read_path: _scheduler_pb2.ReadPath
    prefill_seconds: float
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., hit_tokens: _Optional[int] = ..., read_path: _Optional[_Union[_scheduler_pb2.ReadPath, str]] = ..., prefill_seconds: _Optional[float] = ...) -> None: ...

class Region(_message.Message):
    __slots__ = ("address", "length")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    address: int
    length: int
    def __init__(self, address: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_tokens", "hit_tokens", "read_path", "decode_node", "decode_agent", "decode_agent_metadata", "decode_hit", "decode_new", "cache_salt", "decode_vllm")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    READ_PATH_FIELD_NUMBER: _ClassVar[int]
    DECODE_NODE_FIELD_NUMBER: _ClassVar[int]
    DECODE_AGENT_FIELD_NUMBER: _ClassVar[int]
    DECODE_AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    DECODE_HIT_FIELD_NUMBER: _ClassVar[int]
    DECODE_NEW_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    DECODE_VLLM_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_tokens: _containers.RepeatedScalarFieldContainer[int]
    hit_tokens: int
    read_path: _scheduler_pb2.ReadPath
    decode_node: str
    decode_agent: str
    decode_agent_metadata: bytes
    decode_hit: Region
    decode_new: Region
    cache_salt: bytes
    decode_vllm: VllmKvTarget
    def __init__(self, request_id: _Optional[str] = ..., prompt_tokens: _Optional[_Iterable[int]] = ..., hit_tokens: _Optional[int] = ..., read_path: _Optional[_Union[_scheduler_pb2.ReadPath, str]] = ..., decode_node: _Optional[str] = ..., decode_agent: _Optional[str] = ..., decode_agent_metadata: _Optional[bytes] = ..., decode_hit: _Optional[_Union[Region, _Mapping]] = ..., decode_new: _Optional[_Union[Region, _Mapping]] = ..., cache_salt: _Optional[bytes] = ..., decode_vllm: _Optional[_Union[VllmKvTarget, _Mapping]] = ...) -> None: ...

class VllmKvTarget(_message.Message):
    __slots__ = ("layer_addresses", "block_bytes", "block_ids", "deadline_unix", "xfer_id", "progress_address")
    LAYER_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_FIELD_NUMBER: _ClassVar[int]
    XFER_ID_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    layer_addresses: _containers.RepeatedScalarFieldContainer[int]
    block_bytes: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    deadline_unix: float
    xfer_id: str
    progress_address: int
    def __init__(self, layer_addresses: _Optional[_Iterable[int]] = ..., block_bytes: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., deadline_unix: _Optional[float] = ..., xfer_id: _Optional[str] = ..., progress_address: _Optional[int] = ...) -> None: ...

class PrefillAccepted(_message.Message):
    __slots__ = ("prefill_agent", "prefill_agent_metadata", "prefill_hit")
    PREFILL_AGENT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    PREFILL_HIT_FIELD_NUMBER: _ClassVar[int]
    prefill_agent: str
    prefill_agent_metadata: bytes
    prefill_hit: Region
    def __init__(self, prefill_agent: _Optional[str] = ..., prefill_agent_metadata: _Optional[bytes] = ..., prefill_hit: _Optional[_Union[Region, _Mapping]] = ...) -> None: ...

class PrefillDone(_message.Message):
    __slots__ = ("last_logits", "vocab_size", "compute_seconds", "wait_seconds")
    LAST_LOGITS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    last_logits: bytes
    vocab_size: int
    compute_seconds: float
    wait_seconds: float
    def __init__(self, last_logits: _Optional[bytes] = ..., vocab_size: _Optional[int] = ..., compute_seconds: _Optional[float] = ..., wait_seconds: _Optional[float] = ...) -> None: ...

class PrefillMessage(_message.Message):
    __slots__ = ("accepted", "done")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    accepted: PrefillAccepted
    done: PrefillDone
    def __init__(self, accepted: _Optional[_Union[PrefillAccepted, _Mapping]] = ..., done: _Optional[_Union[PrefillDone, _Mapping]] = ...) -> None: ...

class TransferInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TransferInfo(_message.Message):
    __slots__ = ("agent", "metadata", "node_id", "role", "config_hash")
    AGENT_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONFIG_HASH_FIELD_NUMBER: _ClassVar[int]
    agent: str
    metadata: bytes
    node_id: str
    role: _scheduler_pb2.Role
    config_hash: str
    def __init__(self, agent: _Optional[str] = ..., metadata: _Optional[bytes] = ..., node_id: _Optional[str] = ..., role: _Optional[_Union[_scheduler_pb2.Role, str]] = ..., config_hash: _Optional[str] = ...) -> None: ...
