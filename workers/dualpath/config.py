"""The typed model of a DualPath cluster: the one config every process shares.

A `DualPathCluster` custom resource's `spec` is parsed here (camelCase on the wire,
snake_case in Python). The operator renders it into a ConfigMap, the local cluster and the
simulator build the same object without Kubernetes. Nothing else parses this YAML.

Units: `_gbps` fields are gigabits per second (network convention: a "400 Gbps SNIC");
`_bytes` bytes, `_s` / `Seconds` seconds, `_ms` / `Ms` milliseconds.
"""

from __future__ import annotations

import hashlib
import json
from enum import Enum
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

API_GROUP = "dualpath.io"
API_VERSION = "v1alpha1"
KIND = "DualPathCluster"
API_VERSION_FULL = f"{API_GROUP}/{API_VERSION}"


class ConfigError(ValueError):
    """A cluster spec that cannot work; the message names the field and the fix."""


class _Model(BaseModel):
    # extra="forbid": a misspelt field is an error naming it, not a silently ignored key.
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )


class Role(str, Enum):
    PREFILL = "prefill"
    DECODE = "decode"


DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float8": 1}


class RopeScaling(_Model):
    """Llama 3's RoPE frequency scaling (`rope_type: llama3` in a checkpoint's config.json):
    long wavelengths are divided by `factor`, short ones kept, the band between blended."""

    type: Literal["llama3"] = "llama3"
    factor: float = Field(gt=0)
    low_freq_factor: float = Field(default=1.0, gt=0)
    high_freq_factor: float = Field(default=4.0, gt=0)
    original_max_position_embeddings: int = Field(default=8192, gt=0)

    @model_validator(mode="after")
    def _check_band(self) -> RopeScaling:
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError("ropeScaling.highFreqFactor must be > lowFreqFactor")
        return self


class ModelSpec(_Model):
    """Model dimensions. `preset` fills every dimension not given explicitly."""

    name: str = "dualpath-tiny"
    preset: str | None = "tiny"
    image: str = "ghcr.io/dualpath/dualpath:0.1.0"
    checkpoint_path: str | None = Field(
        default=None, description="local dir with config.json + *.safetensors (Llama/Qwen2)"
    )
    attention: Literal["gqa", "mla"] = "gqa"
    layers: int = Field(default=0, ge=0, le=512)
    hidden_size: int = Field(default=0, ge=0)
    heads: int = Field(default=0, ge=0)
    kv_heads: int = Field(default=0, ge=0)
    head_dim: int = Field(default=0, ge=0)
    intermediate_size: int = Field(default=0, ge=0)
    vocab_size: int = Field(default=0, ge=0)
    # MLA (DeepSeek-style): the cached latent per token per layer is kv_lora_rank + rope_head_dim.
    kv_lora_rank: int = Field(default=0, ge=0)
    rope_head_dim: int = Field(default=0, ge=0)
    # Active parameters per token, for the simulator's FLOPs model (0 = derive from dims).
    active_params: int = Field(default=0, ge=0)
    dtype: Literal["float16", "bfloat16", "float32", "float8"] = "float32"
    block_tokens: int = Field(default=64, ge=1, le=4096)
    seed: int = 0
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        preset = data.get("preset", "tiny" if "preset" not in data else None)
        if preset is None:
            return data
        if preset not in MODEL_PRESETS:
            raise ValueError(
                f"unknown model preset {preset!r}; choose one of {sorted(MODEL_PRESETS)} "
                "or set preset: null and give the dimensions"
            )
        # Normalise camelCase keys so explicit values override the preset's snake_case ones.
        by_alias = {to_camel(f): f for f in cls.model_fields}
        merged = dict(MODEL_PRESETS[preset])
        for key, value in data.items():
            if value not in (None, 0) or key == "seed":
                merged[by_alias.get(key, key)] = value
        merged["preset"] = preset
        return merged

    @model_validator(mode="after")
    def _check_dims(self) -> ModelSpec:
        if self.attention == "gqa":
            for field in ("layers", "hidden_size", "heads", "kv_heads", "head_dim", "vocab_size"):
                if getattr(self, field) <= 0:
                    raise ValueError(f"{to_camel(field)} must be > 0 (or use a preset)")
            if self.heads % self.kv_heads:
                raise ValueError(
                    f"heads ({self.heads}) must be a multiple of kvHeads ({self.kv_heads})"
                )
        else:
            if self.layers <= 0 or self.kv_lora_rank <= 0:
                raise ValueError("an MLA model needs layers > 0 and kvLoraRank > 0")
        return self

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def kv_bytes_per_token_layer(self) -> int:
        """Bytes of cached K and V (or MLA latent) for one token in one layer."""
        if self.attention == "mla":
            return (self.kv_lora_rank + self.rope_head_dim) * self.dtype_bytes
        return 2 * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv_bytes_per_token_layer * self.layers

    @property
    def block_bytes(self) -> int:
        """Payload bytes of one full block (all layers, K and V), header excluded."""
        return self.kv_bytes_per_token * self.block_tokens

    @property
    def fingerprint(self) -> str:
        """Identifies the model's KV format: blocks of another fingerprint are misses."""
        dims = self.model_dump(
            include={
                "name",
                "attention",
                "layers",
                "hidden_size",
                "heads",
                "kv_heads",
                "head_dim",
                "kv_lora_rank",
                "rope_head_dim",
                "dtype",
                "block_tokens",
                "seed",
                "checkpoint_path",
                "vocab_size",
                "intermediate_size",
                # K is cached after rotary: another RoPE is another KV
                "rope_theta",
                "rope_scaling",
            }
        )
        return hashlib.sha256(json.dumps(dims, sort_keys=True).encode()).hexdigest()[:16]


# Presets: dims only. `tiny` is for tests (fast on CPU), `small` for benchmarks, the rest are
# shapes of real models (KV sizes drive the simulator and the store benchmark).
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        layers=4,
        hidden_size=64,
        heads=4,
        kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=512,
        dtype="float32",
    ),
    "small": dict(
        layers=8,
        hidden_size=512,
        heads=8,
        kv_heads=4,
        head_dim=64,
        intermediate_size=1408,
        vocab_size=4096,
        dtype="float32",
    ),
    # The store benchmark's default KV shape (Llama-3-8B-like): 32 layers, 8 KV heads, 128 dim, fp16.
    "llama3-8b": dict(
        name="llama3-8b",
        layers=32,
        hidden_size=4096,
        heads=32,
        kv_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=128256,
        dtype="float16",
        active_params=8_000_000_000,
    ),
    "qwen2.5-32b": dict(
        name="qwen2.5-32b",
        layers=64,
        hidden_size=5120,
        heads=40,
        kv_heads=8,
        head_dim=128,
        intermediate_size=27648,
        vocab_size=152064,
        dtype="bfloat16",
        active_params=32_500_000_000,
    ),
    # DeepSeek-V3.2-like MLA (671B total, ~37B active): the cached latent per token per layer is
    # kv_lora_rank + rope_head_dim = 576 values (bf16 here: 1152 B; x61 layers = 70 KB/token).
    "deepseek-v3.2": dict(
        name="deepseek-v3.2",
        attention="mla",
        layers=61,
        hidden_size=7168,
        heads=128,
        kv_heads=1,
        head_dim=128,
        kv_lora_rank=512,
        rope_head_dim=64,
        intermediate_size=18432,
        vocab_size=129280,
        dtype="bfloat16",
        active_params=37_000_000_000,
    ),
    # A smaller DeepSeek-style MLA MoE, ~27B total / ~4B active (the paper's 27B; dims are ours:
    # 30 layers, hidden 3072, same 512+64 latent -> 34.5 KB/token in bf16).
    "dsmla-27b": dict(
        name="dsmla-27b",
        attention="mla",
        layers=30,
        hidden_size=3072,
        heads=24,
        kv_heads=1,
        head_dim=128,
        kv_lora_rank=512,
        rope_head_dim=64,
        intermediate_size=8192,
        vocab_size=129280,
        dtype="bfloat16",
        active_params=4_000_000_000,
    ),
}


class ResourceList(_Model):
    model_config = ConfigDict(extra="allow", frozen=True)


class Toleration(_Model):
    key: str | None = None
    operator: Literal["Exists", "Equal"] = "Equal"
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None


class PoolSpec(_Model):
    """One role's pool of worker pods (prefill or decode)."""

    replicas: int = Field(default=1, ge=0, le=4096)
    gpus_per_pod: int = Field(default=0, ge=0, le=16)
    image: str | None = None
    resources: dict[str, dict[str, str]] = Field(default_factory=dict)
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    # KV host buffer per node (decode: the path-D staging buffer; prefill: the load buffer).
    kv_buffer_bytes: int = Field(default=1 << 30, ge=1 << 20)
    # Local emulation / simulator: prefill throughput of one node (tokens/s) when known.
    prefill_tokens_per_s: int = Field(default=0, ge=0)


class StorageSpec(_Model):
    """Where KV blocks live: a POSIX directory (3FS FUSE, NFS, CephFS, Lustre, local disk)."""

    backend: Literal["posix"] = "posix"
    path: str = "/var/lib/dualpath/kv"
    # A Kubernetes volume source for `path` (e.g. {"persistentVolumeClaim": {"claimName": x}}).
    volume: dict[str, Any] | None = None
    capacity_bytes: int = Field(default=64 << 30, ge=1 << 20)
    # Storage NIC bandwidth per node; 0 = uncapped (real hardware). Locally it is a token bucket.
    snic_gbps: float = Field(default=0.0, ge=0.0)
    read_concurrency: int = Field(default=8, ge=1, le=1024)
    # Read blocks through NIXL's POSIX plugin instead of preadv. Off by default: on a POSIX
    # directory NIXL POSIX costs ~110 us a transfer and copies slower, so the store reads at
    # 0.68-0.85 of a plain read against 0.82-0.93 for preadv (`dualpath bench store`, docs/kv.md).
    use_nixl: bool = False


class TrafficClassSpec(_Model):
    service_level: int = Field(ge=0, le=15)
    traffic_class: int = Field(ge=0, le=255)


class QosSpec(_Model):
    """IB QoS of DESIGN section 5: model traffic high priority, KV traffic low priority."""

    enabled: bool = True
    model: TrafficClassSpec = TrafficClassSpec(service_level=0, traffic_class=0)
    kv: TrafficClassSpec = TrafficClassSpec(service_level=2, traffic_class=64)
    kv_virtual_lane: int = Field(default=2, ge=0, le=14)
    high_weight: int = Field(default=99, ge=1, le=255)
    low_weight: int = Field(default=1, ge=1, le=255)

    @model_validator(mode="after")
    def _distinct(self) -> QosSpec:
        if self.enabled and self.model.service_level == self.kv.service_level:
            raise ValueError(
                "qos.model.serviceLevel and qos.kv.serviceLevel must differ, otherwise KV "
                "traffic is not isolated from the model's collectives"
            )
        return self


class RdmaSpec(_Model):
    resource_name: str = "rdma/hca_shared_devices_a"
    count: int = Field(default=1, ge=0, le=64)
    ib_addr_type: Literal["ib_global", "ib_local", "eth"] | None = None


class NetworkSpec(_Model):
    rdma: RdmaSpec = RdmaSpec()
    multus_networks: list[str] = Field(default_factory=list)
    qos: QosSpec = QosSpec()
    # Compute NIC bandwidth per node for local emulation and the simulator; 0 = uncapped.
    cnic_gbps: float = Field(default=0.0, ge=0.0)


class PolicyName(str, Enum):
    DUALPATH = "dualpath"
    PREFILL_READ = "prefill-read"
    DECODE_READ = "decode-read"
    ROUND_ROBIN = "round-robin"


class SchedulerSpec(_Model):
    policy: PolicyName = PolicyName.DUALPATH
    replicas: int = Field(default=1, ge=1, le=1)  # one active scheduler; state rebuilds on restart
    # alpha: a read queue is "short" while it holds less than this many seconds of SNIC reading.
    short_read_queue_seconds: float = Field(default=3.0, gt=0)
    # beta: a prefill node is "overloaded" above this many seconds of queued prefill tokens.
    overloaded_prefill_seconds: float = Field(default=5.0, gt=0)
    heartbeat_interval_ms: int = Field(default=20, ge=1, le=10_000)
    node_timeout_ms: int = Field(default=2000, ge=10, le=600_000)
    port: int = Field(default=50051, ge=1, le=65535)

    @model_validator(mode="after")
    def _timeouts(self) -> SchedulerSpec:
        if self.node_timeout_ms <= 2 * self.heartbeat_interval_ms:
            raise ValueError("nodeTimeoutMs must exceed twice heartbeatIntervalMs")
        return self


class FrontendSpec(_Model):
    replicas: int = Field(default=1, ge=0, le=256)
    service_type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    port: int = Field(default=8000, ge=1, le=65535)
    max_request_bytes: int = Field(default=4 << 20, ge=1024)
    max_context_tokens: int = Field(default=65536, ge=16)
    max_new_tokens: int = Field(default=1024, ge=1)


class ClusterSpec(_Model):
    """`spec` of a DualPathCluster."""

    model: ModelSpec = ModelSpec()
    prefill: PoolSpec = PoolSpec(replicas=1)
    decode: PoolSpec = PoolSpec(replicas=2)
    storage: StorageSpec = StorageSpec()
    network: NetworkSpec = NetworkSpec()
    scheduler: SchedulerSpec = SchedulerSpec()
    frontend: FrontendSpec = FrontendSpec()

    def pool(self, role: Role | str) -> PoolSpec:
        return self.prefill if Role(role) is Role.PREFILL else self.decode


class ClusterConfig(BaseModel):
    """A whole DualPathCluster object: identity plus spec."""

    model_config = ConfigDict(frozen=True)

    name: str = "local"
    namespace: str = "default"
    spec: ClusterSpec = ClusterSpec()

    @property
    def config_hash(self) -> str:
        """Hash of what the processes read: rendered into every pod template, so a change rolls
        the pods, and workers register it so the scheduler never pairs two versions. Replica
        counts and Kubernetes-only placement (resources, node selector, tolerations, Service
        type) are left out: a scale must change replica counts and nothing else, and
        placement already sits in the one pod template it concerns."""
        spec = self.spec.model_dump(mode="json", by_alias=True)
        for role in ("prefill", "decode"):
            for key in ("replicas", "resources", "nodeSelector", "tolerations"):
                spec[role].pop(key)
        spec["scheduler"].pop("replicas")
        for key in ("replicas", "serviceType"):
            spec["frontend"].pop(key)
        text = json.dumps(spec, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def spec_json(self) -> str:
        return self.spec.model_dump_json(by_alias=True)

    def to_resource(self) -> dict[str, Any]:
        return {
            "apiVersion": API_VERSION_FULL,
            "kind": KIND,
            "metadata": {"name": self.name, "namespace": self.namespace},
            "spec": self.spec.model_dump(mode="json", by_alias=True, exclude_defaults=False),
        }


def _format_error(err: ValidationError, prefix: str) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join([prefix, *(str(p) for p in e["loc"])]) if e["loc"] else prefix
        msg = e["msg"].removeprefix("Value error, ")
        got = e.get("input")
        shown = "" if isinstance(got, dict | list) or got is None else f" (got {got!r})"
        lines.append(f"{loc}: {msg}{shown}")
    return "; ".join(lines)


def parse_spec(spec: dict[str, Any] | None, prefix: str = "spec") -> ClusterSpec:
    """Validate a CR `spec` mapping; raises ConfigError naming each bad field."""
    try:
        return ClusterSpec.model_validate(spec or {})
    except ValidationError as err:
        raise ConfigError(_format_error(err, prefix)) from None


def from_resource(obj: dict[str, Any]) -> ClusterConfig:
    """Parse a DualPathCluster resource (as applied with kubectl or read from the API)."""
    if not isinstance(obj, dict):
        raise ConfigError("a DualPathCluster must be a YAML mapping")
    if obj.get("apiVersion") != API_VERSION_FULL:
        raise ConfigError(f"apiVersion: must be {API_VERSION_FULL} (got {obj.get('apiVersion')!r})")
    if obj.get("kind") != KIND:
        raise ConfigError(f"kind: must be {KIND} (got {obj.get('kind')!r})")
    meta = obj.get("metadata") or {}
    name = meta.get("name")
    if not name:
        raise ConfigError("metadata.name: required")
    return ClusterConfig(
        name=name, namespace=meta.get("namespace") or "default", spec=parse_spec(obj.get("spec"))
    )


def load(path: str | Path) -> ClusterConfig:
    """Load a DualPathCluster YAML file (the first document of that kind in it)."""
    p = Path(path)
    try:
        docs = [d for d in yaml.safe_load_all(p.read_text()) if d]
    except FileNotFoundError:
        raise ConfigError(f"{p}: no such file") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{p}: not valid YAML: {err}") from None
    for doc in docs:
        if isinstance(doc, dict) and doc.get("kind") == KIND:
            return from_resource(doc)
    raise ConfigError(f"{p}: no {KIND} document found")


def local_default() -> ClusterConfig:
    """The embedded local default: what `dualpath up` runs with no file."""
    return load(Path(__file__).parent / "data" / "local.yaml")
