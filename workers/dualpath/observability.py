"""Metrics and health endpoints every process serves (`/metrics`, `/health`).

A tiny threaded HTTP server so processes without an HTTP framework (workers, scheduler,
operator) expose the same two endpoints as the FastAPI frontend. It is owned by the caller:
`stop()` shuts it down.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)


class ObservabilityServer:
    def __init__(
        self,
        port: int,
        host: str = "0.0.0.0",
        health: Callable[[], tuple[bool, str]] | None = None,
        registry: CollectorRegistry = REGISTRY,
    ) -> None:
        health_fn = health or (lambda: (True, "ok"))
        reg = registry

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server API)
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    body, ctype, code = generate_latest(reg), CONTENT_TYPE_LATEST, 200
                elif path in ("/health", "/healthz", "/readyz"):
                    ok, msg = health_fn()
                    body, ctype, code = msg.encode(), "text/plain", 200 if ok else 503
                else:
                    body, ctype, code = b"not found", "text/plain", 404
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

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
        log.info("metrics and health on :%d (/metrics, /health)", self.port)
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)
