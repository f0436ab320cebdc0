"""Workload objects: worker StatefulSets + headless Services, control-plane Deployments."""

from __future__ import annotations

from typing import Any

from dualpath.config import ClusterConfig, Role
from dualpath.process import Component

from .common import (
    METRICS_PORT,
    WORKER_GRPC_PORT,
    child_name,
    metadata,
    selector_labels,
)
from .pods import control_pod_template, worker_pod_template


def worker_service(cfg: ClusterConfig, role: Role, owner: dict | None) -> dict[str, Any]:
    """Headless: each worker is addressed by its stable pod DNS name."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(cfg, child_name(cfg, role.value), role.value, owner),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector_labels(cfg, role.value),
            "ports": [
                {"name": "grpc", "port": WORKER_GRPC_PORT, "targetPort": "grpc"},
                {"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics"},
            ],
        },
    }


def worker_statefulset(
    cfg: ClusterConfig, role: Role, owner: dict | None, replicas: int | None = None
) -> dict[str, Any]:
    """`replicas`: the pool's count (the one owner after creation, see `scaling.py`); None for
    the cluster spec's initial count (`dualpath render`, a pool not created yet)."""
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": metadata(cfg, child_name(cfg, role.value), role.value, owner),
        "spec": {
            "replicas": cfg.spec.pool(role).replicas if replicas is None else replicas,
            "serviceName": child_name(cfg, role.value),
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": selector_labels(cfg, role.value)},
            "updateStrategy": {"type": "RollingUpdate"},
            "template": worker_pod_template(cfg, role),
        },
    }


def worker_pdb(cfg: ClusterConfig, role: Role, owner: dict | None) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(cfg, child_name(cfg, role.value), role.value, owner),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector_labels(cfg, role.value)},
        },
    }


def scheduler_objects(cfg: ClusterConfig, owner: dict | None) -> list[dict[str, Any]]:
    name = child_name(cfg, "scheduler")
    port = cfg.spec.scheduler.port
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(cfg, name, "scheduler", owner),
        "spec": {
            "replicas": cfg.spec.scheduler.replicas,
            # One active scheduler: never two with diverging views.
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": selector_labels(cfg, "scheduler")},
            "template": control_pod_template(cfg, Component.SCHEDULER, port, "grpc"),
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(cfg, name, "scheduler", owner),
        "spec": {
            "selector": selector_labels(cfg, "scheduler"),
            "ports": [
                {"name": "grpc", "port": port, "targetPort": "grpc"},
                {"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics"},
            ],
        },
    }
    return [deployment, service]


def frontend_objects(cfg: ClusterConfig, owner: dict | None) -> list[dict[str, Any]]:
    name = child_name(cfg, "frontend")
    fe = cfg.spec.frontend
    template = control_pod_template(cfg, Component.FRONTEND, fe.port, "http")
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(cfg, name, "frontend", owner),
        "spec": {
            "replicas": fe.replicas,
            "selector": {"matchLabels": selector_labels(cfg, "frontend")},
            "template": template,
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(cfg, name, "frontend", owner),
        "spec": {
            "type": fe.service_type,
            "selector": selector_labels(cfg, "frontend"),
            "ports": [{"name": "http", "port": fe.port, "targetPort": "http"}],
        },
    }
    return [deployment, service]
