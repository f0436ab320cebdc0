"""`dualpath frontend --fake` as a real process under the supervisor, over real HTTP."""

from __future__ import annotations

import io
import json
import sys

import httpx
from dualpath.config import local_default
from dualpath.local.supervisor import ProcSpec, Supervisor, free_port

MODEL = local_default().spec.model.name


def test_frontend_process_serves_streams_rejects_and_stops() -> None:
    port = free_port()
    sup = Supervisor(grace_s=2.0, sink=io.StringIO())
    with sup:
        sup.start(
            [
                ProcSpec(
                    "frontend",
                    [
                        sys.executable,
                        "-m",
                        "dualpath.cli",
                        "frontend",
                        "--fake",
                        "--host",
                        "127.0.0.1",
                        "--port",
                        str(port),
                    ],
                    health_url=f"http://127.0.0.1:{port}/health",
                    ready_timeout_s=60,
                )
            ]
        )
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
            req = {"model": MODEL, "prompt": "hello world", "max_tokens": 8}
            plain = c.post("/v1/completions", json=req).json()["choices"][0]["text"]
            with c.stream("POST", "/v1/completions", json={**req, "stream": True}) as r:
                chunks = [
                    json.loads(ln[6:])
                    for ln in r.iter_lines()
                    if ln.startswith("data: ") and ln != "data: [DONE]"
                ]
            assert "".join(ch["choices"][0]["text"] for ch in chunks) == plain
            bad = c.post(
                "/v1/completions", content=b"{oops", headers={"content-type": "application/json"}
            )
            assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
            assert c.post("/v1/completions", json={**req, "model": "nope"}).status_code == 404
            assert c.post("/v1/completions", json=req).json()["choices"][0]["text"] == plain
        proc = sup.children[0].proc
    assert proc.poll() is not None
