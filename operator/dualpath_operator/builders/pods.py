"""Pod templates of every DualPath process: one `dualpath` image, one command per role (vLLM
workers, `spec.workers.engine: vllm`: the same `dualpath worker` command in the vLLM image).

The command, arguments and process environment come from `dualpath.process.process_command`
(the function `dualpath up` uses too); this module adds what a pod needs around them: the pod's
placement (ConfigMap mount, Service names, fixed ports, the storage volume where a process uses
storage), the downward-API and QoS environment, resources, probes and the grace period.
"""

from __future__ import annotations

import math
from typing import Any

from dualpath.config import ClusterConfig, PoolSpec, Role
from dualpath.grpc_auth import TOKEN_KEY
from dualpath.process import (
    Component,
    Placement,
    process_command,
    termination_grace_seconds,
    uses_storage,
)

from .common import (
    API_KEYS_MOUNT,
    CONFIG_FILE,
    CONFIG_HASH_KEY,
    CONFIG_MOUNT,
    METRICS_PORT,
    TOKEN_MOUNT,
    WORKER_GRPC_PORT,
    child_name,
    labels,
)
from .qos import qos_env

SHM_SIZE = "16Gi"
TMP_SIZE = "1Gi"
# The root filesystem is read-only: /tmp (scratch of Python, UCX, NIXL) is the writable mount.
TMP_MOUNT = "/tmp"
NON_ROOT_UID = 65532
PROBE_PERIOD_SECONDS = 5
# /livez answers within 2 s (it checks the event loop); the probe waits a little longer.
LIVENESS_TIMEOUT_SECONDS = 5
# A vLLM worker's writable cache (the root filesystem is read-only): HOME, vLLM's,
# torch.compile's and Triton's caches; its `vllm serve` child inherits the environment.
VLLM_CACHE_MOUNT = "/var/cache/dualpath-vllm"


def _downward_env() -> list[dict[str, Any]]:
    return [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]


def _config_volume(cfg: ClusterConfig) -> dict[str, Any]:
    return {"name": "config", "configMap": {"name": child_name(cfg, "config")}}


def worker_runs_as_root(cfg: ClusterConfig) -> bool:
    """Root only where RDMA needs it: a container's added IPC_LOCK (pinning the registered KV
    buffer beyond the memlock limit) takes effect for root only (Kubernetes sets no ambient
    capabilities); `spec.workers.runAsNonRoot` overrides."""
    forced = cfg.spec.workers.run_as_non_root
    return (not forced) if forced is not None else cfg.spec.network.rdma.count > 0


def container_security(non_root: bool, add: tuple[str, ...] = ()) -> dict[str, Any]:
    """Every DualPath container: no capability but `add`, no privilege escalation, a read-only
    root filesystem (writable: /tmp, /dev/shm, the storage volume)."""
    caps: dict[str, Any] = {"drop": ["ALL"]}
    if add:
        caps["add"] = list(add)
    sc: dict[str, Any] = {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": caps,
    }
    if non_root:
        sc.update(runAsNonRoot=True, runAsUser=NON_ROOT_UID, runAsGroup=NON_ROOT_UID)
    else:
        sc.update(runAsNonRoot=False, runAsUser=0)
    return sc


def pod_security() -> dict[str, Any]:
    """Pod-level hardening of every DualPath pod: the runtime's seccomp profile, and no
    service-account token (no DualPath process calls the Kubernetes API)."""
    return {
        "automountServiceAccountToken": False,
        "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
    }


def _tmp_volume() -> dict[str, Any]:
    return {"name": "tmp", "emptyDir": {"sizeLimit": TMP_SIZE}}


def _tmp_mount() -> dict[str, Any]:
    return {"name": "tmp", "mountPath": TMP_MOUNT}


def _probe(path: str, port: int | str, **extra: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": PROBE_PERIOD_SECONDS,
        "failureThreshold": 3,
        **extra,
    }


def worker_probes(cfg: ClusterConfig) -> dict[str, dict[str, Any]]:
    """Startup: the model may load for `spec.workers.startupSeconds`; liveness then checks the
    process answers (also while draining); readiness is "model loaded, registered, not draining".
    """
    startup_checks = math.ceil(cfg.spec.workers.startup_seconds / PROBE_PERIOD_SECONDS)
    return {
        "startupProbe": _probe(
            "/livez",
            "metrics",
            failureThreshold=startup_checks,
            timeoutSeconds=LIVENESS_TIMEOUT_SECONDS,
        ),
        "livenessProbe": _probe(
            "/livez", "metrics", periodSeconds=10, timeoutSeconds=LIVENESS_TIMEOUT_SECONDS
        ),
        "readinessProbe": _probe("/readyz", "metrics"),
    }


def scheduler_address(cfg: ClusterConfig) -> str:
    return f"{child_name(cfg, 'scheduler')}:{cfg.spec.scheduler.port}"


def pod_placement(cfg: ClusterConfig, component: Component | str) -> Placement:
    """Where a process runs in its pod: the ConfigMap's file, Service names, container ports,
    and the storage volume mounted at `spec.storage.path` for the processes that use it."""
    comp = Component(component)
    ports = {
        Component.SCHEDULER: cfg.spec.scheduler.port,
        Component.FRONTEND: cfg.spec.frontend.port,
    }
    return Placement(
        config_file=CONFIG_FILE,
        scheduler=scheduler_address(cfg),
        host="0.0.0.0",
        port=ports.get(comp, WORKER_GRPC_PORT),
        metrics_port=METRICS_PORT,
        storage=cfg.spec.storage.path if uses_storage(comp) else None,
        node_id="$(POD_NAME)" if comp.role else "",
        advertise=f"$(POD_NAME).{child_name(cfg, comp.value)}" if comp.role else "",
        api_keys=API_KEYS_MOUNT
        if comp is Component.FRONTEND and cfg.spec.frontend.auth.secret_name
        else "",
        token_file=f"{TOKEN_MOUNT}/{TOKEN_KEY}",
    )


def _container_command(cfg: ClusterConfig, component: Component) -> dict[str, Any]:
    cmd = process_command(cfg, component, pod_placement(cfg, component))
    return {
        "command": list(cmd.command),
        "args": list(cmd.args),
        "env": [*_downward_env(), *({"name": k, "value": v} for k, v in cmd.env.items())],
    }


def _storage_mounts(cfg: ClusterConfig, component: Component) -> list[dict[str, Any]]:
    """The storage volume, mounted where the process's placement says (if it uses storage)."""
    path = pod_placement(cfg, component).storage
    return [{"name": "kv-store", "mountPath": path}] if path else []


def _api_keys_mounts(cfg: ClusterConfig, component: Component) -> list[dict[str, Any]]:
    """The frontend's API-key Secret (`spec.frontend.auth.secretName`), where its placement
    says; the kubelet updates the files in place, the frontend re-reads them."""
    path = pod_placement(cfg, component).api_keys
    return [{"name": "api-keys", "mountPath": path, "readOnly": True}] if path else []


def _api_keys_volumes(cfg: ClusterConfig, component: Component) -> list[dict[str, Any]]:
    if not _api_keys_mounts(cfg, component):
        return []
    secret = {"secretName": cfg.spec.frontend.auth.secret_name}
    return [{"name": "api-keys", "secret": secret}]


def token_secret_name(cfg: ClusterConfig) -> str:
    return child_name(cfg, "token")


def _token_mount() -> dict[str, Any]:
    # a directory mount (not subPath): the kubelet swaps the files in place on rotation
    return {"name": "cluster-token", "mountPath": TOKEN_MOUNT, "readOnly": True}


def _token_volume(cfg: ClusterConfig) -> dict[str, Any]:
    """The cluster token Secret the operator creates once (`reconcile.ensure_token`)."""
    # the default mode (0644): the processes run as a non-root uid without an fsGroup, and
    # the volume is seen by this pod's one container only
    return {"name": "cluster-token", "secret": {"secretName": token_secret_name(cfg)}}


def _model_mounts(cfg: ClusterConfig, component: Component) -> list[dict[str, Any]]:
    """`spec.model.volume`, read-only at the checkpoint path, where the checkpoint is read:
    the workers load the weights, the frontend its tokenizer."""
    model = cfg.spec.model
    if model.volume is None or component is Component.SCHEDULER:
        return []
    return [{"name": "model", "mountPath": model.checkpoint_path, "readOnly": True}]


def _model_volumes(cfg: ClusterConfig, component: Component) -> list[dict[str, Any]]:
    if not _model_mounts(cfg, component):
        return []
    return [{"name": "model", **(cfg.spec.model.volume or {})}]


def _engine_extras(cfg: ClusterConfig) -> tuple[list, list, list]:
    """(env, volume mounts, volumes) a worker's engine adds: vLLM's writable cache."""
    if cfg.spec.workers.engine != "vllm":
        return [], [], []
    env = [
        {"name": k, "value": v}
        for k, v in (
            ("HOME", VLLM_CACHE_MOUNT),
            ("XDG_CACHE_HOME", VLLM_CACHE_MOUNT),
            ("VLLM_CACHE_ROOT", f"{VLLM_CACHE_MOUNT}/vllm"),
            ("TRITON_CACHE_DIR", f"{VLLM_CACHE_MOUNT}/triton"),
            # no usage reports from inside a cluster (they would leave through the open egress)
            ("VLLM_NO_USAGE_STATS", "1"),
            ("DO_NOT_TRACK", "1"),
        )
    ]
    size = str(cfg.spec.workers.vllm.cache_bytes)
    return (
        env,
        [{"name": "vllm-cache", "mountPath": VLLM_CACHE_MOUNT}],
        [{"name": "vllm-cache", "emptyDir": {"sizeLimit": size}}],
    )


def worker_image(cfg: ClusterConfig, role: Role) -> str:
    """The pool's image, else the engine's: `model.image`, or `workers.vllm.image`."""
    spec = cfg.spec
    engine_image = spec.workers.vllm.image if spec.workers.engine == "vllm" else spec.model.image
    return spec.pool(role).image or engine_image


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
    comp = Component(role.value)
    annotations = {CONFIG_HASH_KEY: cfg.config_hash}
    if net.multus_networks:
        annotations["k8s.v1.cni.cncf.io/networks"] = ",".join(net.multus_networks)
    engine_env, engine_mounts, engine_volumes = _engine_extras(cfg)
    container = {
        "name": role.value,
        "image": worker_image(cfg, role),
        "imagePullPolicy": "IfNotPresent",
        **_container_command(cfg, comp),
        "ports": [
            {"name": "grpc", "containerPort": WORKER_GRPC_PORT},
            {"name": "metrics", "containerPort": METRICS_PORT},
        ],
        "resources": {k: v for k, v in (("limits", limits), ("requests", requests)) if v},
        # RDMA needs locked memory; the start-up check reports a low memlock as a condition.
        "securityContext": container_security(not worker_runs_as_root(cfg), ("IPC_LOCK",)),
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True},
            {"name": "dshm", "mountPath": "/dev/shm"},
            _tmp_mount(),
            _token_mount(),
            *_storage_mounts(cfg, comp),
            *_model_mounts(cfg, comp),
            *engine_mounts,
        ],
        **worker_probes(cfg),
    }
    container["env"] += [*qos_env(net), *engine_env]
    pod_spec: dict[str, Any] = {
        **pod_security(),
        "containers": [container],
        # Drain: in-flight reads, relays and handoffs finish (spec.workers.drainSeconds), then
        # the process stops its parts; the kubelet's SIGKILL comes only after both.
        "terminationGracePeriodSeconds": termination_grace_seconds(cfg),
        "volumes": [
            _config_volume(cfg),
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": SHM_SIZE}},
            _tmp_volume(),
            _token_volume(cfg),
            *([_storage_volume(cfg)] if _storage_mounts(cfg, comp) else []),
            *_model_volumes(cfg, comp),
            *engine_volumes,
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
    cfg: ClusterConfig, component: Component, port: int, port_name: str
) -> dict[str, Any]:
    """Scheduler and frontend: no GPUs; no storage volume (they never touch storage)."""
    if component is Component.FRONTEND:
        # /health (readiness: the scheduler sees a prefill and a decode node) and /metrics on
        # its HTTP port; no liveness endpoint of its own
        ports = [{"name": port_name, "containerPort": port}]
        probes = {
            "readinessProbe": {
                "httpGet": {"path": "/health", "port": port_name},
                "periodSeconds": 5,
            }
        }
    else:
        ports = [
            {"name": port_name, "containerPort": port},
            {"name": "metrics", "containerPort": METRICS_PORT},
        ]
        probes = {
            "readinessProbe": _probe("/readyz", "metrics"),
            "livenessProbe": _probe(
                "/livez", "metrics", periodSeconds=10, timeoutSeconds=LIVENESS_TIMEOUT_SECONDS
            ),
        }
    container = {
        "name": component.value,
        "image": cfg.spec.model.image,
        "imagePullPolicy": "IfNotPresent",
        **_container_command(cfg, component),
        "ports": ports,
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True},
            _tmp_mount(),
            _token_mount(),
            *_api_keys_mounts(cfg, component),
            *_storage_mounts(cfg, component),
            *_model_mounts(cfg, component),
        ],
        **probes,
        "securityContext": container_security(non_root=True),
    }
    return {
        "metadata": {
            "labels": labels(cfg, component.value),
            "annotations": {CONFIG_HASH_KEY: cfg.config_hash},
        },
        "spec": {
            **pod_security(),
            "containers": [container],
            "volumes": [
                _config_volume(cfg),
                _tmp_volume(),
                _token_volume(cfg),
                *_api_keys_volumes(cfg, component),
                *([_storage_volume(cfg)] if _storage_mounts(cfg, component) else []),
                *_model_volumes(cfg, component),
            ],
        },
    }
