"""The generated CRDs: current, valid, and admitting exactly the specs that can work."""

from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from celcheck import walk
from crdtools import admit
from dualpath import config
from dualpath_operator import crd

ROOT = Path(__file__).resolve().parents[3]


def test_crds_on_disk_and_in_the_chart_are_current():
    for name, text in crd.crd_files().items():
        for d in (crd.CRD_DIR, crd.CHART_CRD_DIR):
            assert (d / name).read_text() == text, f"{d / name} is stale: run make crds"


@pytest.mark.parametrize("version", ["1.28.0", "1.33.0"])
def test_crds_are_valid_kubernetes_objects(version):
    for text in crd.crd_files().values():
        kubernetes_validate.validate(yaml.safe_load(text.split("\n", 1)[1]), version, strict=True)


@pytest.mark.parametrize("make", [crd.cluster_crd, crd.pool_crd])
def test_crd_schemas_are_structural(make):
    # the API server refuses $ref; every node has a type, except int-or-string (whose anyOf
    # may only list integer and string) and schemaless preserve-unknown nodes
    text = yaml.safe_dump(make())
    assert "$ref" not in text and "$defs" not in text and "propertyNames" not in text
    for path, node in walk(make()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]):
        if node.get("x-kubernetes-int-or-string"):
            assert "type" not in node and node.get("anyOf", []) in (
                [],
                [{"type": "integer"}, {"type": "string"}],
            ), path
        else:
            assert "anyOf" not in node and "type" in node, path


@pytest.mark.parametrize("make", [crd.cluster_crd, crd.pool_crd])
def test_every_field_is_described_for_kubectl_explain(make):
    schema = make()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    fields = [(p, n) for p, n in walk(schema) if p and not p.endswith("[*]")]
    assert len(fields) >= 8
    undescribed = [p for p, n in fields if not n.get("description", "").strip()]
    assert undescribed == []


def test_a_llama3_rope_scaling_is_admitted_and_read():
    model = {"preset": "tiny", "ropeTheta": 500000.0, "ropeScaling": {"factor": 8.0}}
    cr = {
        "apiVersion": "dualpath.io/v1alpha1",
        "kind": "DualPathCluster",
        "metadata": {"name": "x"},
        "spec": {"model": model},
    }
    assert admit(cr, crd.cluster_crd()) == []
    scaling = config.from_resource(cr).spec.model.rope_scaling
    assert scaling is not None and scaling.factor == 8.0 and scaling.high_freq_factor == 4.0


def test_pool_crd_has_the_scale_subresource():
    sub = crd.pool_crd()["spec"]["versions"][0]["subresources"]
    assert sub["scale"]["specReplicasPath"] == ".spec.replicas"
    assert sub["scale"]["labelSelectorPath"] == ".status.selector"


@pytest.mark.parametrize(
    "path", ["examples/dualpathcluster.yaml", "workers/dualpath/data/local.yaml"]
)
def test_examples_are_accepted(path):
    cr = yaml.safe_load((ROOT / path).read_text())
    assert admit(cr, crd.cluster_crd()) == []
    config.from_resource(cr)  # and the operator's own model agrees


GOOD = [
    {"prefill": {"resources": {"requests": {"cpu": 4, "memory": "16Gi"}}}},
    {"decode": {"resources": {"limits": {"cpu": "500m", "nvidia.com/gpu": 1, "memory": "1e9"}}}},
    {"storage": {"volume": {"persistentVolumeClaim": {"claimName": "kv", "readOnly": False}}}},
    {"storage": {"volume": {"hostPath": {"path": "/mnt/3fs", "type": "Directory"}}}},
    {"frontend": {"maxNewTokens": 4096, "maxContextTokens": 4096, "port": 8080}},
    {
        "model": {"preset": None, "layers": 2, "hiddenSize": 16, "heads": 2, "kvHeads": 1}
        | {"headDim": 8, "vocabSize": 32}
    },
]


def _cr(spec, name="x"):
    cr = {
        "apiVersion": "dualpath.io/v1alpha1",
        "kind": "DualPathCluster",
        "metadata": {"name": name},
    }
    if spec is not None:
        cr["spec"] = spec
    return cr


@pytest.mark.parametrize("spec", GOOD)
def test_good_specs_pass_the_api_server_and_the_model(spec):
    assert admit(_cr(spec), crd.cluster_crd()) == []
    config.from_resource(_cr(spec))


@pytest.mark.parametrize("name", ["a", "agents", "a-1", "x" * config.MAX_NAME_LENGTH])
def test_names_whose_children_fit_are_admitted(name):
    assert admit(_cr({}, name), crd.cluster_crd()) == []
    assert config.from_resource(_cr({}, name)).name == name


BAD = [
    ({"prefill": {"replicas": -1}}, "replicas"),
    ({"prefill": {"replicas": 2}, "decode": {"replicas": 0}}, "decode.replicas must be at least 1"),
    ({"model": {"preset": "gpt-9"}}, "model.preset must be one of"),
    (
        {"model": {"preset": None, "heads": 4, "kvHeads": 3, "layers": 2, "headDim": 8}},
        "multiple of model.kvHeads",
    ),
    ({"network": {"qos": {"kv": {"serviceLevel": 0, "trafficClass": 0}}}}, "must differ"),
    ({"network": {"rdma": {"resourceName": "rdma", "count": 1}}}, "device-plugin resource"),
    (
        {"scheduler": {"heartbeatIntervalMs": 500, "nodeTimeoutMs": 600}},
        "nodeTimeoutMs must exceed",
    ),
    ({"scheduler": {"policy": "fastest"}}, "policy"),
    ({"frontend": {"serviceType": "Ingress"}}, "serviceType"),
]


# (metadata.name, spec or None for none, what the API server says, what the model says)
BAD_CRS = [
    ("x" * (config.MAX_NAME_LENGTH + 1), {}, "metadata.name must be", "metadata.name"),
    ("a.b", {}, "DNS-1035", "metadata.name"),
    ("1abc", {}, "DNS-1035", "metadata.name"),
    ("x", None, "spec", "spec: required"),
    ("x", {"prefill": {"resources": {"requests": {"cpu": "lots"}}}}, "cpu", "spec.prefill"),
    ("x", {"prefill": {"resources": {"requests": {"cpu": 0.5}}}}, "cpu", "quantity"),
    ("x", {"decode": {"resources": {"requestz": {"cpu": "1"}}}}, "requestz", "requestz"),
    ("x", {"storage": {"path": "kv"}}, "storage.path must be an absolute", "spec.storage.path"),
    ("x", {"storage": {"volume": {"nfz": {"path": "/x"}}}}, "nfz", "spec.storage.volume"),
    (
        "x",
        {"storage": {"volume": {"emptyDir": {}, "hostPath": {"path": "/x"}}}},
        "volume",
        "exactly one volume source",
    ),
    ("x", {"storage": {"volume": {"persistentVolumeClaim": {}}}}, "claimName", "claimName"),
    ("x", {"storage": {"volume": {}}}, "volume", "exactly one volume source"),
    ("x", {"storage": {"volume": {"nfs": {"server": "a", "path": 5}}}}, "path", "nfs.path"),
    ("x", {"model": {"ropeTheta": 0}}, "ropeTheta", "spec.model.ropeTheta"),
    ("x", {"model": {"ropeTheta": -1.5}}, "ropeTheta", "spec.model.ropeTheta"),
    ("x", {"model": {"image": ""}}, "image", "spec.model.image"),
    ("x", {"scheduler": {"port": 9090}}, "scheduler.port must not be", "spec.scheduler.port"),
    ("x", {"frontend": {"port": 9090}}, "frontend.port must not be", "spec.frontend.port"),
    (
        "x",
        {"frontend": {"maxNewTokens": 2048, "maxContextTokens": 1024}},
        "maxNewTokens must be at most",
        "spec.frontend",
    ),
]


@pytest.mark.parametrize("spec, needle", BAD)
def test_bad_specs_are_refused_with_a_readable_message(spec, needle):
    errors = admit(_cr(spec), crd.cluster_crd())
    assert errors and any(needle in e for e in errors), errors
    with pytest.raises(config.ConfigError):  # and the model refuses it too
        config.from_resource(_cr(spec))


@pytest.mark.parametrize("name, spec, api_needle, model_needle", BAD_CRS)
def test_bad_crs_are_refused_by_the_api_server_and_by_the_model(
    name, spec, api_needle, model_needle
):
    errors = admit(_cr(spec, name), crd.cluster_crd())
    assert errors and any(api_needle in e for e in errors), errors
    with pytest.raises(config.ConfigError) as err:  # `dualpath render` refuses it too
        config.from_resource(_cr(spec, name))
    assert model_needle in str(err.value)


def test_no_two_clusters_share_a_child():
    # no child suffix ends with "-" + another one, and names are never truncated: `<a>-<s>` is
    # unique per (cluster, suffix)
    from dualpath_operator.builders import render

    names = {}
    for cluster in ("a", "a-decode", "a-ib", "x" * config.MAX_NAME_LENGTH):
        cfg = config.from_resource(_cr({"frontend": {"replicas": 1}}, cluster))
        for obj in render(cfg, {"name": cluster, "uid": "u"}):
            key = (obj["kind"], obj["metadata"]["name"])
            assert key not in names, f"{key} of {cluster} is also {names[key]}'s"
            names[key] = cluster
            assert len(obj["metadata"]["name"]) <= 63
            assert obj["metadata"]["name"].startswith(cluster + "-")
            if obj["kind"] == "StatefulSet":  # pods get the controller-revision-hash label
                assert len(obj["metadata"]["name"]) <= 52
