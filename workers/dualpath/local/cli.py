"""`dualpath up`: a local cluster (scheduler, workers, frontend) as processes on this machine.

Ctrl-C or SIGTERM stops every process (SIGTERM, then SIGKILL after the grace period: in-flight
turns drain as in the pods); a second one SIGKILLs what is left at once.
"""

from __future__ import annotations

import argparse
import logging
import signal
from dataclasses import replace

from dualpath import config
from dualpath.local.supervisor import RestartPolicy
from dualpath.scheduler.policy import POLICY_NAMES

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-f", "--file", help="DualPathCluster YAML (default: embedded local)")
    parser.add_argument("--run-dir", default="out/local", help="resolved config lives here")
    parser.add_argument("--policy", choices=POLICY_NAMES, help="override spec.scheduler.policy")
    parser.add_argument(
        "--grace",
        type=float,
        default=None,
        help="seconds between TERM and KILL (default: as the pods, spec.workers.drainSeconds "
        "plus a stop margin; an idle worker stops in about a second)",
    )
    parser.add_argument(
        "--storage-dir",
        default=None,
        help="local directory backing the storage volume, given to the workers only "
        "(default: spec.storage.path)",
    )
    parser.add_argument(
        "--engine",
        choices=["dualpath", "vllm"],
        help="override spec.workers.engine: vllm serves on vLLM with the DualPath connector "
        "(a checkpoint of the config's model is written into the run dir when it has none)",
    )
    parser.add_argument("--fresh", action="store_true", help="empty the storage directory first")
    parser.add_argument(
        "--port",
        type=int,
        default=0,
        help="the OpenAI API's port on 127.0.0.1 (default: a free one, printed in the READY line)",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=RestartPolicy().max_restarts,
        help="crashes in a row (none a stable run) after which the cluster stops (default: "
        "%(default)s)",
    )
    parser.add_argument(
        "--max-restart-delay",
        type=float,
        default=RestartPolicy().max_s,
        help="the crash-loop backoff's longest wait before a restart, seconds (default: "
        "%(default)s)",
    )
    parser.add_argument(
        "--no-zygote",
        action="store_true",
        help="restart a crashed worker or scheduler as a fresh process, not as a fork of a "
        "warm process that has done its imports (dualpath.local.zygote)",
    )


def run(args: argparse.Namespace) -> int:
    from dualpath.local.cluster import LocalCluster, with_overrides
    from dualpath.local.supervisor import StartError

    cfg = config.load_or_default(args.file)
    if args.policy:
        cfg = with_overrides(cfg, **{"scheduler.policy": args.policy})
    if args.engine:
        cfg = with_overrides(cfg, **{"workers.engine": args.engine})
    cluster = LocalCluster(
        cfg,
        args.run_dir,
        grace_s=args.grace,
        fresh_storage=args.fresh,
        storage_dir=args.storage_dir,
        zygote=not args.no_zygote,
        frontend_port=args.port,
    )
    cluster.supervisor.restart = replace(
        cluster.supervisor.restart,
        max_restarts=args.max_restarts,
        max_s=args.max_restart_delay,
    )
    stop = cluster.supervisor.abort  # Ctrl-C during start aborts the start too

    def on_signal(*_: object) -> None:
        if stop.is_set():  # the second one: no more grace
            cluster.supervisor.hurry.set()
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    try:
        cluster.start()
        print(
            f"READY up frontend={cluster.endpoints.frontend} "
            f"scheduler={cluster.endpoints.scheduler} tokenizer={cluster.tokenizer_dir}",
            flush=True,
        )
        while not stop.wait(0.2):
            gave_up = cluster.supervisor.heal()  # a crashed process restarts, the rest serve on
            if gave_up:
                log.error(
                    "process crashed %d times in a row: %s; stopping the cluster",
                    cluster.supervisor.restart.max_restarts + 1,
                    ", ".join(f"{n} (code {rc})" for n, rc in gave_up),
                )
                return 1
        log.info("stopping local cluster")
        return 0
    except StartError as err:
        log.error("local cluster did not start: %s", err)
        return 1
    finally:
        cluster.stop()
