"""The command, arguments and environment of every DualPath process (DESIGN section 7).

`process_command(cfg, component, placement)` is the one place that turns the config into what a
process runs. The operator's pod builders call it with a pod's placement (the config file in
the ConfigMap mount, Service DNS names, the fixed container ports, the storage volume's mount
point) and `dualpath up` with a local one (its `cluster.yaml`, 127.0.0.1 and free ports, a local
directory for the volume), so the local cluster runs what the operator deploys.

What differs is where a process runs, never what it runs: a pod adds the downward-API variables
(POD_NAME, POD_IP) and the fabric's QoS variables (DESIGN section 5); the local cluster runs the
entry point as `python -m dualpath.cli` and adds `--log-level` and OMP_NUM_THREADS=1.
Worker knobs (timeouts, drain, KV cache size) are read by the worker from `spec.workers`, so they
are not arguments: the rendered config carries them to pods and local processes alike.

With `spec.workers.engine: vllm` a worker is `vllm serve <model>` instead (docs/vllm.md): its
placement's port is vLLM's HTTP port, and what the DualPath connector inside it needs (scheduler,
node id, store) travels in `--kv-transfer-config`, written by `dualpath.integrations.vllm.config`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from dualpath.config import ClusterConfig, Role
from dualpath.integrations.vllm.config import ConnectorSettings, kv_transfer_config_arg


class Component(str, Enum):
    """One kind of DualPath process."""

    SCHEDULER = "scheduler"
    PREFILL = "prefill"
    DECODE = "decode"
    FRONTEND = "frontend"

    @property
    def role(self) -> Role | None:
        """The worker role, or None for the control processes."""
        return Role(self.value) if self.value in ("prefill", "decode") else None


# The processes that read or write KV blocks and so mount the storage volume: workers read the
# hit blocks (either path) and write each turn's new blocks (DESIGN sections 2 and 3). The
# frontend and the scheduler learn hits from the scheduler's block index, never from storage.
STORAGE_USERS = frozenset({Component.PREFILL, Component.DECODE})

# What runs every process, in every container image (pyproject's console script).
ENTRY_POINT = ("dualpath",)
# What runs a vLLM worker (engine vllm): vLLM's own CLI, in the vLLM image (Dockerfile.vllm).
VLLM_ENTRY_POINT = ("vllm",)

# Seconds a worker needs after its drain to stop its parts (gRPC server, scheduler agent, NIXL,
# the engine's thread); the pod's grace period adds this to `spec.workers.drainSeconds`.
STOP_MARGIN_SECONDS = 15


def uses_storage(component: Component | str) -> bool:
    return Component(component) in STORAGE_USERS


def termination_grace_seconds(cfg: ClusterConfig) -> int:
    """The pod's terminationGracePeriodSeconds and the local cluster's SIGTERM-to-SIGKILL time."""
    return cfg.spec.workers.drain_seconds + STOP_MARGIN_SECONDS


@dataclass(frozen=True)
class Placement:
    """Where one process runs: its files, addresses and ports (a pod's or a local process's)."""

    config_file: str  # the rendered DualPathCluster YAML this process reads
    scheduler: str  # host:port of the scheduler's gRPC service
    host: str  # bind address
    port: int  # gRPC port (scheduler, workers) or HTTP port (frontend)
    metrics_port: int = 0  # /metrics, /livez, /readyz (the frontend serves them on `port`)
    storage: str | None = None  # the KV volume's mount point; only for STORAGE_USERS
    node_id: str = ""  # workers: the id the scheduler knows the node by
    advertise: str = ""  # workers: the host peers reach it at (with the bound port)
    api_keys: str = ""  # frontend: file or directory of API keys ("": the API is open)
    token_file: str = ""  # every process: the cluster token file ("": gRPC unauthenticated)


@dataclass(frozen=True)
class ProcessCommand:
    command: tuple[str, ...]
    args: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)

    @property
    def argv(self) -> list[str]:
        return [*self.command, *self.args]


def process_command(
    cfg: ClusterConfig, component: Component | str, at: Placement
) -> ProcessCommand:
    """The `dualpath ...` command line and environment of one process of `cfg`."""
    comp = Component(component)
    if uses_storage(comp) and not at.storage:
        raise ValueError(f"{comp.value}: reads and writes KV blocks, give its storage mount")
    if not uses_storage(comp) and at.storage:
        raise ValueError(f"{comp.value}: never touches storage, give it no storage mount")
    served = ["-f", at.config_file, "--host", at.host, "--port", str(at.port)]
    env = {"DUALPATH_COMPONENT": comp.value}
    if comp is Component.SCHEDULER:
        args = ["scheduler", *served, "--metrics-port", str(at.metrics_port)]
    elif comp is Component.FRONTEND:
        args = ["frontend", *served, "--scheduler", at.scheduler]
        if at.api_keys:
            args += ["--api-keys", at.api_keys]
    else:
        if not at.node_id or not at.advertise:
            raise ValueError(f"{comp.value}: a worker needs its node id and advertised host")
        if cfg.spec.workers.engine == "vllm":
            env["DUALPATH_CONFIG_HASH"] = cfg.config_hash
            return ProcessCommand(VLLM_ENTRY_POINT, tuple(vllm_serve_args(cfg, comp, at)), env)
        args = [
            "worker",
            "--role",
            comp.value,
            *served,
            "--node-id",
            at.node_id,
            "--advertise",
            at.advertise,
            "--scheduler",
            at.scheduler,
            "--metrics-port",
            str(at.metrics_port),
            "--storage",
            str(at.storage),
        ]
        env["DUALPATH_CONFIG_HASH"] = cfg.config_hash
    if at.token_file:
        args += ["--token-file", at.token_file]
    return ProcessCommand(ENTRY_POINT, tuple(args), env)


def vllm_serve_args(cfg: ClusterConfig, component: Component, at: Placement) -> list[str]:
    """`vllm serve ...` of one vLLM worker: what vLLM needs from the one config (served name,
    block size, context length, tensor parallelism over the pod's GPUs, KV cache space) and the
    DualPath connector's `--kv-transfer-config`; `workers.vllm.extraArgs` last."""
    spec = cfg.spec
    vllm = spec.workers.vllm
    role = component.role
    assert role is not None and at.storage
    settings = ConnectorSettings(
        config_file=at.config_file,
        storage=at.storage,
        node_id=at.node_id,
        scheduler=at.scheduler,
        token_file=at.token_file,
        node_role=role.value,
        advertise_address=f"{at.advertise}:{at.port}",
        metrics_port=at.metrics_port,
    )
    args = [
        "serve",
        spec.vllm_model(),
        "--host",
        at.host,
        "--port",
        str(at.port),
        "--served-model-name",
        spec.model.name,
        # one block is one block on both sides: vLLM's pages are the store's blocks
        "--block-size",
        str(spec.model.block_tokens),
        "--max-model-len",
        str(spec.frontend.max_context_tokens),
        "--dtype",
        spec.model.dtype,
        "--seed",
        str(spec.model.seed),
    ]
    gpus = spec.pool(role).gpus_per_pod
    if gpus > 1:
        args += ["--tensor-parallel-size", str(gpus)]
    if vllm.kv_cache_bytes:
        args += ["--kv-cache-memory-bytes", str(vllm.kv_cache_bytes)]
    else:
        args += ["--gpu-memory-utilization", f"{vllm.gpu_memory_percent / 100:.2f}"]
    args += ["--kv-transfer-config", kv_transfer_config_arg(settings)]
    return [*args, *vllm.extra_args]
