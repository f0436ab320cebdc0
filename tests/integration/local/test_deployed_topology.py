"""The topology the operator deploys, without Kubernetes: only the workers reach the store.

In the pods the storage volume is mounted in the prefill and decode workers only; the frontend
and the scheduler run without it and must still serve hits. Here `dualpath up` (LocalCluster)
runs the same processes with the volume as a local directory given to the workers alone, while
`spec.storage.path` (what the pods see) names a directory that exists nowhere on this machine.
A second turn must be served with cached tokens and the same greedy answer as a recompute.
"""

from __future__ import annotations

import io
from pathlib import Path

import httpx
import pytest
from dualpath.local.cluster import LocalCluster
from dualpath.process import uses_storage
from tiny_configs import tiny_local

pytestmark = pytest.mark.slow

BT = 16


def _cfg(pod_storage: Path):
    return tiny_local(
        BT,
        **{"scheduler.policy": "dualpath", "storage.path": str(pod_storage), "storage.snicGbps": 8},
    )


def _complete(c: httpx.Client, model: str, prompt: list[int], session: str) -> dict:
    r = c.post(
        "/v1/completions",
        json={"model": model, "prompt": prompt, "max_tokens": 6, "session_id": session},
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_frontend_and_scheduler_serve_hits_without_the_storage_volume(tmp_path: Path) -> None:
    pod_storage = tmp_path / "mounted-in-worker-pods-only" / "kv"
    cfg = _cfg(pod_storage)
    model = cfg.spec.model.name
    first = [4 + (i * 37) % 250 for i in range(200)]
    volume = tmp_path / "volume"
    with LocalCluster(
        cfg, tmp_path / "run", sink=io.StringIO(), grace_s=3, storage_dir=volume
    ) as cl:
        for spec in cl.specs:
            component = spec.env["DUALPATH_COMPONENT"]
            gets_volume = any(str(volume) in part for part in (*spec.argv, *spec.env.values()))
            assert gets_volume == uses_storage(component), spec.name
        with httpx.Client(base_url=cl.endpoints.frontend, timeout=120) as c:
            turn1 = _complete(c, model, first, "agent")
            assert turn1["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            second = first + turn1["dualpath"]["token_ids"] + [4 + i for i in range(20)]
            turn2 = _complete(c, model, second, "agent")
    assert any(volume.rglob("*")), "the workers stored no blocks in their volume"
    # the hit was found although neither the frontend nor the scheduler can reach the store
    assert turn2["usage"]["prompt_tokens_details"]["cached_tokens"] >= (len(first) // BT) * BT
    assert turn2["dualpath"]["read_path"] in ("prefill", "decode")

    # a recompute of the same turn: a fresh cluster, an empty volume
    with LocalCluster(
        cfg, tmp_path / "run2", sink=io.StringIO(), grace_s=3, storage_dir=tmp_path / "empty"
    ) as cl:
        with httpx.Client(base_url=cl.endpoints.frontend, timeout=120) as c:
            recompute = _complete(c, model, second, "fresh")
    assert recompute["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert turn2["dualpath"]["token_ids"] == recompute["dualpath"]["token_ids"]
    # nothing ever created the pods' storage path on this machine
    assert not pod_storage.parent.exists()
