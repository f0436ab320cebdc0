"""The HTTP front's connection limits: a client cannot hold it open.

uvicorn reads a request's header and body for as long as the client takes, and keeps every
connection it accepts: 1,500 connections sending one header line every 10 s were all held
for 45 s. `guarded_protocol` is uvicorn's h11 protocol with

- a header timeout: a request's header must be complete within `headerTimeoutSeconds` of its
  first byte (of the connection, for the first request): else 408 and the connection closed;
- a body timeout: its body complete within `bodyTimeoutSeconds` of the header: else closed
  (the app's `receive` sees the disconnect);
- a connection cap: a connection beyond `maxConnections` is answered 503 (`Retry-After: 1`)
  and closed at once.

Each drop is counted in `dualpath_frontend_connections_dropped_total` by reason. Limits come
from `spec.frontend` (`FrontendSpec`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

import h11
from prometheus_client import CollectorRegistry, Counter
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)


def _answer(status: str, message: str, kind: str, extra: str = "") -> bytes:
    """A whole HTTP response that closes the connection, with the API's JSON error body."""
    body = json.dumps({"error": {"message": message, "type": kind}}).encode()
    head = (
        f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\n{extra}"
        f"connection: close\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


_TIMEOUT_408 = _answer("408 Request Timeout", "request header not complete in time", "timeout")
_FULL_503 = _answer(
    "503 Service Unavailable", "too many connections", "overloaded", "retry-after: 1\r\n"
)


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    header_timeout_s: float
    body_timeout_s: float
    max_connections: int


def dropped_counter(registry: CollectorRegistry | None) -> Counter:
    return Counter(
        "dualpath_frontend_connections_dropped_total",
        "HTTP connections the front closed: header or body not read in time, or over the "
        "connection cap",
        ["reason"],
        registry=registry,
    )


def guarded_protocol(limits: ConnectionLimits, dropped: Counter) -> type[H11Protocol]:
    """uvicorn's h11 protocol under `limits` (pass it as `uvicorn.run(..., http=...)`)."""

    class GuardedH11Protocol(H11Protocol):
        _guard: asyncio.TimerHandle | None = None
        _phase: str | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                dropped.labels("connections").inc()
                transport.write(_FULL_503)
                transport.close()
                return
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._arm()

        def on_response_complete(self) -> None:
            self._disarm()  # idle until the next request: uvicorn's keep-alive timeout
            super().on_response_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            """The timer of what the client is sending now: a header, a body, or nothing."""
            if self.transport.is_closing():
                return self._disarm()
            state = self.conn.their_state
            if state is h11.IDLE:
                phase, limit = "header", limits.header_timeout_s
            elif state is h11.SEND_BODY:
                phase, limit = "body", limits.body_timeout_s
            else:
                return self._disarm()
            if phase != self._phase:
                self._disarm()
                self._phase = phase
                self._guard = self.loop.call_later(limit, self._too_slow, phase)
            return None

        def _disarm(self) -> None:
            if self._guard is not None:
                self._guard.cancel()
            self._guard, self._phase = None, None

        def _too_slow(self, phase: str) -> None:
            self._guard = None
            if self.transport.is_closing():
                return
            dropped.labels(phase).inc()
            log.debug("closing %s: request %s not read in time", self.client, phase)
            if phase == "header":
                self.transport.write(_TIMEOUT_408)
            self.transport.close()

    return GuardedH11Protocol
