"""NetworkPolicies of one DualPathCluster (`spec.network.policies`, on by default).

Ingress only: the scheduler from this cluster's frontend and workers; the workers (gRPC and,
between workers, every port: UCX picks its TCP ports at run time) from the scheduler, the
frontend and each other; the frontend from `frontendFrom` / `frontendFromCidrs` (default: the
cluster's namespace); the metrics port from the monitoring namespaces. Egress stays open (the
storage volume, DNS and the model registry are outside what the operator knows). RDMA traffic
and Multus secondary networks bypass the pod network, so no NetworkPolicy covers them.
"""

from __future__ import annotations

from typing import Any

from dualpath.config import ClusterConfig, Role

from .common import METRICS_PORT, WORKER_GRPC_PORT, child_name, metadata, selector_labels

WORKER_ROLES = tuple(r.value for r in Role)


def _pods(cfg: ClusterConfig, *components: str) -> dict[str, Any]:
    """A peer: this cluster's pods of the given components (same namespace)."""
    sel = selector_labels(cfg, components[0])
    del sel["app.kubernetes.io/component"]
    return {
        "podSelector": {
            "matchLabels": sel,
            "matchExpressions": [
                {
                    "key": "app.kubernetes.io/component",
                    "operator": "In",
                    "values": list(components),
                }
            ],
        }
    }


def _monitoring(cfg: ClusterConfig, port: int | str) -> dict[str, Any]:
    sel = cfg.spec.network.policies.monitoring_namespace_selector
    return {
        "from": [{"namespaceSelector": {"matchLabels": dict(sel)}}],
        "ports": [{"protocol": "TCP", "port": port}],
    }


def _policy(
    cfg: ClusterConfig, component: str, selected: list[str], ingress: list[dict], owner: dict | None
) -> dict[str, Any]:
    target = _pods(cfg, *selected)["podSelector"]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(cfg, child_name(cfg, component), component, owner),
        "spec": {"podSelector": target, "policyTypes": ["Ingress"], "ingress": ingress},
    }


def _frontend_peers(cfg: ClusterConfig) -> list[dict[str, Any]]:
    pol = cfg.spec.network.policies
    peers: list[dict[str, Any]] = []
    for p in pol.frontend_from:
        peer: dict[str, Any] = {"podSelector": {"matchLabels": dict(p.pod_selector)}}
        if p.namespace_selector is not None:
            peer["namespaceSelector"] = {"matchLabels": dict(p.namespace_selector)}
        peers.append(peer)
    peers += [{"ipBlock": {"cidr": c}} for c in pol.frontend_from_cidrs]
    # default: every pod of the cluster's namespace
    return peers or [{"podSelector": {}}]


def network_policies(cfg: ClusterConfig, owner: dict | None) -> list[dict[str, Any]]:
    """The cluster's NetworkPolicies; none when `spec.network.policies.enabled` is false."""
    if not cfg.spec.network.policies.enabled:
        return []
    sched_port = cfg.spec.scheduler.port
    fe_port = cfg.spec.frontend.port
    tcp = "TCP"
    scheduler = _policy(
        cfg,
        "scheduler",
        ["scheduler"],
        [
            {
                "from": [_pods(cfg, "frontend", *WORKER_ROLES)],
                "ports": [{"protocol": tcp, "port": sched_port}],
            },
            _monitoring(cfg, METRICS_PORT),
        ],
        owner,
    )
    workers = _policy(
        cfg,
        "workers",
        list(WORKER_ROLES),
        [
            {
                "from": [_pods(cfg, "scheduler", "frontend")],
                "ports": [{"protocol": tcp, "port": WORKER_GRPC_PORT}],
            },
            # worker <-> worker: gRPC (metadata, handoffs) and UCX's TCP/shared-memory
            # bootstrap on ports it chooses at run time: every port, between this cluster's
            # workers only
            {"from": [_pods(cfg, *WORKER_ROLES)]},
            _monitoring(cfg, METRICS_PORT),
        ],
        owner,
    )
    out = [scheduler, workers]
    if cfg.spec.frontend.replicas > 0:
        out.append(
            _policy(
                cfg,
                "frontend",
                ["frontend"],
                [
                    {
                        "from": _frontend_peers(cfg),
                        "ports": [{"protocol": tcp, "port": fe_port}],
                    },
                    _monitoring(cfg, fe_port),  # /metrics is on the HTTP port
                ],
                owner,
            )
        )
    return out
