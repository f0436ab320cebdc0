"""Metrics and health endpoints every process serves.

A tiny threaded HTTP server so processes without an HTTP framework (workers, scheduler,
operator) expose the same endpoints as the FastAPI frontend. It is owned by the caller:
`stop()` shuts it down.

- `/metrics`: Prometheus text.
- `/livez` (and `/healthz`): liveness, the `live` callable: is the process alive and not
  wedged. A worker answers 503 while it loads its model (its pod's startupProbe gives that
  `spec.workers.startupSeconds`), and 200 while it serves or drains, as long as its event loop
  answers.
- `/readyz` (and `/health`): readiness, the `health` callable: may it take requests now.

A process whose work runs in child processes (the worker on engine vllm: vLLM's server, engine
core and worker, where the DualPath connector reads and writes KV) serves their metrics too:
`WithChildMetrics` adds what the children write as prometheus_client multiprocess files.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

Check = Callable[[], tuple[bool, str]]


def loop_answers(loop: asyncio.AbstractEventLoop, timeout_s: float = 2.0) -> bool:
    """True if `loop` runs a callback within `timeout_s` (call from another thread)."""
    answered = threading.Event()
    try:
        loop.call_soon_threadsafe(answered.set)
    except RuntimeError:  # closed
        return False
    return answered.wait(timeout_s)


def loop_liveness(loop: asyncio.AbstractEventLoop, timeout_s: float = 2.0) -> Check:
    """A liveness check: the process's event loop answers within `timeout_s`."""

    def live() -> tuple[bool, str]:
        if loop_answers(loop, timeout_s):
            return True, "alive"
        return False, f"event loop did not answer within {timeout_s:.0f}s"

    return live


class WithChildMetrics:
    """This process's registry plus the metrics its child processes write into `path` (they
    run with PROMETHEUS_MULTIPROC_DIR=path): one family per name, samples of equal name and
    labels summed, so `/metrics` shows the node's totals (a family both sides register, such
    as `dualpath_kv_read_bytes`, is counted once, not exposed twice)."""

    def __init__(self, path: str, registry: CollectorRegistry = REGISTRY) -> None:
        from prometheus_client.multiprocess import MultiProcessCollector

        self._registry = registry
        self._children = MultiProcessCollector(None, path=path)  # registered nowhere

    def collect(self):  # noqa: ANN201 (prometheus_client's Collector API)
        from prometheus_client import Metric

        families: dict[str, Metric] = {}
        values: dict[str, dict[tuple, float]] = {}
        samples: dict[str, dict[tuple, object]] = {}
        for fam in [*self._registry.collect(), *self._children.collect()]:
            if fam.name not in families:
                families[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                values[fam.name], samples[fam.name] = {}, {}
            for s in fam.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                if s.name.endswith("_created"):  # a timestamp: the first one stands
                    samples[fam.name].setdefault(key, s)
                    continue
                values[fam.name][key] = values[fam.name].get(key, 0.0) + s.value
                samples[fam.name].setdefault(key, s)
        for name, fam in families.items():
            for key, s in samples[name].items():
                value = values[name].get(key, s.value)
                fam.add_sample(s.name, s.labels, value, s.timestamp, s.exemplar)
            yield fam


class ObservabilityServer:
    def __init__(
        self,
        port: int,
        host: str = "0.0.0.0",
        health: Check | None = None,
        registry: CollectorRegistry | WithChildMetrics = REGISTRY,
        live: Check | None = None,
    ) -> None:
        health_fn = health or (lambda: (True, "ok"))
        live_fn = live or (lambda: (True, "alive"))
        reg = registry

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server API)
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    body, ctype, code = generate_latest(reg), CONTENT_TYPE_LATEST, 200
                elif path in ("/health", "/readyz", "/livez", "/healthz"):
                    ok, msg = (live_fn if path in ("/livez", "/healthz") else health_fn)()
                    body, ctype, code = msg.encode(), "text/plain", 200 if ok else 503
                else:
                    body, ctype, code = b"not found", "text/plain", 404
                try:
                    self.send_response(code)
                    self.send_header("Content-Type", ctype)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the prober gave up first (its timeout): nothing to tell anyone

            def log_message(self, *args: object) -> None:  # scrapes are not events
                return

        self._httpd = ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="observability", daemon=True
        )

    def start(self) -> ObservabilityServer:
        self._thread.start()
        log.info("metrics and health on :%d (/metrics, /livez, /readyz)", self.port)
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)
