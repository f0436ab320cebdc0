"""The reconcile: spec -> desired children -> server-side apply -> observed status.

Level-triggered and idempotent: every pass renders the whole desired state and applies it, so
any pass converges from wherever the cluster is; restarting the operator changes nothing.
The API is behind `ClusterApi` so tests run against an in-memory fake.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

from dualpath import config
from dualpath.config import Role

from .builders import child_name, render
from .builders.checks import spec_warnings
from .builders.common import selector_labels
from .builders.pods import scheduler_address
from .status import WorkloadObservation, compute_status

log = logging.getLogger(__name__)
FIELD_MANAGER = "dualpath-operator"


class ClusterApi(Protocol):
    def apply(self, obj: dict[str, Any]) -> dict[str, Any]: ...
    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None: ...
    def patch_status(
        self, api_version: str, kind: str, namespace: str, name: str, status: dict[str, Any]
    ) -> None: ...
    def patch_spec(
        self, api_version: str, kind: str, namespace: str, name: str, patch: dict[str, Any]
    ) -> None: ...


@dataclass
class ReconcileResult:
    status: dict[str, Any]
    applied: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def _key(obj: dict) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


def reconcile(api: ClusterApi, body: dict[str, Any]) -> ReconcileResult:
    """One pass for one DualPathCluster `body` (as read from the API)."""
    cfg = config.from_resource(body)  # ConfigError: the caller marks the spec invalid
    meta = body["metadata"]
    owner = {"name": meta["name"], "uid": meta["uid"]}
    applied = []
    for obj in render(cfg, owner):
        api.apply(obj)
        applied.append(_key(obj))
    workloads = observe(api, cfg)
    for role in (Role.PREFILL, Role.DECODE):
        w = workloads[role.value]
        selector = ",".join(f"{k}={v}" for k, v in selector_labels(cfg, role.value).items())
        api.patch_status(
            "dualpath.io/v1alpha1",
            "DualPathPool",
            cfg.namespace,
            child_name(cfg, role.value),
            {"replicas": w.replicas, "readyReplicas": w.ready, "selector": selector},
        )
    warnings = spec_warnings(cfg)
    status = compute_status(
        meta.get("generation", 0),
        cfg.config_hash,
        workloads,
        scheduler_address(cfg),
        (body.get("status") or {}).get("conditions"),
        warnings=warnings,
    )
    if cfg.spec.frontend.replicas:
        status["frontendEndpoint"] = f"{child_name(cfg, 'frontend')}:{cfg.spec.frontend.port}"
    return ReconcileResult(status, applied, warnings)


def observe(api: ClusterApi, cfg: config.ClusterConfig) -> dict[str, WorkloadObservation]:
    out = {}
    for role in (Role.PREFILL, Role.DECODE):
        name = child_name(cfg, role.value)
        out[role.value] = WorkloadObservation.from_object(
            name,
            cfg.spec.pool(role).replicas,
            api.get("apps/v1", "StatefulSet", cfg.namespace, name),
        )
    sched = child_name(cfg, "scheduler")
    out["scheduler"] = WorkloadObservation.from_object(
        sched, cfg.spec.scheduler.replicas, api.get("apps/v1", "Deployment", cfg.namespace, sched)
    )
    if cfg.spec.frontend.replicas:
        fe = child_name(cfg, "frontend")
        out["frontend"] = WorkloadObservation.from_object(
            fe, cfg.spec.frontend.replicas, api.get("apps/v1", "Deployment", cfg.namespace, fe)
        )
    return out


def pool_scaled(api: ClusterApi, pool: dict[str, Any]) -> bool:
    """`kubectl scale dualpathpool/...` or an HPA changed a pool: write it into the cluster
    spec, the one source of truth. Returns True if the cluster spec changed."""
    spec = pool.get("spec") or {}
    role, cluster, replicas = spec.get("role"), spec.get("cluster"), spec.get("replicas")
    ns = pool["metadata"]["namespace"]
    body = api.get("dualpath.io/v1alpha1", "DualPathCluster", ns, cluster)
    if body is None or role not in ("prefill", "decode") or replicas is None:
        return False
    current = ((body.get("spec") or {}).get(role) or {}).get("replicas")
    if current == replicas:
        return False
    api.patch_spec(
        "dualpath.io/v1alpha1",
        "DualPathCluster",
        ns,
        cluster,
        {"spec": {role: {"replicas": replicas}}},
    )
    log.info(
        "pool %s scaled: %s/%s spec.%s.replicas %s -> %s",
        pool["metadata"]["name"],
        ns,
        cluster,
        role,
        current,
        replicas,
    )
    return True
