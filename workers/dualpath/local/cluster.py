"""A local DualPath cluster as processes: scheduler, P prefill + D decode workers, frontend.

`LocalCluster(cfg, run_dir)` writes the resolved config to `run_dir/cluster.yaml` (every child
reads that same file), picks free ports, starts the processes in dependency order (each waits
for its readiness endpoint), and stops them all on exit. Each worker emulates its node's storage
NIC (`spec.storage.snicGbps`, a token bucket in the store's read queue) and compute link
(`spec.network.cnicGbps`).

Every process runs what the operator deploys: `dualpath.process.process_command` builds its
arguments and environment for both. Only the placement differs (docs/local.md): the config file
is `run_dir/cluster.yaml` instead of the ConfigMap mount, the scheduler is 127.0.0.1 on a free
port instead of its Service, every port is free instead of fixed, the storage volume is a local
directory (given to the workers only, as only their pods mount it), node ids are `<role>-<i>`
instead of the pod names; and locally the entry point is `python -m dualpath.cli` with
`--log-level`, workers get OMP_NUM_THREADS=1. gRPC is authenticated as a deployed cluster's is
(`spec.security.tls.mode`): under mtls (the default) a fresh CA in `run_dir/tls/ca/` issues
each process its own directory (`run_dir/tls/<name>/`: the node id for workers) and one for the
operator's tools (`run_dir/tls/admin/`, `client_auth`); under token, a fresh token file
(`run_dir/token`, mode 0600) instead of the operator's Secret.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import yaml

from dualpath.config import ClusterConfig, TlsMode, from_resource
from dualpath.frontend.tokenizer import save_hf_tokenizer
from dualpath.grpc_auth import Auth, ClusterToken, write_token_file
from dualpath.local.interrupt import INTERRUPT_GRACE_S
from dualpath.local.supervisor import ProcSpec, Supervisor, free_port
from dualpath.process import (
    Component,
    Placement,
    ProcessCommand,
    process_command,
    termination_grace_seconds,
    uses_storage,
)
from dualpath.tls import LocalCA, TlsCredentials

log = logging.getLogger(__name__)

LOCAL_HOST = "127.0.0.1"
# Many processes share this machine's cores: one torch thread each. UCX (NIXL's transport)
# on loopback and shared memory only: by default it listens on every interface, the
# machine's external one included. Each is a default: the environment of `dualpath up` wins.
LOCAL_WORKER_ENV = {"OMP_NUM_THREADS": "1", "UCX_NET_DEVICES": "lo", "UCX_TLS": "tcp,sm,self"}


def local_worker_env() -> dict[str, str]:
    return {k: os.environ.get(k, v) for k, v in LOCAL_WORKER_ENV.items()}


def with_overrides(cfg: ClusterConfig, **spec_paths: object) -> ClusterConfig:
    """A copy of `cfg` with dotted camelCase spec fields replaced, e.g. `scheduler.policy`."""
    res = cfg.to_resource()
    for dotted, value in spec_paths.items():
        node = res["spec"]
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return from_resource(res)


def with_vllm_checkpoint(cfg: ClusterConfig, out: Path) -> ClusterConfig:
    """`cfg` serving its model from a checkpoint of its seeded weights written to `out` (vLLM
    loads checkpoints only; the DualPath engine loads the same one)."""
    from dualpath.local.model import write_checkpoint

    if not (out / "config.json").is_file():
        write_checkpoint(cfg.spec.model, out)
    return with_overrides(cfg, **{"model.checkpointPath": str(out.resolve())})


# vLLM starts in 30-80 s alone; two at once on a busy 2-core machine take longer
VLLM_READY_TIMEOUT_S = 600


@dataclass
class Endpoints:
    scheduler: str = ""
    scheduler_health: str = ""
    frontend: str = ""
    workers: dict[str, str] = field(default_factory=dict)  # node id -> readiness URL


def local_argv(cmd: ProcessCommand, log_level: str = "INFO") -> list[str]:
    """The entry point as this interpreter's module, plus `--log-level` (one token: cli.py
    picks the command by position)."""
    return [sys.executable, "-m", "dualpath.cli", f"--log-level={log_level}", *cmd.args]


def local_placement(
    cfg_path: Path,
    component: Component,
    scheduler: str,
    storage: Path,
    index: int = 0,
    token_file: Path | None = None,
    ca: LocalCA | None = None,
    port: int = 0,
) -> Placement:
    """A process's placement on this machine: loopback, free ports (`port`, when not 0, for its
    own), the local storage dir for the processes that use storage; with `ca`, its own TLS
    directory issued by it."""
    worker = component.role is not None
    node_id = f"{component.value}-{index}" if worker else ""
    name = node_id or component.value
    tls_dir = ca.issue_dir(name, component.value, name) if ca is not None else ""
    if component is Component.SCHEDULER:
        port = int(scheduler.rsplit(":", 1)[1])
    return Placement(
        config_file=str(cfg_path),
        scheduler=scheduler,
        host=LOCAL_HOST,
        port=port or free_port(),
        metrics_port=0 if component is Component.FRONTEND else free_port(),
        storage=str(storage) if uses_storage(component) else None,
        node_id=node_id,
        advertise=LOCAL_HOST if worker else "",
        token_file=str(token_file or ""),
        tls_dir=str(tls_dir),
    )


def process_specs(
    cfg_path: Path,
    cfg: ClusterConfig,
    storage: Path,
    log_level: str = "INFO",
    token_file: Path | None = None,
    ca: LocalCA | None = None,
    frontend_port: int = 0,
) -> tuple[list[ProcSpec], Endpoints]:
    """The processes of a local cluster in start order, and their endpoints; the frontend on
    `frontend_port` (0: a free one)."""
    ep = Endpoints()
    ep.scheduler = f"{LOCAL_HOST}:{free_port()}"

    def spec(component: Component, index: int = 0, **kw: object) -> tuple[ProcSpec, Placement]:
        port = frontend_port if component is Component.FRONTEND else 0
        at = local_placement(
            cfg_path, component, ep.scheduler, storage, index, token_file, ca, port
        )
        cmd = process_command(cfg, component, at)
        name = at.node_id or component.value
        extra = local_worker_env() if component.role else {}
        return ProcSpec(name, local_argv(cmd, log_level), env={**cmd.env, **extra}, **kw), at

    sched, at = spec(Component.SCHEDULER, ready_timeout_s=60, fork_restart=True)
    ep.scheduler_health = sched.health_url = f"http://{LOCAL_HOST}:{at.metrics_port}/readyz"
    specs = [sched]
    for component in (Component.PREFILL, Component.DECODE):
        for i in range(cfg.spec.pool(component.role).replicas):
            ready_s = VLLM_READY_TIMEOUT_S if cfg.spec.workers.engine == "vllm" else 180
            worker, at = spec(component, i, ready_timeout_s=ready_s, stop_wave=1, fork_restart=True)
            worker.health_url = ep.workers[at.node_id] = (
                f"http://{LOCAL_HOST}:{at.metrics_port}/readyz"
            )
            specs.append(worker)
    frontend, at = spec(Component.FRONTEND, ready_timeout_s=120, stop_wave=2)
    ep.frontend = f"http://{LOCAL_HOST}:{at.port}"
    frontend.health_url = f"{ep.frontend}/health"
    specs.append(frontend)
    return specs, ep


def run_dir_auth(run_dir: str | Path) -> Auth | None:
    """What an operator's tool (the fault suite, a scheduler client) authenticates with to the
    cluster of `run_dir`: its `admin` certificate, the token, or nothing (mode off)."""
    run_dir = Path(run_dir)
    if (run_dir / "tls" / "admin").is_dir():
        return TlsCredentials(run_dir / "tls" / "admin")
    return ClusterToken(run_dir / "token") if (run_dir / "token").exists() else None


class LocalCluster:
    """Owns the processes of one local cluster; use as a context manager."""

    def __init__(
        self,
        cfg: ClusterConfig,
        run_dir: str | Path,
        sink: IO[str] | None = None,
        grace_s: float | None = None,
        log_level: str = "INFO",
        fresh_storage: bool = False,
        storage_dir: str | Path | None = None,
        zygote: bool = False,
        frontend_port: int = 0,
    ) -> None:
        """`grace_s`: SIGTERM to SIGKILL (default: the pods' grace, spec.workers.drainSeconds
        plus the stop margin). `storage_dir`: the local directory that backs the storage volume,
        given to the processes that mount it (the workers). By default it is spec.storage.path
        (resolved, and written so into cluster.yaml); a directory apart from spec.storage.path
        runs the deployed topology exactly: no other process can reach the store. `zygote`: a
        crashed worker or scheduler is restarted forked from a warm process that has done
        their imports (`dualpath.local.zygote`), not started afresh (`dualpath up`; off for
        benchmarks and tests, where its imports would compete for the CPU). `frontend_port`:
        the OpenAI API's port on 127.0.0.1 (0: a free one)."""
        self.zygote = zygote
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        storage = Path(cfg.spec.storage.path if storage_dir is None else storage_dir)
        if not storage.is_absolute():
            storage = (Path.cwd() / storage).resolve()
        if fresh_storage and storage.exists():
            shutil.rmtree(storage)
        storage.mkdir(parents=True, exist_ok=True)
        if storage_dir is None:
            cfg = with_overrides(cfg, **{"storage.path": str(storage)})
        if cfg.spec.workers.engine == "vllm" and not cfg.spec.model.checkpoint_path:
            cfg = with_vllm_checkpoint(cfg, self.run_dir / "model")
        self.cfg = cfg
        self.storage = storage
        self.cfg_path = self.run_dir / "cluster.yaml"
        self.cfg_path.write_text(yaml.safe_dump(self.cfg.to_resource(), sort_keys=False))
        # new credentials per start: a process of an earlier run cannot join this one
        mode = self.cfg.spec.security.tls.mode
        self.token_file = (
            write_token_file(self.run_dir / "token") if mode is TlsMode.TOKEN else None
        )
        self.ca: LocalCA | None = None
        if mode is TlsMode.MTLS:
            shutil.rmtree(self.run_dir / "tls", ignore_errors=True)
            self.ca = LocalCA(self.run_dir / "tls", self.cfg.name)
            self.ca.issue_dir("admin", "admin", "admin")
        # what a client's `--tokenizer <dir>` loads (the checkpoint's own when it has one)
        self.tokenizer_dir = save_hf_tokenizer(self.cfg.spec.model, self.run_dir / "tokenizer")
        self.specs, self.endpoints = process_specs(
            self.cfg_path, self.cfg, storage, log_level, self.token_file, self.ca, frontend_port
        )
        grace = termination_grace_seconds(self.cfg) if grace_s is None else grace_s
        self.supervisor = Supervisor(grace_s=grace, sink=sink)

    def client_auth(self) -> Auth | None:
        return run_dir_auth(self.run_dir)

    def start(self) -> LocalCluster:
        log.info(
            "starting local cluster: 1 scheduler, %d prefill, %d decode, 1 frontend "
            "(SNIC %.2f Gbps/node, storage %s)",
            self.cfg.spec.prefill.replicas,
            self.cfg.spec.decode.replicas,
            self.cfg.spec.storage.snic_gbps,
            self.storage,
        )
        try:
            sched, *workers, frontend = self.specs
            self.supervisor.start([sched])
            for w in workers:  # workers load the model in parallel
                self.supervisor.spawn(w)
            self.supervisor.wait_ready([w.name for w in workers])
            self.supervisor.start([frontend])
            if self.zygote:  # warm from now on: a crashed worker or scheduler restarts fast
                from dualpath.local.zygote_client import Zygote

                self.supervisor.zygote = Zygote(env=local_worker_env())
        except BaseException:
            self.supervisor.stop()
            raise
        log.info(
            "local cluster up: OpenAI API at %s/v1, tokenizer %s",
            self.endpoints.frontend,
            self.tokenizer_dir,
        )
        return self

    def stop(self, grace_s: float | None = None) -> None:
        """Stop every process (`grace_s`: at most this SIGTERM to SIGKILL, else each one's)."""
        self.supervisor.stop(grace_s)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        # left on Ctrl-C / SIGTERM (KeyboardInterrupt): the turns are abandoned, drain nothing
        interrupted = exc_type is not None and issubclass(exc_type, KeyboardInterrupt)
        self.stop(INTERRUPT_GRACE_S if interrupted else None)
