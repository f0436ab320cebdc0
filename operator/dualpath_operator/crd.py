"""The CRDs, generated from the config model (`make crds`); a test checks crds/ is current.

pydantic's JSON schema -> a structural OpenAPI v3 schema: $refs inlined, `anyOf [X, null]` ->
`nullable`, no titles, 2020-style exclusive bounds -> OpenAPI 3.0 booleans, free-form maps
preserved. CEL rules carry the cross-field checks with messages a person understands.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import yaml
from dualpath.config import API_GROUP, API_VERSION, MODEL_PRESETS, ClusterSpec

ROOT = Path(__file__).resolve().parents[2]
CRD_DIR = ROOT / "crds"
CHART_CRD_DIR = ROOT / "charts" / "dualpath" / "crds"

# CEL rules per schema path (dotted, under spec): (rule, message).
CEL_RULES: dict[str, list[tuple[str, str]]] = {
    "": [
        (
            "self.prefill.replicas == 0 || self.decode.replicas > 0",
            "decode.replicas must be at least 1 when prefill.replicas > 0: prefill hands every "
            "request's KV to a decode node",
        ),
    ],
    "model": [
        (
            "!has(self.preset) || self.preset == null || self.preset in "
            + repr(sorted(MODEL_PRESETS)).replace("'", '"'),
            "model.preset must be one of "
            + ", ".join(sorted(MODEL_PRESETS))
            + " (or omit it and give the dimensions)",
        ),
        (
            "!has(self.kvHeads) || self.kvHeads == 0 || self.heads % self.kvHeads == 0",
            "model.heads must be a multiple of model.kvHeads (grouped-query attention)",
        ),
    ],
    "network.qos": [
        (
            "!self.enabled || self.model.serviceLevel != self.kv.serviceLevel",
            "network.qos.model.serviceLevel and network.qos.kv.serviceLevel must differ, or KV "
            "traffic is not isolated from the model's collectives",
        ),
    ],
    "network.rdma": [
        (
            "self.count == 0 || self.resourceName.contains('/')",
            "network.rdma.resourceName must be a device-plugin resource such as "
            "rdma/hca_shared_devices_a",
        ),
    ],
    "scheduler": [
        (
            "self.nodeTimeoutMs > 2 * self.heartbeatIntervalMs",
            "scheduler.nodeTimeoutMs must exceed twice scheduler.heartbeatIntervalMs, or healthy "
            "nodes are dropped between heartbeats",
        ),
    ],
}


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
    if "anyOf" in node:
        options = [o for o in node.pop("anyOf") if o.get("type") != "null"]
        if len(options) == 1:
            node = {**options[0], **node, "nullable": True}
    if "$ref" in node:  # after anyOf: an optional nested model is `anyOf [$ref, null]`
        target = copy.deepcopy(defs[node.pop("$ref").rsplit("/", 1)[-1]])
        node = {**target, **node}
    node.pop("title", None)
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
    raw = ClusterSpec.model_json_schema(by_alias=True)
    defs = raw.pop("$defs", {})
    schema = _structural(raw, defs)
    for path, rules in CEL_RULES.items():
        target = schema
        for part in filter(None, path.split(".")):
            target = target["properties"][part]
        target["x-kubernetes-validations"] = [{"rule": r, "message": m} for r, m in rules]
    return schema


def _conditions_schema() -> dict[str, Any]:
    return {
        "type": "array",
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["type"],
        "items": {
            "type": "object",
            "required": ["type", "status"],
            "properties": {
                "type": {"type": "string"},
                "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
                "reason": {"type": "string"},
                "message": {"type": "string"},
                "lastTransitionTime": {"type": "string", "format": "date-time"},
                "observedGeneration": {"type": "integer"},
            },
        },
    }


def _pool_status() -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "replicas": {"type": "integer"},
            "readyReplicas": {"type": "integer"},
            "updatedReplicas": {"type": "integer"},
        },
    }


def cluster_crd() -> dict[str, Any]:
    status = {
        "type": "object",
        "properties": {
            "observedGeneration": {"type": "integer"},
            "phase": {"type": "string"},
            "configHash": {"type": "string"},
            "schedulerEndpoint": {"type": "string"},
            "frontendEndpoint": {"type": "string"},
            "prefill": _pool_status(),
            "decode": _pool_status(),
            "conditions": _conditions_schema(),
        },
    }
    cols = [
        ("Prefill", ".status.prefill.readyReplicas", "integer", "ready prefill workers"),
        ("Decode", ".status.decode.readyReplicas", "integer", "ready decode workers"),
        ("Ready", '.status.conditions[?(@.type=="Ready")].status', "string", "Ready condition"),
        ("Reason", '.status.conditions[?(@.type=="Ready")].reason', "string", "why"),
        ("Age", ".metadata.creationTimestamp", "date", "age"),
    ]
    return _crd(
        "DualPathCluster",
        "dualpathclusters",
        ["dpc"],
        {
            "type": "object",
            "properties": {"spec": spec_schema(), "status": status},
        },
        cols,
        scale=None,
    )


def pool_crd() -> dict[str, Any]:
    schema = {
        "type": "object",
        "properties": {
            "spec": {
                "type": "object",
                "required": ["cluster", "role", "replicas"],
                "properties": {
                    "cluster": {"type": "string", "description": "owning DualPathCluster"},
                    "role": {"type": "string", "enum": ["prefill", "decode"]},
                    "replicas": {"type": "integer", "minimum": 0, "maximum": 4096},
                },
                "x-kubernetes-validations": [
                    {
                        "rule": "self.role == oldSelf.role && self.cluster == oldSelf.cluster",
                        "message": "spec.role and spec.cluster of a DualPathPool are immutable",
                    }
                ],
            },
            "status": {
                "type": "object",
                "properties": {
                    "replicas": {"type": "integer"},
                    "readyReplicas": {"type": "integer"},
                    "selector": {"type": "string"},
                },
            },
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
        out[name] = "# Generated by `make crds` from workers/dualpath/config.py. Do not edit.\n" + (
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
