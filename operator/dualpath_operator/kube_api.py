"""`ClusterApi` over the real Kubernetes API (dynamic client, server-side apply).

Every call has a deadline (`REQUEST_TIMEOUT_S`). Guarded writes put `metadata.resourceVersion`
in the body: the API server then refuses them with 409 when the object moved on.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import ConflictError, NotFoundError, ResourceNotFoundError

from .pass_state import FIELD_MANAGER

REQUEST_TIMEOUT_S = 30


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

    def apply(self, obj: dict[str, Any], field_manager: str = FIELD_MANAGER) -> dict[str, Any]:
        res = self._res(obj["apiVersion"], obj["kind"])
        meta = obj["metadata"]
        out = res.server_side_apply(
            body=obj,
            name=meta["name"],
            namespace=meta.get("namespace"),
            field_manager=field_manager,
            force_conflicts=True,
            _request_timeout=REQUEST_TIMEOUT_S,
        )
        return out.to_dict()

    def create_only(self, obj: dict[str, Any]) -> bool:
        try:
            self._res(obj["apiVersion"], obj["kind"]).create(
                body=obj,
                namespace=obj["metadata"].get("namespace"),
                _request_timeout=REQUEST_TIMEOUT_S,
            )
        except ConflictError:  # AlreadyExists: leave it as it is
            return False
        return True

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None:
        try:
            return (
                self._res(api_version, kind)
                .get(name=name, namespace=namespace, _request_timeout=REQUEST_TIMEOUT_S)
                .to_dict()
            )
        except NotFoundError:
            return None

    def served(self, api_version: str, kind: str) -> bool:
        """Whether the API server serves the kind (its CRD is installed): discovery only."""
        try:
            self._res(api_version, kind)
        except ResourceNotFoundError:
            return False
        return True

    def list(self, api_version, kind, namespace, labels) -> list[dict[str, Any]]:
        selector = ",".join(f"{k}={v}" for k, v in labels.items())
        if not self.served(api_version, kind):
            return []  # a kind not installed (cert-manager's) holds no children
        out = self._res(api_version, kind).get(
            namespace=namespace, label_selector=selector, _request_timeout=REQUEST_TIMEOUT_S
        )
        return out.to_dict().get("items") or []

    def delete(self, api_version, kind, namespace, name, uid) -> None:
        self._res(api_version, kind).delete(
            name=name,
            namespace=namespace,
            body={"preconditions": {"uid": uid}, "propagationPolicy": "Background"},
            _request_timeout=REQUEST_TIMEOUT_S,
        )

    def patch_status(self, api_version, kind, namespace, name, status) -> None:
        self._res(api_version, kind).status.patch(
            body={"status": status},
            name=name,
            namespace=namespace,
            content_type="application/merge-patch+json",
            _request_timeout=REQUEST_TIMEOUT_S,
        )

    def event(self, obj: dict[str, Any], type_: str, reason: str, message: str) -> None:
        """A core/v1 Event on `obj`, as `kubectl describe` shows them."""
        meta = obj["metadata"]
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        self._res("v1", "Event").create(
            namespace=meta["namespace"],
            body={
                "apiVersion": "v1",
                "kind": "Event",
                "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
                "involvedObject": {
                    "apiVersion": obj["apiVersion"],
                    "kind": obj["kind"],
                    "name": meta["name"],
                    "namespace": meta["namespace"],
                    "uid": meta.get("uid"),
                    "resourceVersion": meta.get("resourceVersion"),
                },
                "type": type_,
                "reason": reason,
                "message": message[:1024],
                "source": {"component": FIELD_MANAGER},
                "reportingComponent": FIELD_MANAGER,
                "firstTimestamp": now,
                "lastTimestamp": now,
                "count": 1,
            },
            _request_timeout=REQUEST_TIMEOUT_S,
        )
