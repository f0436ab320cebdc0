"""`ClusterApi` over the real Kubernetes API (dynamic client, server-side apply)."""

from __future__ import annotations

from typing import Any

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import NotFoundError

from .reconcile import FIELD_MANAGER


def load_kube_config() -> k8s.ApiClient:
    try:
        k8s_config.load_incluster_config()
    except k8s_config.ConfigException:
        k8s_config.load_kube_config()
    return k8s.ApiClient()


class KubeApi:
    def __init__(self, api_client: k8s.ApiClient | None = None) -> None:
        self.dyn = DynamicClient(api_client or load_kube_config())
        self._resources: dict[tuple[str, str], Any] = {}

    def _res(self, api_version: str, kind: str):
        key = (api_version, kind)
        if key not in self._resources:
            self._resources[key] = self.dyn.resources.get(api_version=api_version, kind=kind)
        return self._resources[key]

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        res = self._res(obj["apiVersion"], obj["kind"])
        meta = obj["metadata"]
        out = res.server_side_apply(
            body=obj,
            name=meta["name"],
            namespace=meta.get("namespace"),
            field_manager=FIELD_MANAGER,
            force_conflicts=True,
        )
        return out.to_dict()

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None:
        try:
            return self._res(api_version, kind).get(name=name, namespace=namespace).to_dict()
        except NotFoundError:
            return None

    def patch_status(self, api_version, kind, namespace, name, status) -> None:
        res = self._res(api_version, kind)
        res.status.patch(
            body={"status": status},
            name=name,
            namespace=namespace,
            content_type="application/merge-patch+json",
        )

    def patch_spec(self, api_version, kind, namespace, name, patch) -> None:
        self._res(api_version, kind).patch(
            body=patch,
            name=name,
            namespace=namespace,
            content_type="application/merge-patch+json",
        )
