"""One place that classifies Kubernetes API errors into retry-later vs give-up."""

from __future__ import annotations

import kopf
from kubernetes.client.exceptions import ApiException

RETRY_STATUSES = {404, 409, 429, 500, 502, 503, 504}


def classify(err: Exception, what: str) -> Exception:
    """An exception for kopf: TemporaryError (retried with backoff) or PermanentError."""
    status = getattr(err, "status", None)
    if isinstance(err, ApiException) and status is not None:
        reason = f"{what}: HTTP {status} {err.reason}"
        if status in RETRY_STATUSES:
            return kopf.TemporaryError(reason, delay=10 if status == 429 else 5)
        return kopf.PermanentError(f"{reason}: {(err.body or '')[:300]}")
    return kopf.TemporaryError(f"{what}: {err}", delay=10)
