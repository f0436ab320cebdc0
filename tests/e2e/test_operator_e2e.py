"""Opt-in: the operator against a real API server (`make e2e KUBECONFIG=...`).

Applies the CRDs, runs `dualpath operator` against the cluster, applies a DualPathCluster and
checks: children appear, status is Ready or Progressing, `kubectl scale` resizes the pool's
StatefulSet, deleting the CR garbage-collects every child. Images need not be pullable.
"""

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not os.environ.get("KUBECONFIG") or os.environ.get("DUALPATH_E2E") != "1",
        reason="needs a real cluster: make e2e KUBECONFIG=...",
    ),
]
KUBECTL = os.environ.get("KUBECTL", str(ROOT / ".tools" / "bin" / "kubectl"))


def kubectl(*args, check=True, input=None):
    return subprocess.run(
        [KUBECTL, *args], check=check, capture_output=True, text=True, input=input, timeout=120
    )


def wait_for(what, fn, timeout_s=180):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def namespace():
    ns = f"dualpath-e2e-{uuid.uuid4().hex[:6]}"
    kubectl("apply", "--server-side", "-f", str(ROOT / "crds"))
    kubectl(
        "wait",
        "--for=condition=Established",
        "crd/dualpathclusters.dualpath.io",
        "crd/dualpathpools.dualpath.io",
        "--timeout=60s",
    )
    kubectl("create", "namespace", ns)
    op = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dualpath.cli",
            "operator",
            "--namespace",
            ns,
            "--liveness",
            "",
            "--metrics-port",
            "0",
        ]
    )
    yield ns
    op.terminate()
    op.wait(timeout=30)
    kubectl("delete", "namespace", ns, "--wait=false", check=False)


def get(kind, name, ns):
    res = kubectl("get", kind, name, "-n", ns, "-o", "json", check=False)
    return json.loads(res.stdout) if res.returncode == 0 else None


def test_cluster_lifecycle(namespace):
    cr = yaml.safe_load((ROOT / "examples" / "dualpathcluster.yaml").read_text())
    cr["metadata"]["namespace"] = namespace
    cr["spec"]["prefill"].update(
        replicas=1, gpusPerPod=0, resources={}, nodeSelector={}, tolerations=[]
    )
    cr["spec"]["decode"].update(replicas=1, gpusPerPod=0, nodeSelector={}, tolerations=[])
    cr["spec"]["network"]["rdma"]["count"] = 0
    cr["spec"]["storage"].pop("volume")
    kubectl("apply", "-f", "-", input=yaml.safe_dump(cr))
    name = cr["metadata"]["name"]

    wait_for(
        "children",
        lambda: (
            get("statefulset", f"{name}-decode", namespace)
            and get("deployment", f"{name}-scheduler", namespace)
            and get("dualpathpool", f"{name}-prefill", namespace)
        ),
    )
    status = wait_for(
        "status",
        lambda: (get("dualpathcluster", name, namespace) or {}).get("status", {}).get("conditions"),
    )
    ready = next(c for c in status if c["type"] == "Ready")
    progressing = next(c for c in status if c["type"] == "Progressing")
    assert ready["status"] == "True" or progressing["status"] == "True"

    kubectl("scale", f"dualpathpool/{name}-decode", "-n", namespace, "--replicas=2")
    wait_for(
        "scaled statefulset",
        lambda: (
            (get("statefulset", f"{name}-decode", namespace) or {}).get("spec", {}).get("replicas")
            == 2
        ),
    )
    assert get("dualpathcluster", name, namespace)["spec"]["decode"]["replicas"] == 2

    kubectl("delete", "dualpathcluster", name, "-n", namespace, "--wait=true")
    wait_for(
        "garbage collection",
        lambda: all(
            get(kind, f"{name}-{suffix}", namespace) is None
            for kind, suffix in [
                ("statefulset", "decode"),
                ("statefulset", "prefill"),
                ("deployment", "scheduler"),
                ("configmap", "config"),
                ("dualpathpool", "decode"),
            ]
        ),
    )
