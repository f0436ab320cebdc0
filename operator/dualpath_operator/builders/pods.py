"""Pod templates of every DualPath process: one `dualpath` image, one command per role."""

from __future__ import annotations

from typing import Any

from dualpath.config import ClusterConfig, PoolSpec, Role

from .common import (
    CONFIG_FILE,
    CONFIG_HASH_KEY,
    CONFIG_MOUNT,
    METRICS_PORT,
    WORKER_GRPC_PORT,
    child_name,
    labels,
)
from .qos import qos_env

SHM_SIZE = "16Gi"


def _downward_env() -> list[dict[str, Any]]:
    return [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]


def _config_volume(cfg: ClusterConfig) -> dict[str, Any]:
    return {"name": "config", "configMap": {"name": child_name(cfg, "config")}}


def _probe(path: str, port: int | str) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": 5, "failureThreshold": 3}


def scheduler_address(cfg: ClusterConfig) -> str:
    return f"{child_name(cfg, 'scheduler')}:{cfg.spec.scheduler.port}"


def _storage_volume(cfg: ClusterConfig) -> dict[str, Any]:
    # A shared filesystem (3FS FUSE, NFS, CephFS, Lustre) via the given volume source;
    # without one each pod gets a scratch dir (reported as a warning condition).
    source = cfg.spec.storage.volume or {"emptyDir": {}}
    return {"name": "kv-store", **source}


def worker_pod_template(cfg: ClusterConfig, role: Role) -> dict[str, Any]:
    spec = cfg.spec
    pool: PoolSpec = spec.pool(role)
    net = spec.network
    limits: dict[str, Any] = dict(pool.resources.limits)
    requests: dict[str, Any] = dict(pool.resources.requests)
    if pool.gpus_per_pod:
        limits["nvidia.com/gpu"] = str(pool.gpus_per_pod)
        requests["nvidia.com/gpu"] = str(pool.gpus_per_pod)
    if net.rdma.count:
        limits[net.rdma.resource_name] = str(net.rdma.count)
        requests[net.rdma.resource_name] = str(net.rdma.count)
    annotations = {CONFIG_HASH_KEY: cfg.config_hash}
    if net.multus_networks:
        annotations["k8s.v1.cni.cncf.io/networks"] = ",".join(net.multus_networks)
    container = {
        "name": role.value,
        "image": pool.image or spec.model.image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["dualpath"],
        "args": [
            "worker",
            "--role",
            role.value,
            "-f",
            CONFIG_FILE,
            "--node-id",
            "$(POD_NAME)",
            "--host",
            "0.0.0.0",
            "--port",
            str(WORKER_GRPC_PORT),
            "--advertise",
            "$(POD_NAME)." + child_name(cfg, role.value),
            "--scheduler",
            scheduler_address(cfg),
            "--metrics-port",
            str(METRICS_PORT),
        ],
        "env": [
            *_downward_env(),
            {"name": "DUALPATH_COMPONENT", "value": role.value},
            {"name": "DUALPATH_CONFIG_HASH", "value": cfg.config_hash},
            *qos_env(net),
        ],
        "ports": [
            {"name": "grpc", "containerPort": WORKER_GRPC_PORT},
            {"name": "metrics", "containerPort": METRICS_PORT},
        ],
        "resources": {k: v for k, v in (("limits", limits), ("requests", requests)) if v},
        # RDMA needs locked memory; the start-up check reports a low memlock as a condition.
        "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}},
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True},
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "kv-store", "mountPath": spec.storage.path},
        ],
        "readinessProbe": _probe("/health", "metrics"),
        "livenessProbe": {**_probe("/health", "metrics"), "initialDelaySeconds": 30},
    }
    pod_spec: dict[str, Any] = {
        "containers": [container],
        # Drain: in-flight reads, relays and handoffs finish before the pod goes.
        "terminationGracePeriodSeconds": 120,
        "volumes": [
            _config_volume(cfg),
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": SHM_SIZE}},
            _storage_volume(cfg),
        ],
    }
    if pool.node_selector:
        pod_spec["nodeSelector"] = dict(pool.node_selector)
    if pool.tolerations:
        pod_spec["tolerations"] = [
            t.model_dump(by_alias=True, exclude_none=True) for t in pool.tolerations
        ]
    pod_labels = {**labels(cfg, role.value), CONFIG_HASH_KEY: cfg.config_hash}
    return {"metadata": {"labels": pod_labels, "annotations": annotations}, "spec": pod_spec}


def control_pod_template(
    cfg: ClusterConfig, component: str, args: list[str], port: int, port_name: str
) -> dict[str, Any]:
    container = {
        "name": component,
        "image": cfg.spec.model.image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["dualpath"],
        "args": args,
        "env": [*_downward_env(), {"name": "DUALPATH_COMPONENT", "value": component}],
        "ports": [
            {"name": port_name, "containerPort": port},
            {"name": "metrics", "containerPort": METRICS_PORT},
        ],
        "volumeMounts": [{"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True}],
        "readinessProbe": _probe("/health", "metrics"),
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "runAsNonRoot": True,
            "runAsUser": 65532,
        },
    }
    return {
        "metadata": {
            "labels": labels(cfg, component),
            "annotations": {CONFIG_HASH_KEY: cfg.config_hash},
        },
        "spec": {"containers": [container], "volumes": [_config_volume(cfg)]},
    }
