"""Issue 21 items 2 and 5: the rendered NetworkPolicies let exactly the documented traffic in
(checked with an evaluator of the NetworkPolicy semantics), every pod is hardened, and the
operator's RBAC covers every kind it renders."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from dualpath import config
from dualpath.cli import main as cli_main
from dualpath_operator.builders import render
from dualpath_operator.builders.common import API_KEYS_MOUNT, METRICS_PORT, WORKER_GRPC_PORT

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "dualpathcluster.yaml"
OWNER = {"name": "agents", "uid": "u"}
K8S_VERSIONS = ["1.28.0", "1.33.0"]


def _cfg(spec_patch: dict | None = None, name: str = "agents", ns: str = "default"):
    base = config.load(EXAMPLE)
    spec = base.to_resource()["spec"]
    for key, value in (spec_patch or {}).items():
        spec[key] = {**spec.get(key, {}), **value}
    return config.ClusterConfig(name=name, namespace=ns, spec=config.parse_spec(spec))


def _kind(objs, kind):
    return [o for o in objs if o["kind"] == kind]


# ---- a small evaluator of NetworkPolicy ingress semantics ---------------------------------


def _selects(selector: dict, labels: dict) -> bool:
    for k, v in selector.get("matchLabels", {}).items():
        if labels.get(k) != v:
            return False
    for e in selector.get("matchExpressions", []):
        have = e["key"] in labels
        if e["operator"] == "In" and not (have and labels[e["key"]] in e["values"]):
            return False
        if e["operator"] == "NotIn" and have and labels[e["key"]] in e["values"]:
            return False
        if e["operator"] == "Exists" and not have:
            return False
        if e["operator"] == "DoesNotExist" and have:
            return False
    return True


class Pod:
    def __init__(self, ns: str, labels: dict, ip: str = "10.0.0.1", ns_labels=None) -> None:
        self.ns, self.labels, self.ip = ns, labels, ip
        self.ns_labels = {"kubernetes.io/metadata.name": ns, **(ns_labels or {})}


def _peer_admits(peer: dict, policy_ns: str, src: Pod) -> bool:
    if "ipBlock" in peer:
        net = ipaddress.ip_network(peer["ipBlock"]["cidr"], strict=False)
        return ipaddress.ip_address(src.ip) in net
    if "namespaceSelector" in peer:
        if not _selects(peer["namespaceSelector"], src.ns_labels):
            return False
    elif src.ns != policy_ns:
        return False
    return _selects(peer.get("podSelector", {}), src.labels)


def allowed(policies: list[dict], src: Pod, dst: Pod, port: int) -> bool:
    """Ingress to `dst` on TCP `port` from `src` under `policies` (all in dst's namespace)."""
    selecting = [
        p
        for p in policies
        if p["metadata"]["namespace"] == dst.ns
        and "Ingress" in p["spec"]["policyTypes"]
        and _selects(p["spec"]["podSelector"], dst.labels)
    ]
    if not selecting:
        return True  # not isolated
    for p in selecting:
        for rule in p["spec"].get("ingress", []):
            ports = rule.get("ports")
            if ports and not any(x.get("port") == port for x in ports):
                continue
            peers = rule.get("from")
            if not peers or any(_peer_admits(peer, dst.ns, src) for peer in peers):
                return True
    return False


def _pod(cfg, component: str, ns: str | None = None, name: str | None = None) -> Pod:
    """A pod as the cluster's templates label it."""
    objs = render(cfg, OWNER)
    kinds = ("StatefulSet", "Deployment")
    for o in objs:
        if o["kind"] in kinds:
            labels = o["spec"]["template"]["metadata"]["labels"]
            if labels["app.kubernetes.io/component"] == component:
                return Pod(ns or cfg.namespace, dict(labels))
    raise AssertionError(component)


@pytest.fixture
def example():
    return _cfg()


def test_the_example_renders_policies_and_hardened_workers_through_the_cli(capsys):
    """The issue's bar: `dualpath render -f examples/dualpathcluster.yaml`."""
    assert cli_main(["render", "-f", str(EXAMPLE)]) == 0
    docs = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
    names = sorted(d["metadata"]["name"] for d in _kind(docs, "NetworkPolicy"))
    assert names == ["agents-frontend", "agents-scheduler", "agents-workers"]
    for sts in _kind(docs, "StatefulSet"):
        pod = sts["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        assert c["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_policies_and_hardened_pods_pass_the_schemas_with_every_option(version):
    cfg = _cfg(
        {
            "network": {
                "policies": {
                    "frontendFrom": [
                        {"namespaceSelector": {"kubernetes.io/metadata.name": "ingress-nginx"}},
                        {"podSelector": {"app": "agent"}},
                        {"namespaceSelector": {}, "podSelector": {"team": "a"}},
                    ],
                    "frontendFromCidrs": ["203.0.113.0/24", "2001:db8::/32"],
                    "monitoringNamespaceSelector": {"team": "obs"},
                }
            },
            "frontend": {"auth": {"secretName": "api-keys", "requestsPerSecond": 5}},
            "workers": {"runAsNonRoot": True},
        }
    )
    objs = render(cfg, OWNER)
    assert len(_kind(objs, "NetworkPolicy")) == 3
    for obj in objs:
        if not obj["apiVersion"].startswith("dualpath.io"):
            kubernetes_validate.validate(obj, version, strict=True)


def test_who_may_reach_whom_by_default(example):
    pols = _kind(render(example, OWNER), "NetworkPolicy")
    sched, fe = _pod(example, "scheduler"), _pod(example, "frontend")
    pre, dec = _pod(example, "prefill"), _pod(example, "decode")
    sport, fport = example.spec.scheduler.port, example.spec.frontend.port
    stranger = Pod("default", {"app": "curl"})  # any other pod of the namespace
    elsewhere = Pod("team-b", {"app": "curl"})
    monitor = Pod("monitoring", {"app": "prometheus"})
    # another DualPathCluster in the same namespace is a stranger too
    other = _pod(_cfg(name="other"), "frontend")

    # scheduler: this cluster's frontend and workers only
    for src in (fe, pre, dec):
        assert allowed(pols, src, sched, sport)
    for src in (stranger, elsewhere, monitor, other):
        assert not allowed(pols, src, sched, sport)
    # workers: gRPC from the scheduler, the frontend and each other
    for dst in (pre, dec):
        for src in (sched, fe, pre, dec):
            assert allowed(pols, src, dst, WORKER_GRPC_PORT)
        for src in (stranger, elsewhere, monitor, other):
            assert not allowed(pols, src, dst, WORKER_GRPC_PORT)
        # UCX's TCP ports are chosen at run time: every port, but only worker to worker
        assert allowed(pols, pre, dst, 40123) and allowed(pols, dec, dst, 40123)
        assert not allowed(pols, sched, dst, 40123) and not allowed(pols, fe, dst, 40123)
        assert not allowed(pols, stranger, dst, 40123)
    # frontend: default is the cluster's namespace, not other namespaces
    assert allowed(pols, stranger, fe, fport) and allowed(pols, other, fe, fport)
    assert not allowed(pols, elsewhere, fe, fport)
    assert not allowed(pols, Pod("x", {}, ip="198.51.100.7"), fe, fport)
    # metrics: from the monitoring namespace only (the frontend's /metrics is on its HTTP port)
    for dst in (sched, pre, dec):
        assert allowed(pols, monitor, dst, METRICS_PORT)
        assert not allowed(pols, stranger, dst, METRICS_PORT)
    assert allowed(pols, monitor, fe, fport)
    assert not allowed(pols, monitor, sched, sport)


def test_frontend_peers_replace_the_namespace_default():
    cfg = _cfg(
        {
            "network": {
                "policies": {
                    "frontendFrom": [
                        {"namespaceSelector": {"kubernetes.io/metadata.name": "ingress-nginx"}}
                    ],
                    "frontendFromCidrs": ["203.0.113.0/24"],
                }
            }
        }
    )
    pols = _kind(render(cfg, OWNER), "NetworkPolicy")
    fe, port = _pod(cfg, "frontend"), cfg.spec.frontend.port
    assert allowed(pols, Pod("ingress-nginx", {"app": "controller"}), fe, port)
    assert allowed(pols, Pod("x", {}, ip="203.0.113.9"), fe, port)
    assert not allowed(pols, Pod("x", {}, ip="198.51.100.7"), fe, port)
    assert not allowed(pols, Pod("default", {"app": "curl"}), fe, port)


def test_policies_can_be_switched_off_and_bad_cidrs_are_refused():
    cfg = _cfg({"network": {"policies": {"enabled": False}}})
    assert not _kind(render(cfg, OWNER), "NetworkPolicy")
    with pytest.raises(config.ConfigError, match="frontendFromCidrs.*10.0.0.300/8"):
        _cfg({"network": {"policies": {"frontendFromCidrs": ["10.0.0.300/8"]}}})


def _templates(objs):
    return [o["spec"]["template"] for o in objs if o["kind"] in ("StatefulSet", "Deployment")]


@pytest.mark.parametrize("source", ["example", "local"])
def test_every_pod_is_hardened(source):
    cfg = _cfg() if source == "example" else config.local_default()
    tpls = _templates(render(cfg, OWNER))
    assert len(tpls) == 4
    for tpl in tpls:
        spec = tpl["spec"]
        comp = tpl["metadata"]["labels"]["app.kubernetes.io/component"]
        assert spec["automountServiceAccountToken"] is False, comp
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, comp
        volumes = {v["name"]: v for v in spec["volumes"]}
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["capabilities"]["drop"] == ["ALL"], comp
            assert sc["capabilities"].get("add", []) == (
                ["IPC_LOCK"] if comp in ("prefill", "decode") else []
            ), comp
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
            mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
            assert volumes[mounts["/tmp"]["name"]]["emptyDir"], comp  # the writable scratch
            assert all(m["name"] in volumes for m in c["volumeMounts"]), comp
            if comp in ("scheduler", "frontend"):
                assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0, comp


@pytest.mark.parametrize(
    ("rdma", "override", "non_root"),
    [(1, None, False), (0, None, True), (1, True, True), (0, False, False)],
)
def test_workers_are_non_root_unless_rdma_needs_ipc_lock(rdma, override, non_root):
    workers = {"runAsNonRoot": override} if override is not None else {}
    cfg = _cfg({"network": {"rdma": {"count": rdma}}, "workers": workers})
    for sts in _kind(render(cfg, OWNER), "StatefulSet"):
        (c,) = sts["spec"]["template"]["spec"]["containers"]
        sc = c["securityContext"]
        assert sc["runAsNonRoot"] is non_root
        assert (sc["runAsUser"] != 0) is non_root


def test_the_api_key_secret_is_mounted_into_the_frontend_and_passed_to_it():
    from dualpath.cli import build_parser

    cfg = _cfg({"frontend": {"auth": {"secretName": "team-keys"}}})
    (dep,) = [
        o
        for o in render(cfg, OWNER)
        if o["kind"] == "Deployment" and o["metadata"]["name"] == "agents-frontend"
    ]
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == API_KEYS_MOUNT)
    vol = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert vol["secret"]["secretName"] == "team-keys" and mount["readOnly"] is True
    assert build_parser(c["args"]).parse_args(c["args"]).api_keys == API_KEYS_MOUNT
    # without a Secret no key file is given: the API is open (to whom the policy lets in)
    (plain,) = [
        o
        for o in render(_cfg(), OWNER)
        if o["kind"] == "Deployment" and o["metadata"]["name"] == "agents-frontend"
    ]
    assert "--api-keys" not in plain["spec"]["template"]["spec"]["containers"][0]["args"]
