"""The typed model of a DualPath cluster: the one config every process shares.

A `DualPathCluster` custom resource's `spec` is parsed here (camelCase on the wire,
snake_case in Python). The operator renders it into a ConfigMap, the local cluster and the
simulator build the same object without Kubernetes. Nothing else parses this YAML.

Units: `_gbps` fields are gigabits per second (network convention: a "400 Gbps SNIC");
`_bytes` bytes, `_s` / `Seconds` seconds, `_ms` / `Ms` milliseconds.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import re
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from dualpath import default_image

API_GROUP = "dualpath.io"
API_VERSION = "v1alpha1"
KIND = "DualPathCluster"
API_VERSION_FULL = f"{API_GROUP}/{API_VERSION}"


class ConfigError(ValueError):
    """A cluster spec that cannot work; the message names the field and the fix."""


class _Model(BaseModel):
    # extra="forbid": a misspelt field is an error naming it, not a silently ignored key.
    # Field docstrings are the descriptions `kubectl explain` shows (emitted into the CRD).
    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
        use_attribute_docstrings=True,
    )

    @field_validator("*")
    @classmethod
    def _sorted_maps(cls, value: Any) -> Any:
        # The API server hands the operator every map with its keys sorted (Go's JSON), a file
        # keeps them as written: sorted here, both render and hash the same.
        return _sort_keys(value) if isinstance(value, dict) else value


def _sort_keys(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _sort_keys(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_sort_keys(v) for v in value]
    return value


class Role(str, Enum):
    PREFILL = "prefill"
    DECODE = "decode"


DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float8": 1}

# A cluster's children are `<name>-<suffix>` (longest: `-scheduler`); its StatefulSets
# `<name>-prefill` must stay within 52 characters, or their pods get no controller-revision-hash
# label (`<statefulset>-<10-char hash>` <= 63). So a name is a DNS-1035 label (Services are named
# after it) of at most 52 - len("-prefill") = 44 characters, and children are never truncated.
MAX_NAME_LENGTH = 44
DNS1035_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
# The port every process serves /metrics on; a component's own port must not take it.
METRICS_PORT = 9090
# Kubernetes' resource.Quantity (as in every generated CRD): 4, 500m, 16Gi, 1e3.
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|"
    r"([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)


def _quantity(value: Any) -> Any:
    # int-or-string as in any Kubernetes YAML: `cpu: 4` and `cpu: "4"` are the same quantity
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, str) and re.fullmatch(QUANTITY_PATTERN, value):
        return value
    raise ValueError("must be a Kubernetes quantity such as 4, 500m or 16Gi")


Quantity = Annotated[
    str,
    BeforeValidator(_quantity),
    WithJsonSchema(
        {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": QUANTITY_PATTERN,
            "x-kubernetes-int-or-string": True,
        }
    ),
]


class RopeScaling(_Model):
    """Llama 3's RoPE frequency scaling (`rope_type: llama3` in a checkpoint's config.json):
    long wavelengths are divided by `factor`, short ones kept, the band between blended."""

    type: Literal["llama3"] = "llama3"
    """Scaling scheme; only llama3 is implemented."""
    factor: float = Field(gt=0)
    """Divisor of the long wavelengths (Llama 3.1: 8)."""
    low_freq_factor: float = Field(default=1.0, gt=0)
    """Wavelengths above originalMaxPositionEmbeddings / lowFreqFactor are fully scaled."""
    high_freq_factor: float = Field(default=4.0, gt=0)
    """Wavelengths below originalMaxPositionEmbeddings / highFreqFactor are kept."""
    original_max_position_embeddings: int = Field(default=8192, gt=0)
    """Context length the model was pre-trained with."""

    @model_validator(mode="after")
    def _check_band(self) -> RopeScaling:
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError("ropeScaling.highFreqFactor must be > lowFreqFactor")
        return self


# The volume sources a KV directory (storage.volume) or a checkpoint (model.volume) can live on,
# with the keys each one needs.
VOLUME_SOURCES: dict[str, tuple[str, ...]] = {
    "persistentVolumeClaim": ("claimName",),
    "nfs": ("server", "path"),
    "hostPath": ("path",),
    "csi": ("driver",),
    "cephfs": ("monitors",),
    "glusterfs": ("endpoints", "path"),
    "azureFile": ("secretName", "shareName"),
    "ephemeral": (),
    "emptyDir": (),
}


def _volume_schema() -> dict[str, Any]:
    def source(name: str, needs: tuple[str, ...]) -> dict[str, Any]:
        node: dict[str, Any] = {
            "type": "object",
            "description": f"A Kubernetes {name} volume source (as in a pod's volumes).",
            "x-kubernetes-preserve-unknown-fields": True,
        }
        if needs:
            node["required"] = list(needs)
            node["properties"] = {
                k: {
                    "type": "array" if k == "monitors" else "string",
                    "description": f"{k} of the {name} source",
                }
                | ({"items": {"type": "string"}} if k == "monitors" else {})
                for k in needs
            }
        return node

    return {
        "type": "object",
        "nullable": True,
        "minProperties": 1,
        "maxProperties": 1,
        "properties": {k: source(k, needs) for k, needs in VOLUME_SOURCES.items()},
    }


def volume_message(field: str) -> str:
    return f"{field} must have exactly one volume source, one of " + ", ".join(VOLUME_SOURCES)


def check_volume_source(volume: dict[str, Any] | None, field: str) -> dict[str, Any] | None:
    """One volume source of VOLUME_SOURCES with the keys it needs, typed as in _volume_schema."""
    if volume is None:
        return None
    if len(volume) != 1 or next(iter(volume)) not in VOLUME_SOURCES:
        raise ValueError(f"{volume_message(field)} (got {sorted(volume)})")
    kind, source = next(iter(volume.items()))
    if not isinstance(source, dict):
        raise ValueError(f"{kind} must be a mapping")
    missing = [k for k in VOLUME_SOURCES[kind] if k not in source]
    if missing:
        raise ValueError(f"{kind} needs {', '.join(missing)}")
    for key in VOLUME_SOURCES[kind]:
        want = list if key == "monitors" else str
        if not isinstance(source[key], want):
            raise ValueError(f"{kind}.{key} must be a {'list' if want is list else 'string'}")
    return volume


MODEL_VOLUME_MESSAGE = "model.volume needs model.checkpointPath: the volume is mounted there"


class ModelSpec(_Model):
    """Model dimensions. `preset` fills every dimension not given explicitly."""

    name: str = Field(default="dualpath-tiny", min_length=1)
    """Served model name (the OpenAI `model` field); part of the KV fingerprint. Default: the
    preset's."""
    preset: str | None = "tiny"
    """Named shape filling every dimension not given: tiny, tiny64, small, llama3-8b, qwen2.5-32b,
    deepseek-v3.2, dsmla-27b; null to give all dimensions explicitly."""
    image: str = Field(default=default_image(), min_length=1)
    """Container image of every DualPath process (vLLM workers: workers.vllm.image)."""
    checkpoint_path: str | None = None
    """Local dir with config.json + *.safetensors (Llama/Qwen2); unset: random weights."""
    volume: Annotated[dict[str, Any] | None, WithJsonSchema(_volume_schema())] = None
    """Kubernetes volume source holding the checkpoint, mounted read-only at checkpointPath in
    the worker and frontend pods (the frontend reads its tokenizer): exactly one of
    persistentVolumeClaim, nfs, hostPath, csi, cephfs, glusterfs, azureFile, ephemeral,
    emptyDir; unset: the checkpoint is in the image (or there is none)."""
    attention: Literal["gqa", "mla"] = "gqa"
    """gqa (grouped-query, K and V cached) or mla (DeepSeek latent cached). Default: the
    preset's."""
    layers: int = Field(default=0, ge=0, le=512)
    """Transformer layers (0 or unset: the preset's)."""
    hidden_size: int = Field(default=0, ge=0)
    """Model width (0 or unset: the preset's)."""
    heads: int = Field(default=0, ge=0)
    """Attention heads (0 or unset: the preset's)."""
    kv_heads: int = Field(default=0, ge=0)
    """K/V heads of grouped-query attention; divides heads (0 or unset: the preset's)."""
    head_dim: int = Field(default=0, ge=0)
    """Dimension of one head (0 or unset: the preset's)."""
    intermediate_size: int = Field(default=0, ge=0)
    """MLP width (0 or unset: the preset's)."""
    vocab_size: int = Field(default=0, ge=0)
    """Vocabulary size (0 or unset: the preset's)."""
    kv_lora_rank: int = Field(default=0, ge=0)
    """MLA: latent rank; the cached latent per token per layer is kvLoraRank + ropeHeadDim."""
    rope_head_dim: int = Field(default=0, ge=0)
    """MLA: rotary part of the cached latent."""
    active_params: int = Field(default=0, ge=0)
    """Active parameters per token, for the simulator's FLOPs model (0: derived from dims)."""
    dtype: Literal["float16", "bfloat16", "float32", "float8"] = "float32"
    """Weights and KV cache element type. Default: the preset's."""
    block_tokens: int = Field(default=64, ge=1, le=4096)
    """Tokens per KV block: the unit of storage, lookup and transfer."""
    seed: int = 0
    """Seed of random weights (no checkpoint); part of the KV fingerprint."""
    rope_theta: float = Field(default=10000.0, gt=0)
    """RoPE base frequency (Llama 3: 500000)."""
    rope_scaling: RopeScaling | None = None
    """Llama 3 RoPE scaling; unset: none."""
    rms_norm_eps: float = Field(default=1e-6, gt=0)
    """Epsilon of RMSNorm."""

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
            field = by_alias.get(key, key)
            if value is None or (value == 0 and field in PRESET_FIELDS):
                continue  # unset (or a 0 dimension): the preset's
            merged[field] = value
        merged["preset"] = preset
        return merged

    @field_validator("volume")
    @classmethod
    def _one_source(cls, volume: dict[str, Any] | None) -> dict[str, Any] | None:
        return check_volume_source(volume, "model.volume")

    @model_validator(mode="after")
    def _volume_needs_a_path(self) -> ModelSpec:
        if self.volume is not None and not self.checkpoint_path:
            raise ValueError(MODEL_VOLUME_MESSAGE)
        return self

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
        name="dualpath-tiny",
        layers=4,
        hidden_size=64,
        heads=4,
        kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=512,
        dtype="float32",
    ),
    # tiny's size with a head dim vLLM's CPU attention supports (32, 64, 80, ...): the model of
    # the vLLM integration's tests, served by both engines from one checkpoint (docs/vllm.md)
    "tiny64": dict(
        name="dualpath-tiny64",
        layers=4,
        hidden_size=256,
        heads=4,
        kv_heads=2,
        head_dim=64,
        intermediate_size=512,
        vocab_size=512,
        dtype="float32",
    ),
    "small": dict(
        name="dualpath-small",
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

# Fields a preset fills: they get no schema default in the CRD (an API-server default would look
# explicit and beat the preset); unset, they come from the preset (or the model's own default).
PRESET_FIELDS = frozenset(k for preset in MODEL_PRESETS.values() for k in preset)


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


class TrafficClassSpec(_Model):
    """An InfiniBand service level and a RoCE/IP traffic class."""

    service_level: int = Field(ge=0, le=15)
    """InfiniBand service level (SL), 0-15."""
    traffic_class: int = Field(ge=0, le=255)
    """Traffic class (RoCE DSCP << 2), 0-255."""


class QosSpec(_Model):
    """IB QoS of docs/design.md section 5: model traffic high priority, KV traffic low priority."""

    enabled: bool = True
    """Separate model and KV traffic by service level and virtual lane."""
    model: TrafficClassSpec = TrafficClassSpec(service_level=0, traffic_class=0)
    """Model collectives (NCCL): high priority."""
    kv: TrafficClassSpec = TrafficClassSpec(service_level=2, traffic_class=64)
    """KV transfers (UCX/NIXL): low priority."""
    kv_virtual_lane: int = Field(default=2, ge=0, le=14)
    """Virtual lane the KV service level maps to."""
    high_weight: int = Field(default=99, ge=1, le=255)
    """VL arbitration weight of model traffic."""
    low_weight: int = Field(default=1, ge=1, le=255)
    """VL arbitration weight of KV traffic."""

    @model_validator(mode="after")
    def _distinct(self) -> QosSpec:
        if self.enabled and self.model.service_level == self.kv.service_level:
            raise ValueError(
                "qos.model.serviceLevel and qos.kv.serviceLevel must differ, otherwise KV "
                "traffic is not isolated from the model's collectives"
            )
        return self


class RdmaSpec(_Model):
    """The RDMA device every worker pod requests."""

    resource_name: str = Field(default="rdma/hca_shared_devices_a", min_length=1, max_length=253)
    """Device-plugin resource of the RDMA NIC."""
    count: int = Field(default=1, ge=0, le=64)
    """Devices per worker pod (0: no RDMA, TCP fallback)."""
    ib_addr_type: Literal["ib_global", "ib_local", "eth"] | None = None
    """UCX_IB_ADDR_TYPE: ib_global (routed IB), ib_local, eth (RoCE); unset: UCX's choice."""

    @model_validator(mode="after")
    def _device_plugin_resource(self) -> RdmaSpec:
        if self.count and "/" not in self.resource_name:
            raise ValueError(
                "network.rdma.resourceName must be a device-plugin resource such as "
                "rdma/hca_shared_devices_a"
            )
        return self


class PolicyPeerSpec(_Model):
    """Pods allowed to reach the frontend: those matching podSelector in the namespaces matching
    namespaceSelector."""

    namespace_selector: dict[str, str] | None = None
    """matchLabels of the namespaces, e.g. {kubernetes.io/metadata.name: ingress-nginx}; {}:
    every namespace; unset: the cluster's own namespace."""
    pod_selector: dict[str, str] = Field(default_factory=dict)
    """matchLabels of the pods in those namespaces; {}: every pod."""


class NetworkPoliciesSpec(_Model):
    """Kubernetes NetworkPolicies of the cluster's pods (ingress only; egress stays open)."""

    enabled: bool = True
    """Render NetworkPolicies: the scheduler reachable only from this cluster's frontend and
    workers, the workers only from the scheduler, the frontend and each other, the frontend
    from frontendFrom and frontendFromCidrs, metrics from monitoringNamespaceSelector."""
    frontend_from: list[PolicyPeerSpec] = Field(default_factory=list, max_length=32)
    """Pods that may call the frontend's HTTP API; empty: every pod of the cluster's
    namespace (add your ingress controller's namespace here, or CIDRs below)."""
    frontend_from_cidrs: list[str] = Field(default_factory=list, max_length=32)
    """IP ranges that may call the frontend's HTTP API, e.g. a load balancer's source range
    (0.0.0.0/0: anyone that can reach the Service)."""
    monitoring_namespace_selector: dict[str, str] = Field(
        default_factory=lambda: {"kubernetes.io/metadata.name": "monitoring"}
    )
    """matchLabels of the namespaces whose pods may scrape the metrics ports (and the
    frontend's /metrics); {}: every namespace."""

    @field_validator("frontend_from_cidrs")
    @classmethod
    def _cidrs(cls, cidrs: list[str]) -> list[str]:
        for cidr in cidrs:
            try:
                ipaddress.ip_network(cidr, strict=False)
            except ValueError:
                raise ValueError(
                    f"network.policies.frontendFromCidrs: {cidr!r} is not a CIDR such as 10.0.0.0/8"
                ) from None
        return cidrs


class NetworkSpec(_Model):
    """Compute and storage networks of the worker pods."""

    rdma: RdmaSpec = RdmaSpec()
    """RDMA device requested by every worker pod."""
    multus_networks: list[str] = Field(default_factory=list, max_length=16)
    """Multus networks attached to every worker pod (k8s.v1.cni.cncf.io/networks)."""
    qos: QosSpec = QosSpec()
    """InfiniBand QoS: service levels, traffic classes, VL arbitration."""
    cnic_gbps: float = Field(default=0.0, ge=0.0)
    """Compute NIC bandwidth per node for local emulation and the simulator; 0: uncapped."""
    policies: NetworkPoliciesSpec = NetworkPoliciesSpec()
    """NetworkPolicies: who may reach the scheduler, the workers, the frontend and metrics."""


# The one list of policy names (the CRD's enum); the scheduler's registry
# (`scheduler.policy.POLICIES`) maps each to its class and fails to import if one is missing.
class PolicyName(str, Enum):
    DUALPATH = "dualpath"
    PREFILL_READ = "prefill-read"
    DECODE_READ = "decode-read"
    ROUND_ROBIN = "round-robin"


class SchedulerSpec(_Model):
    """The scheduler: picks a prefill and a decode node and the KV read path per request."""

    policy: PolicyName = PolicyName.DUALPATH
    """dualpath (read path chosen per request), prefill-read, decode-read or round-robin."""
    replicas: int = Field(default=1, ge=1, le=1)
    """Always 1: one active scheduler; its state rebuilds on restart."""
    short_read_queue_seconds: float = Field(default=3.0, gt=0)
    """alpha: a read queue is short while it holds less than this many seconds of reading."""
    overloaded_prefill_seconds: float = Field(default=5.0, gt=0)
    """beta: a prefill node is overloaded above this many seconds of queued prefill tokens."""
    heartbeat_interval_ms: int = Field(default=20, ge=1, le=10_000)
    """How often each worker reports its load."""
    node_timeout_ms: int = Field(default=2000, ge=10, le=600_000)
    """A worker silent this long leaves the pool (gets no requests); more than twice
    heartbeatIntervalMs. Silent five times this long, it is forgotten: dropped from the view
    until its process registers again."""
    breaker_failures: int = Field(default=3, ge=1, le=1000)
    """Failed requests in a row (client cancels never count) that open a node's circuit
    breaker: no requests are routed to it (never to the last available node of its role)."""
    max_in_flight_per_node: int = Field(default=0, ge=0, le=1_000_000)
    """Requests routed to one node and not completed yet, at most (0: no cap). A request that
    finds every node at the cap waits in the scheduler's queue and is then refused (HTTP 429
    with Retry-After): an overload burst is shed instead of queued past clients' deadlines."""
    breaker_open_seconds: float = Field(default=5.0, gt=0, le=3600)
    """How long an open breaker keeps its node out before one probe request may go there
    (half-open): a success closes it, a failure opens it for this long again."""
    port: int = Field(default=50051, ge=1, le=65535)
    """gRPC port of the scheduler (not the metrics port 9090)."""
    route_lease_seconds: float = Field(default=10.0, gt=0, le=3600)
    """A routed request that no worker claims (its Generate or Prefill never arrives: the
    client or frontend went away between Route and the call) is released after this long:
    counted, out of the in-flight count and of a draining worker's wait."""

    @model_validator(mode="after")
    def _timeouts(self) -> SchedulerSpec:
        if self.node_timeout_ms <= 2 * self.heartbeat_interval_ms:
            raise ValueError("nodeTimeoutMs must exceed twice heartbeatIntervalMs")
        return self

    @field_validator("port")
    @classmethod
    def _not_metrics(cls, port: int) -> int:
        if port == METRICS_PORT:
            raise ValueError(f"scheduler.port must not be the metrics port {METRICS_PORT}")
        return port


class FrontendAuthSpec(_Model):
    """API keys of the frontend: `Authorization: Bearer <key>` on every /v1 call."""

    secret_name: str | None = Field(default=None, min_length=1, max_length=253)
    """Secret (in the cluster's namespace) holding the API keys: each data entry a key, or
    several keys one per line; mounted into the frontend pods, rotated without a restart.
    Unset: the API is open (to whom the NetworkPolicy lets in)."""
    requests_per_second: float = Field(default=0.0, ge=0.0)
    """Per-key rate limit (a token bucket; over it: 429 with Retry-After); 0: unlimited."""
    burst: int = Field(default=0, ge=0, le=100_000)
    """Requests a key may make at once above the rate; 0: one second's worth (at least 1)."""
    isolate_tenants: bool = True
    """With API keys: each key's tenant (its Secret data entry) gets its own KV cache (a salt
    seeds its block ids), so tenants never share or probe each other's cached prefixes; a
    prefix common to several tenants (a shared system prompt) is stored once per tenant.
    false: one shared cache for every key (a single-tenant cluster). No effect without keys;
    a request's `cache_salt` partitions the cache further either way."""


class FrontendSpec(_Model):
    """The OpenAI-compatible HTTP frontend."""

    replicas: int = Field(default=1, ge=0, le=256)
    """Frontend pods; 0: none."""
    service_type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    """Type of the frontend Service."""
    port: int = Field(default=8000, ge=1, le=65535)
    """HTTP port (not the metrics port 9090)."""
    max_request_bytes: int = Field(default=4 << 20, ge=1024)
    """Largest request body accepted."""
    max_context_tokens: int = Field(default=65536, ge=16)
    """Longest prompt plus completion accepted."""
    max_new_tokens: int = Field(default=1024, ge=1)
    """Longest completion; at most maxContextTokens."""
    auth: FrontendAuthSpec = FrontendAuthSpec()
    """API keys and per-key rate limits; unset secretName: no keys required."""
    header_timeout_seconds: int = Field(default=10, ge=1, le=3600)
    """Time a client has to send a request's whole header (from its first byte): slower is
    answered 408 and closed (a client cannot hold the front open with a slow header)."""
    body_timeout_seconds: int = Field(default=60, ge=1, le=3600)
    """Time a client has to send a request's whole body once its header is in: slower is
    closed."""
    max_connections: int = Field(default=4096, ge=1, le=1_000_000)
    """Open HTTP connections per frontend process; one more is answered 503 and closed."""

    @field_validator("port")
    @classmethod
    def _not_metrics(cls, port: int) -> int:
        if port == METRICS_PORT:
            raise ValueError(f"frontend.port must not be the metrics port {METRICS_PORT}")
        return port

    @model_validator(mode="after")
    def _new_tokens_fit(self) -> FrontendSpec:
        if self.max_new_tokens > self.max_context_tokens:
            raise ValueError("frontend.maxNewTokens must be at most frontend.maxContextTokens")
        return self


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


class TlsMode(str, Enum):
    MTLS = "mtls"
    TOKEN = "token"
    OFF = "off"


class TlsSpec(_Model):
    """How DualPath processes authenticate each other on gRPC."""

    mode: TlsMode = TlsMode.MTLS
    """mtls: every process has its own certificate (role and node id in its SAN URI) and every
    channel is mutual TLS; the scheduler binds a node id to the certificate that registered it.
    token: plaintext gRPC with the one shared cluster token. off: neither (trusted networks
    and tests only)."""
    cert_manager: bool | None = None
    """Issue the certificates with cert-manager (an Issuer over the cluster's CA and, per worker
    pod, its csi-driver); unset: when the operator finds cert-manager's CRDs. false: the
    operator's own CA in a Secret, with one certificate per role (proves the role, not the
    pod)."""


class SecuritySpec(_Model):
    """Trust between the cluster's pods."""

    tls: TlsSpec = TlsSpec()
    """Authentication of gRPC between processes."""


class ClusterSpec(_Model):
    """`spec` of a DualPathCluster."""

    model: ModelSpec = ModelSpec()
    """The served model: a preset and/or explicit dimensions, image, checkpoint."""
    prefill: PoolSpec = PoolSpec(replicas=1)
    """Prefill workers: compute prompts' KV, layer by layer."""
    decode: PoolSpec = PoolSpec(replicas=2)
    """Decode workers: generate tokens; at least 1 when prefill has replicas."""
    storage: StorageSpec = StorageSpec()
    """Shared KV block store."""
    network: NetworkSpec = NetworkSpec()
    """RDMA, Multus networks and InfiniBand QoS."""
    scheduler: SchedulerSpec = SchedulerSpec()
    """Request scheduler."""
    frontend: FrontendSpec = FrontendSpec()
    """OpenAI-compatible HTTP frontend."""
    workers: WorkersSpec = WorkersSpec()
    """Worker processes: model load budget, drain, deadlines, decode KV cache."""
    security: SecuritySpec = SecuritySpec()
    """Trust between pods: mutual TLS (default) or the shared token on gRPC."""

    @model_validator(mode="after")
    def _decode_for_prefill(self) -> ClusterSpec:
        if self.prefill.replicas > 0 and self.decode.replicas == 0:
            raise ValueError(
                "decode.replicas must be at least 1 when prefill.replicas > 0: prefill hands "
                "every request's KV to a decode node"
            )
        return self

    @model_validator(mode="after")
    def _vllm_dtype(self) -> ClusterSpec:
        # No checkpointPath is not refused here: `dualpath up --engine vllm` writes one after
        # parsing; the CRD refuses it for the operator (VLLM_MODEL_MESSAGE) and the worker at
        # start.
        if self.workers.engine == "vllm" and self.model.dtype not in VLLM_DTYPES:
            raise ValueError(VLLM_DTYPE_MESSAGE)
        return self

    def pool(self, role: Role | str) -> PoolSpec:
        return self.prefill if Role(role) is Role.PREFILL else self.decode


class ClusterConfig(BaseModel):
    """A whole DualPathCluster object: identity plus spec."""

    model_config = ConfigDict(frozen=True)

    name: str = "local"
    namespace: str = "default"
    spec: ClusterSpec = ClusterSpec()

    @field_validator("name")
    @classmethod
    def _child_names_fit(cls, name: str) -> str:
        if len(name) > MAX_NAME_LENGTH or not re.fullmatch(DNS1035_LABEL, name):
            raise ValueError(NAME_MESSAGE)
        return name

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


VLLM_MODEL_MESSAGE = (
    "workers.engine vllm needs model.checkpointPath (vLLM serves a checkpoint; the frontend "
    "tokenizes with its tokenizer.json): a directory in the image, or on model.volume"
)
VLLM_DTYPE_MESSAGE = (
    "workers.engine vllm serves model.dtype float16, bfloat16 or float32; for an fp8 KV cache "
    "keep the weights' dtype and add --kv-cache-dtype fp8 to workers.vllm.extraArgs"
)

NAME_MESSAGE = (
    f"must be a DNS-1035 label (lowercase letters, digits and '-', starting with "
    f"a letter) of at most {MAX_NAME_LENGTH} characters, so that every child "
    "(<name>-scheduler, <name>-prefill-<n>, ...) is named after it in full"
)


def _format_error(err: ValidationError, prefix: str) -> str:
    lines = []
    for e in err.errors():
        # camelCase as on the wire (a preset's fields come back under their Python names)
        parts = [to_camel(p) if isinstance(p, str) and "_" in p else str(p) for p in e["loc"]]
        loc = ".".join([prefix, *parts])
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
    if not isinstance(obj.get("spec"), dict):
        raise ConfigError("spec: required (a mapping; {} takes every default)")
    spec = parse_spec(obj["spec"])
    try:
        return ClusterConfig(name=name, namespace=meta.get("namespace") or "default", spec=spec)
    except ValidationError as err:
        raise ConfigError(_format_error(err, "metadata")) from None


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


def load_or_default(path: str | Path | None) -> ClusterConfig:
    """The cluster file at `path`, or the embedded local default when no file is given (every
    command's `-f/--file`)."""
    return load(path) if path else local_default()
