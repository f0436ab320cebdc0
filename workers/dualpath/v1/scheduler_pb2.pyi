from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_PREFILL: _ClassVar[Role]
    ROLE_DECODE: _ClassVar[Role]

class ReadPath(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    READ_PATH_UNSPECIFIED: _ClassVar[ReadPath]
    READ_PATH_PREFILL: _ClassVar[ReadPath]
    READ_PATH_DECODE: _ClassVar[ReadPath]
ROLE_UNSPECIFIED: Role
ROLE_PREFILL: Role
ROLE_DECODE: Role
READ_PATH_UNSPECIFIED: ReadPath
READ_PATH_PREFILL: ReadPath
READ_PATH_DECODE: ReadPath

class NodeLoad(_message.Message):
    __slots__ = ("read_pending_bytes", "tokens_queued", "tokens_running", "requests_running", "buffer_free_bytes", "draining")
    READ_PENDING_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_QUEUED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    BUFFER_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    read_pending_bytes: int
    tokens_queued: int
    tokens_running: int
    requests_running: int
    buffer_free_bytes: int
    draining: bool
    def __init__(self, read_pending_bytes: _Optional[int] = ..., tokens_queued: _Optional[int] = ..., tokens_running: _Optional[int] = ..., requests_running: _Optional[int] = ..., buffer_free_bytes: _Optional[int] = ..., draining: _Optional[bool] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("node_id", "role", "address", "transfer_address", "snic_bytes_per_s", "prefill_tokens_per_s", "group", "config_hash", "load", "incarnation")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SNIC_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    CONFIG_HASH_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    role: Role
    address: str
    transfer_address: str
    snic_bytes_per_s: float
    prefill_tokens_per_s: float
    group: str
    config_hash: str
    load: NodeLoad
    incarnation: str
    def __init__(self, node_id: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., address: _Optional[str] = ..., transfer_address: _Optional[str] = ..., snic_bytes_per_s: _Optional[float] = ..., prefill_tokens_per_s: _Optional[float] = ..., group: _Optional[str] = ..., config_hash: _Optional[str] = ..., load: _Optional[_Union[NodeLoad, _Mapping]] = ..., incarnation: _Optional[str] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("heartbeat_interval_ms", "node_timeout_ms")
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    NODE_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_ms: int
    node_timeout_ms: int
    def __init__(self, heartbeat_interval_ms: _Optional[int] = ..., node_timeout_ms: _Optional[int] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("node_id", "load", "incarnation", "claimed_request_ids")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    CLAIMED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    load: NodeLoad
    incarnation: str
    claimed_request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, node_id: _Optional[str] = ..., load: _Optional[_Union[NodeLoad, _Mapping]] = ..., incarnation: _Optional[str] = ..., claimed_request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class HeartbeatAck(_message.Message):
    __slots__ = ("known", "kv_snapshot_id")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    KV_SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    known: bool
    kv_snapshot_id: int
    def __init__(self, known: _Optional[bool] = ..., kv_snapshot_id: _Optional[int] = ...) -> None: ...

class RouteRequest(_message.Message):
    __slots__ = ("request_id", "session_id", "prompt_tokens", "context_bytes", "max_new_tokens", "queue_timeout_s", "block_keys", "exclude_nodes")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    BLOCK_KEYS_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_NODES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    session_id: str
    prompt_tokens: int
    context_bytes: int
    max_new_tokens: int
    queue_timeout_s: float
    block_keys: bytes
    exclude_nodes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_id: _Optional[str] = ..., session_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., context_bytes: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., queue_timeout_s: _Optional[float] = ..., block_keys: _Optional[bytes] = ..., exclude_nodes: _Optional[_Iterable[str]] = ...) -> None: ...

class RouteResponse(_message.Message):
    __slots__ = ("request_id", "prefill_node", "prefill_address", "decode_node", "decode_address", "read_path", "policy", "est_read_finish_s", "hit_tokens", "hit_bytes")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_NODE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DECODE_NODE_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    READ_PATH_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    EST_READ_FINISH_S_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prefill_node: str
    prefill_address: str
    decode_node: str
    decode_address: str
    read_path: ReadPath
    policy: str
    est_read_finish_s: float
    hit_tokens: int
    hit_bytes: int
    def __init__(self, request_id: _Optional[str] = ..., prefill_node: _Optional[str] = ..., prefill_address: _Optional[str] = ..., decode_node: _Optional[str] = ..., decode_address: _Optional[str] = ..., read_path: _Optional[_Union[ReadPath, str]] = ..., policy: _Optional[str] = ..., est_read_finish_s: _Optional[float] = ..., hit_tokens: _Optional[int] = ..., hit_bytes: _Optional[int] = ...) -> None: ...

class CompleteRequest(_message.Message):
    __slots__ = ("request_id", "generated_tokens", "ok", "cancelled", "failed_node")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    FAILED_NODE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    generated_tokens: int
    ok: bool
    cancelled: bool
    failed_node: str
    def __init__(self, request_id: _Optional[str] = ..., generated_tokens: _Optional[int] = ..., ok: _Optional[bool] = ..., cancelled: _Optional[bool] = ..., failed_node: _Optional[str] = ...) -> None: ...

class CompleteResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("known", "routed_in_flight")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    ROUTED_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    known: bool
    routed_in_flight: int
    def __init__(self, known: _Optional[bool] = ..., routed_in_flight: _Optional[int] = ...) -> None: ...

class ClusterViewRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("node_id", "role", "address", "healthy", "load", "seconds_since_heartbeat", "group", "config_hash")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SINCE_HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    CONFIG_HASH_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    role: Role
    address: str
    healthy: bool
    load: NodeLoad
    seconds_since_heartbeat: float
    group: str
    config_hash: str
    def __init__(self, node_id: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., address: _Optional[str] = ..., healthy: _Optional[bool] = ..., load: _Optional[_Union[NodeLoad, _Mapping]] = ..., seconds_since_heartbeat: _Optional[float] = ..., group: _Optional[str] = ..., config_hash: _Optional[str] = ...) -> None: ...

class ClusterViewResponse(_message.Message):
    __slots__ = ("nodes", "policy", "routed_total", "in_flight")
    NODES_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    ROUTED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeInfo]
    policy: str
    routed_total: int
    in_flight: int
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodeInfo, _Mapping]]] = ..., policy: _Optional[str] = ..., routed_total: _Optional[int] = ..., in_flight: _Optional[int] = ...) -> None: ...

class KvEventBatch(_message.Message):
    __slots__ = ("node_id", "epoch", "seq", "stored_keys", "stored_parents", "stored_depths", "removed_keys")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    STORED_KEYS_FIELD_NUMBER: _ClassVar[int]
    STORED_PARENTS_FIELD_NUMBER: _ClassVar[int]
    STORED_DEPTHS_FIELD_NUMBER: _ClassVar[int]
    REMOVED_KEYS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    epoch: str
    seq: int
    stored_keys: bytes
    stored_parents: bytes
    stored_depths: bytes
    removed_keys: bytes
    def __init__(self, node_id: _Optional[str] = ..., epoch: _Optional[str] = ..., seq: _Optional[int] = ..., stored_keys: _Optional[bytes] = ..., stored_parents: _Optional[bytes] = ..., stored_depths: _Optional[bytes] = ..., removed_keys: _Optional[bytes] = ...) -> None: ...

class KvEventAck(_message.Message):
    __slots__ = ("gap",)
    GAP_FIELD_NUMBER: _ClassVar[int]
    gap: bool
    def __init__(self, gap: _Optional[bool] = ...) -> None: ...

class KvSnapshotChunk(_message.Message):
    __slots__ = ("node_id", "snapshot_id", "keys")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    snapshot_id: int
    keys: bytes
    def __init__(self, node_id: _Optional[str] = ..., snapshot_id: _Optional[int] = ..., keys: _Optional[bytes] = ...) -> None: ...

class KvSnapshotAck(_message.Message):
    __slots__ = ("installed", "blocks")
    INSTALLED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    installed: bool
    blocks: int
    def __init__(self, installed: _Optional[bool] = ..., blocks: _Optional[int] = ...) -> None: ...
