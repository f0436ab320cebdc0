"""What every section of the cluster model shares: the resource's API group and kind, the error
a bad spec raises, the base of every section's model (camelCase on the wire, misspelt fields
refused, frozen), the roles, Kubernetes' name and quantity rules and the volume sources a
directory can live on."""

from __future__ import annotations

import re
from enum import Enum
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, WithJsonSchema, field_validator
from pydantic.alias_generators import to_camel

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


# A cluster's children are `<name>-<suffix>` (longest: `-scheduler`); its StatefulSets
# `<name>-prefill` must stay within 52 characters, or their pods get no controller-revision-hash
# label (`<statefulset>-<10-char hash>` <= 63). So a name is a DNS-1035 label (Services are named
# after it) of at most 52 - len("-prefill") = 44 characters, and children are never truncated.
MAX_NAME_LENGTH = 44
DNS1035_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
# The port every process serves /metrics on; a component's own port must not take it.
METRICS_PORT = 9090


def not_metrics_port(section: str, port: int) -> int:
    """A section's serving port, refused when it is the metrics port every process binds."""
    if port == METRICS_PORT:
        raise ValueError(f"{section}.port must not be the metrics port {METRICS_PORT}")
    return port


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
