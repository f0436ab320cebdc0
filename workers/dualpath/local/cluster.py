"""A local DualPath cluster as processes: scheduler, P prefill + D decode workers, frontend.

`LocalCluster(cfg, run_dir)` writes the resolved config to `run_dir/cluster.yaml` (every child
reads that same file), picks free ports, starts the processes in dependency order (each waits
for its `/health`), and stops them all on exit. Each worker emulates its node's storage NIC
(`spec.storage.snicGbps`, a token bucket in the store's read queue) and compute link
(`spec.network.cnicGbps`).
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import yaml

from dualpath.config import ClusterConfig, from_resource
from dualpath.local.supervisor import ProcSpec, Supervisor, free_port

log = logging.getLogger(__name__)


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


@dataclass
class Endpoints:
    scheduler: str = ""
    scheduler_health: str = ""
    frontend: str = ""
    workers: dict[str, str] = field(default_factory=dict)  # node id -> health URL


def _dualpath(*args: str) -> list[str]:
    return [sys.executable, "-m", "dualpath.cli", *args]


def process_specs(
    cfg_path: Path, cfg: ClusterConfig, storage: Path, log_level: str = "INFO"
) -> tuple[list[ProcSpec], Endpoints]:
    ep = Endpoints()
    sched_port, sched_metrics = free_port(), free_port()
    ep.scheduler = f"127.0.0.1:{sched_port}"
    ep.scheduler_health = f"http://127.0.0.1:{sched_metrics}/health"
    common = [f"--log-level={log_level}"]  # one token: cli.py picks the command by position
    specs = [
        ProcSpec(
            "scheduler",
            _dualpath(
                *common,
                "scheduler",
                "-f",
                str(cfg_path),
                "--host",
                "127.0.0.1",
                "--port",
                str(sched_port),
                "--metrics-port",
                str(sched_metrics),
            ),
            health_url=ep.scheduler_health,
            ready_timeout_s=60,
        )
    ]
    for role, pool in (("prefill", cfg.spec.prefill), ("decode", cfg.spec.decode)):
        for i in range(pool.replicas):
            name = f"{role}-{i}"
            port, metrics = free_port(), free_port()
            argv = _dualpath(
                *common,
                "worker",
                "--role",
                role,
                "--index",
                str(i),
                "-f",
                str(cfg_path),
                "--node-id",
                name,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--metrics-port",
                str(metrics),
                "--scheduler",
                ep.scheduler,
                "--storage",
                str(storage),
            )
            ep.workers[name] = f"http://127.0.0.1:{metrics}/health"
            specs.append(
                ProcSpec(
                    name,
                    argv,
                    health_url=ep.workers[name],
                    ready_timeout_s=180,
                    env={"OMP_NUM_THREADS": "1"},
                    stop_wave=1,
                )
            )
    fe_port = free_port()
    ep.frontend = f"http://127.0.0.1:{fe_port}"
    specs.append(
        ProcSpec(
            "frontend",
            _dualpath(
                *common,
                "frontend",
                "-f",
                str(cfg_path),
                "--host",
                "127.0.0.1",
                "--port",
                str(fe_port),
                "--scheduler",
                ep.scheduler,
            ),
            health_url=f"{ep.frontend}/health",
            ready_timeout_s=120,
            stop_wave=2,
        )
    )
    return specs, ep


class LocalCluster:
    """Owns the processes of one local cluster; use as a context manager."""

    def __init__(
        self,
        cfg: ClusterConfig,
        run_dir: str | Path,
        sink: IO[str] | None = None,
        grace_s: float = 5.0,
        log_level: str = "INFO",
        fresh_storage: bool = False,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        storage = Path(cfg.spec.storage.path)
        if not storage.is_absolute():
            storage = (Path.cwd() / storage).resolve()
        if fresh_storage and storage.exists():
            import shutil

            shutil.rmtree(storage)
        storage.mkdir(parents=True, exist_ok=True)
        self.cfg = with_overrides(cfg, **{"storage.path": str(storage)})
        self.storage = storage
        self.cfg_path = self.run_dir / "cluster.yaml"
        self.cfg_path.write_text(yaml.safe_dump(self.cfg.to_resource(), sort_keys=False))
        self.specs, self.endpoints = process_specs(self.cfg_path, self.cfg, storage, log_level)
        self.supervisor = Supervisor(grace_s=grace_s, sink=sink)

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
        except BaseException:
            self.supervisor.stop()
            raise
        log.info("local cluster up: OpenAI API at %s/v1", self.endpoints.frontend)
        return self

    def stop(self) -> None:
        self.supervisor.stop()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
