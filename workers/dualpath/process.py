"""The command, arguments and environment of every DualPath process (docs/design.md section 7).

`process_command(cfg, component, placement)` is the one place that turns the config into what a
process runs. The operator's pod builders call it with a pod's placement (the config file in
the ConfigMap mount, Service DNS names, the fixed container ports, the storage volume's mount
point) and `dualpath up` with a local one (its `cluster.yaml`, 127.0.0.1 and free ports, a local
directory for the volume), so the local cluster runs what the operator deploys.

What differs is where a process runs, never what it runs: a pod adds the downward-API variables
(POD_NAME, POD_IP) and the fabric's QoS variables (docs/design.md section 5); the local cluster runs the
entry point as `python -m dualpath.cli` and adds `--log-level` and OMP_NUM_THREADS=1.
Worker knobs (timeouts, drain, KV cache size) are read by the worker from `spec.workers`, so they
are not arguments: the rendered config carries them to pods and local processes alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from dualpath.config import ClusterConfig, Role


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
# hit blocks (either path) and write each turn's new blocks (docs/design.md sections 2 and 3). The
# frontend and the scheduler learn hits from the scheduler's block index, never from storage.
STORAGE_USERS = frozenset({Component.PREFILL, Component.DECODE})

# What runs every process, in every container image (pyproject's console script).
ENTRY_POINT = ("dualpath",)

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
    tls_dir: str = ""  # every process: its mutual TLS directory (used instead of the token)


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
    if at.tls_dir:  # mutual TLS: the shared token is not handed out at all
        args += ["--tls-dir", at.tls_dir]
    elif at.token_file:
        args += ["--token-file", at.token_file]
    return ProcessCommand(ENTRY_POINT, tuple(args), env)
