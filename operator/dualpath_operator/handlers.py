"""kopf handlers: thin. They gather the body, call `reconcile`, and write status/events."""

from __future__ import annotations

import logging

import kopf
from dualpath.config import API_GROUP, API_VERSION, ConfigError

from . import reconcile as rec
from .k8s_errors import classify
from .status import compute_status

_api = None


def api():
    global _api
    if _api is None:
        from .kube_api import KubeApi

        _api = KubeApi()
    return _api


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_):
    settings.persistence.finalizer = "dualpath.io/operator"  # none added: GC does deletes
    settings.posting.level = logging.INFO
    settings.watching.server_timeout = 300
    settings.execution.max_workers = 8
    # Field managers: our applies are server-side with FIELD_MANAGER; kopf's own annotations
    # for progress go to status.kopf, not into the spec.
    settings.persistence.progress_storage = kopf.StatusProgressStorage(field="status.kopf")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="dualpath.io", key="last-handled-configuration"
    )


def _reconcile(body, patch, logger) -> None:
    try:
        result = rec.reconcile(api(), dict(body))
    except ConfigError as err:
        status = compute_status(
            body.get("metadata", {}).get("generation", 0),
            "",
            {},
            "",
            (body.get("status") or {}).get("conditions"),
            apply_error=f"invalid spec: {err}",
        )
        patch.status.update(status)
        kopf.warn(body, reason="InvalidSpec", message=str(err))
        raise kopf.PermanentError(f"invalid spec: {err}") from None
    except kopf.PermanentError:
        raise
    except Exception as err:  # classified once, here
        raise classify(err, "apply children") from err
    previous = (body.get("status") or {}).get("conditions") or []
    was_ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in previous)
    patch.status.update(result.status)
    is_ready = result.status["phase"] == "Ready"
    if is_ready != was_ready:
        kopf.info(
            body,
            reason="Ready" if is_ready else "Progressing",
            message=result.status["conditions"][0]["message"],
        )
    logger.info("reconciled %d children; phase %s", len(result.applied), result.status["phase"])


@kopf.on.resume(API_GROUP, API_VERSION, "dualpathclusters")
@kopf.on.create(API_GROUP, API_VERSION, "dualpathclusters")
@kopf.on.update(API_GROUP, API_VERSION, "dualpathclusters", field="spec")
def cluster_changed(body, patch, logger, **_):
    _reconcile(body, patch, logger)
    kopf.info(
        body,
        reason="Applied",
        message=f"children applied for generation {body.get('metadata', {}).get('generation')}",
    )


@kopf.timer(
    API_GROUP, API_VERSION, "dualpathclusters", interval=10, initial_delay=5, idle=0, sharp=False
)
def cluster_resync(body, patch, logger, **_):
    """Level trigger: repair drift and refresh status from the children every 10 s."""
    _reconcile(body, patch, logger)


@kopf.on.field(API_GROUP, API_VERSION, "dualpathpools", field="spec.replicas")
def pool_scaled(body, old, new, logger, **_):
    if old is None:
        return
    try:
        if rec.pool_scaled(api(), dict(body)):
            kopf.info(body, reason="Scaled", message=f"replicas {old} -> {new}")
    except Exception as err:
        raise classify(err, "write pool scale into the cluster spec") from err
