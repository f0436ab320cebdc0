"""Liveness and readiness are separate endpoints: a loading or draining worker is alive but not
ready, and a wedged event loop fails liveness."""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.error
import urllib.request

from dualpath.observability import ObservabilityServer, loop_liveness
from prometheus_client import CollectorRegistry


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_livez_and_readyz_answer_from_their_own_checks():
    ready = {"ok": False}
    obs = ObservabilityServer(
        0,
        host="127.0.0.1",
        health=lambda: (ready["ok"], "ready" if ready["ok"] else "loading"),
        live=lambda: (True, "alive"),
        registry=CollectorRegistry(),
    ).start()
    try:
        assert _get(obs.port, "/livez") == (200, "alive")
        assert _get(obs.port, "/readyz") == (503, "loading")
        assert _get(obs.port, "/health") == (503, "loading")
        ready["ok"] = True
        assert _get(obs.port, "/readyz") == (200, "ready")
        assert _get(obs.port, "/nope")[0] == 404
    finally:
        obs.stop()


def test_loop_liveness_fails_while_the_event_loop_is_blocked():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    live = loop_liveness(loop, timeout_s=0.3)
    try:
        assert live()[0]
        loop.call_soon_threadsafe(time.sleep, 1.0)  # a blocking call on the loop
        time.sleep(0.05)
        ok, msg = live()
        assert not ok and "did not answer" in msg
        time.sleep(1.0)
        assert live()[0]
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


_CHILD = """
from prometheus_client import Counter, Histogram
reads = Counter("demo_read_bytes_total", "bytes read", ["backend"])
reads.labels(backend="preadv").inc(1000)
Counter("demo_child_only_total", "only the child has it").inc(3)
Histogram("demo_seconds", "a histogram", buckets=(1.0,)).observe(0.5)
"""


def test_child_process_metrics_are_served_with_the_process_own_summed_once(tmp_path):
    """vLLM's processes write multiprocess files; the worker's /metrics adds them to its own
    registry: a family both register is one family, its samples summed (the node's total)."""
    import os
    import subprocess
    import sys

    from dualpath.observability import WithChildMetrics
    from prometheus_client import Counter
    from prometheus_client.parser import text_string_to_metric_families

    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    for _ in range(2):  # two child processes (vLLM's engine core and worker)
        subprocess.run([sys.executable, "-c", _CHILD], env=env, check=True, timeout=60)
    own = CollectorRegistry()
    Counter("demo_read_bytes_total", "bytes read", ["backend"], registry=own).labels(
        backend="preadv"
    ).inc(24)
    obs = ObservabilityServer(
        0, host="127.0.0.1", registry=WithChildMetrics(str(tmp_path), own)
    ).start()
    try:
        code, text = _get(obs.port, "/metrics")
    finally:
        obs.stop()
    assert code == 200
    assert text.count("# TYPE demo_read_bytes_total counter") == 1, text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    totals = {s.name: s.value for s in fams["demo_read_bytes"].samples}
    assert totals["demo_read_bytes_total"] == 2 * 1000 + 24
    assert [s.value for s in fams["demo_child_only"].samples] == [6]
    hist = {(s.name, s.labels.get("le")): s.value for s in fams["demo_seconds"].samples}
    assert hist[("demo_seconds_bucket", "1.0")] == 2
    assert hist[("demo_seconds_count", None)] == 2
