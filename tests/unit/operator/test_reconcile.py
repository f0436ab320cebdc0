"""The reconcile against an in-memory API: idempotent, status follows children, scale writes
through to the cluster spec, an operator restart changes nothing."""

import copy
from pathlib import Path

import yaml
from dualpath_operator.reconcile import pool_scaled, reconcile

ROOT = Path(__file__).resolve().parents[3]


class FakeApi:
    """Server-side apply as a whole-object replace keyed by (apiVersion, kind, ns, name)."""

    def __init__(self):
        self.objects = {}
        self.writes = 0

    def _k(self, api_version, kind, ns, name):
        return (api_version, kind, ns, name)

    def apply(self, obj):
        m = obj["metadata"]
        key = self._k(obj["apiVersion"], obj["kind"], m["namespace"], m["name"])
        current = self.objects.get(key)
        merged = {**copy.deepcopy(obj), "status": (current or {}).get("status", {})}
        if current != merged:
            self.writes += 1
            self.objects[key] = merged
        return merged

    def get(self, api_version, kind, ns, name):
        return copy.deepcopy(self.objects.get(self._k(api_version, kind, ns, name)))

    def patch_status(self, api_version, kind, ns, name, status):
        self.objects[self._k(api_version, kind, ns, name)]["status"] = status

    def patch_spec(self, api_version, kind, ns, name, patch):
        obj = self.objects[self._k(api_version, kind, ns, name)]
        for role, fields in patch["spec"].items():
            obj["spec"].setdefault(role, {}).update(fields)


def cluster_body():
    cr = yaml.safe_load((ROOT / "examples" / "dualpathcluster.yaml").read_text())
    cr["metadata"].update(uid="uid-1", generation=3)
    return cr


def set_ready(api, kind, name, n):
    obj = api.objects[("apps/v1", kind, "default", name)]
    obj["status"] = {"replicas": n, "readyReplicas": n, "updatedReplicas": n}


def test_first_pass_creates_children_and_reports_progressing():
    api = FakeApi()
    result = reconcile(api, cluster_body())
    kinds = sorted({k[1] for k in api.objects})
    assert kinds == [
        "ConfigMap",
        "Deployment",
        "DualPathPool",
        "NetworkPolicy",
        "PodDisruptionBudget",
        "Service",
        "StatefulSet",
    ]
    assert result.status["observedGeneration"] == 3
    ready = next(c for c in result.status["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "False" and ready["reason"] == "RolloutInProgress"
    progressing = next(c for c in result.status["conditions"] if c["type"] == "Progressing")
    assert progressing["status"] == "True"
    pool = api.objects[("dualpath.io/v1alpha1", "DualPathPool", "default", "agents-decode")]
    assert pool["status"]["selector"].startswith("app.kubernetes.io/name=dualpath")


def test_second_pass_and_a_restarted_operator_change_nothing():
    api = FakeApi()
    body = cluster_body()
    reconcile(api, body)
    writes = api.writes
    reconcile(api, body)
    reconcile(api, copy.deepcopy(body))  # a fresh operator process sees the same world
    assert api.writes == writes


def test_ready_only_when_every_pod_runs_the_current_template():
    api = FakeApi()
    body = cluster_body()
    reconcile(api, body)
    set_ready(api, "StatefulSet", "agents-prefill", 4)
    set_ready(api, "StatefulSet", "agents-decode", 8)
    set_ready(api, "Deployment", "agents-scheduler", 1)
    set_ready(api, "Deployment", "agents-frontend", 2)
    status = reconcile(api, body).status
    assert status["phase"] == "Ready" and status["decode"]["readyReplicas"] == 8
    # A rollout: one decode pod still on the old template -> not Ready.
    api.objects[("apps/v1", "StatefulSet", "default", "agents-decode")]["status"][
        "updatedReplicas"
    ] = 7
    body["status"] = status
    status2 = reconcile(api, body).status
    ready = next(c for c in status2["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "False" and "agents-decode" in ready["message"]


def test_drift_is_repaired():
    api = FakeApi()
    body = cluster_body()
    reconcile(api, body)
    api.objects[("apps/v1", "StatefulSet", "default", "agents-prefill")]["spec"]["replicas"] = 1
    reconcile(api, body)
    assert (
        api.objects[("apps/v1", "StatefulSet", "default", "agents-prefill")]["spec"]["replicas"]
        == 4
    )


def test_kubectl_scale_on_a_pool_writes_through_to_the_cluster_spec():
    api = FakeApi()
    body = cluster_body()
    api.objects[("dualpath.io/v1alpha1", "DualPathCluster", "default", "agents")] = body
    reconcile(api, body)
    pool = api.get("dualpath.io/v1alpha1", "DualPathPool", "default", "agents-decode")
    pool["spec"]["replicas"] = 12
    assert pool_scaled(api, pool)
    assert body["spec"]["decode"]["replicas"] == 12
    assert not pool_scaled(api, pool)  # already in sync
    reconcile(api, body)
    sts = api.objects[("apps/v1", "StatefulSet", "default", "agents-decode")]
    assert sts["spec"]["replicas"] == 12


def test_degraded_reports_startup_warnings():
    api = FakeApi()
    body = cluster_body()
    body["spec"]["storage"].pop("volume")
    status = reconcile(api, body).status
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "True" and "storage.volume" in degraded["message"]
