"""Rendered children: valid Kubernetes objects that carry RDMA, networks, QoS env and shm."""

from pathlib import Path

import kubernetes_validate
import pytest
from dualpath import config
from dualpath_operator.builders import CONFIG_HASH_KEY, render

ROOT = Path(__file__).resolve().parents[3]
K8S_VERSIONS = ["1.28.0", "1.33.0"]
OWNER = {"name": "agents", "uid": "0c8f-uid"}


@pytest.fixture
def example():
    return config.load(ROOT / "examples" / "dualpathcluster.yaml")


def by_kind(objs, kind, name=None):
    return [
        o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
    ]


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("source", ["example", "local"])
def test_every_rendered_manifest_is_valid(version, source, example):
    cfg = example if source == "example" else config.local_default()
    for obj in render(cfg, OWNER):
        if obj["apiVersion"].startswith("dualpath.io"):
            continue  # our own CRs: checked against the generated CRD elsewhere
        kubernetes_validate.validate(obj, version, strict=True)
        assert len(obj["metadata"]["name"]) <= 63
        assert obj["metadata"]["ownerReferences"][0]["uid"] == OWNER["uid"]


def test_worker_pods_carry_rdma_networks_qos_and_shm(example):
    objs = render(example, OWNER)
    for role in ("prefill", "decode"):
        sts = by_kind(objs, "StatefulSet", f"agents-{role}")[0]
        tpl = sts["spec"]["template"]
        c = tpl["spec"]["containers"][0]
        assert c["resources"]["limits"]["rdma/hca_shared_devices_a"] == "1"
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "8"
        assert (
            tpl["metadata"]["annotations"]["k8s.v1.cni.cncf.io/networks"] == "ib-cnic-0,ib-snic-0"
        )
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert (env["NCCL_IB_SL"], env["UCX_IB_SL"], env["UCX_IB_ADDR_TYPE"]) == (
            "0",
            "2",
            "ib_global",
        )
        assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"]
        shm = next(v for v in tpl["spec"]["volumes"] if v["name"] == "dshm")
        assert shm["emptyDir"]["medium"] == "Memory"
        assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
        kv = next(v for v in tpl["spec"]["volumes"] if v["name"] == "kv-store")
        assert kv["persistentVolumeClaim"]["claimName"] == "kvcache-3fs"
        assert tpl["metadata"]["annotations"][CONFIG_HASH_KEY] == example.config_hash
        assert sts["spec"]["replicas"] == example.spec.pool(role).replicas


def test_spec_change_rolls_pods_and_render_is_deterministic(example):
    a = render(example, OWNER)
    assert render(example, OWNER) == a
    changed = config.ClusterConfig(
        name=example.name,
        namespace=example.namespace,
        spec=config.parse_spec(
            {**example.to_resource()["spec"], "scheduler": {"policy": "prefill-read"}}
        ),
    )
    b = render(changed, OWNER)

    def hash_of(objs):
        sts = by_kind(objs, "StatefulSet", "agents-prefill")[0]
        return sts["spec"]["template"]["metadata"]["annotations"][CONFIG_HASH_KEY]

    assert hash_of(a) != hash_of(b)


def test_qos_policy_config_map_puts_kv_on_a_low_weight_lane(example):
    cm = by_kind(render(example, OWNER), "ConfigMap", "agents-ib-qos")[0]
    text = cm["data"]["opensm-qos.conf"]
    assert "qos_max_vls 4" in text and "qos_high_limit 240" in text
    assert "qos_vlarb_high 0:192,1:192,2:0,3:192" in text
    assert "qos_vlarb_low 0:192,1:192,2:64,3:192" in text


def test_config_map_round_trips_to_the_same_config(example, tmp_path):
    cm = by_kind(render(example, OWNER), "ConfigMap", "agents-config")[0]
    path = tmp_path / "cluster.yaml"
    path.write_text(cm["data"]["cluster.yaml"])
    assert config.load(path) == example


def test_render_cli_prints_what_the_operator_applies(capsys):
    from dualpath.cli import main

    assert (
        main(["render", "-f", str(ROOT / "examples" / "dualpathcluster.yaml"), "--uid", "u"]) == 0
    )
    import yaml

    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    cfg = config.load(ROOT / "examples" / "dualpathcluster.yaml")
    assert docs == render(cfg, {"name": cfg.name, "uid": "u"})


def test_every_rendered_container_command_is_one_the_cli_accepts(example):
    """The operator's pods and the `dualpath` CLI agree: each rendered container's args parse
    (argparse exits on an unknown flag), with Kubernetes' $(VAR) expansion stood in."""
    from dualpath.cli import build_parser

    containers = [
        c
        for obj in render(example, OWNER)
        if obj["kind"] in ("StatefulSet", "Deployment")
        for c in obj["spec"]["template"]["spec"]["containers"]
    ]
    assert {c["args"][0] for c in containers} >= {"worker", "scheduler", "frontend"}
    for c in containers:
        assert c["command"] == ["dualpath"]
        args = [
            a.replace("$(POD_NAME)", "pod-0").replace("$(POD_IP)", "10.0.0.1") for a in c["args"]
        ]
        parsed = build_parser(args).parse_args(args)
        assert parsed._command  # a command was chosen
        if args[0] == "worker":
            assert parsed.role in ("prefill", "decode") and parsed.scheduler


def _with(cfg, **roles):
    spec = cfg.to_resource()["spec"]
    for role, replicas in roles.items():
        spec[role]["replicas"] = replicas
    return config.ClusterConfig(
        name=cfg.name, namespace=cfg.namespace, spec=config.parse_spec(spec)
    )


def _templates(objs):
    import yaml

    return {
        f"{o['kind']}/{o['metadata']['name']}": yaml.safe_dump(o["spec"]["template"])
        for o in objs
        if o["kind"] in ("StatefulSet", "Deployment")
    }


@pytest.mark.parametrize(
    "scale", [{"decode": 12}, {"prefill": 1}, {"prefill": 0, "decode": 0}, {"frontend": 5}]
)
def test_a_replica_change_leaves_every_pod_template_byte_identical(example, scale):
    """A scale (kubectl scale dpp/..., an HPA step) must change replica counts and nothing
    else: no pod rolls, the scheduler (Recreate) is not re-created."""
    scaled = _with(example, **scale)
    assert scaled.config_hash == example.config_hash
    before, after = _templates(render(example, OWNER)), _templates(render(scaled, OWNER))
    assert after == before
    counts = {
        o["metadata"]["name"]: o["spec"]["replicas"]
        for o in render(scaled, OWNER)
        if o["kind"] in ("StatefulSet", "Deployment")
    }
    for role, n in scale.items():
        assert counts[f"agents-{role}"] == n


def test_a_setting_the_processes_read_still_rolls_them(example):
    spec = example.to_resource()["spec"]
    spec["storage"]["readConcurrency"] = 3
    changed = config.ClusterConfig(name="agents", spec=config.parse_spec(spec))
    assert changed.config_hash != example.config_hash


def test_child_kinds_cover_everything_render_produces(example):
    """Pruning lists CHILD_KINDS: a kind missing there would never be pruned."""
    from dualpath_operator.builders import CHILD_KINDS

    for cfg in (example, config.local_default()):
        kinds = {(o["apiVersion"], o["kind"]) for o in render(cfg, OWNER)}
        assert kinds <= set(CHILD_KINDS)
        for obj in render(cfg, OWNER):
            assert obj["metadata"]["labels"]["dualpath.io/cluster"] == cfg.name


@pytest.mark.parametrize("counts", [{"decode": 12}, {"prefill": 0, "decode": 3}])
def test_a_pool_count_changes_its_statefulset_count_and_nothing_else(example, counts):
    """The operator renders with the pools' counts (`render(..., replicas=)`): only the worker
    StatefulSets' `spec.replicas` differ; the ConfigMap, the pools as created and every
    template are the cluster spec's, so a scale writes one field and rolls nothing."""
    import copy

    base, scaled = render(example, OWNER), render(example, OWNER, counts)
    assert len(base) == len(scaled)
    for before, after in zip(base, scaled, strict=True):
        name = after["metadata"]["name"]
        if after["kind"] == "StatefulSet":
            role = name.removeprefix("agents-")
            assert after["spec"]["replicas"] == counts.get(role, example.spec.pool(role).replicas)
            after = copy.deepcopy(after)
            after["spec"]["replicas"] = before["spec"]["replicas"]
        assert after == before, f"{after['kind']}/{name} changed with a pool count"


def test_a_pool_is_applied_without_its_count():
    """Created with the cluster spec's count; every apply after that leaves the count (the
    scale subresource's, written by people and HPAs) to its owner."""
    from dualpath.config import Role
    from dualpath_operator.builders import pool, pool_for_apply

    cfg = config.local_default()
    created = pool(cfg, Role.DECODE, OWNER)
    assert created["spec"]["replicas"] == cfg.spec.decode.replicas
    applied = pool_for_apply(created)
    assert "replicas" not in applied["spec"]
    assert applied["spec"] == {"cluster": cfg.name, "role": "decode"}
    assert applied["metadata"] == created["metadata"]
    assert created["spec"]["replicas"] == cfg.spec.decode.replicas  # the input is not changed
