"""The CRDs, generated from the config model (`make crds`); a test checks crds/ is current.

pydantic's JSON schema -> a structural OpenAPI v3 schema: $refs inlined, `anyOf [X, null]` ->
`nullable`, no titles, 2020-style exclusive bounds -> OpenAPI 3.0 booleans, free-form maps
preserved, int-or-string quantities kept as Kubernetes writes them. CEL rules carry the
cross-field checks with messages a person understands; the model refuses the same specs.
A nested model's default is only what differs from its fields' defaults (the API server fills
the rest), and preset-filled model fields have none, so a preset is never beaten by a default.
"""

from __future__ import annotations

import copy
import re
import sys
from pathlib import Path
from typing import Any

import yaml
from dualpath.config import (
    API_GROUP,
    API_VERSION,
    DNS1035_LABEL,
    MAX_NAME_LENGTH,
    METRICS_PORT,
    MODEL_PRESETS,
    MODEL_VOLUME_MESSAGE,
    NAME_MESSAGE,
    PRESET_FIELDS,
    STORAGE_PATH_MESSAGE,
    VLLM_DTYPE_MESSAGE,
    VLLM_DTYPES,
    VLLM_MODEL_MESSAGE,
    ClusterSpec,
    ModelSpec,
)
from pydantic import BaseModel
from pydantic.alias_generators import to_camel
from pydantic.json_schema import GenerateJsonSchema

from .status import ClusterStatus, PoolObjectStatus

ROOT = Path(__file__).resolve().parents[2]
CRD_DIR = ROOT / "crds"
CHART_CRD_DIR = ROOT / "charts" / "dualpath" / "crds"

_PRESETS = repr(sorted(MODEL_PRESETS)).replace("'", '"')
# workers.engine is optional on the wire (its default is the schema's): guarded with has()
_NOT_VLLM = "!has(self.workers) || !has(self.workers.engine) || self.workers.engine != 'vllm'"
# a nullable field given a value (has() is true for an explicit null too)
_SET = "has({0}) && type({0}) != null_type"

_SELF_FIELDS = re.compile(r"\bself((?:\.[A-Za-z_][A-Za-z0-9_]*)+)(\()?")


def when_set(rule: str) -> str:
    """`rule`, holding where a field it reads is absent. The API server checks every rule against
    every default when the CRD is created, as the default is written (a `{}` has no keys, and
    `self.port` on it is "no such key"), before any defaulting inside it; a stored object has
    every defaulted key, so there the guards change nothing."""
    guards: list[str] = []
    for match in _SELF_FIELDS.finditer(rule):
        parts = match.group(1).lstrip(".").split(".")
        if match.group(2):  # `self.path.startsWith(`: the last part is a method
            parts = parts[:-1]
        for i in range(1, len(parts) + 1):
            guard = f"!has(self.{'.'.join(parts[:i])})"
            if guard not in guards:
                guards.append(guard)
    # || binds tighter than ?: and looser than && and the comparisons: bracket what could bind
    body = f"({rule})" if any(op in rule for op in ("||", "&&", "?")) else rule
    return " || ".join([*guards, body])


# CEL rules per schema path (dotted; "" is the object root, "spec" its spec): (rule, message).
# Every rule that reads a field is wrapped in when_set(); tests/unit/operator/crdtools.py
# evaluates each rule against each default as the API server does at CRD creation.
# The pydantic model refuses the same specs (tests/unit/operator/test_crd.py checks both). Rules
# are compiled and type-checked against the schema's types like the API server does
# (tests/unit/operator/celcheck.py): a nullable field is typed as its base type, so a null is
# told apart with type(x) == null_type, never x == null.
CEL_RULES: dict[str, list[tuple[str, str]]] = {
    "": [
        (
            f"size(self.metadata.name) <= {MAX_NAME_LENGTH} && "
            f"self.metadata.name.matches('{DNS1035_LABEL}')",
            f"metadata.name {NAME_MESSAGE}",
        ),
    ],
    "spec": [
        (
            when_set("self.prefill.replicas == 0 || self.decode.replicas > 0"),
            "decode.replicas must be at least 1 when prefill.replicas > 0: prefill hands every "
            "request's KV to a decode node",
        ),
        (
            _NOT_VLLM + " || (has(self.model) && " + _SET.format("self.model.checkpointPath") + ")",
            VLLM_MODEL_MESSAGE,
        ),
        (
            _NOT_VLLM
            + " || !has(self.model) || !has(self.model.dtype) || self.model.dtype in "
            + repr(list(VLLM_DTYPES)).replace("'", '"'),
            VLLM_DTYPE_MESSAGE,
        ),
    ],
    "spec.model": [
        (
            "!has(self.preset) || type(self.preset) == null_type || self.preset in " + _PRESETS,
            "model.preset must be one of "
            + ", ".join(sorted(MODEL_PRESETS))
            + " (or null, giving the dimensions)",
        ),
        (
            "!has(self.kvHeads) || !has(self.heads) || self.kvHeads == 0 || "
            "self.heads % self.kvHeads == 0",
            "model.heads must be a multiple of model.kvHeads (grouped-query attention)",
        ),
        (
            f"!({_SET.format('self.volume')}) || ({_SET.format('self.checkpointPath')})",
            MODEL_VOLUME_MESSAGE,
        ),
    ],
    "spec.storage": [
        (when_set("self.path.startsWith('/')"), STORAGE_PATH_MESSAGE),
    ],
    "spec.network.qos": [
        (
            when_set("!self.enabled || self.model.serviceLevel != self.kv.serviceLevel"),
            "network.qos.model.serviceLevel and network.qos.kv.serviceLevel must differ, or KV "
            "traffic is not isolated from the model's collectives",
        ),
    ],
    "spec.network.rdma": [
        (
            when_set("self.count == 0 || self.resourceName.contains('/')"),
            "network.rdma.resourceName must be a device-plugin resource such as "
            "rdma/hca_shared_devices_a",
        ),
    ],
    "spec.scheduler": [
        (
            when_set("self.nodeTimeoutMs > 2 * self.heartbeatIntervalMs"),
            "scheduler.nodeTimeoutMs must exceed twice scheduler.heartbeatIntervalMs, or healthy "
            "nodes are dropped between heartbeats",
        ),
        (
            when_set(f"self.port != {METRICS_PORT}"),
            f"scheduler.port must not be the metrics port {METRICS_PORT}",
        ),
    ],
    "spec.frontend": [
        (
            when_set(f"self.port != {METRICS_PORT}"),
            f"frontend.port must not be the metrics port {METRICS_PORT}",
        ),
        (
            when_set("self.maxNewTokens <= self.maxContextTokens"),
            "frontend.maxNewTokens must be at most frontend.maxContextTokens",
        ),
    ],
    "spec.workers": [
        (
            when_set("self.requestTimeoutSeconds >= self.transferDeadlineSeconds"),
            "workers.requestTimeoutSeconds must be >= workers.transferDeadlineSeconds "
            "(a prefill call includes its KV transfers)",
        ),
    ],
}


class _DefaultsAsObjects(GenerateJsonSchema):
    """A nested model's default is written as what differs from its own fields' defaults: the
    API server fills the rest field by field. A model's preset-filled dims are left out."""

    def encode_default(self, dft: Any) -> Any:
        if isinstance(dft, BaseModel):
            exclude = set(PRESET_FIELDS) if isinstance(dft, ModelSpec) else None
            return dft.model_dump(
                mode="json", by_alias=True, exclude_defaults=True, exclude=exclude
            )
        return super().encode_default(dft)


def _strip_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_strip_none(v) for v in value]
    return value


def _structural(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_structural(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    if "anyOf" in node and not node.get("x-kubernetes-int-or-string"):
        options = [o for o in node.pop("anyOf") if o.get("type") != "null"]
        if len(options) == 1:
            node = {**options[0], **node, "nullable": True}
    if "$ref" in node:  # after anyOf: an optional nested model is `anyOf [$ref, null]`
        target = copy.deepcopy(defs[node.pop("$ref").rsplit("/", 1)[-1]])
        node = {**target, **node}
    node.pop("title", None)
    if "description" in node:  # docstrings wrap; kubectl explain wraps again
        node["description"] = " ".join(node["description"].split())
    if "const" in node:
        node["enum"] = [node.pop("const")]
    if "default" in node:
        if node["default"] is None:
            node.pop("default")
        else:
            node["default"] = _strip_none(node["default"])
    if "exclusiveMinimum" in node and not isinstance(node["exclusiveMinimum"], bool):
        node["minimum"], node["exclusiveMinimum"] = node["exclusiveMinimum"], True
    if node.get("type") == "object" and "properties" in node:
        node.pop("additionalProperties", None)  # unknown fields are pruned by the API server
    if node.get("type") == "object" and node.get("additionalProperties") is True:
        node.pop("additionalProperties")
        node["x-kubernetes-preserve-unknown-fields"] = True
    if (
        node.get("type") == "object"
        and "properties" not in node
        and ("additionalProperties" not in node)
    ):
        node["x-kubernetes-preserve-unknown-fields"] = True
    return {k: _structural(v, defs) if k != "default" else v for k, v in node.items()}


def spec_schema() -> dict[str, Any]:
    raw = ClusterSpec.model_json_schema(by_alias=True, schema_generator=_DefaultsAsObjects)
    defs = raw.pop("$defs", {})
    schema = _structural(raw, defs)
    for field in PRESET_FIELDS:  # unset, they come from the preset
        schema["properties"]["model"]["properties"][to_camel(field)].pop("default", None)
    return schema


def _with_rules(root: dict[str, Any]) -> dict[str, Any]:
    for path, rules in CEL_RULES.items():
        target = root
        for part in filter(None, path.split(".")):
            target = target["properties"][part]
        target["x-kubernetes-validations"] = [{"rule": r, "message": m} for r, m in rules]
    return root


def _int(description: str, **extra: Any) -> dict[str, Any]:
    return {"type": "integer", "description": description, **extra}


def _str(description: str, **extra: Any) -> dict[str, Any]:
    return {"type": "string", "description": description, **extra}


def _no_defaults(node: Any) -> Any:
    if isinstance(node, list):
        return [_no_defaults(n) for n in node]
    if not isinstance(node, dict):
        return node
    return {k: _no_defaults(v) for k, v in node.items() if k != "default"}


def status_schema(model: type[BaseModel]) -> dict[str, Any]:
    """A status subresource's schema from its typed model (`status.py`). No defaults: the
    operator writes every field it means, the API server fills none in."""
    raw = model.model_json_schema(by_alias=True)
    defs = raw.pop("$defs", {})
    return _no_defaults(_structural(raw, defs))


def cluster_crd() -> dict[str, Any]:
    status = status_schema(ClusterStatus)
    cols = [
        ("Prefill", ".status.prefill.readyReplicas", "integer", "ready prefill workers"),
        ("Decode", ".status.decode.readyReplicas", "integer", "ready decode workers"),
        ("Ready", '.status.conditions[?(@.type=="Ready")].status', "string", "Ready condition"),
        ("Reason", '.status.conditions[?(@.type=="Ready")].reason', "string", "why"),
        ("Age", ".metadata.creationTimestamp", "date", "age"),
    ]
    root = {
        "type": "object",
        "description": "A DualPath inference cluster: model, prefill and decode pools, KV "
        "storage, network, scheduler and frontend.",
        "required": ["spec"],
        "properties": {
            "spec": {**spec_schema(), "description": "The desired cluster."},
            "status": status,
        },
    }
    return _crd("DualPathCluster", "dualpathclusters", ["dpc"], _with_rules(root), cols, None)


def pool_crd() -> dict[str, Any]:
    schema = {
        "type": "object",
        "description": "One role's workers of a DualPathCluster; scale it with kubectl scale "
        "or an HPA.",
        "required": ["spec"],
        "properties": {
            "spec": {
                "type": "object",
                "description": "Which cluster and role, and how many workers.",
                "required": ["cluster", "role", "replicas"],
                "properties": {
                    "cluster": _str("The owning DualPathCluster (immutable).", maxLength=253),
                    "role": _str("prefill or decode (immutable).", enum=["prefill", "decode"]),
                    "replicas": _int("Desired workers.", minimum=0, maximum=4096),
                },
                "x-kubernetes-validations": [
                    {
                        "rule": "self.role == oldSelf.role && self.cluster == oldSelf.cluster",
                        "message": "spec.role and spec.cluster of a DualPathPool are immutable",
                    }
                ],
            },
            "status": status_schema(PoolObjectStatus),
        },
    }
    cols = [
        ("Role", ".spec.role", "string", "prefill or decode"),
        ("Desired", ".spec.replicas", "integer", "desired workers"),
        ("Ready", ".status.readyReplicas", "integer", "ready workers"),
        ("Age", ".metadata.creationTimestamp", "date", "age"),
    ]
    scale = {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    return _crd("DualPathPool", "dualpathpools", ["dpp"], schema, cols, scale)


def _crd(kind, plural, short, schema, cols, scale) -> dict[str, Any]:
    subresources: dict[str, Any] = {"status": {}}
    if scale:
        subresources["scale"] = scale
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{plural}.{API_GROUP}",
            "labels": {"app.kubernetes.io/part-of": "dualpath"},
        },
        "spec": {
            "group": API_GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": kind,
                "plural": plural,
                "singular": kind.lower(),
                "listKind": f"{kind}List",
                "shortNames": short,
                "categories": ["dualpath"],
            },
            "versions": [
                {
                    "name": API_VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": schema},
                    "subresources": subresources,
                    "additionalPrinterColumns": [
                        {"name": n, "jsonPath": p, "type": t, "description": d}
                        for n, p, t, d in cols
                    ],
                }
            ],
        },
    }


def crd_files() -> dict[str, str]:
    out = {}
    for crd in (cluster_crd(), pool_crd()):
        name = f"{API_GROUP}_{crd['spec']['names']['plural']}.yaml"
        out[name] = "# Generated by `make crds` from workers/dualpath/config/. Do not edit.\n" + (
            yaml.safe_dump(crd, sort_keys=False, width=100)
        )
    return out


def write(dirs: tuple[Path, ...] = (CRD_DIR, CHART_CRD_DIR)) -> None:
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
        for name, text in crd_files().items():
            (d / name).write_text(text)
            print(d / name)


if __name__ == "__main__":
    write(tuple(Path(a) for a in sys.argv[1:]) or (CRD_DIR, CHART_CRD_DIR))
