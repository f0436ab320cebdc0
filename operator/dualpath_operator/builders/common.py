"""Names, labels and owner references shared by every builder (and by the Helm chart's helpers)."""

from __future__ import annotations

from typing import Any

from dualpath.config import API_VERSION_FULL, KIND, ClusterConfig
from dualpath.config import METRICS_PORT as METRICS_PORT  # one definition: the model checks ports

OPERATOR_NAME = "dualpath-operator"
CONFIG_HASH_KEY = "dualpath.io/config-hash"
CLUSTER_LABEL = "dualpath.io/cluster"
ROLE_LABEL = "dualpath.io/role"
WORKER_GRPC_PORT = 50061
FRONTEND_PORT_NAME = "http"
CONFIG_MOUNT = "/etc/dualpath"
CONFIG_FILE = f"{CONFIG_MOUNT}/cluster.yaml"
KV_MOUNT = "/var/lib/dualpath/kv"
API_KEYS_MOUNT = "/etc/dualpath-api-keys"
# The cluster token Secret (`<cluster>-token`, key `token`), mounted into every DualPath pod.
TOKEN_MOUNT = "/etc/dualpath-token"
TLS_MOUNT = "/etc/dualpath-tls"  # the process's ca.crt, tls.crt, tls.key (dualpath.tls)


def child_name(cfg: ClusterConfig, suffix: str) -> str:
    """`<cluster>-<suffix>`, kept within the 63-character DNS label limit."""
    base = cfg.name[: 63 - len(suffix) - 1].rstrip("-")
    return f"{base}-{suffix}"


def selector_labels(cfg: ClusterConfig, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "dualpath",
        "app.kubernetes.io/instance": cfg.name,
        "app.kubernetes.io/component": component,
    }


def labels(cfg: ClusterConfig, component: str) -> dict[str, str]:
    from dualpath import __version__

    return {
        **selector_labels(cfg, component),
        "app.kubernetes.io/part-of": "dualpath",
        "app.kubernetes.io/managed-by": OPERATOR_NAME,
        "app.kubernetes.io/version": __version__,
        CLUSTER_LABEL: cfg.name,
    }


def metadata(
    cfg: ClusterConfig, name: str, component: str, owner: dict[str, Any] | None
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": cfg.namespace,
        "labels": labels(cfg, component),
    }
    if owner:
        meta["ownerReferences"] = [owner_reference(owner)]
    return meta


def owner_reference(owner: dict[str, Any]) -> dict[str, Any]:
    """Controller reference to the DualPathCluster: garbage collection does the deletes."""
    return {
        "apiVersion": API_VERSION_FULL,
        "kind": KIND,
        "name": owner["name"],
        "uid": owner["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }
