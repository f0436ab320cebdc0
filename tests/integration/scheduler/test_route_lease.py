"""Routes that are never used (`spec.scheduler.routeLeaseSeconds`), against a real scheduler
process: a route whose call reaches no worker is released within its lease (the cluster view's
in-flight count and a draining node's open routes drop, the counter says so); a route the
decode node claimed (its heartbeat carries the request id) stays open until its Complete."""

import asyncio
import os
import signal
import time
import urllib.request

from dualpath.scheduler.client import NodeAgent, Registration, SchedulerClient
from dualpath.scheduler.policy import NodeLoad
from dualpath_proc import spawn_ready
from schedtools import free_port, wait_nodes
from tiny_configs import tiny_cluster, write_config

LEASE_S = 1.0


def _agent(scheduler: str, node_id: str, role: str, port: int) -> NodeAgent:
    return NodeAgent(
        scheduler,
        Registration(node_id, role, f"127.0.0.1:{port}", snic_bytes_per_s=1e9),
        lambda: NodeLoad(buffer_free_bytes=1 << 40),
    ).start()


async def _open_routes(agent: NodeAgent, want: int, timeout_s: float = 30.0) -> int:
    """Poll `Drain` (a draining worker's question) until it says `want` (or the timeout)."""
    deadline = time.monotonic() + timeout_s
    while (n := await agent.drain()) != want and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    return n


def _released_total(metrics_port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("dualpath_scheduler_routes_released_total "):
                return float(line.split()[1])
    raise AssertionError("no dualpath_scheduler_routes_released_total")


async def test_an_unclaimed_route_is_released_within_its_lease(tmp_path):
    cfg = tiny_cluster("lease", scheduler={"routeLeaseSeconds": LEASE_S})
    port, metrics_port = free_port(), free_port()
    proc, _ = spawn_ready(
        ["scheduler", "-f", str(write_config(cfg, tmp_path / "c.yaml")), "--host", "127.0.0.1"]
        + ["--port", str(port), "--metrics-port", str(metrics_port)]
    )
    address = f"127.0.0.1:{port}"
    prefill = _agent(address, "p0", "prefill", 7501)
    decode = _agent(address, "d0", "decode", 7502)
    client = SchedulerClient(address)
    try:
        await wait_nodes(client, 2)
        routes = [await client.route(prompt_tokens=64, max_new_tokens=4) for _ in range(4)]
        claimed = routes[0].request_id
        decode.claim(claimed)  # as the decode worker does when its Generate arrives
        assert await decode.drain() == 4  # all four open right after routing
        # the three never claimed are released within the lease (plus a liveness period)
        assert await _open_routes(prefill, 1) == 1
        assert await _open_routes(decode, 1) == 1
        assert (await client.cluster_view()).in_flight == 1
        assert _released_total(metrics_port) == 3
        await asyncio.sleep(3 * LEASE_S)  # the claimed one is not released however long
        assert (await client.cluster_view()).in_flight == 1
        await client.complete(claimed)
        assert await _open_routes(decode, 0) == 0
    finally:
        await prefill.stop()
        await decode.stop()
        await client.close()
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)


async def test_sigint_does_not_wait_for_routes_whose_call_never_came(tmp_path):
    """Real scheduler and worker processes under mutual TLS. Four routes to the decode worker
    are never used (no Generate comes); SIGINT to the worker: its drain sees them open, then
    released by their lease, and it drains cleanly, long before its drain bound."""
    import subprocess
    import sys

    from dualpath.tls import LocalCA, TlsCredentials
    from tiny_configs import pools

    drain_s = 120
    cfg = tiny_cluster(
        "lease",
        **pools(1, 16 << 20),
        storage={"path": str(tmp_path / "kv")},
        scheduler={"routeLeaseSeconds": LEASE_S},
        workers={"drainSeconds": drain_s},
    )
    cfg_file = str(write_config(cfg, tmp_path / "c.yaml"))
    ca = LocalCA(tmp_path / "tls", "lease")
    for name, role in (
        ("scheduler", "scheduler"),
        ("prefill-0", "prefill"),
        ("decode-0", "decode"),
    ):
        ca.issue_dir(name, role, name)
    ca.issue_dir("frontend", "frontend", "frontend")
    port = free_port()
    address = f"127.0.0.1:{port}"
    common = ["-f", cfg_file, "--host", "127.0.0.1"]
    sched, _ = spawn_ready(
        ["scheduler", *common, "--port", str(port), "--tls-dir", str(ca.dir / "scheduler")]
    )
    procs, logs = [sched], {}
    client = SchedulerClient(address, token=TlsCredentials(ca.dir / "frontend"))
    try:
        for node, role in (("prefill-0", "prefill"), ("decode-0", "decode")):
            logs[node] = tmp_path / f"{node}.log"
            with open(logs[node], "w") as err:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "dualpath.cli", "worker", "--role", role, *common]
                    + ["--node-id", node, "--scheduler", address, "--storage", str(tmp_path)]
                    + ["--tls-dir", str(ca.dir / node)],
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                    start_new_session=True,
                    env={**os.environ, "OMP_NUM_THREADS": "1"},
                )
            procs.append(proc)
        await wait_nodes(client, 2, timeout_s=120)
        for _ in range(4):
            await client.route(prompt_tokens=64, max_new_tokens=4)
        decode = procs[2]
        decode.send_signal(signal.SIGINT)
        decode.wait(timeout=drain_s)  # within the drain bound, or this raises
        text = logs["decode-0"].read_text()
        assert "4 routed requests open" in text  # it did see them...
        assert "drained in" in text and "drain time" not in text  # ...and did not wait them out
    finally:
        await client.close()
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            p.wait(timeout=30)
