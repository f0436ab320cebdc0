"""Pure builders: a `ClusterConfig` in, the complete list of desired child manifests out.

No kopf, no API client: `render()` is what the operator applies and what `dualpath render`
prints, so the two can never differ.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import yaml
from dualpath.config import API_VERSION_FULL, ClusterConfig, Role

from .common import CLUSTER_LABEL, CONFIG_HASH_KEY, child_name, labels, metadata, owner_reference
from .netpol import network_policies
from .pods import token_secret_name
from .qos import opensm_qos_policy, qos_config_map, qos_env
from .workloads import (
    frontend_objects,
    scheduler_objects,
    worker_pdb,
    worker_service,
    worker_statefulset,
)

POOL_KIND = "DualPathPool"
# libyaml when present: the same text as SafeDumper, 5x faster (every reconcile renders it).
_YAML_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
# Every (apiVersion, kind) `render` can produce: what pruning lists (by the cluster label, then
# by owner uid) to delete children a spec no longer asks for. A test keeps it complete.
CHILD_KINDS: tuple[tuple[str, str], ...] = (
    ("v1", "ConfigMap"),
    ("v1", "Service"),
    ("apps/v1", "Deployment"),
    ("apps/v1", "StatefulSet"),
    ("policy/v1", "PodDisruptionBudget"),
    ("networking.k8s.io/v1", "NetworkPolicy"),
    (API_VERSION_FULL, POOL_KIND),
)


def config_map(cfg: ClusterConfig, owner: dict | None) -> dict[str, Any]:
    """The rendered config every process reads (`-f /etc/dualpath/cluster.yaml`)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(cfg, child_name(cfg, "config"), "config", owner),
        "data": {
            "cluster.yaml": yaml.dump(cfg.to_resource(), Dumper=_YAML_DUMPER, sort_keys=False),
            "config-hash": cfg.config_hash,
        },
    }


def token_secret(cfg: ClusterConfig, owner: dict | None, token: str) -> dict[str, Any]:
    """The cluster token every process presents on gRPC (`dualpath.grpc_auth`). Not part of
    `render`: its data is random, so the operator creates it once (create-only, never applied:
    an apply would rotate it every pass) and garbage collection deletes it with the cluster."""
    from dualpath.grpc_auth import TOKEN_KEY

    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata(cfg, token_secret_name(cfg), "token", owner),
        "type": "Opaque",
        "stringData": {TOKEN_KEY: token + "\n"},
    }


def pool(cfg: ClusterConfig, role: Role, owner: dict | None) -> dict[str, Any]:
    """Per-role scaling handle: `kubectl scale dualpathpool/<c>-prefill` and HPAs target it.
    As created: its count is the cluster spec's initial one; after that the pool owns it
    (`pool_for_apply`, `scaling.py`)."""
    return {
        "apiVersion": API_VERSION_FULL,
        "kind": POOL_KIND,
        "metadata": metadata(cfg, child_name(cfg, role.value), role.value, owner),
        "spec": {
            "cluster": cfg.name,
            "role": role.value,
            "replicas": cfg.spec.pool(role).replicas,
        },
    }


def pool_for_apply(obj: dict[str, Any]) -> dict[str, Any]:
    """A rendered pool as every pass applies it: without `spec.replicas`, the one field people
    and HPAs write, so the operator's field manager never owns it (it sets it only on create)."""
    spec = {k: v for k, v in obj["spec"].items() if k != "replicas"}
    return {**obj, "spec": spec}


def render(
    cfg: ClusterConfig,
    owner: dict | None = None,
    replicas: Mapping[str, int] | None = None,
) -> list[dict[str, Any]]:
    """Every child of one DualPathCluster, in apply order. `replicas`: each worker
    StatefulSet's count (the pools' counts); without it, the cluster spec's initial ones."""
    out: list[dict[str, Any]] = [config_map(cfg, owner), qos_config_map(cfg, owner)]
    out += network_policies(cfg, owner)  # before the pods: none runs unprotected
    out += scheduler_objects(cfg, owner)
    for role in (Role.PREFILL, Role.DECODE):
        out += [
            worker_service(cfg, role, owner),
            worker_statefulset(cfg, role, owner, (replicas or {}).get(role.value)),
            worker_pdb(cfg, role, owner),
            pool(cfg, role, owner),
        ]
    if cfg.spec.frontend.replicas > 0:
        out += frontend_objects(cfg, owner)
    return out


__all__ = [
    "CHILD_KINDS",
    "CLUSTER_LABEL",
    "CONFIG_HASH_KEY",
    "POOL_KIND",
    "child_name",
    "config_map",
    "labels",
    "opensm_qos_policy",
    "owner_reference",
    "pool",
    "pool_for_apply",
    "qos_env",
    "render",
    "token_secret",
]
