"""Local processes listen on loopback only (issue 37): a scheduler started as `dualpath up`
starts it (`--host 127.0.0.1`) binds its gRPC and its /metrics and probe port there, not on
0.0.0.0; a local cluster's workers get UCX limited to loopback and shared memory."""

from __future__ import annotations

import os
import signal

from dualpath.local.supervisor import tcp_sockets
from dualpath_proc import spawn_ready


def test_a_local_scheduler_listens_on_loopback_only():
    proc, line = spawn_ready(
        ["scheduler", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0"]
    )
    try:
        listening = [addr for state, addr in tcp_sockets(proc.pid) if state == "LISTEN"]
        assert len(listening) >= 2, (line, listening)  # gRPC and /metrics
        assert all(a.startswith("127.0.0.1:") for a in listening), listening
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)


def test_local_workers_get_ucx_on_loopback_unless_told_otherwise(tmp_path, monkeypatch):
    from dualpath import config
    from dualpath.local.cluster import process_specs

    cfg = config.local_default()
    specs, _ = process_specs(tmp_path / "c.yaml", cfg, tmp_path / "kv")
    workers = [s for s in specs if s.name.startswith(("prefill", "decode"))]
    assert workers and all(s.env["UCX_NET_DEVICES"] == "lo" for s in workers)
    assert all(s.env["UCX_TLS"] == "tcp,sm,self" for s in workers)
    assert all(
        "--host" in s.argv and s.argv[s.argv.index("--host") + 1] == "127.0.0.1" for s in specs
    )
    monkeypatch.setenv("UCX_NET_DEVICES", "eth1")  # the environment of `dualpath up` wins
    specs, _ = process_specs(tmp_path / "c.yaml", cfg, tmp_path / "kv")
    assert {s.env["UCX_NET_DEVICES"] for s in specs if "UCX_NET_DEVICES" in s.env} == {"eth1"}
