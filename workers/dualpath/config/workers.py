"""The workers: `spec.prefill` and `spec.decode` (a role's pool of pods), `spec.storage` (the
shared KV directory they read and write) and `spec.workers` (how each worker process starts,
bounds its waits and drains, and the vLLM engine's pods)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, WithJsonSchema, field_validator, model_validator

from dualpath import default_image
from dualpath.config.common import (
    Quantity,
    _Model,
    _volume_schema,
    check_volume_source,
    volume_message,
)


class Toleration(_Model):
    """A Kubernetes toleration copied into every worker pod."""

    key: str | None = None
    """Taint key to tolerate; unset with operator Exists: every taint."""
    operator: Literal["Exists", "Equal"] = "Equal"
    """Exists (any value) or Equal (value must match)."""
    value: str | None = None
    """Taint value, for operator Equal."""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    """Taint effect to tolerate; unset: every effect."""


class Resources(_Model):
    """Container resources of a worker pod, as in any pod spec (`cpu: 4`, `memory: 16Gi`)."""

    limits: dict[str, Quantity] = Field(default_factory=dict, max_length=32)
    """Most of each resource a worker may use."""
    requests: dict[str, Quantity] = Field(default_factory=dict, max_length=32)
    """Resources reserved for each worker."""


class PoolSpec(_Model):
    """One role's pool of worker pods (prefill or decode)."""

    replicas: int = Field(default=1, ge=0, le=4096)
    """Worker pods of this role when its pool is created; after that the DualPathPool owns the
    count (scale with `kubectl scale dualpathpool/<name>-<role>` or an HPA) and an edit here
    scales nothing."""
    gpus_per_pod: int = Field(default=0, ge=0, le=16)
    """nvidia.com/gpu per worker pod (0: CPU)."""
    image: str | None = Field(default=None, min_length=1)
    """Worker image; unset: model.image."""
    resources: Resources = Field(default_factory=Resources)
    """Extra container resources; GPUs and the RDMA device are added from gpusPerPod and
    network.rdma."""
    node_selector: dict[str, str] = Field(default_factory=dict)
    """Node labels the worker pods must match."""
    tolerations: list[Toleration] = Field(default_factory=list, max_length=64)
    """Taints the worker pods tolerate."""
    kv_buffer_bytes: int = Field(default=1 << 30, ge=1 << 20)
    """KV host buffer per node (decode: the path-D staging buffer; prefill: the load buffer)."""
    prefill_tokens_per_s: int = Field(default=0, ge=0)
    """Local emulation / simulator: prefill throughput of one node (tokens/s); 0: unknown."""


class StorageSpec(_Model):
    """Where KV blocks live: a POSIX directory (3FS FUSE, NFS, CephFS, Lustre, local disk)."""

    backend: Literal["posix"] = "posix"
    """Store backend; posix: one file per block in a shared directory."""
    path: str = Field(default="/var/lib/dualpath/kv", min_length=1, max_length=4096)
    """Absolute path of the KV directory, mounted there in every worker pod."""
    volume: Annotated[dict[str, Any] | None, WithJsonSchema(_volume_schema())] = None
    """Kubernetes volume source for path: exactly one of persistentVolumeClaim, nfs, hostPath,
    csi, cephfs, glusterfs, azureFile, ephemeral, emptyDir; unset: a private emptyDir per pod."""
    capacity_bytes: int = Field(default=64 << 30, ge=1 << 20)
    """Bytes of KV the store may hold before evicting."""
    snic_gbps: float = Field(default=0.0, ge=0.0)
    """Storage NIC bandwidth per node; 0: uncapped (real hardware). Locally a token bucket."""
    read_concurrency: int = Field(default=8, ge=1, le=1024)
    """Block reads in flight per node."""
    read_timeout_ms: int = Field(default=10_000, ge=10, le=3_600_000)
    """Longest a storage read may stall: a hit read in flight this long, or a node's read queue
    that finished no read for this long while a request waits on it, ends the request's hit
    there and the rest is recomputed (a stuck store costs time, not a hung request; a slow one
    that moves is waited for)."""
    # Off by default: on a POSIX directory NIXL POSIX costs ~110 us a transfer and copies slower,
    # so the store reads at 0.68-0.85 of a plain read against 0.82-0.93 for preadv
    # (`dualpath bench store`, docs/kv.md).
    use_nixl: bool = False
    """Read blocks through NIXL's POSIX plugin instead of preadv."""

    @field_validator("path")
    @classmethod
    def _absolute(cls, path: str) -> str:
        if not path.startswith("/"):
            raise ValueError(STORAGE_PATH_MESSAGE)
        return path

    @field_validator("volume")
    @classmethod
    def _one_source(cls, volume: dict[str, Any] | None) -> dict[str, Any] | None:
        return check_volume_source(volume, "storage.volume")


STORAGE_PATH_MESSAGE = "storage.path must be an absolute path: it is the mount path in every pod"
VOLUME_MESSAGE = volume_message("storage.volume")


VLLM_DTYPES = ("float16", "bfloat16", "float32")


class VllmSpec(_Model):
    """The pods of vLLM workers (`workers.engine: vllm`): each runs `dualpath worker`, which
    serves on its own `vllm serve` child with the DualPath KV connector (docs/vllm.md)."""

    image: str = Field(default=default_image("vllm"), min_length=1)
    """Image of the vLLM worker pods: the dualpath image built with ENGINE=vllm (vLLM added); a
    pool's image overrides it."""
    cache_bytes: int = Field(default=8 << 30, ge=1 << 20)
    """Size limit of a vLLM pod's writable cache (an emptyDir: vLLM's, torch.compile's and
    Triton's caches); the root filesystem is read-only."""


class WorkersSpec(_Model):
    """How every worker process (both pools) starts, bounds its waits and drains."""

    startup_seconds: int = Field(default=600, ge=10, le=86_400)
    """Seconds a worker may take to load its model; the pod's startupProbe allows this long."""
    drain_seconds: int = Field(default=120, ge=0, le=3600)
    """On SIGTERM, longest wait for in-flight reads, relays and handoffs; the pod's grace
    period is this plus a 15 s stop margin."""
    transfer_deadline_seconds: int = Field(default=60, ge=1, le=3600)
    """Deadline of one KV transfer, one peer notification wait or one KV buffer wait."""
    request_timeout_seconds: int = Field(default=600, ge=1, le=86_400)
    """Deadline of one prefill call, queueing for compute included; at least
    transferDeadlineSeconds."""
    kv_cache_tokens: int = Field(default=65536, ge=16, le=1 << 26)
    """Decode: tokens of the paged KV cache shared by the decode batch."""
    prefill_batch_quota_ms: int = Field(default=0, ge=0, le=60_000)
    """Prefill: compute quota of one batch of the intra-node batcher; queued requests join a
    batch FIFO while the cost model's estimates (calibrated at start-up) fit it, and run as one
    forward, each bit-identical to running alone. 0: one request per compute job. The paper
    uses 300 ms on a GPU; scale it to the hardware (docs/engine.md)."""
    engine: Literal["dualpath", "vllm"] = "dualpath"
    """The engine that serves the model on every worker: dualpath (the project's torch engine)
    or vllm (an unmodified vLLM with the DualPath KV connector, docs/vllm.md)."""
    run_as_non_root: bool | None = None
    """Run worker containers as uid 65532; unset: non-root unless they request RDMA devices
    (network.rdma.count > 0), where IPC_LOCK, which pins the KV buffer, only takes effect for
    root. Non-root with RDMA needs the runtime's memlock ulimit raised (checked at start-up)."""
    vllm: VllmSpec = VllmSpec()
    """vLLM worker pods (engine vllm): image and writable cache."""

    @model_validator(mode="after")
    def _request_covers_transfer(self) -> WorkersSpec:
        if self.request_timeout_seconds < self.transfer_deadline_seconds:
            raise ValueError(
                "workers.requestTimeoutSeconds must be >= workers.transferDeadlineSeconds "
                "(a prefill call includes its KV transfers)"
            )
        return self
