"""`dualpath scheduler`: run the gRPC scheduler service."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from dualpath import config
from dualpath.grpc_auth import Auth, add_token_argument, load_auth
from dualpath.log import name_process
from dualpath.observability import ObservabilityServer, loop_liveness
from dualpath.scheduler.policy import POLICY_NAMES
from dualpath.units import gbps_to_bytes_per_s

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-f", "--file", help="DualPathCluster YAML (default: embedded local)")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, help="gRPC port (default: spec.scheduler.port)")
    parser.add_argument("--metrics-port", type=int, default=0, help="/metrics and /health")
    parser.add_argument("--policy", choices=POLICY_NAMES, help="override spec.scheduler.policy")
    add_token_argument(parser)


def build(
    cfg: config.ClusterConfig,
    policy_name: str | None = None,
    host: str = "0.0.0.0",
    port: int = 0,
    token: Auth | None = None,
):
    from dualpath.scheduler.policy import get_policy, thresholds_from_spec
    from dualpath.scheduler.policy.types import DEFAULT_CNIC_BYTES_PER_S
    from dualpath.scheduler.service import SchedulerServer, SchedulerServicer
    from dualpath.scheduler.state import SchedulerState

    s = cfg.spec.scheduler
    gbps = cfg.spec.network.cnic_gbps
    cnic = gbps_to_bytes_per_s(gbps) if gbps else DEFAULT_CNIC_BYTES_PER_S
    state = SchedulerState(
        get_policy(policy_name or s.policy.value),
        thresholds_from_spec(s),
        node_timeout_s=s.node_timeout_ms / 1000.0,
        cnic_bytes_per_s=cnic,
        block_tokens=cfg.spec.model.block_tokens,
        breaker_failures=s.breaker_failures,
        breaker_cooldown_s=s.breaker_open_seconds,
        max_in_flight_per_node=s.max_in_flight_per_node,
        route_lease_s=s.route_lease_seconds,
    )
    servicer = SchedulerServicer(state, s.heartbeat_interval_ms, s.node_timeout_ms)
    return SchedulerServer(servicer, host, port, token)


async def serve(args: argparse.Namespace) -> None:
    name_process("scheduler")
    cfg = config.load_or_default(args.file)
    port = args.port if args.port is not None else cfg.spec.scheduler.port
    server = build(
        cfg, args.policy, args.host, port, load_auth(args.token_file, args.tls_dir, "scheduler")
    )
    # on the gRPC bind address: a pod's (0.0.0.0, for the kubelet), loopback locally
    obs = ObservabilityServer(
        args.metrics_port, args.host, live=loop_liveness(asyncio.get_running_loop())
    ).start()
    await server.start()
    print(f"READY scheduler grpc={server.port} metrics={obs.port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("stopping scheduler")
    await server.stop()
    obs.stop()


def run(args: argparse.Namespace) -> int:
    asyncio.run(serve(args))
    return 0
