"""One place that classifies Kubernetes API errors: retry later, or a spec that cannot work.

`describe()` turns an error from any API call into an `ApiFailure` naming the child and the
field the API server complained about, read from the `Status` body (`details.causes`), so the
user sees it in the DualPathCluster's `Degraded` condition and a Warning event.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

RETRY_STATUSES = {404, 409, 429, 502, 503, 504}
# A 500 from server-side apply whose message says the object does not fit the schema is the
# caller's error (kubernetes/kubernetes#122480, #139253): a retry can never succeed.
SCHEMA_500_MARKERS = (
    "failed to create typed patch object",
    "failed to create typed live object",
    "field not declared in schema",
    "duplicate entries for key",
    "expected string, got",
    "expected numeric",
    "cannot be handled as",
    "unable to convert",
    "quantities must match",
)
MESSAGE_LIMIT = 600


@dataclass(frozen=True)
class ApiFailure:
    """An API error as data: `retryable` or a spec problem the user must fix."""

    retryable: bool
    status: int | None
    reason: str  # the API's reason (Invalid, BadRequest, Conflict, ...) or the exception type
    message: str  # for people: the child, then each field and what is wrong with it

    @property
    def conflict(self) -> bool:
        return self.status == 409


def _status_body(err: Exception) -> dict[str, Any]:
    body = getattr(err, "body", None)
    if isinstance(body, bytes):
        body = body.decode("utf-8", "replace")
    if isinstance(body, dict):
        return body
    if isinstance(body, str) and body.strip().startswith("{"):
        try:
            parsed = json.loads(body)
        except ValueError:
            return {"message": body}
        return parsed if isinstance(parsed, dict) else {}
    return {"message": body} if isinstance(body, str) and body else {}


def _fields(status: dict[str, Any], fallback: str) -> str:
    causes = (status.get("details") or {}).get("causes") or []
    parts = []
    for c in causes:
        field, msg = c.get("field"), c.get("message") or c.get("reason") or ""
        parts.append(f"{field}: {msg}" if field else msg)
    return "; ".join(p for p in parts if p) or status.get("message") or fallback


def describe(err: Exception, child: str = "") -> ApiFailure:
    """Classify `err` from an API call about `child` ("Kind/name", may be empty)."""
    code = getattr(err, "status", None)
    prefix = f"{child}: " if child else ""
    if not isinstance(code, int):  # connection reset, timeout, DNS: the server may be fine soon
        return ApiFailure(True, None, type(err).__name__, f"{prefix}{err}"[:MESSAGE_LIMIT])
    status = _status_body(err)
    reason = status.get("reason") or getattr(err, "reason", None) or f"HTTP{code}"
    text = _fields(status, str(getattr(err, "reason", "") or code))
    message = f"{prefix}{text}"[:MESSAGE_LIMIT]
    if code == 500:
        lowered = (status.get("message") or "").lower()
        return ApiFailure(
            not any(m in lowered for m in SCHEMA_500_MARKERS), code, str(reason), message
        )
    return ApiFailure(code in RETRY_STATUSES or code >= 500, code, str(reason), message)


def is_not_found(err: Exception) -> bool:
    return getattr(err, "status", None) == 404
