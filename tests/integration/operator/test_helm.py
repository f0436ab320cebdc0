"""The chart with the real helm binary: lint, template, and every output a valid object."""

import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from dualpath import config
from dualpath_operator.builders import render

OWNER = {"name": "agents", "uid": "u"}

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "charts" / "dualpath"
EXAMPLE = ROOT / "examples" / "dualpathcluster.yaml"


def helm(tools, *args):
    return subprocess.run(
        [str(tools / "helm"), *args], check=True, capture_output=True, text=True, timeout=120
    ).stdout


def test_helm_lint_strict(tools):
    out = helm(tools, "lint", "--strict", str(CHART))
    assert "0 chart(s) failed" in out


@pytest.mark.parametrize(
    "values",
    [
        [],
        ["--set", "operator.watchNamespaces={team-a,team-b}"],
        ["--set", "serviceMonitor.enabled=true", "--set", "serviceAccount.create=false"],
        ["--set", "podMonitor.enabled=true", "--set", "podMonitor.namespaces={team-a}"],
    ],
)
def test_helm_template_is_valid_kubernetes(tools, values):
    out = helm(
        tools, "template", "rel", str(CHART), "--namespace", "dualpath", "--include-crds", *values
    )
    docs = [d for d in yaml.safe_load_all(out) if d]
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "ClusterRole", "CustomResourceDefinition"} <= kinds
    for doc in docs:
        if doc["kind"] in ("ServiceMonitor", "PodMonitor"):
            continue  # Prometheus Operator CRDs, not in the Kubernetes schemas
        kubernetes_validate.validate(doc, "1.28.0", strict=True)


def test_namespaced_install_binds_only_the_watched_namespaces(tools):
    out = helm(tools, "template", "rel", str(CHART), "--set", "operator.watchNamespaces={a,b}")
    bindings = [d for d in yaml.safe_load_all(out) if d and d["kind"] == "RoleBinding"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["a", "b"]


def refused(tools, *args) -> str:
    """helm's error output for a command that must fail."""
    res = subprocess.run([str(tools / "helm"), *args], capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    return res.stderr


def test_values_schema_refuses_bad_values(tools):
    err = refused(tools, "template", "rel", str(CHART), "--set", "image.pullPolicy=Sometimes")
    assert "pullPolicy" in err


def test_one_operator_replica_only(tools):
    """No leader election: more than one replica would have two operators writing."""
    assert "replicaCount" in refused(
        tools, "template", "rel", str(CHART), "--set", "replicaCount=2"
    )
    out = helm(tools, "template", "rel", str(CHART))
    dep = next(d for d in yaml.safe_load_all(out) if d and d["kind"] == "Deployment")
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"


def test_rbac_allows_pruning_every_child_kind(tools):
    from dualpath_operator.builders import CHILD_KINDS

    out = helm(tools, "template", "rel", str(CHART))
    role = next(
        d
        for d in yaml.safe_load_all(out)
        if d and d["kind"] == "ClusterRole" and not d["metadata"]["name"].endswith("discovery")
    )
    plural = {
        "ConfigMap": "configmaps",
        "Service": "services",
        "Deployment": "deployments",
        "StatefulSet": "statefulsets",
        "PodDisruptionBudget": "poddisruptionbudgets",
        "NetworkPolicy": "networkpolicies",
        "DualPathPool": "dualpathpools",
    }
    for api_version, kind in CHILD_KINDS:
        group = api_version.rpartition("/")[0]
        assert any(
            group in r["apiGroups"]
            and plural[kind] in r["resources"]
            and {"list", "delete", "patch"} <= set(r["verbs"])
            for r in role["rules"]
        ), kind


def test_notes_give_a_crd_upgrade_that_works_after_helm_install():
    notes = (CHART / "templates" / "NOTES.txt").read_text()
    assert "<your-mirror>" not in notes and "https://" not in notes
    assert "kubectl apply --server-side --force-conflicts" in notes
    assert "dualpathpool/<name>-decode" in notes


def _frontend_cluster() -> config.ClusterConfig:
    base = config.load(EXAMPLE)
    spec = base.to_resource()["spec"]
    spec["frontend"] = {**spec.get("frontend", {}), "replicas": 1}
    return config.ClusterConfig(name="agents", namespace="default", spec=config.parse_spec(spec))


def _plural(kind: str) -> str:
    low = kind.lower()
    return low[:-1] + "ies" if low.endswith("y") else low + "s"


def test_the_operators_rbac_covers_every_kind_it_renders(tools):
    out = helm(tools, "template", "rel", str(CHART))
    (role,) = [
        d
        for d in yaml.safe_load_all(out)
        if d and d["kind"] == "ClusterRole" and not d["metadata"]["name"].endswith("-discovery")
    ]
    cfg = _frontend_cluster()
    for obj in render(cfg, OWNER):
        group = obj["apiVersion"].rpartition("/")[0]
        plural = _plural(obj["kind"])
        verbs = {
            v
            for r in role["rules"]
            if group in r["apiGroups"] and plural in r["resources"]
            for v in r["verbs"]
        }
        assert {"get", "create", "patch"} <= verbs, (group, plural, verbs)
    netpol = {
        v
        for r in role["rules"]
        if "networking.k8s.io" in r["apiGroups"] and "networkpolicies" in r["resources"]
        for v in r["verbs"]
    }
    assert "delete" in netpol  # a switched-off policy is removed


def test_grafana_dashboard_ships_as_a_sidecar_configmap(tools):
    """The ConfigMap carries the repo's dashboard JSON, byte for byte, under the label the
    kube-prometheus-stack Grafana sidecar selects (switchable); the PodMonitor scrapes the data
    plane's pods, whose series the dashboard reads."""
    import json

    def rendered(*values):
        out = helm(tools, "template", "rel", str(CHART), "--namespace", "dualpath", *values)
        return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(out) if d}

    want = (CHART / "dashboards" / "dualpath.json").read_text().rstrip("\n")
    cm = rendered()[("ConfigMap", "rel-dualpath-dashboard")]
    kubernetes_validate.validate(cm, "1.28.0", strict=True)
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == "dualpath"
    assert cm["data"]["dualpath.json"] == want and json.loads(want)["uid"]
    cm = rendered(
        "--set",
        "grafanaDashboard.label=dash",
        "--set",
        "grafanaDashboard.namespace=monitoring",
        "--set",
        "grafanaDashboard.annotations.grafana_folder=DualPath",
    )[("ConfigMap", "rel-dualpath-dashboard")]
    assert (
        cm["metadata"]["labels"]["dash"] == "1"
        and "grafana_dashboard" not in cm["metadata"]["labels"]
    )
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "DualPath"}
    off = rendered("--set", "grafanaDashboard.enabled=false")
    assert not any(kind == "ConfigMap" for kind, _ in off)
    assert not any(kind == "PodMonitor" for kind, _ in off)
    pm = rendered("--set", "podMonitor.enabled=true")[("PodMonitor", "rel-dualpath-data-plane")]
    assert pm["spec"]["namespaceSelector"] == {"any": True}
    assert pm["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/part-of": "dualpath"}
    assert {e["port"] for e in pm["spec"]["podMetricsEndpoints"]} == {"metrics", "http"}


def test_podmonitor_selects_every_data_plane_pod_the_operator_renders(tools):
    """Every pod template the operator applies matches the PodMonitor's selector and serves
    /metrics on one of its ports; the operator's own pod is left to the ServiceMonitor."""
    from dualpath import config
    from dualpath_operator.builders import render

    out = helm(tools, "template", "rel", str(CHART), "--set", "podMonitor.enabled=true")
    pm = next(d for d in yaml.safe_load_all(out) if d and d["kind"] == "PodMonitor")
    sel, ports = pm["spec"]["selector"], {e["port"] for e in pm["spec"]["podMetricsEndpoints"]}
    (expr,) = sel["matchExpressions"]
    cfg = config.load(ROOT / "examples" / "dualpathcluster.yaml")
    templates = [o["spec"]["template"] for o in render(cfg) if "template" in o.get("spec", {})]
    assert len(templates) == 4  # scheduler, prefill, decode, frontend
    for t in templates:
        labels = t["metadata"]["labels"]
        assert sel["matchLabels"].items() <= labels.items()
        assert labels[expr["key"]] in expr["values"]
        (container,) = t["spec"]["containers"]
        assert ports & {p["name"] for p in container["ports"]}, labels


def test_the_operator_image_defaults_to_the_release_image_and_follows_values(tools):
    """The chart's default image is the one source's (`dualpath.default_image()`), and a
    team's registry and tag replace it (docs/image.md)."""
    from dualpath import default_image

    def operator_image(*values):
        out = helm(tools, "template", "rel", str(CHART), *values)
        dep = next(d for d in yaml.safe_load_all(out) if d and d["kind"] == "Deployment")
        return dep["spec"]["template"]["spec"]["containers"][0]["image"]

    assert operator_image() == default_image()
    own = ["--set", "image.repository=registry.example.com/ml/dualpath", "--set", "image.tag=abc"]
    assert operator_image(*own) == "registry.example.com/ml/dualpath:abc"
