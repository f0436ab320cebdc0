"""The reconcile against an in-memory API with resourceVersions and 409s: idempotent, status
follows children, each replica count has one writer (the pool's is people's, the
StatefulSet's follows it), apply failures reported, children pruned."""

import copy
import logging
from pathlib import Path

import pytest
import yaml
from dualpath_operator import metrics
from dualpath_operator.reconcile import Backoff, Reconciler, reconcile
from fakeapi import FakeApi, api_error
from prometheus_client import REGISTRY

ROOT = Path(__file__).resolve().parents[3]
DPC = ("dualpath.io/v1alpha1", "DualPathCluster")
DPP = ("dualpath.io/v1alpha1", "DualPathPool")


def cluster_body():
    return yaml.safe_load((ROOT / "examples" / "dualpathcluster.yaml").read_text())


@pytest.fixture
def api():
    api = FakeApi()
    api.create(cluster_body())
    return api


def cr(api):
    return api.obj(*DPC, "agents")


def cond(status, ctype):
    return next(c for c in status["conditions"] if c["type"] == ctype)


def set_ready(api, kind, name, n):
    api.obj("apps/v1", kind, name)["status"] = {
        "replicas": n,
        "readyReplicas": n,
        "updatedReplicas": n,
    }


def replicas(api, role):
    """(cluster spec, pool spec, StatefulSet spec) replicas of one role."""
    return (
        cr(api)["spec"][role]["replicas"],
        api.obj(*DPP, f"agents-{role}")["spec"]["replicas"],
        api.obj("apps/v1", "StatefulSet", f"agents-{role}")["spec"]["replicas"],
    )


def test_first_pass_creates_children_and_reports_progressing(api):
    result = reconcile(api, "default", "agents")
    kinds = sorted({k[1] for k in api.objects} - {"DualPathCluster"})
    assert kinds == [
        "ConfigMap",
        "Deployment",
        "DualPathPool",
        "NetworkPolicy",
        "PodDisruptionBudget",
        "Secret",
        "Service",
        "StatefulSet",
    ]
    status = cr(api)["status"]  # written by the reconcile itself
    assert status == result.status | {"frontendEndpoint": "agents-frontend:8000"}
    assert status["observedGeneration"] == 1
    assert cond(status, "Ready")["status"] == "False"
    assert cond(status, "Ready")["reason"] == "RolloutInProgress"
    assert cond(status, "Progressing")["status"] == "True"
    pool = api.obj(*DPP, "agents-decode")
    assert pool["status"]["selector"].startswith("app.kubernetes.io/name=dualpath")
    assert pool["spec"]["replicas"] == 8  # created with the cluster spec's initial count
    assert not (pool["metadata"].get("annotations") or {})  # no bookkeeping of a merge
    assert "annotations" not in cr(api)["metadata"]


def test_the_token_secret_is_created_once_and_never_rewritten(api):
    """Created on the first pass with a random token, the cluster label and the owner reference
    (garbage collection deletes it with the cluster); later passes, and a restarted operator,
    leave it as it is (an apply would rotate it every pass); a deleted one comes back."""
    reconcile(api, "default", "agents")
    secret = api.obj("v1", "Secret", "agents-token")
    token = secret["stringData"]["token"].strip()
    assert len(token) >= 40
    assert secret["metadata"]["labels"]["dualpath.io/cluster"] == "agents"
    (ref,) = secret["metadata"]["ownerReferences"]
    assert ref["uid"] == cr(api)["metadata"]["uid"] and ref["controller"] is True
    version = secret["metadata"]["resourceVersion"]
    for _ in range(3):
        reconcile(api, "default", "agents")
    again = api.obj("v1", "Secret", "agents-token")
    assert again["stringData"]["token"].strip() == token
    assert again["metadata"]["resourceVersion"] == version
    assert not any(c.startswith("apply Secret") for c in api.calls)  # create-only, never applied
    del api.objects[("v1", "Secret", "default", "agents-token")]
    reconcile(api, "default", "agents")
    assert api.obj("v1", "Secret", "agents-token")["stringData"]["token"].strip() != token


def test_a_refused_token_secret_is_reported_and_the_rest_applied(api):
    api.refuse[("Secret", "agents-token")] = api_error(403, "Forbidden", "secrets is forbidden")
    result = reconcile(api, "default", "agents")
    assert result.result == "apply_failed"
    assert any("agents-token" in f.message or "secrets" in f.message for f in result.failures)
    assert api.obj("apps/v1", "StatefulSet", "agents-decode")  # the rest still applied


def test_a_settled_pass_and_a_restarted_operator_change_nothing(api):
    reconcile(api, "default", "agents")  # creates the children
    reconcile(api, "default", "agents")  # records on the cluster which pool versions it holds
    writes = api.writes
    reconcile(api, "default", "agents")
    Reconciler(api).run("default", "agents")  # a fresh operator process sees the same world
    assert api.writes == writes


def test_ready_only_when_every_pod_runs_the_current_template(api):
    reconcile(api, "default", "agents")
    set_ready(api, "StatefulSet", "agents-prefill", 4)
    set_ready(api, "StatefulSet", "agents-decode", 8)
    set_ready(api, "Deployment", "agents-scheduler", 1)
    set_ready(api, "Deployment", "agents-frontend", 2)
    status = reconcile(api, "default", "agents").status
    assert status["phase"] == "Ready" and status["decode"]["readyReplicas"] == 8
    assert any(e["reason"] == "Ready" for e in api.events)
    api.obj("apps/v1", "StatefulSet", "agents-decode")["status"]["updatedReplicas"] = 7
    ready = cond(reconcile(api, "default", "agents").status, "Ready")
    assert ready["status"] == "False" and "agents-decode" in ready["message"]


def test_drift_is_repaired(api):
    reconcile(api, "default", "agents")
    api.obj("apps/v1", "StatefulSet", "agents-prefill")["spec"]["replicas"] = 1
    reconcile(api, "default", "agents")
    assert api.obj("apps/v1", "StatefulSet", "agents-prefill")["spec"]["replicas"] == 4


def test_kubectl_scale_on_a_pool_lands_in_the_statefulset_and_nowhere_else(api):
    reconcile(api, "default", "agents")
    cluster_version = cr(api)["metadata"]["resourceVersion"]
    api.user_patch_spec(*DPP, "agents-decode", {"replicas": 12})
    reconcile(api, "default", "agents")
    # The cluster spec keeps the initial count a person wrote: the operator never writes it.
    assert replicas(api, "decode") == (8, 12, 12)
    assert cr(api)["metadata"].get("generation") == 1
    assert cr(api)["metadata"]["resourceVersion"] != cluster_version  # only its status moved
    scaled = [e for e in api.events if e["reason"] == "Scaled"]
    assert scaled[-1]["message"].startswith("StatefulSet agents-decode replicas 8 -> 12")
    assert "DualPathPool agents-decode" in scaled[-1]["message"]


def test_the_pool_is_created_with_the_cluster_count_and_never_written_by_the_operator(api):
    """After creation the pool owns its count: a later edit of the cluster spec's count scales
    nothing, every pass applies the pool without `spec.replicas`, and a deleted pool comes
    back with the cluster spec's count (its initial count, again)."""
    reconcile(api, "default", "agents")
    assert not [c for c in api.applied_spec_changes if c[0] == "DualPathPool"]
    api.user_patch_spec(*DPC, "agents", {"prefill": {"replicas": 6}})
    reconcile(api, "default", "agents")
    assert replicas(api, "prefill") == (6, 4, 4)
    assert not [e for e in api.events if e["reason"] == "Scaled"]
    assert not [c for c in api.applied_spec_changes if c[0] == "DualPathPool"]
    del api.objects[(*DPP, "default", "agents-prefill")]
    reconcile(api, "default", "agents")
    assert replicas(api, "prefill") == (6, 6, 6)


def test_a_pool_scale_written_after_the_pass_read_it_is_not_overwritten(api):
    """The race of the issue: the pass read the pool at 8, a scale to 3 lands before its
    apply. The pool apply carries no count, so the scale stands; the StatefulSet, written from
    the count this pass read, takes 3 on the next pass (the pool's watch event)."""
    reconcile(api, "default", "agents")
    fired = []

    def scale_once(op):
        if op == "apply DualPathPool/agents-decode" and not fired:
            fired.append(op)
            api.user_patch_spec(*DPP, "agents-decode", {"replicas": 3})

    api.hook = scale_once
    reconcile(api, "default", "agents")
    api.hook = None
    assert fired and replicas(api, "decode")[1] == 3
    reconcile(api, "default", "agents")
    assert replicas(api, "decode") == (8, 3, 3)
    assert not [c for c in api.applied_spec_changes if c[0] == "DualPathPool"]


def test_a_refused_unsafe_scale_is_reported_and_not_undone(api):
    reconcile(api, "default", "agents")
    api.user_patch_spec(*DPP, "agents-decode", {"replicas": 0})
    status = reconcile(api, "default", "agents").status
    degraded = cond(status, "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "UnsafeScale"
    assert "decode replicas 0 with prefill replicas 4" in degraded["message"]
    # Not done (the StatefulSet keeps 8) and not undone (the ask stays on the pool).
    assert replicas(api, "decode") == (8, 0, 8)
    accepted = cond(status, "ScaleAccepted")
    assert accepted["status"] == "False" and accepted["reason"] == "UnsafeScale"
    warnings = [(e["kind"], e["reason"]) for e in api.events if e["type"] == "Warning"]
    assert ("DualPathPool", "UnsafeScale") in warnings
    assert ("DualPathCluster", "UnsafeScale") in warnings
    n_events = len(api.events)
    reconcile(api, "default", "agents")
    assert len(api.events) == n_events  # reported once, not every pass
    # Scaling prefill to 0 too makes the ask safe: both land.
    api.user_patch_spec(*DPP, "agents-prefill", {"replicas": 0})
    status = reconcile(api, "default", "agents").status
    assert replicas(api, "decode") == (8, 0, 0) and replicas(api, "prefill") == (4, 0, 0)
    assert cond(status, "Degraded")["reason"] != "UnsafeScale"
    assert cond(status, "ScaleAccepted")["status"] == "True"


INVALID_IMAGE = api_error(
    422,
    "Invalid",
    'StatefulSet.apps "agents-decode" is invalid: spec.template.spec.containers[0].image: '
    "Required value",
    causes=[
        {
            "reason": "FieldValueRequired",
            "message": "Required value",
            "field": "spec.template.spec.containers[0].image",
        }
    ],
    name="agents-decode",
    kind="StatefulSet",
)
TYPED_PATCH_500 = api_error(
    500,
    "InternalError",
    "failed to create typed patch object (default/agents-prefill; apps/v1, Kind=StatefulSet): "
    ".spec.template.spec.volumes[2].bogus: field not declared in schema",
)


@pytest.mark.parametrize(
    "kind, name, err, needle",
    [
        ("StatefulSet", "agents-decode", INVALID_IMAGE, "containers[0].image: Required value"),
        ("StatefulSet", "agents-prefill", TYPED_PATCH_500, "volumes[2].bogus: field not declared"),
        (
            "Service",
            "agents-scheduler",
            api_error(400, "BadRequest", "spec.ports[1].port: Duplicate value: 9090"),
            "Duplicate value: 9090",
        ),
    ],
)
def test_an_apply_the_server_refuses_ends_degraded_naming_child_and_field(
    api, kind, name, err, needle
):
    api.refuse[(kind, name)] = err
    rec = Reconciler(api, Backoff(base_s=10, max_s=600, clock=lambda: 0.0))
    outcome = rec.run("default", "agents")
    assert outcome.result == "apply_failed" and outcome.retry_after_s is None
    status = cr(api)["status"]
    degraded = cond(status, "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "ApplyFailed"
    assert degraded["message"].startswith(f"{kind}/{name}: ") and needle in degraded["message"]
    assert cond(status, "Ready")["status"] == "False" and status["phase"] == "Failed"
    warning = [e for e in api.events if e["type"] == "Warning"]
    assert warning and warning[0]["reason"] == "ApplyFailed" and needle in warning[0]["message"]
    # The other children were applied; the failed one is retried with backoff, not hot.
    assert ("apps/v1", "Deployment", "default", "agents-scheduler") in api.objects
    assert rec.due() == [] and rec.backoff.failures(("default", "agents")) == 1
    del api.refuse[(kind, name)]
    rec.backoff.clock = lambda: 11.0
    assert rec.due() == [("default", "agents")]
    assert rec.run("default", "agents").result == "ok"
    assert cond(cr(api)["status"], "Degraded")["reason"] != "ApplyFailed"


def test_retryable_errors_back_off_and_are_reported_once_they_persist(api):
    api.refuse[("ConfigMap", "agents-config")] = api_error(503, "ServiceUnavailable", "etcd down")
    rec = Reconciler(api, Backoff(base_s=10, max_s=40, clock=lambda: 0.0))
    delays = [rec.run("default", "agents").retry_after_s for _ in range(4)]
    assert delays == [10, 20, 40, 40]
    degraded = cond(cr(api)["status"], "Degraded")
    assert degraded["reason"] == "ApiRetrying" and "ConfigMap/agents-config" in degraded["message"]


def test_an_invalid_spec_is_reported_with_the_field(api):
    cr(api)["spec"]["scheduler"]["nodeTimeoutMs"] = 5
    assert Reconciler(api).run("default", "agents").result == "invalid_spec"
    degraded = cond(cr(api)["status"], "Degraded")
    assert degraded["reason"] == "InvalidSpec" and "nodeTimeoutMs" in degraded["message"]
    assert api.events[-1]["reason"] == "InvalidSpec"


def test_frontend_replicas_zero_prunes_the_frontend_and_its_status(api):
    reconcile(api, "default", "agents")
    assert cr(api)["status"]["frontendEndpoint"] == "agents-frontend:8000"
    # Same label, another owner: not ours to delete.
    foreign = copy.deepcopy(api.obj("v1", "Service", "agents-frontend"))
    foreign["metadata"].update(name="agents-frontend-other", uid="x")
    foreign["metadata"]["ownerReferences"][0]["uid"] = "another-cr"
    api.create(foreign)
    api.user_patch_spec(*DPC, "agents", {"frontend": {"replicas": 0}})
    result = reconcile(api, "default", "agents")
    assert sorted(result.pruned) == [
        "Deployment/agents-frontend",
        "NetworkPolicy/agents-frontend",
        "Service/agents-frontend",
    ]
    assert ("apps/v1", "Deployment", "default", "agents-frontend") not in api.objects
    assert ("v1", "Service", "default", "agents-frontend") not in api.objects
    assert ("v1", "Service", "default", "agents-frontend-other") in api.objects
    assert "frontendEndpoint" not in cr(api)["status"]


def test_switching_network_policies_off_prunes_them(api):
    reconcile(api, "default", "agents")
    assert ("networking.k8s.io/v1", "NetworkPolicy", "default", "agents-workers") in api.objects
    api.user_patch_spec(*DPC, "agents", {"network": {"policies": {"enabled": False}}})
    result = reconcile(api, "default", "agents")
    assert sorted(p for p in result.pruned if p.startswith("NetworkPolicy/")) == [
        "NetworkPolicy/agents-frontend",
        "NetworkPolicy/agents-scheduler",
        "NetworkPolicy/agents-workers",
    ]


def test_a_deleted_cluster_is_left_to_garbage_collection(api):
    reconcile(api, "default", "agents")
    del api.objects[(*DPC, "default", "agents")]
    rec = Reconciler(api)
    rec.known.add(("default", "agents"))
    assert rec.run("default", "agents").result == "gone"
    assert rec.known == set()


def test_log_lines_name_the_object_and_metrics_count_results(api, caplog):
    def sample(result):
        return (
            REGISTRY.get_sample_value("dualpath_operator_reconciles_total", {"result": result})
            or 0.0
        )

    before = sample("ok")
    with caplog.at_level(logging.INFO, logger="dualpath_operator.reconcile"):
        Reconciler(api).run("default", "agents")
    assert sample("ok") == before + 1
    count = REGISTRY.get_sample_value(
        "dualpath_operator_reconcile_duration_seconds_count", {"result": "ok"}
    )
    assert count and count >= 1
    assert metrics.RECONCILES is not None
    lines = [r.getMessage() for r in caplog.records]
    assert lines and all(line.startswith("[default/agents] ") for line in lines)


def test_a_listing_the_server_refuses_is_reported_with_the_apply_failures(api):
    real_list = api.list

    def bad_list(*args):
        raise api_error(400, "BadRequest", "unable to parse requirement: invalid label value")

    api.list = bad_list
    assert Reconciler(api).run("default", "agents").result == "apply_failed"
    degraded = cond(cr(api)["status"], "Degraded")
    assert degraded["reason"] == "ApplyFailed" and "pruning: " in degraded["message"]
    api.list = real_list
    assert Reconciler(api).run("default", "agents").result == "ok"
