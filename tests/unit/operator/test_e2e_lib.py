"""The e2e test's helpers, without a cluster: a failed command shows its stderr and the step,
a wait says what it was waiting for, the storm plan kills in the middle, bad inputs resolve."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "e2e"))
from e2e_lib import (  # noqa: E402
    BAD_INPUTS,
    StepFailed,
    bad_input_outcome,
    documented_commands,
    policy_admits,
    run,
    schedulable_nodes,
    selector_matches,
    shrink_example,
    split_image,
    step,
    storm_plan,
    wait_for,
)

ROOT = Path(__file__).resolve().parents[3]


def test_a_failed_command_names_the_step_and_shows_its_stderr():
    cmd = [
        sys.executable,
        "-c",
        "import sys; sys.stderr.write('Error from server (Invalid)'); sys.exit(3)",
    ]
    with pytest.raises(StepFailed) as err, step("apply the example"):
        run(cmd)
    text = str(err.value)
    assert "step 'apply the example'" in text and "exited 3" in text
    assert "Error from server (Invalid)" in text


def test_check_false_returns_the_result_for_the_caller_to_judge():
    res = run([sys.executable, "-c", "import sys; sys.exit(1)"], check=False)
    assert res.returncode == 1


def test_an_assertion_inside_a_step_names_it():
    with pytest.raises(StepFailed, match="step 'scale 7'.*12 != 13"), step("scale 7"):
        assert 12 == 13, "12 != 13"


def test_a_wait_that_times_out_names_what_it_waited_for():
    now = [0.0]
    seen = []

    def fn():
        seen.append(1)
        return None

    def sleep(s):
        now[0] += s

    with pytest.raises(StepFailed, match="waiting for pool == 3"), step("storm"):
        wait_for("pool == 3", fn, timeout_s=10, interval_s=2, clock=lambda: now[0], sleep=sleep)
    assert len(seen) == 6
    assert wait_for("x", lambda: 5, clock=lambda: 0.0, sleep=sleep) == 5


def test_the_storm_plan_has_50_scales_and_two_kill_restart_windows_in_the_middle():
    plan = storm_plan(14)
    assert len(plan.values) == 50
    assert all(a != b for a, b in zip(plan.values, plan.values[1:], strict=False))
    for kill, restart in zip(plan.kill_before, plan.restart_before, strict=True):
        assert 0 < kill < restart < 50
    assert plan.restart_before[0] < plan.kill_before[1]
    assert storm_plan(14) == plan


def test_the_shrunk_example_needs_no_gpu_rdma_or_shared_volume():
    cr = yaml.safe_load((ROOT / "examples" / "dualpathcluster.yaml").read_text())
    small = shrink_example(cr, "ns-1")
    assert small["metadata"]["namespace"] == "ns-1"
    for role in ("prefill", "decode"):
        assert small["spec"][role]["gpusPerPod"] == 0 and not small["spec"][role]["nodeSelector"]
    assert (
        small["spec"]["network"]["rdma"]["count"] == 0 and "volume" not in small["spec"]["storage"]
    )
    assert cr["spec"]["prefill"]["gpusPerPod"] == 8  # the original is untouched


def test_bad_inputs_mutate_what_they_say():
    cr = yaml.safe_load((ROOT / "examples" / "dualpathcluster.yaml").read_text())
    got = {}
    for label, mutate in BAD_INPUTS:
        c = shrink_example(cr, "ns", f"bad-{label}")
        mutate(c)
        got[label] = c
    assert got["cpu-lots"]["spec"]["prefill"]["resources"]["requests"]["cpu"] == "lots"
    assert got["scheduler-port-9090"]["spec"]["scheduler"]["port"] == 9090
    assert got["empty-image"]["spec"]["model"]["image"] == ""
    assert len(got["name-74-chars"]["metadata"]["name"]) == 74
    assert "." in got["dotted-name"]["metadata"]["name"]
    assert "bogusSource" in got["bogus-volume"]["spec"]["storage"]["volume"]


def test_a_bad_input_resolves_as_refused_or_degraded_and_not_before():
    ok = subprocess.CompletedProcess([], 0, "", "")
    refused = subprocess.CompletedProcess([], 1, "", "The DualPathCluster is invalid: spec.x")
    assert bad_input_outcome(refused, None).how == "refused"
    assert bad_input_outcome(ok, None) is None
    progressing = {"status": {"conditions": [{"type": "Degraded", "status": "False"}]}}
    assert bad_input_outcome(ok, progressing) is None
    warning_only = {
        "status": {
            "conditions": [{"type": "Degraded", "status": "True", "reason": "StartupChecks"}]
        }
    }
    assert bad_input_outcome(ok, warning_only) is None
    failed = {
        "status": {
            "conditions": [
                {
                    "type": "Degraded",
                    "status": "True",
                    "reason": "ApplyFailed",
                    "message": "Service/x-scheduler: spec.ports[1].port: Duplicate value",
                }
            ]
        }
    }
    out = bad_input_outcome(ok, failed)
    assert out.how == "degraded" and "Service/x-scheduler" in out.message


def test_the_documented_crd_upgrade_command_is_read_from_the_doc():
    doc = (ROOT / "docs" / "operator.md").read_text()
    kubectl = documented_commands(doc, "Upgrading CRDs", "kubectl")
    helm = documented_commands(doc, "Upgrading CRDs", "helm")
    assert kubectl == [
        "kubectl apply --server-side --force-conflicts --field-manager=dualpath-crds "
        "-f charts/dualpath/crds/".split()
    ]
    assert helm and helm[0][:2] == ["helm", "upgrade"]
    for path in (a for c in kubectl for a in c if a.endswith("/")):
        assert (ROOT / path).is_dir(), path  # the doc names paths of this repo


def test_a_doc_without_the_section_or_command_is_a_step_failure():
    doc = "# x\n## Other\n```bash\nkubectl get x  # comment\n```\n"
    assert documented_commands(doc, "Other", "kubectl") == [["kubectl", "get", "x"]]
    with pytest.raises(StepFailed, match="no '## Missing' section"):
        documented_commands(doc, "Missing", "kubectl")
    with pytest.raises(StepFailed, match="no `helm` command"):
        documented_commands(doc, "Other", "helm")


def _node(name, ready="True", unschedulable=False, taints=()):
    return {
        "metadata": {"name": name},
        "spec": {"unschedulable": unschedulable, "taints": list(taints)},
        "status": {"conditions": [{"type": "Ready", "status": ready}]},
    }


def test_the_live_e2e_runs_on_a_schedulable_node_and_says_why_there_is_none():
    assert schedulable_nodes({"items": []}) == ([], "no schedulable node (the cluster has none)")
    nodes = {
        "items": [
            _node("a", ready="False"),
            _node("b", unschedulable=True),
            _node(
                "c",
                taints=[{"key": "node-role.kubernetes.io/control-plane", "effect": "NoSchedule"}],
            ),
        ]
    }
    names, why = schedulable_nodes(nodes)
    assert names == [] and "a not Ready" in why and "b cordoned" in why
    assert "c tainted node-role.kubernetes.io/control-plane" in why
    soft = _node("d", taints=[{"key": "x", "effect": "PreferNoSchedule"}])
    assert schedulable_nodes({"items": [*nodes["items"], soft]}) == (["d"], "")


def test_an_image_splits_into_the_charts_repository_and_tag():
    assert split_image("ghcr.io/dualpath/dualpath:0.1.0") == ("ghcr.io/dualpath/dualpath", "0.1.0")
    assert split_image("localhost:5000/dualpath") == ("localhost:5000/dualpath", "latest")
    assert split_image("localhost:5000/dualpath:dev") == ("localhost:5000/dualpath", "dev")


def test_a_selector_matches_as_the_api_server_evaluates_it():
    pod = {"app": "dualpath", "role": "decode"}
    assert selector_matches({}, pod) and selector_matches(None, pod)
    assert selector_matches({"matchLabels": {"app": "dualpath"}}, pod)
    assert not selector_matches({"matchLabels": {"app": "other"}}, pod)
    ins = {"key": "role", "operator": "In", "values": ["prefill", "decode"]}
    assert selector_matches({"matchExpressions": [ins]}, pod)
    assert not selector_matches({"matchExpressions": [{**ins, "values": ["prefill"]}]}, pod)
    assert not selector_matches({"matchExpressions": [{**ins, "operator": "NotIn"}]}, pod)
    assert selector_matches({"matchExpressions": [{"key": "role", "operator": "Exists"}]}, pod)
    assert not selector_matches({"matchExpressions": [{"key": "x", "operator": "Exists"}]}, pod)
    assert selector_matches({"matchExpressions": [{"key": "x", "operator": "DoesNotExist"}]}, pod)


def test_the_rendered_policies_admit_each_path_the_cluster_needs_and_no_other():
    from dualpath import config
    from dualpath_operator.builders import render

    cfg = config.load(ROOT / "examples" / "dualpathcluster.yaml")
    objs = render(cfg, {"name": cfg.name, "uid": "u"})
    policies = {o["metadata"]["name"]: o for o in objs if o["kind"] == "NetworkPolicy"}
    labels = {
        o["metadata"]["labels"]["app.kubernetes.io/component"]: o["spec"]["template"]["metadata"][
            "labels"
        ]
        for o in objs
        if o["kind"] in ("Deployment", "StatefulSet")
    }
    sched, workers = policies["agents-scheduler"], policies["agents-workers"]
    port = cfg.spec.scheduler.port
    for src in ("frontend", "prefill", "decode"):
        assert policy_admits(sched, labels[src], labels["scheduler"], port)
    assert not policy_admits(sched, labels["frontend"], labels["scheduler"], port + 1)
    assert policy_admits(workers, labels["scheduler"], labels["decode"], 50061)
    assert policy_admits(workers, labels["prefill"], labels["decode"], 40000)
    assert not policy_admits(workers, labels["frontend"], labels["decode"], 40000)
    assert not policy_admits(workers, {"app": "elsewhere"}, labels["decode"], 50061)
