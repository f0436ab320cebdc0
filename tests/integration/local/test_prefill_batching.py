"""The prefill worker with the intra-node batcher on (`workers.prefillBatchQuotaMs`): concurrent
agents' turns go through the batcher, and every answer is the one the unbatched worker gives."""

from __future__ import annotations

import asyncio
import io
import urllib.request
from pathlib import Path

import httpx
import pytest
from dualpath.local.cluster import LocalCluster
from prometheus_client.parser import text_string_to_metric_families
from tiny_configs import tiny_local

pytestmark = pytest.mark.slow

AGENTS, TURNS = 4, 2


def _cfg(tmp: Path, quota_ms: int):
    return tiny_local(
        **{
            "scheduler.policy": "dualpath",
            "storage.path": str(tmp / f"kv-{quota_ms}"),
            "storage.snicGbps": 8,
            "workers.prefillBatchQuotaMs": quota_ms,
        },
    )


async def _agents(base: str, model: str) -> dict[int, list[list[int]]]:
    async with httpx.AsyncClient(base_url=base, timeout=120) as c:

        async def agent(a: int) -> list[list[int]]:
            prompt, out = f"Agent {a} starts a careful task. " * (4 + a), []
            for turn in range(TURNS):
                r = await c.post(
                    "/v1/completions",
                    json={"model": model, "prompt": prompt, "max_tokens": 5, "session_id": f"a{a}"},
                )
                assert r.status_code == 200, r.text
                out.append(r.json()["dualpath"]["token_ids"])
                prompt += r.json()["choices"][0]["text"] + f" result {turn}: ok. " * (2 + a)
            return out

        return dict(enumerate(await asyncio.gather(*(agent(a) for a in range(AGENTS)))))


def _batches(metrics_url: str) -> tuple[float, float]:
    """(batches formed, requests they held) from the prefill worker's histogram."""
    with urllib.request.urlopen(metrics_url, timeout=10) as r:  # noqa: S310 (local URL)
        text = r.read().decode()
    for fam in text_string_to_metric_families(text):
        if fam.name == "dualpath_worker_prefill_batch_requests":
            got = {s.name.rsplit("_", 1)[1]: s.value for s in fam.samples}
            return got["count"], got["sum"]
    raise AssertionError("the prefill worker exports no dualpath_worker_prefill_batch_requests")


def test_batched_prefill_gives_the_unbatched_answers(tmp_path: Path) -> None:
    answers = {}
    for quota_ms in (0, 5000):
        cfg = _cfg(tmp_path, quota_ms)
        with LocalCluster(cfg, tmp_path / str(quota_ms), sink=io.StringIO(), grace_s=3) as cl:
            answers[quota_ms] = asyncio.run(_agents(cl.endpoints.frontend, cfg.spec.model.name))
            url = cl.endpoints.workers["prefill-0"].replace("/readyz", "/metrics")
            batches, requests = _batches(url)
        if quota_ms:
            assert requests == AGENTS * TURNS  # every prefill went through the batcher
            # how many shared a batch depends on arrival timing here; the unit tests of
            # BatchAdmission pin the batching itself
            assert 1 <= batches <= requests
        else:
            assert batches == requests == 0  # off: no batches
    assert answers[0] == answers[5000]
