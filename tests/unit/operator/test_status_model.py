"""The status is a typed model and the CRDs' status schemas are generated from it: what the
operator writes is what the API server's schema accepts."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from crdtools import schema_errors
from dualpath_operator.crd import cluster_crd, pool_crd, status_schema
from dualpath_operator.status import (
    ClusterStatus,
    PoolObjectStatus,
    Problem,
    WorkloadObservation,
    compute_status,
)

NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def _schema(crd: dict) -> dict:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]


@pytest.mark.parametrize(
    ("workloads", "problems", "frontend"),
    [
        ({"prefill": WorkloadObservation("p", 2, 2, 2, 2)}, [], "agents-frontend:8000"),
        ({}, [Problem("InvalidSpec", "spec.decode.replicas: too many")], None),
        ({"decode": WorkloadObservation("d", 3, exists=False)}, [], None),
    ],
)
def test_what_compute_status_writes_fits_the_generated_schema(workloads, problems, frontend):
    status = compute_status(7, "abc", workloads, "sched:50051", None, problems, None, frontend, NOW)
    assert schema_errors(status, _schema(cluster_crd())) == []
    assert ClusterStatus.model_validate(status).model_dump(by_alias=True) == status
    assert [c["type"] for c in status["conditions"]] == ["Ready", "Progressing", "Degraded"]
    assert status["conditions"][0]["lastTransitionTime"] == "2026-01-02T03:04:05Z"


def test_the_crds_status_schemas_are_the_models():
    assert _schema(cluster_crd()) == status_schema(ClusterStatus)
    assert _schema(pool_crd()) == status_schema(PoolObjectStatus)
    props = _schema(cluster_crd())["properties"]
    assert set(props) == {f.alias for f in ClusterStatus.model_fields.values()}
    assert props["conditions"]["x-kubernetes-list-map-keys"] == ["type"]
    assert props["conditions"]["items"]["required"] == ["type", "status"]
    assert "default" not in str(_schema(cluster_crd()))  # the API server fills nothing in


def test_a_bad_condition_status_is_refused_by_the_schema():
    status = compute_status(1, "", {}, "", now=NOW)
    status["conditions"][0]["status"] = "Maybe"
    assert schema_errors(status, _schema(cluster_crd()))
