"""What the worker's pieces have in common, below all of them: a node's options
(`NodeOptions`), the address it advertises, the channels it dials prefill peers over, and `Node`:
what a node holds, as its parts (`parts.py`), its gRPC service (`service.py`), its registration
(`registration.py`) and its drain (`drain.py`) read and set it. `node.WorkerNode`, on top of
them, is the node; the vLLM worker (`vllm.py`) shares the options, the address and the channels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from dualpath.config import ClusterConfig, Role
from dualpath.grpc_auth import Auth
from dualpath.grpc_channels import ChannelCache
from dualpath.v1 import worker_pb2_grpc as wpb_grpc

if TYPE_CHECKING:  # the parts import torch and NIXL: built in start() (parts.py)
    from dualpath.engine import Engine
    from dualpath.kv.events import KvEventBuffer
    from dualpath.kv.protocol import BlockStore
    from dualpath.kv.queue import ReadQueue
    from dualpath.transfer.protocol import KVTransfer
    from dualpath.worker.decode import DecodeRole
    from dualpath.worker.prefill import PrefillRole

MAX_MESSAGE_BYTES = 64 << 20  # a Prefill's prompt and logits of a large vocabulary


@dataclass
class NodeOptions:
    role: Role
    node_id: str
    host: str = "127.0.0.1"
    port: int = 0
    advertise: str = ""  # host[:port] peers and the scheduler use (port: the bound one)
    advertise_host: str = ""  # with the bound port when `advertise` is empty (default host)
    scheduler: str = ""  # empty: run without a scheduler (tests)
    storage: str = ""
    # None: from spec.workers (kvCacheTokens, transferDeadlineSeconds, requestTimeoutSeconds,
    # drainSeconds); a value overrides the config for tests and local experiments
    kv_cache_tokens: int | None = None  # decode: the paged KV cache of the decode batch
    deadline_s: float | None = None  # one transfer, one notification wait, one buffer wait
    request_timeout_s: float | None = None  # one Prefill call, queueing for compute included
    drain_s: float | None = None  # drain bound on SIGTERM
    store_backend: str = "auto"
    # the cluster token every gRPC call to and from this node carries, or its mutual TLS
    # certificate (`dualpath.tls`); None: unauthenticated
    token: Auth | None = None


def advertised_address(opts: NodeOptions, port: int) -> str:
    """The host:port peers and the scheduler dial: `advertise` as given when it names a port,
    else its host (or `advertise_host`, or the bound host) with the bound `port`."""
    adv = opts.advertise
    if adv and adv.rsplit(":", 1)[-1].isdigit():
        return adv
    return f"{adv or opts.advertise_host or opts.host}:{port}"


def prefill_channels(auth: Auth | None) -> ChannelCache:
    """A decode node's channels to prefill nodes (it calls their Prefill only): by address,
    closed when unreachable, idle, or their node left the cluster (`grpc_channels`)."""
    return ChannelCache(
        auth,
        server_role="prefill",
        options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)],
    )


class Standing(Protocol):
    """The node's standing with the scheduler, as the service and the drain use it
    (`registration.NodeRegistration`)."""

    def claim(self, request_id: str) -> None: ...

    async def flush_kv_events(self) -> None: ...

    async def drain(self) -> int: ...


class Node(Protocol):
    """What a worker node holds (`node.WorkerNode`): its config, options and timeouts, its
    state, its parts (None until built) and its standing with the scheduler."""

    cfg: ClusterConfig
    opts: NodeOptions
    role: Role
    node_id: str
    kv_cache_tokens: int
    deadline_s: float
    request_timeout_s: float
    drain_s: float
    storage_path: str
    draining: bool  # told the scheduler; still serving what is in flight
    stopping: bool  # refusing new calls
    inflight: int  # Prefill and Generate calls being served
    engine: Engine | None
    store: BlockStore | None
    read_queue: ReadQueue | None
    transfer: KVTransfer | None
    prefill: PrefillRole | None
    decode: DecodeRole | None
    kv_events: KvEventBuffer | None
    registration: Standing

    @property
    def address(self) -> str: ...

    async def worker_stub(self, address: str) -> wpb_grpc.WorkerStub: ...

    async def stop(self) -> None: ...
