"""The generated CRDs: current, valid, and admitting exactly the specs that can work."""

from pathlib import Path

import kubernetes_validate
import pytest
import yaml
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


def test_crd_schemas_are_structural():
    # the API server refuses $ref in a CRD schema; an optional nested model must be inlined
    for text in crd.crd_files().values():
        assert "$ref" not in text and "anyOf" not in text and "$defs" not in text


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


@pytest.mark.parametrize("spec, needle", BAD)
def test_bad_specs_are_refused_with_a_readable_message(spec, needle):
    cr = {
        "apiVersion": "dualpath.io/v1alpha1",
        "kind": "DualPathCluster",
        "metadata": {"name": "x"},
        "spec": spec,
    }
    errors = admit(cr, crd.cluster_crd())
    assert errors and any(needle in e for e in errors), errors
