"""Each reconcile phase on its own, against the in-memory API: what it reads, what it writes,
and the condition it reports when it fails; then the phases in order and the status they make."""

import pytest
import yaml
from dualpath_operator import phases, scaling
from dualpath_operator.pass_state import Pass, PhaseError, object_log
from dualpath_operator.phases import run_phases
from dualpath_operator.reconcile import Backoff, Reconciler, reconcile
from dualpath_operator.status import PHASE_CONDITIONS, ConditionType, compute_status
from fakeapi import FakeApi, api_error
from test_reconcile import DPC, DPP, ROOT, cond, cr, token_mode

CERT_MANAGER_KIND = ("cert-manager.io/v1", "Certificate")
FORBIDDEN = api_error(403, "Forbidden", "secrets is forbidden")
UNAVAILABLE = api_error(503, "ServiceUnavailable", "etcd down")


@pytest.fixture
def api():
    api = FakeApi()
    api.create(yaml.safe_load((ROOT / "examples" / "dualpathcluster.yaml").read_text()))
    return api


def new_pass(api, upto: str | None = None) -> Pass:
    """A pass over the example, with the phases before `upto` already run."""
    p = Pass(api, api.get(*DPC, "default", "agents"), object_log("default", "agents"))
    for phase in phases.PHASES:
        if phase.name == upto:
            break
        phase.run(p)
    return p


def sts_replicas(api, role):
    return api.obj("apps/v1", "StatefulSet", f"agents-{role}")["spec"]["replicas"]


# -- parse -----------------------------------------------------------------------------------


def test_parse_reads_the_spec_into_the_config_model(api):
    p = new_pass(api, upto="replicas")
    assert p.cfg is not None and p.cfg.spec.decode.replicas == 8
    assert p.problems == [] and not p.stopped


def test_parse_stops_the_pass_on_an_invalid_spec_with_spec_valid_false(api):
    cr(api)["spec"]["scheduler"]["nodeTimeoutMs"] = 5
    p = run_phases(Pass(api, api.get(*DPC, "default", "agents"), object_log("default", "x")))
    assert p.stopped and p.cfg is None
    assert [o.condition for o in p.ran] == [ConditionType.SPEC_VALID]
    (problem,) = p.problems
    assert problem.reason == "InvalidSpec" and problem.condition == ConditionType.SPEC_VALID
    assert api.calls == ["get DualPathCluster/agents"]  # nothing read or written after parse


# -- replicas --------------------------------------------------------------------------------


def test_replicas_without_pools_are_the_cluster_spec_initial_counts(api):
    p = new_pass(api, upto="token")
    assert p.pools == {"prefill": None, "decode": None}
    assert {r: p.plan.target(r) for r in scaling.ROLES} == {"prefill": 4, "decode": 8}


def test_replicas_follow_the_pools_not_the_cluster_spec(api):
    reconcile(api, "default", "agents")
    api.user_patch_spec(*DPP, "agents-decode", {"replicas": 3})
    api.user_patch_spec(*DPC, "agents", {"prefill": {"replicas": 9}})  # initial only: ignored
    p = new_pass(api, upto="token")
    assert {r: p.plan.target(r) for r in scaling.ROLES} == {"prefill": 4, "decode": 3}
    assert p.plan.live == {"prefill": 4, "decode": 8}
    assert p.problems == []


def test_replicas_refuse_an_unsafe_ask_keeping_what_the_statefulsets_have(api):
    reconcile(api, "default", "agents")
    api.user_patch_spec(*DPP, "agents-decode", {"replicas": 0})
    p = new_pass(api, upto="token")
    assert {r: p.plan.target(r) for r in scaling.ROLES} == {"prefill": 4, "decode": 8}
    (problem,) = p.problems
    assert problem.reason == "UnsafeScale" and problem.condition == ConditionType.SCALE_ACCEPTED
    assert "DualPathPool decode" in problem.message and not problem.blocks_ready


# -- token -----------------------------------------------------------------------------------


def test_token_is_created_once(api):
    token_mode(api)
    p = new_pass(api, upto="token")
    phases.ensure_token(p)
    token = api.obj("v1", "Secret", "agents-token")["stringData"]["token"]
    phases.ensure_token(new_pass(api, upto="token"))
    assert api.obj("v1", "Secret", "agents-token")["stringData"]["token"] == token
    assert p.problems == []


def test_token_refused_is_reported_on_token_ready(api):
    token_mode(api)
    api.refuse[("Secret", "agents-token")] = FORBIDDEN
    p = new_pass(api, upto="token")
    phases.ensure_token(p)
    (problem,) = p.problems
    assert problem.condition == ConditionType.TOKEN_READY and problem.reason == "ApplyFailed"
    assert "Secret/agents-token" in problem.message and len(p.failures) == 1


def test_token_retryable_error_is_raised_naming_token_ready(api):
    token_mode(api)
    api.refuse[("Secret", "agents-token")] = UNAVAILABLE
    with pytest.raises(PhaseError) as err:
        phases.ensure_token(new_pass(api, upto="token"))
    assert err.value.condition == ConditionType.TOKEN_READY and err.value.failure.retryable


def test_under_mtls_the_phase_makes_the_ca_unless_cert_manager_is_served(api):
    p = new_pass(api, upto="token")
    assert p.cfg.spec.security.tls.cert_manager is False  # resolved by parse: not served
    phases.ensure_token(p)
    assert api.obj("v1", "Secret", "agents-ca") and api.obj("v1", "Secret", "agents-frontend-tls")
    assert ("v1", "Secret", "default", "agents-token") not in api.objects
    api.served_kinds = frozenset({("cert-manager.io/v1", "Certificate")})
    del api.objects[("v1", "Secret", "default", "agents-ca")]
    p = new_pass(api, upto="token")
    assert p.cfg.spec.security.tls.cert_manager is True
    phases.ensure_token(p)
    assert ("v1", "Secret", "default", "agents-ca") not in api.objects  # cert-manager's job


def test_dualpath_render_resolves_cert_manager_as_the_operator_does(api, tmp_path, capsys):
    """The operator's applied config hash equals `dualpath render`'s (the e2e's first check):
    both resolve an unset certManager through one function, render from its flag."""
    import argparse

    from dualpath_operator import render_cli

    example = ROOT / "examples" / "dualpathcluster.yaml"
    for served, flag in ((frozenset(), "no"), (frozenset({CERT_MANAGER_KIND}), "yes")):
        api.served_kinds = served
        p = new_pass(api, upto="token")
        parser = argparse.ArgumentParser()
        render_cli.add_arguments(parser)
        assert render_cli.run(parser.parse_args(["-f", str(example), "--cert-manager", flag])) == 0
        rendered = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
        cm = next(d for d in rendered if d["kind"] == "ConfigMap")
        assert cm["data"]["config-hash"] == p.cfg.config_hash, flag


# -- apply -----------------------------------------------------------------------------------


def test_apply_creates_each_pool_with_its_initial_count_and_applies_it_without_one(api):
    p = new_pass(api, upto="apply")
    phases.apply_children(p)
    assert "create DualPathPool/agents-decode" in api.calls
    assert "apply DualPathPool/agents-decode" not in api.calls  # created: nothing to apply
    assert api.obj(*DPP, "agents-decode")["spec"]["replicas"] == 8
    api.user_patch_spec(*DPP, "agents-decode", {"replicas": 5})
    api.calls.clear()
    p = new_pass(api, upto="apply")
    phases.apply_children(p)
    assert "apply DualPathPool/agents-decode" in api.calls
    assert api.obj(*DPP, "agents-decode")["spec"]["replicas"] == 5  # the scale stands
    assert sts_replicas(api, "decode") == 5
    assert not [c for c in api.applied_spec_changes if c[0] == "DualPathPool"]


def test_apply_emits_scaled_when_a_statefulset_count_changes(api):
    reconcile(api, "default", "agents")
    api.user_patch_spec(*DPP, "agents-prefill", {"replicas": 2})
    p = new_pass(api, upto="apply")
    phases.apply_children(p)
    (event,) = [e for e in api.events if e["reason"] == "Scaled"]
    assert event["message"].startswith("StatefulSet agents-prefill replicas 4 -> 2")
    phases.apply_children(new_pass(api, upto="apply"))
    assert len([e for e in api.events if e["reason"] == "Scaled"]) == 1  # no change: no event


def test_apply_refused_child_is_reported_on_children_applied_and_the_rest_applied(api):
    api.refuse[("Service", "agents-scheduler")] = api_error(400, "BadRequest", "bad port")
    p = new_pass(api, upto="apply")
    phases.apply_children(p)
    (problem,) = p.problems
    assert problem.condition == ConditionType.CHILDREN_APPLIED
    assert problem.message.startswith("Service/agents-scheduler: ")
    assert "StatefulSet/agents-decode" in p.applied
    assert "Service/agents-scheduler" not in p.applied


def test_apply_retryable_error_is_raised_naming_children_applied(api):
    api.refuse[("ConfigMap", "agents-config")] = UNAVAILABLE
    with pytest.raises(PhaseError) as err:
        phases.apply_children(new_pass(api, upto="apply"))
    assert err.value.condition == ConditionType.CHILDREN_APPLIED
    assert "ConfigMap/agents-config" in err.value.failure.message


# -- prune -----------------------------------------------------------------------------------


def test_prune_deletes_only_owned_children_no_longer_rendered(api):
    reconcile(api, "default", "agents")
    api.user_patch_spec(*DPC, "agents", {"frontend": {"replicas": 0}})
    p = new_pass(api, upto="prune")
    phases.prune_children(p)
    assert sorted(p.pruned) == [
        "Deployment/agents-frontend",
        "NetworkPolicy/agents-frontend",
        "Service/agents-frontend",
    ]
    assert p.problems == []


def test_prune_refused_listing_is_reported_on_children_pruned(api):
    p = new_pass(api, upto="prune")

    def bad_list(*_):
        raise api_error(400, "BadRequest", "unable to parse requirement")

    api.list = bad_list
    phases.prune_children(p)
    (problem,) = p.problems
    assert problem.condition == ConditionType.CHILDREN_PRUNED
    assert problem.message.startswith("pruning: ")


# -- observe and pool status -----------------------------------------------------------------


def test_observe_measures_the_workers_against_the_pools_counts(api):
    reconcile(api, "default", "agents")
    api.user_patch_spec(*DPP, "agents-decode", {"replicas": 3})
    p = new_pass(api, upto="observe")
    phases.observe_children(p)
    assert p.workloads["decode"].desired == 3 and p.workloads["prefill"].desired == 4
    assert set(p.workloads) == {"prefill", "decode", "scheduler", "frontend"}


def test_pool_status_is_the_statefulsets_and_a_missing_pool_is_skipped(api):
    reconcile(api, "default", "agents")
    api.obj("apps/v1", "StatefulSet", "agents-decode")["status"] = {
        "replicas": 8,
        "readyReplicas": 5,
    }
    p = new_pass(api, upto="pool status")
    del api.objects[(*DPP, "default", "agents-prefill")]
    phases.report_pools(p)
    status = api.obj(*DPP, "agents-decode")["status"]
    assert (status["replicas"], status["readyReplicas"]) == (8, 5)
    assert status["selector"].startswith("app.kubernetes.io/name=dualpath")
    assert p.problems == []


def test_pool_status_error_other_than_not_found_leaves_naming_pools_reported(api):
    reconcile(api, "default", "agents")
    p = new_pass(api, upto="pool status")

    def failing(*_):
        raise UNAVAILABLE

    api.patch_status = failing
    with pytest.raises(PhaseError) as err:
        run_phases(p, tuple(ph for ph in phases.PHASES if ph.name == "pool status"))
    assert err.value.condition == ConditionType.POOLS_REPORTED


# -- in order, and the status they make ------------------------------------------------------


def test_the_phases_run_in_order_and_each_has_its_own_condition():
    assert [ph.name for ph in phases.PHASES] == [
        "parse",
        "replicas",
        "token",
        "apply",
        "prune",
        "observe",
        "pool status",
    ]
    assert tuple(ph.outcome.condition for ph in phases.PHASES) == PHASE_CONDITIONS


def test_a_pass_writes_every_phase_condition_true_after_the_summary_ones(api):
    status = reconcile(api, "default", "agents").status
    types = [c["type"] for c in status["conditions"]]
    assert types == ["Ready", "Progressing", "Degraded", *PHASE_CONDITIONS]
    for ctype in PHASE_CONDITIONS:
        c = cond(status, ctype)
        assert (c["status"], c["reason"], c["observedGeneration"]) == ("True", "Succeeded", 1)


def test_an_invalid_spec_keeps_the_conditions_of_the_phases_that_did_not_run(api):
    reconcile(api, "default", "agents")
    applied_before = cond(cr(api)["status"], "ChildrenApplied")
    api.user_patch_spec(*DPC, "agents", {"scheduler": {"nodeTimeoutMs": 5}})
    reconcile(api, "default", "agents")
    status = cr(api)["status"]
    spec_valid = cond(status, "SpecValid")
    assert (spec_valid["status"], spec_valid["reason"]) == ("False", "InvalidSpec")
    assert spec_valid["observedGeneration"] == 2
    assert cond(status, "ChildrenApplied") == applied_before  # about generation 1, as it was


def test_a_persistent_retryable_error_marks_its_phase_api_retrying(api):
    reconcile(api, "default", "agents")
    api.refuse[("ConfigMap", "agents-config")] = UNAVAILABLE
    rec = Reconciler(api, Backoff(base_s=10, max_s=40, clock=lambda: 0.0))
    for _ in range(Reconciler.REPORT_AFTER_FAILURES):
        assert rec.run("default", "agents").result == "error"
    status = cr(api)["status"]
    applied = cond(status, "ChildrenApplied")
    assert (applied["status"], applied["reason"]) == ("False", "ApiRetrying")
    assert "ConfigMap/agents-config" in applied["message"]
    assert cond(status, "TokenReady")["status"] == "True"  # the phases before it, as they were
    del api.refuse[("ConfigMap", "agents-config")]
    rec.backoff.clock = lambda: 1000.0
    assert rec.run("default", "agents").result == "ok"
    assert cond(cr(api)["status"], "ChildrenApplied")["status"] == "True"


def test_an_unhandled_error_in_a_phase_leaves_as_phase_error_naming_its_condition(api):
    p = new_pass(api, upto="observe")

    def broken_get(*_):
        raise ConnectionResetError("reset by peer")

    api.get = broken_get
    with pytest.raises(PhaseError) as err:
        run_phases(p, tuple(ph for ph in phases.PHASES if ph.name == "observe"))
    assert err.value.condition == ConditionType.CHILDREN_OBSERVED
    assert err.value.failure.retryable and "reset by peer" in err.value.failure.message


def test_compute_status_without_phases_writes_only_the_summary_conditions():
    status = compute_status(3, "h", {}, "s:1")
    assert [c["type"] for c in status["conditions"]] == ["Ready", "Progressing", "Degraded"]


def old_operator_pool(api, replicas):
    """A pool as an older operator left it: its server-side apply set (and owns) the count."""
    reconcile(api, "default", "agents")
    pool = api.get(*DPP, "default", "agents-decode")
    applied = {
        "apiVersion": pool["apiVersion"],
        "kind": pool["kind"],
        "metadata": {k: pool["metadata"][k] for k in ("name", "namespace", "labels")},
        "spec": {**pool["spec"], "replicas": replicas},
    }
    api.apply(applied, field_manager=phases.FIELD_MANAGER)
    assert scaling.applies_count(api.obj(*DPP, "agents-decode"), phases.FIELD_MANAGER)


def test_a_count_an_older_operator_applied_is_handed_over_once_and_kept(api):
    old_operator_pool(api, 12)
    reconcile(api, "default", "agents")
    pool = api.obj(*DPP, "agents-decode")
    assert pool["spec"]["replicas"] == 12 and sts_replicas(api, "decode") == 12
    assert not scaling.applies_count(pool, phases.FIELD_MANAGER)
    assert scaling.applies_count(pool, scaling.COUNT_HANDOVER_MANAGER)
    api.calls.clear()
    reconcile(api, "default", "agents")
    assert api.calls.count("apply DualPathPool/agents-decode") == 1  # no second handover
    api.user_patch_spec(*DPP, "agents-decode", {"replicas": 5})  # the scale takes the field
    reconcile(api, "default", "agents")
    assert api.obj(*DPP, "agents-decode")["spec"]["replicas"] == 5
    assert sts_replicas(api, "decode") == 5


def test_without_the_handover_the_first_apply_would_drop_an_applied_count(api, monkeypatch):
    """What the handover prevents, as server-side apply does it: the count is deleted."""
    old_operator_pool(api, 12)
    monkeypatch.setattr(scaling, "applies_count", lambda *_: False)
    p = new_pass(api, upto="apply")
    phases.apply_children(p)
    assert "replicas" not in api.obj(*DPP, "agents-decode")["spec"]
