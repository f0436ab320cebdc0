"""Opt-in: the operator against a real API server (`make e2e KUBECONFIG=...`).

Runs `dualpath operator` locally against the cluster and checks, in order, each failure naming
its step and showing kubectl's stderr: `helm install` with the chart's own crds/ (on a cluster
without them), `helm upgrade` and the CRD upgrade command of docs/operator.md; the example applied; a preset spec's config hash equal
to `dualpath render`'s; a storm of 50 `kubectl scale dpp/...` with the operator killed and
restarted twice ending at the last value (pool and StatefulSet; the cluster spec's count is
the initial one and stays as applied); an unsafe scale reported; every bad input refused at
admission or Degraded with a reason; `frontend.replicas: 0` pruned; `kubectl delete dpc` with
the operator stopped; `helm install` shipping the Grafana dashboard ConfigMap (and the PodMonitor
where the Prometheus Operator's CRD is installed), `helm uninstall`, then namespace deletion. Images need not be pullable
and pods may stay Pending (no kubelet needed).
"""

import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from e2e_lib import (  # noqa: E402
    BAD_INPUTS,
    StepFailed,
    bad_input_outcome,
    condition,
    documented_commands,
    get_json,
    run,
    shrink_example,
    step,
    storm_plan,
    wait_for,
)

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not os.environ.get("KUBECONFIG") or os.environ.get("DUALPATH_E2E") != "1",
        reason="needs a real cluster: make e2e KUBECONFIG=...",
    ),
]
KUBECTL = os.environ.get("KUBECTL", str(ROOT / ".tools" / "bin" / "kubectl"))
HELM = os.environ.get("HELM", str(ROOT / ".tools" / "bin" / "helm"))
NAME = "agents"


def kubectl(*args, check=True, input=None, timeout_s=120):
    return run([KUBECTL, *args], check=check, input=input, timeout_s=timeout_s)


class Operator:
    """`dualpath operator` as a child process that a step can SIGKILL and start again."""

    def __init__(self, namespace: str, log_dir: Path) -> None:
        self.namespace, self.log_dir, self.proc, self.starts = namespace, log_dir, None, 0

    def start(self) -> None:
        self.starts += 1
        log = open(self.log_dir / f"operator-{self.starts}.log", "w")  # noqa: SIM115
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                [str(ROOT / "workers"), str(ROOT / "operator"), os.environ.get("PYTHONPATH", "")]
            ),
        }
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dualpath.cli",
                "operator",
                "--namespace",
                self.namespace,
                "--liveness",
                "",
                "--metrics-port",
                "0",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )

    def kill(self) -> None:
        """SIGKILL: no cleanup, as a node loss or OOM would."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()

    def log_tail(self, chars: int = 4000) -> str:
        path = self.log_dir / f"operator-{self.starts}.log"
        return path.read_text()[-chars:] if path.exists() else ""


@pytest.fixture(scope="module")
def namespace():
    ns = f"dualpath-e2e-{uuid.uuid4().hex[:6]}"
    with step("install the CRDs"):
        # --force-conflicts: after `helm install` Helm's field manager owns the CRDs' fields.
        kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds"))
        kubectl(
            "wait",
            "--for=condition=Established",
            "crd/dualpathclusters.dualpath.io",
            "crd/dualpathpools.dualpath.io",
            "--timeout=60s",
        )
    with step("create the namespace"):
        kubectl("create", "namespace", ns)
    yield ns
    kubectl("delete", "namespace", ns, "--wait=false", check=False)


@pytest.fixture(scope="module")
def operator(namespace):
    with tempfile.TemporaryDirectory() as logs:
        op = Operator(namespace, Path(logs))
        op.start()
        yield op
        op.stop()


@pytest.fixture
def show_operator_log(request, operator):
    """On a failure, the operator's log is part of the report (see conftest.py)."""
    yield
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        print("--- operator log (tail) ---\n" + operator.log_tail(), file=sys.stderr)


def example(ns, name=NAME):
    cr = yaml.safe_load((ROOT / "examples" / "dualpathcluster.yaml").read_text())
    return shrink_example(cr, ns, name)


def cluster(ns, name=NAME):
    return get_json(KUBECTL, "dualpathcluster", name, ns)


def replicas_of(ns, role, name=NAME):
    """(cluster spec, pool spec, StatefulSet spec) replicas of one role. After creation the pool
    owns the count and the StatefulSet follows it; the cluster spec's is the initial count,
    never written by the operator (docs/operator.md, "who owns each count")."""
    c = cluster(ns, name) or {}
    pool = get_json(KUBECTL, "dualpathpool", f"{name}-{role}", ns) or {}
    sts = get_json(KUBECTL, "statefulset", f"{name}-{role}", ns) or {}
    return (
        c.get("spec", {}).get(role, {}).get("replicas"),
        pool.get("spec", {}).get("replicas"),
        sts.get("spec", {}).get("replicas"),
    )


CRDS = ("dualpathclusters.dualpath.io", "dualpathpools.dualpath.io")


def test_0_helm_install_with_its_crds_then_upgrade_and_the_documented_crd_upgrade():
    """Runs before the suite applies crds/: on an empty cluster `helm install` creates the CRDs
    from the chart's crds/ (not --skip-crds). DUALPATH_E2E_FRESH_CRDS=1 (a throwaway cluster
    only: every DualPath object goes with them) deletes CRDs left by an earlier run first."""
    ns = f"dualpath-e2e-{uuid.uuid4().hex[:6]}-crds"
    release = "dualpath-crds-e2e"
    chart = str(ROOT / "charts" / "dualpath")
    with step("the CRDs before helm install"):
        present = [c for c in CRDS if kubectl("get", "crd", c, check=False).returncode == 0]
        if present and os.environ.get("DUALPATH_E2E_FRESH_CRDS") == "1":
            kubectl("delete", "crd", *present, "--timeout=120s", timeout_s=150)
            present = []
        if present:
            print(
                f"CRDs already installed ({present}): helm keeps them; the install from the "
                "chart's crds/ is checked on a cluster without them"
            )
    values = ["--set", "replicaCount=0", "--set", f"operator.watchNamespaces={{{ns}}}"]
    try:
        with step("helm install with the chart's crds/"):
            run(
                [HELM, "install", release, chart, "-n", ns, "--create-namespace", *values],
                timeout_s=300,
            )
            kubectl(
                "wait", "--for=condition=Established", *(f"crd/{c}" for c in CRDS), "--timeout=60s"
            )
        if not present:
            with step("helm created the CRDs (its field manager owns them)"):
                for c in CRDS:
                    managers = {
                        m.get("manager")
                        for m in json.loads(
                            kubectl("get", "crd", c, "-o", "json", "--show-managed-fields").stdout
                        )["metadata"].get("managedFields", [])
                    }
                    if "helm" not in managers:
                        raise StepFailed(f"crd/{c} managed by {sorted(managers)}, not helm")
        with step("the example is admitted by the installed CRD (server-side dry run)"):
            kubectl("apply", "--dry-run=server", "-f", "-", input=yaml.safe_dump(example(ns)))
        with step("helm upgrade"):
            run([HELM, "upgrade", release, chart, "-n", ns, "--reuse-values"], timeout_s=300)
        with step("the documented CRD upgrade command (docs/operator.md), then helm upgrade"):
            doc = (ROOT / "docs" / "operator.md").read_text()
            for cmd in documented_commands(doc, "Upgrading CRDs", "kubectl"):
                args = [str(ROOT / a) if (ROOT / a).exists() and "/" in a else a for a in cmd[1:]]
                kubectl(*args)
            run([HELM, "upgrade", release, chart, "-n", ns, "--reuse-values"], timeout_s=300)
            kubectl("apply", "--dry-run=server", "-f", "-", input=yaml.safe_dump(example(ns)))
        with step("helm uninstall keeps the CRDs; the namespace is deleted"):
            run([HELM, "uninstall", release, "-n", ns, "--wait"], timeout_s=300)
            for c in CRDS:
                kubectl("get", "crd", c)
            kubectl("delete", "namespace", ns, "--timeout=120s", timeout_s=150)
    finally:  # a failed step leaves no release or namespace behind
        run([HELM, "uninstall", release, "-n", ns, "--wait"], check=False, timeout_s=300)
        kubectl("delete", "namespace", ns, "--ignore-not-found", "--wait=false", check=False)


def test_1_example_applied_and_its_hash_equals_dualpath_render(namespace, operator):
    cr = example(namespace)
    with step("apply the example (preset qwen2.5-32b, shrunk)"):
        kubectl("apply", "-f", "-", input=yaml.safe_dump(cr))
    with step("children appear"):
        wait_for(
            "StatefulSets, scheduler Deployment and pools",
            lambda: all(
                get_json(KUBECTL, kind, f"{NAME}-{suffix}", namespace)
                for kind, suffix in [
                    ("statefulset", "decode"),
                    ("statefulset", "prefill"),
                    ("deployment", "scheduler"),
                    ("deployment", "frontend"),
                    ("dualpathpool", "prefill"),
                    ("dualpathpool", "decode"),
                    ("networkpolicy", "scheduler"),
                    ("networkpolicy", "workers"),
                    ("networkpolicy", "frontend"),
                    ("secret", "token"),  # created once (create-only)
                ]
            ),
        )
    with step("status reports Ready or Progressing, not Degraded by an apply"):
        wait_for("status.conditions", lambda: condition(cluster(namespace), "Ready"))
        obj = cluster(namespace)
        degraded = condition(obj, "Degraded")
        assert degraded["reason"] not in ("ApplyFailed", "InvalidSpec", "ApiRetrying"), degraded
        assert "True" in (
            condition(obj, "Ready")["status"],
            condition(obj, "Progressing")["status"],
        )
        assert "kopf" not in obj["status"]  # kopf's progress lives in annotations
    with step("the config hash equals `dualpath render` of the same file"):
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
            yaml.safe_dump(cr, f)
        rendered = run(
            [sys.executable, "-m", "dualpath.cli", "render", "-f", f.name],
        ).stdout
        cm = next(
            d
            for d in yaml.safe_load_all(rendered)
            if d and d["metadata"]["name"] == f"{NAME}-config"
        )
        want = cm["data"]["config-hash"]
        got = wait_for("status.configHash", lambda: cluster(namespace)["status"].get("configHash"))
        assert got == want, f"operator applied hash {got}, dualpath render says {want}"
        sts = get_json(KUBECTL, "statefulset", f"{NAME}-decode", namespace)
        tpl_hash = sts["spec"]["template"]["metadata"]["annotations"]["dualpath.io/config-hash"]
        assert tpl_hash == want
    with step("kubectl get dpp shows desired and ready"):
        out = kubectl("get", "dpp", "-n", namespace).stdout
        assert "DESIRED" in out and "READY" in out, out


def test_2_a_scale_storm_with_two_operator_kills_ends_at_the_last_value(
    namespace, operator, show_operator_log
):
    plan = storm_plan(seed=int(os.environ.get("DUALPATH_E2E_SEED", "14")))
    initial = replicas_of(namespace, "decode")[0]  # the cluster spec's, as applied
    templates_before = get_json(KUBECTL, "statefulset", f"{NAME}-prefill", namespace)["spec"][
        "template"
    ]
    for i, value in enumerate(plan.values):
        if i in plan.kill_before:
            with step(f"kill the operator before scale {i}"):
                operator.kill()
        if i in plan.restart_before:
            with step(f"restart the operator before scale {i}"):
                operator.start()
        with step(f"scale {i}: kubectl scale dpp/{NAME}-decode --replicas={value}"):
            kubectl("scale", f"dpp/{NAME}-decode", "-n", namespace, f"--replicas={value}")
        time.sleep(0.2 + 0.1 * (i % 4))
    last = plan.values[-1]
    want = (initial, last, last)  # cluster spec untouched; pool and StatefulSet at the last
    with step(f"pool and StatefulSet end at the last value {last}, the cluster spec untouched"):
        wait_for(
            f"decode replicas (cluster spec, pool, StatefulSet) == {want}",
            lambda: replicas_of(namespace, "decode") == want,
            timeout_s=120,
        )
        time.sleep(20)  # more than one resync: nothing reverts it
        got = replicas_of(namespace, "decode")
        assert got == want, f"reverted after settling: {got}"
    with step("no server-side apply owns the pool's count: its one writer is the scale"):
        pool = json.loads(
            kubectl(
                "get", f"dpp/{NAME}-decode", "-n", namespace, "-o", "json", "--show-managed-fields"
            ).stdout
        )
        appliers = [
            m["manager"]
            for m in pool["metadata"].get("managedFields") or []
            if m.get("operation") == "Apply"
            and "f:replicas" in ((m.get("fieldsV1") or {}).get("f:spec") or {})
        ]
        assert appliers == [], f"spec.replicas applied by {appliers}"
    with step("no scale rolled a pod template"):
        after = get_json(KUBECTL, "statefulset", f"{NAME}-prefill", namespace)["spec"]["template"]
        assert after == templates_before


def test_3_an_unsafe_scale_is_reported_not_done_and_not_undone(
    namespace, operator, show_operator_log
):
    initial, _, before = replicas_of(namespace, "decode")
    with step("kubectl scale dpp/...-decode --replicas=0 while prefill runs"):
        kubectl("scale", f"dpp/{NAME}-decode", "-n", namespace, "--replicas=0")
    with step("Degraded=True reason UnsafeScale, with a Warning event"):
        wait_for(
            "Degraded UnsafeScale",
            lambda: (
                (condition(cluster(namespace), "Degraded") or {}).get("reason") == "UnsafeScale"
            ),
        )
        events = kubectl(
            "get", "events", "-n", namespace, "--field-selector", "reason=UnsafeScale", "-o", "json"
        ).stdout
        assert json.loads(events)["items"], "no UnsafeScale event"
        assert replicas_of(namespace, "decode") == (initial, 0, before)
        accepted = condition(cluster(namespace), "ScaleAccepted") or {}
        assert (accepted.get("status"), accepted.get("reason")) == ("False", "UnsafeScale")
    with step("scaling decode back to 1 clears it"):
        kubectl("scale", f"dpp/{NAME}-decode", "-n", namespace, "--replicas=1")
        wait_for(
            "Degraded no longer UnsafeScale",
            lambda: (
                (condition(cluster(namespace), "Degraded") or {}).get("reason") != "UnsafeScale"
            ),
        )


@pytest.mark.parametrize("label, mutate", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_4_a_bad_input_is_refused_or_degraded_with_a_reason(
    namespace, operator, show_operator_log, label, mutate
):
    cr = example(namespace, name=f"bad-{label}")
    mutate(cr)
    name = cr["metadata"]["name"]
    with step(f"apply bad input {label}"):
        applied = kubectl("apply", "-f", "-", input=yaml.safe_dump(cr), check=False)
    with step(f"bad input {label}: refused at admission or Degraded with a reason"):
        outcome = wait_for(
            f"{label} refused or Degraded",
            lambda: bad_input_outcome(
                applied, None if applied.returncode else cluster(namespace, name)
            ),
            timeout_s=90,
        )
        assert outcome.message, outcome
        print(f"{label}: {outcome.how}: {outcome.message}")
    if applied.returncode == 0:
        kubectl("delete", "dualpathcluster", name, "-n", namespace, "--wait=false", check=False)


def test_5_frontend_replicas_zero_prunes_the_frontend(namespace, operator, show_operator_log):
    with step("patch frontend.replicas: 0"):
        kubectl(
            "patch",
            "dualpathcluster",
            NAME,
            "-n",
            namespace,
            "--type=merge",
            "-p",
            json.dumps({"spec": {"frontend": {"replicas": 0}}}),
        )
    with step("the frontend Deployment and Service are deleted"):
        wait_for(
            "frontend gone",
            lambda: (
                get_json(KUBECTL, "deployment", f"{NAME}-frontend", namespace) is None
                and get_json(KUBECTL, "service", f"{NAME}-frontend", namespace) is None
                and get_json(KUBECTL, "networkpolicy", f"{NAME}-frontend", namespace) is None
            ),
        )
    with step("status drops frontendEndpoint"):
        wait_for(
            "no status.frontendEndpoint",
            lambda: "frontendEndpoint" not in (cluster(namespace) or {}).get("status", {}),
        )


def test_6_delete_completes_with_the_operator_stopped(namespace, operator, show_operator_log):
    with step("no finalizer on the cluster"):
        assert not cluster(namespace)["metadata"].get("finalizers")
    with step("stop the operator"):
        operator.kill()
    with step("kubectl delete dpc completes without the operator"):
        kubectl("delete", "dualpathcluster", NAME, "-n", namespace, "--timeout=60s")
    with step("garbage collection deletes the children"):
        wait_for(
            "children deleted",
            lambda: all(
                get_json(KUBECTL, kind, f"{NAME}-{suffix}", namespace) is None
                for kind, suffix in [
                    ("statefulset", "decode"),
                    ("statefulset", "prefill"),
                    ("deployment", "scheduler"),
                    ("configmap", "config"),
                    ("dualpathpool", "decode"),
                    ("secret", "token"),  # by its owner reference
                ]
            ),
        )
    operator.start()  # for any test after this one


def test_7_helm_uninstall_then_namespace_deletion(namespace):
    ns = f"{namespace}-helm"
    release = "dualpath-e2e"
    with step("helm install (operator scaled to 0: no image pull needed)"):
        run(
            [
                HELM,
                "install",
                release,
                str(ROOT / "charts" / "dualpath"),
                "-n",
                ns,
                "--create-namespace",
                "--set",
                "replicaCount=0",
                "--set",
                f"operator.watchNamespaces={{{ns}}}",
            ],
            timeout_s=300,
        )
    with step("the Grafana dashboard ConfigMap carries the sidecar's label and the repo's JSON"):
        cms = json.loads(
            kubectl("get", "configmap", "-n", ns, "-l", "grafana_dashboard=1", "-o", "json").stdout
        )["items"]
        if len(cms) != 1:
            raise StepFailed(f"want 1 ConfigMap labelled grafana_dashboard=1, got {len(cms)}")
        shipped = json.loads(cms[0]["data"]["dualpath.json"])
        want = json.loads(
            (ROOT / "charts" / "dualpath" / "dashboards" / "dualpath.json").read_text()
        )
        if shipped != want:
            raise StepFailed("the dashboard in the ConfigMap differs from dashboards/dualpath.json")
    with step("the PodMonitor, where the Prometheus Operator's CRD is installed"):
        has_crd = kubectl("get", "crd", "podmonitors.monitoring.coreos.com", check=False)
        if has_crd.returncode == 0:
            run(
                [HELM, "upgrade", release, str(ROOT / "charts" / "dualpath"), "-n", ns]
                + ["--reuse-values", "--set", "podMonitor.enabled=true"],
                timeout_s=300,
            )
            kubectl("get", "podmonitor", "-n", ns, f"{release}-data-plane")
        else:
            print(
                "no PodMonitor CRD on this cluster: the PodMonitor is checked by helm lint/template only"
            )
    with step("a DualPathCluster in the release namespace"):
        kubectl("apply", "-f", "-", input=yaml.safe_dump(example(ns)))
    with step("helm uninstall"):
        run([HELM, "uninstall", release, "-n", ns, "--wait"], timeout_s=300)
    with step("the namespace (and the CR in it) is deleted"):
        try:
            kubectl("delete", "namespace", ns, "--timeout=120s", timeout_s=150)
        except StepFailed:
            left = kubectl("get", "dpc", "-n", ns, "-o", "json", check=False).stdout
            raise StepFailed(f"namespace {ns} not deleted; left: {left[:2000]}") from None
