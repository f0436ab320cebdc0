"""`dualpath operator`: run the kopf operator (in cluster or against $KUBECONFIG)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--namespace", action="append", help="watch only these namespaces (default: all)"
    )
    parser.add_argument(
        "--liveness", default="http://0.0.0.0:8080/healthz", help="kopf liveness endpoint"
    )
    parser.add_argument("--metrics-port", type=int, default=9090)


def run(args: argparse.Namespace) -> int:
    import kopf
    from dualpath.observability import ObservabilityServer

    from . import handlers  # noqa: F401  (registers the handlers)

    # /metrics: dualpath_operator_* (reconciles, errors, latency per result) + process metrics.
    obs = ObservabilityServer(args.metrics_port).start()
    try:
        kopf.run(
            # One replica, no peering/leader election (the chart refuses replicaCount > 1):
            # standalone also keeps kopf from needing the KopfPeering CRDs.
            standalone=True,
            clusterwide=not args.namespace,
            namespaces=args.namespace or [],
            liveness_endpoint=args.liveness or None,
        )
    finally:
        obs.stop()
    return 0
