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
