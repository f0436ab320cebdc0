"""`dualpath worker --role prefill|decode`: run one worker process."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import socket

from dualpath import config
from dualpath.grpc_auth import add_token_argument, load_auth
from dualpath.log import name_process

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--role", required=True, choices=["prefill", "decode"])
    parser.add_argument("-f", "--file", help="DualPathCluster YAML (default: embedded local)")
    parser.add_argument("--index", type=int, default=0, help="replica index (default node id)")
    parser.add_argument("--node-id", help="default: <role>-<index>, or $POD_NAME")
    parser.add_argument("--host", default="0.0.0.0", help="gRPC bind address")
    parser.add_argument("--port", type=int, default=0, help="gRPC port (0: pick a free one)")
    parser.add_argument(
        "--advertise",
        default="",
        help="host:port peers reach this worker at (default: "
        "$POD_IP or the bind host, with the bound port)",
    )
    parser.add_argument("--metrics-port", type=int, default=0, help="/metrics and /health")
    parser.add_argument("--scheduler", default="", help="scheduler host:port (empty: none)")
    parser.add_argument("--storage", default=None, help="KV directory (default: spec.storage.path)")
    add_token_argument(parser)
    # The worker's knobs live in spec.workers (so a deployed cluster sets them); these flags
    # override the config for local experiments and tests.
    parser.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=None,
        help="override spec.workers.kvCacheTokens (decode: tokens of the paged KV cache)",
    )
    parser.add_argument(
        "--deadline",
        type=float,
        default=None,
        help="override spec.workers.transferDeadlineSeconds (one KV transfer or wait, s)",
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="override spec.workers.requestTimeoutSeconds (one prefill call, s)",
    )
    parser.add_argument(
        "--drain-seconds",
        "--grace",
        dest="drain_seconds",
        type=float,
        default=None,
        help="override spec.workers.drainSeconds (drain time on SIGTERM, s)",
    )


async def serve(args: argparse.Namespace) -> int:
    import os

    from prometheus_client import REGISTRY

    from dualpath.observability import ObservabilityServer
    from dualpath.worker.common import NodeOptions
    from dualpath.worker.node import WorkerNode

    cfg = config.load_or_default(args.file)
    role = config.Role(args.role)
    node_id = args.node_id or os.environ.get("POD_NAME") or f"{role.value}-{args.index}"
    name_process(f"{role.value}:{node_id}")  # ps, pgrep and the log lines tell the roles apart
    opts = NodeOptions(
        role=role,
        node_id=node_id,
        host=args.host,
        port=args.port,
        scheduler=args.scheduler,
        storage=args.storage or "",
        kv_cache_tokens=args.kv_cache_tokens,
        deadline_s=args.deadline,
        request_timeout_s=args.request_timeout,
        drain_s=args.drain_seconds,
        advertise=args.advertise,
        advertise_host=os.environ.get("POD_IP")
        or (args.host if args.host not in ("0.0.0.0", "::") else socket.gethostname()),
        token=load_auth(args.token_file, args.tls_dir, f"{role.value} worker {node_id}"),
    )
    if cfg.spec.workers.engine == "vllm":  # the same worker, serving on vLLM (docs/vllm.md)
        from dualpath.worker.vllm import VllmWorker

        node = VllmWorker(cfg, opts, config_file=args.file or "")
        registry = node.registry  # its vLLM processes' metrics too
    else:
        node = WorkerNode(cfg, opts)
        registry = REGISTRY
    # /metrics and the probes on the gRPC bind address: a pod's (0.0.0.0, for the kubelet),
    # loopback in a local cluster
    obs = ObservabilityServer(
        args.metrics_port, args.host, health=node.health, live=node.live, registry=registry
    ).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        starting = asyncio.ensure_future(node.start())
        if cfg.spec.workers.engine == "vllm":  # vLLM starts in a minute: SIGTERM stops that
            stopped = asyncio.ensure_future(stop.wait())
            await asyncio.wait([starting, stopped], return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
            if not starting.done():
                starting.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await starting
                await node.stop()
                return 0
        await starting
        print(
            f"READY worker role={role.value} node={node_id} grpc={node.address} metrics={obs.port}",
            flush=True,
        )
        exited = getattr(node, "exited", None)  # engine vllm: its vLLM child ended
        waits = [asyncio.ensure_future(stop.wait())]
        if exited is not None:
            waits.append(asyncio.ensure_future(exited.wait()))
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()
        if exited is not None and exited.is_set() and not stop.is_set():
            await node.stop()
            return 1
        await node.drain_and_stop()
    finally:
        obs.stop()
    return 0


def run(args: argparse.Namespace) -> int:
    return asyncio.run(serve(args))
