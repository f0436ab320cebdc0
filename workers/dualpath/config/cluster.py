"""The whole `DualPathCluster`: its spec (`ClusterSpec`, one field per section), its identity
and config hash (`ClusterConfig`), and the one parser of the resource and its YAML file."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel

from dualpath.config.common import (
    API_VERSION_FULL,
    DNS1035_LABEL,
    KIND,
    MAX_NAME_LENGTH,
    ConfigError,
    Role,
    _Model,
)
from dualpath.config.frontend import FrontendSpec
from dualpath.config.model import ModelSpec
from dualpath.config.network import NetworkSpec
from dualpath.config.scheduler import SchedulerSpec
from dualpath.config.security import SecuritySpec
from dualpath.config.workers import VLLM_DTYPES, PoolSpec, StorageSpec, WorkersSpec


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
    return load(Path(__file__).parent.parent / "data" / "local.yaml")


def load_or_default(path: str | Path | None) -> ClusterConfig:
    """The cluster file at `path`, or the embedded local default when no file is given (every
    command's `-f/--file`)."""
    return load(path) if path else local_default()
