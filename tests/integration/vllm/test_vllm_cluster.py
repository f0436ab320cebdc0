"""`dualpath up --engine vllm` end to end: a real vLLM (CPU) per worker with the DualPath
connector, behind the unchanged scheduler and frontend (docs/vllm.md).

One cluster for the module (vLLM starts in 30-80 s): 1 prefill + 1 decode vLLM, the tiny64
model (written as a checkpoint by the cluster), the round-robin policy so consecutive turns
alternate path P and path D. Every answer is greedy and compared with vLLM's own recompute of
the same prompt (a `cache_salt` no block was written under: no hit, the connector loads
nothing). The prompt's KV moves between the two vLLM instances over NIXL (docs/vllm.md): the
connector's counters, which live in vLLM's worker process, are read from the worker's
`/metrics` (which merges its vLLM's processes' metrics).
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import re
import signal
import time
import uuid
from pathlib import Path

import httpx
import pytest
from dualpath.local.cluster import LocalCluster
from dualpath.local.cluster import with_overrides as _with
from tiny_configs import tiny_local

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vLLM is not installed (scripts/install-vllm.sh; make venv installs it)",
    ),
]

MODEL = "dualpath-tiny64"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("vllm")
    cfg = _with(
        tiny_local(),
        **{
            "model": {"preset": "tiny64", "name": MODEL, "blockTokens": 64},
            "prefill.replicas": 1,
            "decode.replicas": 1,
            "storage.path": str(tmp / "kv"),
            "storage.capacityBytes": 1 << 30,
            "scheduler.policy": "round-robin",
            "workers.engine": "vllm",
        },
    )
    log = io.StringIO()
    with LocalCluster(cfg, tmp / "run", sink=log, grace_s=10) as cl:
        yield cl, log


def _turn(c: httpx.Client, messages: list[dict], salt: str = "") -> dict:
    body = {"model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0}
    if salt:
        body["cache_salt"] = salt
    r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _ids(answer: dict) -> list[int]:
    return answer["dualpath"]["token_ids"]


def _cached(answer: dict) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def _conversation(c: httpx.Client, sid: str, turns: int) -> list[tuple[dict, dict]]:
    """(answer, recompute of the same prompt) per turn of one agent."""
    messages = [{"role": "user", "content": f"agent {sid}: plan the task. " * 20}]
    out = []
    for t in range(turns):
        # round-robin alternates the read path route by route: the recompute goes first on
        # odd turns, so the agent's own turns alternate path P and path D
        ref = _turn(c, messages, salt=f"recompute-{sid}-{t}") if t % 2 else None
        answer = _turn(c, messages)
        ref = ref or _turn(c, messages, salt=f"recompute-{sid}-{t}")
        out.append((answer, ref))
        messages += [
            {"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
            {"role": "user", "content": f"tool result {t}: ok. " * 12},
        ]
    return out


def _metric(url: str, name: str) -> dict[str, float]:
    text = httpx.get(url.replace("/readyz", "/metrics"), timeout=10).text
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) :].rsplit(" ", 1)
            out[labels] = float(value)
    return out


def _vllm_url(cl, node: str) -> str:
    """The base URL of the vLLM child of worker `node` (its `--port`, from /proc)."""
    pid = next(c for c in cl.supervisor.children if c.spec.name == node).proc.pid
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        if b"--port" in argv:
            return f"http://127.0.0.1:{argv[argv.index(b'--port') + 1].decode()}"
    raise AssertionError(f"{node} runs no vLLM child")


def _counters(url: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Samples of counter `name` on a worker's /metrics (`url`: its readiness URL), by their
    sorted labels."""
    out: dict[tuple[tuple[str, str], ...], float] = {}
    for line in httpx.get(url.replace("/readyz", "/metrics"), timeout=10).text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) :].rsplit(" ", 1)
            key = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', labels)))
            out[key] = out.get(key, 0.0) + float(value)
    return out


def _count(samples: dict, **labels: str) -> float:
    return sum(v for k, v in samples.items() if set(labels.items()) <= set(k))


def test_turns_hit_the_store_on_both_paths_with_recompute_answers(cluster) -> None:
    cl, _ = cluster
    with httpx.Client(base_url=cl.endpoints.frontend, timeout=300) as c:
        turns = _conversation(c, "a", 4)
    first, first_ref = turns[0]
    assert _cached(first) == 0 and _cached(first_ref) == 0
    for answer, ref in turns[1:]:
        assert _cached(answer) > 0, answer["usage"]  # loaded from the DualPath store
        assert _cached(ref) == 0  # another salt: nothing to load
        assert _ids(answer) == _ids(ref)  # the same greedy tokens as vLLM's recompute
    paths = {a["dualpath"]["read_path"] for a, _ in turns[1:]}
    assert paths == {"prefill", "decode"}, paths
    turned = _metric(cl.endpoints.workers["decode-0"], "dualpath_vllm_turns_total")
    assert turned.get('{path="prefill"}', 0) > 0 and turned.get('{path="decode"}', 0) > 0
    # the KV moved between the instances over NIXL on both paths: path D's hit streamed from
    # the decode's cache to the prefill, and the prefill's blocks written into the decode's
    prefill, decode = cl.endpoints.workers["prefill-0"], cl.endpoints.workers["decode-0"]
    moved = _counters(prefill, "dualpath_vllm_transfer_bytes_total")
    assert _count(moved, path="prefill", direction="prefill_to_decode") > 0, moved
    assert _count(moved, path="decode", direction="prefill_to_decode") > 0, moved
    assert _count(moved, path="decode", direction="decode_to_prefill") > 0, moved
    received = _counters(decode, "dualpath_vllm_transfers_received_total")
    assert _count(received, path="prefill") > 0 and _count(received, path="decode") > 0
    # no second read: the decode read only path D's hits from the store, never path P's
    loads = _counters(decode, "dualpath_vllm_loads_total")
    assert _count(loads, path="prefill") == 0 and _count(loads, path="decode") > 0, loads
    assert _count(_counters(prefill, "dualpath_vllm_loads_total"), path="prefill") > 0
    failed = _counters(decode, "dualpath_vllm_transfer_failures_total")
    failed.update(_counters(prefill, "dualpath_vllm_transfer_failures_total"))
    assert sum(failed.values()) == 0, failed


def test_a_transfer_that_never_comes_ends_in_a_recompute_with_the_same_answer(cluster) -> None:
    """A receiver whose prefill never sends (here: never called) waits until its deadline,
    then vLLM recomputes the prompt: the same greedy tokens, counted as a failed receive."""
    cl, _ = cluster
    vllm, decode = _vllm_url(cl, "decode-0"), cl.endpoints.workers["decode-0"]
    prompt = [100 + i % 300 for i in range(300)]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "return_token_ids": True}  # fmt: skip
    before = _count(_counters(decode, "dualpath_vllm_transfer_failures_total"), stage="receive")
    with httpx.Client(timeout=300) as c:
        ref = c.post(vllm + "/v1/completions", json=body)
        route = {"dualpath": {"receive": True, "xfer_id": f"never/{uuid.uuid4().hex}",
                              "deadline_unix": time.time() + 3, "request_id": "never"}}  # fmt: skip
        got = c.post(vllm + "/v1/completions", json={**body, "kv_transfer_params": route})
    assert ref.status_code == 200 and got.status_code == 200, got.text
    tokens = [json.loads(r.text)["choices"][0]["token_ids"] for r in (ref, got)]
    assert tokens[0] == tokens[1] and tokens[0]
    after = _count(_counters(decode, "dualpath_vllm_transfer_failures_total"), stage="receive")
    assert after == before + 1


def test_every_grpc_channel_is_mutual_tls_and_none_is_refused(cluster) -> None:
    """The default mode: each worker serves mTLS, the decode node dials the prefill node's,
    and each connector inside vLLM publishes its KV events to the scheduler as its node."""
    cl, log = cluster
    assert cl.cfg.spec.security.tls.mode == "mtls"
    text = log.getvalue()
    for node in ("prefill-0", "decode-0"):
        assert f"vLLM connector {node}: gRPC over mutual TLS" in text, text[-3000:]
    assert "refused" not in text, [ln for ln in text.splitlines() if "refused" in ln]
    assert "UNAUTHENTICATED" not in text and "PERMISSION_DENIED" not in text


def test_corrupt_blocks_give_a_recompute_not_a_wrong_answer(cluster) -> None:
    cl, _ = cluster
    with httpx.Client(base_url=cl.endpoints.frontend, timeout=300) as c:
        messages = [{"role": "user", "content": "corrupt me, then answer. " * 24}]
        _turn(c, messages)  # writes the prompt's blocks
        blocks = [p for p in (cl.storage / "blocks").rglob("*") if p.is_file()]
        assert blocks
        for p in blocks:  # 64 bytes of garbage in the middle of every block's KV
            with open(p, "r+b") as f:
                f.seek(p.stat().st_size // 2)
                f.write(os.urandom(64))
        again = _turn(c, messages)
        ref = _turn(c, messages, salt="recompute-corrupt")
    assert _ids(again) == _ids(ref)


def test_a_killed_vllm_decode_instance_restarts_and_the_cluster_serves(cluster) -> None:
    cl, log = cluster
    sup = cl.supervisor
    child = next(c for c in sup.children if c.spec.name == "decode-0")
    worker_pid = child.proc.pid
    children = Path(f"/proc/{worker_pid}/task/{worker_pid}/children").read_text().split()
    assert children, "the decode worker runs its vLLM as a child"
    os.kill(int(children[0]), signal.SIGKILL)  # the vLLM server, not the DualPath worker
    ready = cl.endpoints.workers["decode-0"]
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        assert sup.heal() == []
        if child.proc.pid != worker_pid and _ready(ready):
            break
        time.sleep(1.0)
    else:
        pytest.fail("decode-0 not restarted and ready within 600 s:\n" + log.getvalue()[-3000:])
    assert sup.restarts.get("decode-0") == 1
    with httpx.Client(base_url=cl.endpoints.frontend, timeout=300) as c:
        deadline = time.monotonic() + 120  # the scheduler learns of the new incarnation
        while True:
            r = c.post(
                "/v1/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": "still here?"}],
                      "max_tokens": 4, "temperature": 0},
            )  # fmt: skip
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(1.0)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


def _ready(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
