"""End to end over HTTP on a real local cluster (scheduler, workers, frontend processes)."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from dualpath.local.cluster import LocalCluster
from tiny_configs import tiny_local, write_config

pytestmark = pytest.mark.slow


def _cfg(tmp: Path, policy: str):
    return tiny_local(
        **{
            "scheduler.policy": policy,
            "storage.path": str(tmp / f"kv-{policy}"),
            "storage.snicGbps": 8,
        },
    )


def _session(c: httpx.Client, model: str, sid: str) -> list[dict]:
    out = []
    prompt = "You are a careful agent. " * 8
    for turn in range(3):
        r = c.post(
            "/v1/completions",
            json={"model": model, "prompt": prompt, "max_tokens": 6, "session_id": sid},
        )
        assert r.status_code == 200, r.text
        out.append(r.json())
        prompt += out[-1]["choices"][0]["text"] + f" tool result {turn}: ok. " * 4
    return out


def _stream_text(c: httpx.Client, body: dict) -> str:
    with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return "".join(json.loads(x)["choices"][0]["text"] for x in lines[:-1])


def test_cluster_serves_hits_store_rejects_and_answers_match(tmp_path: Path) -> None:
    answers = {}
    for policy in ("prefill-read", "decode-read", "dualpath"):
        cfg = _cfg(tmp_path, policy)
        model = cfg.spec.model.name
        with LocalCluster(cfg, tmp_path / policy, sink=io.StringIO(), grace_s=3) as cl:
            with httpx.Client(base_url=cl.endpoints.frontend, timeout=120) as c:
                turns = _session(c, model, "s1")
                assert turns[0]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
                assert all(
                    t["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 for t in turns[1:]
                )
                if policy != "dualpath":
                    want = "prefill" if policy == "prefill-read" else "decode"
                    assert {t["dualpath"]["read_path"] for t in turns[1:]} == {want}
                answers[policy] = [t["dualpath"]["token_ids"] for t in turns]
                body = {"model": model, "prompt": "stream me", "max_tokens": 5}
                plain = c.post("/v1/completions", json=body).json()["choices"][0]["text"]
                assert _stream_text(c, body) == plain
                if policy == "dualpath":
                    for bad, status in (
                        (b"{", 400),
                        (json.dumps({"model": "x", "prompt": "a"}).encode(), 404),
                        (
                            json.dumps(
                                {"model": model, "prompt": "a", "top_k": "x", "max_tokens": -1}
                            ).encode(),
                            400,
                        ),
                        (json.dumps({"model": model, "prompt": "a" * 70000}).encode(), 400),
                    ):
                        r = c.post(
                            "/v1/completions",
                            content=bad,
                            headers={"content-type": "application/json"},
                        )
                        assert r.status_code == status and "error" in r.json()
                    assert (
                        c.post("/v1/completions", json=body).json()["choices"][0]["text"] == plain
                    )
                    assert c.get("/health").status_code == 200
                    _assert_grpc_needs_a_cluster_certificate(cl)
    assert answers["prefill-read"] == answers["decode-read"] == answers["dualpath"]


def _assert_grpc_needs_a_cluster_certificate(cl: LocalCluster) -> None:
    """`dualpath up` runs mutual TLS (the default mode): each process has its own directory
    of the run's CA, a plaintext caller gets nothing from the scheduler, the tools' `admin`
    certificate reads the cluster view."""
    import asyncio

    import grpc
    from dualpath.scheduler.client import SchedulerClient
    from dualpath.v1 import scheduler_pb2, scheduler_pb2_grpc

    assert cl.token_file is None
    for s in cl.specs:
        assert s.argv[-2:] == ["--tls-dir", str(cl.run_dir / "tls" / s.name)]
    with grpc.insecure_channel(cl.endpoints.scheduler) as ch:
        with pytest.raises(grpc.RpcError) as err:
            scheduler_pb2_grpc.SchedulerStub(ch).Route(
                scheduler_pb2.RouteRequest(prompt_tokens=10), timeout=5
            )
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # no handshake without one

    async def view():
        client = SchedulerClient(cl.endpoints.scheduler, token=cl.client_auth())
        try:
            return await client.cluster_view()
        finally:
            await client.close()

    nodes = {n.node_id for n in asyncio.run(view()).nodes}
    assert nodes == {s.name for s in cl.specs if s.name.startswith(("prefill", "decode"))}


def test_tenants_of_a_keyed_cluster_never_hit_each_others_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """API keys from a Secret-like directory, one entry per tenant (the frontend process reads
    $DUALPATH_API_KEYS_FILE): tenant A's second turn hits its first turn's blocks; tenant B,
    same prompts, gets 0 cached tokens on its first turn, then hits its own copy."""
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / "team-a").write_text("sk-team-a\n")
    (keys / "team-b").write_text("sk-team-b\n")
    monkeypatch.setenv("DUALPATH_API_KEYS_FILE", str(keys))
    cfg = _cfg(tmp_path, "dualpath")
    model = cfg.spec.model.name
    with LocalCluster(cfg, tmp_path / "tenants", sink=io.StringIO(), grace_s=3) as cl:
        with httpx.Client(base_url=cl.endpoints.frontend, timeout=120) as c:
            assert (
                c.post("/v1/completions", json={"model": model, "prompt": "a"}).status_code == 401
            )
            cached = {}
            for tenant in ("team-a", "team-b"):
                c.headers["Authorization"] = f"Bearer sk-{tenant}"
                turns = _session(c, model, "s1")  # the same session id and prompts
                cached[tenant] = [
                    t["usage"]["prompt_tokens_details"]["cached_tokens"] for t in turns
                ]
    assert cached["team-a"][0] == 0 and all(n > 0 for n in cached["team-a"][1:])
    assert cached["team-b"] == cached["team-a"]  # B starts cold: nothing of A's is hit


def _descendants(pid: int) -> set[int]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    out, todo = set(), [pid]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.add(k)
            todo.append(k)
    return out


def test_dualpath_up_stops_cleanly_on_ctrl_c(tmp_path: Path) -> None:
    cfg_file = write_config(_cfg(tmp_path, "dualpath"), tmp_path / "c.yaml")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dualpath.cli",
            "up",
            "-f",
            str(cfg_file),
            "--run-dir",
            str(tmp_path / "run"),
            "--grace",
            "3",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 240
        line = ""
        while time.monotonic() < deadline and "READY up" not in line:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "dualpath up exited before READY"
        assert "READY up" in line
        kids = _descendants(proc.pid)
        assert len(kids) >= 5  # scheduler, prefill-0, decode-0, decode-1, frontend
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        time.sleep(0.5)
        alive = [
            k
            for k in kids
            if Path(f"/proc/{k}").exists()
            and Path(f"/proc/{k}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        ]
        assert not alive
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
