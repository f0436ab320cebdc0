"""The kopf layer: no handler makes kopf add a finalizer, progress survives the status schema,
the resync task is owned and stopped, errors are classified from the API's Status body."""

import asyncio
import types

import kopf
import pytest
from dualpath_operator import handlers
from dualpath_operator.k8s_errors import describe
from dualpath_operator.reconcile import Backoff, Reconciler
from fakeapi import FakeApi, api_error
from test_reconcile import cluster_body


def finalizer_reasons(registry: kopf.OperatorRegistry) -> list[str]:
    """What would make kopf add its finalizer, read from the registry the way kopf's
    processing does (`requires_finalizer` of spawning and changing handlers)."""
    reasons = [f"{h.id}: timer/daemon" for h in registry._spawning.get_all_handlers()]
    reasons += [
        f"{h.id}: requires_finalizer"
        for h in registry._changing.get_all_handlers()
        if h.requires_finalizer
    ]
    # kopf's own check, for any cause: it consults only handlers that require a finalizer.
    cause = types.SimpleNamespace(resource=None, body={}, old=None, new=None, diff=())
    if not reasons:
        assert not registry._changing.requires_finalizer(cause=cause)
        assert not registry._spawning.requires_finalizer(cause=cause)
    return reasons


def test_no_registered_handler_makes_kopf_add_a_finalizer():
    registry = kopf.get_default_registry()
    ids = {h.id for h in registry._changing.get_all_handlers()}
    assert any("cluster_changed" in i for i in ids) and any("pool_scaled" in i for i in ids)
    assert finalizer_reasons(registry) == []


def test_the_finalizer_check_sees_a_timer_or_a_delete_handler():
    registry = kopf.OperatorRegistry()

    @kopf.timer("dualpath.io", "v1alpha1", "dualpathclusters", interval=10, registry=registry)
    def tick(**_):
        pass

    @kopf.on.delete("dualpath.io", "v1alpha1", "dualpathclusters", registry=registry)
    def gone(**_):
        pass

    assert len(finalizer_reasons(registry)) == 2


def test_startup_stores_progress_in_annotations_and_cleanup_stops_the_resync():
    rec = Reconciler(FakeApi())
    memo = kopf.Memo(reconciler=rec)

    async def lifecycle():
        settings = kopf.OperatorSettings()
        await handlers.configure(settings=settings, memo=memo)
        task = memo.resync
        assert task is not None and not task.done()
        await handlers.stop_resync(memo=memo)
        return settings, task

    settings, task = asyncio.run(lifecycle())
    assert task.cancelled()
    assert memo.reconciler is rec  # startup keeps a reconciler it is given
    progress = settings.persistence.progress_storage
    assert isinstance(progress, kopf.AnnotationsProgressStorage)
    assert progress.prefix == "dualpath.io"
    assert settings.persistence.finalizer == handlers.LEGACY_FINALIZER


def test_resync_reconciles_known_clusters_outside_their_backoff():
    api = FakeApi()
    api.create(cluster_body())
    now = [0.0]
    rec = Reconciler(api, Backoff(base_s=10, clock=lambda: now[0]))
    rec.known.add(("default", "agents"))
    asyncio.run(handlers.resync_once(rec))
    assert ("apps/v1", "StatefulSet", "default", "agents-decode") in api.objects
    api.refuse[("ConfigMap", "agents-config")] = api_error(422, "Invalid", "bad")
    asyncio.run(handlers.resync_once(rec))
    calls = len(api.calls)
    asyncio.run(handlers.resync_once(rec))  # inside the backoff: not touched
    assert len(api.calls) == calls
    now[0] = 11.0
    asyncio.run(handlers.resync_once(rec))
    assert len(api.calls) > calls


def test_a_retryable_error_becomes_a_kopf_temporary_error_with_the_backoff():
    api = FakeApi()
    api.create(cluster_body())
    api.refuse[("ConfigMap", "agents-config")] = api_error(429, "TooManyRequests", "slow down")
    memo = kopf.Memo(reconciler=Reconciler(api, Backoff(base_s=7)))
    with pytest.raises(kopf.TemporaryError) as err:
        handlers.cluster_changed(namespace="default", name="agents", memo=memo)
    assert err.value.delay == 7


@pytest.mark.parametrize(
    "err, retryable, needle",
    [
        (
            api_error(422, "Invalid", "x", causes=[{"field": "spec.a", "message": "bad"}]),
            False,
            "StatefulSet/x: spec.a: bad",
        ),
        (api_error(400, "BadRequest", "spec.ports: Duplicate value"), False, "Duplicate value"),
        (
            api_error(
                500,
                "InternalError",
                "failed to create typed patch object (x): .spec.b: field not declared in schema",
            ),
            False,
            ".spec.b: field not declared",
        ),
        (api_error(500, "InternalError", "etcdserver: request timed out"), True, "timed out"),
        (api_error(409, "Conflict", "the object has been modified"), True, "modified"),
        (api_error(503, "ServiceUnavailable", "down"), True, "down"),
        (api_error(403, "Forbidden", "cannot patch statefulsets"), False, "cannot patch"),
        (ConnectionResetError("reset by peer"), True, "reset by peer"),
    ],
)
def test_api_errors_are_classified_from_the_status_body(err, retryable, needle):
    failure = describe(err, "StatefulSet/x")
    assert failure.retryable is retryable
    assert failure.message.startswith("StatefulSet/x: ") and needle in failure.message
