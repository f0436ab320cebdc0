"""kopf handlers: thin triggers. Each calls the shared `Reconciler`, which reads, applies,
prunes and writes status itself.

No finalizer: nothing here needs one (no timers, daemons or on.delete handlers; kopf adds its
finalizer only for those), so deleting a DualPathCluster never waits for the operator, and
garbage collection through owner references deletes the children. The periodic resync (drift
repair, status refresh) is an operator-owned task started on startup and stopped on cleanup,
not a per-object kopf timer, for exactly that reason. kopf removes the finalizer an older
version left on objects, because the name below still tells it which one is ours.

The one `Reconciler` of the process (its per-object locks only work if it is one) and the
resync task live in kopf's operator-level `memo`, set on startup and handed to every handler:
no module globals, and a test passes its own `kopf.Memo(reconciler=...)`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import kopf
from dualpath.config import API_GROUP, API_VERSION

from .reconcile import Reconciler

log = logging.getLogger(__name__)
RESYNC_INTERVAL_S = 15.0
LEGACY_FINALIZER = "dualpath.io/operator"  # added by versions that had a per-object timer


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_):
    if "reconciler" not in memo:  # a test may bring its own (against an in-memory API)
        from .kube_api import KubeApi

        memo.reconciler = Reconciler(KubeApi())
    settings.persistence.finalizer = LEGACY_FINALIZER  # never added now; only removed
    # Our own events (Scaled, ApplyFailed, UnsafeScale, Ready) are posted by the reconcile;
    # kopf posts only its warnings (a handler that failed).
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.networking.request_timeout = 60
    settings.execution.max_workers = 8
    # Progress (retries, backoff) in annotations: the CRD's status schema prunes status.kopf.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="dualpath.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="dualpath.io", key="last-handled-configuration"
    )
    memo.resync = asyncio.create_task(resync_forever(memo.reconciler), name="dualpath-resync")


@kopf.on.cleanup()
async def stop_resync(memo: kopf.Memo, **_):
    task = memo.get("resync")
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def resync_forever(rec: Reconciler, interval_s: float = RESYNC_INTERVAL_S) -> None:
    """Level trigger: every known cluster is reconciled each interval (drift repaired, status
    refreshed from the children), except those still inside their failure backoff."""
    while True:
        await asyncio.sleep(interval_s)
        await resync_once(rec)


async def resync_once(rec: Reconciler) -> None:
    for namespace, name in rec.due():
        try:
            await asyncio.to_thread(rec.run, namespace, name)
        except Exception:  # a bug, not an API error (those are data): keep the loop alive
            log.exception("[%s/%s] resync failed", namespace, name)


def _run(rec: Reconciler, namespace: str, name: str) -> None:
    outcome = rec.run(namespace, name)
    if outcome.retry_after_s is not None:
        raise kopf.TemporaryError(outcome.message, delay=outcome.retry_after_s)


@kopf.on.resume(API_GROUP, API_VERSION, "dualpathclusters")
@kopf.on.create(API_GROUP, API_VERSION, "dualpathclusters")
@kopf.on.update(API_GROUP, API_VERSION, "dualpathclusters", field="spec")
def cluster_changed(namespace, name, memo, **_):
    _run(memo.reconciler, namespace, name)


@kopf.on.field(API_GROUP, API_VERSION, "dualpathpools", field="spec.replicas")
def pool_scaled(namespace, spec, memo, **_):
    """`kubectl scale dpp/...` or an HPA: the owning cluster's reconcile gives the StatefulSet
    the pool's count."""
    if spec.get("cluster"):
        _run(memo.reconciler, namespace, spec["cluster"])
