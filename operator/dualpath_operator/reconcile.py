"""The reconcile: fresh reads -> replica merge -> desired children -> apply -> prune -> status.

Level-triggered and idempotent: every pass reads the cluster and its pools from the API, renders
the whole desired state, applies it with server-side apply, deletes children it no longer asks
for, and writes the status itself (also when an apply fails). Every state it relies on lives in
API objects (the synced-replicas annotation on each pool), so an operator restart loses nothing.
The API is behind `ClusterApi` so tests run against an in-memory fake.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from dualpath import config
from dualpath.config import API_VERSION_FULL, KIND, Role

from . import metrics, scaling
from .builders import (
    CERT_MANAGER,
    CHILD_KINDS,
    CLUSTER_LABEL,
    POOL_KIND,
    child_name,
    operator_ca_secrets,
    render,
    token_secret,
)
from .builders.checks import spec_warnings
from .builders.common import selector_labels
from .builders.pods import scheduler_address
from .k8s_errors import ApiFailure, describe, is_not_found
from .status import PoolObjectStatus, Problem, WorkloadObservation, compute_status, condition

_log = logging.getLogger(__name__)
FIELD_MANAGER = "dualpath-operator"
CONFLICT_ATTEMPTS = 5  # 409s in a row before the pass is handed to the retry backoff


class ClusterApi(Protocol):
    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply; `metadata.resourceVersion` in `obj` is a precondition."""

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None: ...

    def create_only(self, obj: dict[str, Any]) -> bool:
        """Create `obj` unless it exists (never changes an existing one); True if created."""

    def list(
        self, api_version: str, kind: str, namespace: str, labels: dict[str, str]
    ) -> list[dict[str, Any]]: ...

    def served(self, api_version: str, kind: str) -> bool:
        """Whether the API server serves the kind (cert-manager's CRDs installed)."""

    def delete(self, api_version: str, kind: str, namespace: str, name: str, uid: str) -> None:
        """Delete with a uid precondition (never a same-named successor)."""

    def patch_status(
        self, api_version: str, kind: str, namespace: str, name: str, status: dict[str, Any]
    ) -> None: ...

    def patch_spec(
        self,
        api_version: str,
        kind: str,
        namespace: str,
        name: str,
        patch: dict[str, Any],
        resource_version: str,
    ) -> dict[str, Any]:
        """Merge patch guarded by `resource_version` (409 when the object moved on)."""

    def event(self, obj: dict[str, Any], type_: str, reason: str, message: str) -> None: ...


class ObjectLog(logging.LoggerAdapter):
    """Every line names the object: `[ns/name] ...`, as kopf's own lines do."""

    def process(self, msg, kwargs):
        return f"[{self.extra['key']}] {msg}", kwargs


def object_log(namespace: str, name: str) -> ObjectLog:
    return ObjectLog(_log, {"key": f"{namespace}/{name}"})


@dataclass
class ReconcileResult:
    result: str  # ok, apply_failed, invalid_spec, gone
    status: dict[str, Any] = field(default_factory=dict)
    applied: list[str] = field(default_factory=list)
    pruned: list[str] = field(default_factory=list)
    failures: list[ApiFailure] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


class ChildApiError(Exception):
    """A retryable API error met while applying one child, named for the log and status."""

    def __init__(self, failure: ApiFailure) -> None:
        super().__init__(failure.message)
        self.failure = failure


def failure_of(err: Exception) -> ApiFailure:
    return err.failure if isinstance(err, ChildApiError) else describe(err)


def _key(obj: dict) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


def reconcile(api: ClusterApi, namespace: str, name: str) -> ReconcileResult:
    """One pass for the DualPathCluster `namespace/name`, redone from fresh reads when a
    guarded write meets a newer version (409). Raises the API error if it is retryable."""
    log = object_log(namespace, name)
    for attempt in range(1, CONFLICT_ATTEMPTS + 1):
        try:
            return _pass(api, namespace, name, log)
        except Exception as err:
            failure = failure_of(err)
            if not failure.conflict or attempt == CONFLICT_ATTEMPTS:
                raise
            metrics.CONFLICTS.inc()
            log.info("conflict (%s); redoing the pass from fresh reads", failure.message)
    raise AssertionError("unreachable")


def _pass(api: ClusterApi, ns: str, name: str, log: ObjectLog) -> ReconcileResult:
    body = api.get(API_VERSION_FULL, KIND, ns, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return ReconcileResult("gone")  # garbage collection deletes the children
    meta = body["metadata"]
    previous = body.get("status") or {}
    try:
        cfg = config.from_resource(body)
    except config.ConfigError as err:
        problem = Problem("InvalidSpec", f"invalid spec: {err}")
        status = compute_status(
            meta.get("generation", 0), "", {}, "", previous.get("conditions"), [problem]
        )
        _write_status(api, body, status, previous, log)
        return ReconcileResult("invalid_spec", status)

    owner = {"name": meta["name"], "uid": meta["uid"]}
    pools = {
        r.value: api.get(API_VERSION_FULL, POOL_KIND, ns, child_name(cfg, r.value)) for r in Role
    }
    generation = meta.get("generation", 0)
    plan = scaling.plan(
        {r.value: cfg.spec.pool(r).replicas for r in Role},
        pools,
        generation,
        meta.get("annotations") or {},
    )
    moves = plan.cluster_patch()
    # The pool generation whose count the cluster now holds, so a later stale pool read is
    # recognised (scaling.StaleRead); written in the same guarded patch as the count.
    annotations = meta.get("annotations") or {}
    took = {
        scaling.ABSORBED_POOL.format(role=role): scaling.absorbed(pools[role])
        for role, r in plan.roles.items()
        if pools[role] is not None
        and not plan.refused
        and r.value == r.pool
        and annotations.get(scaling.ABSORBED_POOL.format(role=role))
        != scaling.absorbed(pools[role])
    }
    if moves or took:
        updated = api.patch_spec(
            API_VERSION_FULL,
            KIND,
            ns,
            name,
            {"metadata": {"annotations": took}, "spec": moves},
            meta["resourceVersion"],
        )
        generation = updated["metadata"].get("generation", generation)
        for role, target in moves.items():
            old = plan.roles[role].cluster
            new = target["replicas"]
            pool_name = child_name(cfg, role)
            msg = f"spec.{role}.replicas {old} -> {new}: DualPathPool {pool_name} was scaled"
            metrics.SCALES.labels("pool").inc()
            log.info("%s", msg)
            _emit(api, body, "Normal", "Scaled", msg, log)
    problems = []
    if plan.refused:
        problems.append(Problem("UnsafeScale", plan.refused, blocks_ready=False))
    cfg = cfg.model_copy(
        update={
            "spec": cfg.spec.model_copy(
                update={
                    r.value: cfg.spec.pool(r).model_copy(update={"replicas": plan.target(r.value)})
                    for r in Role
                }
            )
        }
    )

    cfg = resolve_cert_manager(api, cfg)
    desired = render(cfg, owner)
    applied, failures = [], []
    mode = cfg.spec.security.tls.mode
    try:
        if mode is config.TlsMode.TOKEN:
            ensure_token(api, cfg, owner, log)
        elif mode is config.TlsMode.MTLS and not cfg.spec.security.tls.cert_manager:
            ensure_operator_ca(api, cfg, owner, log)
    except Exception as err:
        secret = child_name(cfg, "token" if mode is config.TlsMode.TOKEN else "ca")
        failure = describe(err, f"Secret/{secret}")
        if failure.retryable:
            raise ChildApiError(failure) from err
        metrics.API_ERRORS.labels(failure.reason, "false").inc()
        log.warning("credentials Secret refused: %s", failure.message)
        failures.append(failure)
    for obj in desired:
        if obj["kind"] == POOL_KIND:
            _guard_pool(obj, plan, pools[obj["spec"]["role"]], generation, log)
        try:
            api.apply(obj)
            applied.append(_key(obj))
        except Exception as err:
            failure = describe(err, _key(obj))
            if failure.retryable:  # counted by the Reconciler with the other retried errors
                raise ChildApiError(failure) from err
            metrics.API_ERRORS.labels(failure.reason, "false").inc()
            log.warning("apply refused: %s", failure.message)
            failures.append(failure)
    try:
        pruned = _prune(api, ns, name, meta["uid"], {_key(o) for o in desired}, log)
    except Exception as err:  # e.g. a name no label selector can hold: report, do not stop
        failure = describe(err, "pruning")
        if failure.retryable:
            raise ChildApiError(failure) from err
        pruned, failures = [], [*failures, failure]

    workloads = observe(api, cfg)
    for role in Role:
        w = workloads[role.value]
        selector = ",".join(f"{k}={v}" for k, v in selector_labels(cfg, role.value).items())
        try:
            api.patch_status(
                API_VERSION_FULL,
                POOL_KIND,
                ns,
                child_name(cfg, role.value),
                PoolObjectStatus(
                    replicas=w.replicas, ready_replicas=w.ready, selector=selector
                ).model_dump(by_alias=True),
            )
        except Exception as err:
            if not is_not_found(err):  # a pool whose apply failed above: already reported
                raise
    problems += [Problem("ApplyFailed", f.message) for f in failures]
    warnings = spec_warnings(cfg)
    status = compute_status(
        generation,
        cfg.config_hash,
        workloads,
        scheduler_address(cfg),
        previous.get("conditions"),
        problems,
        warnings,
        f"{child_name(cfg, 'frontend')}:{cfg.spec.frontend.port}"
        if cfg.spec.frontend.replicas
        else None,
    )
    _write_status(api, body, status, previous, log)
    old_degraded = (condition(previous, "Degraded") or {}).get("message") or ""
    if plan.refused and plan.refused not in old_degraded:  # once per refusal, not per pass
        metrics.SCALES_REFUSED.inc()
        for role, r in plan.roles.items():
            if r.source == "pool" and pools[role]:
                _emit(api, pools[role], "Warning", "UnsafeScale", plan.refused, log)
    result = "apply_failed" if failures else "ok"
    log.info(
        "reconciled: %d applied, %d refused, %d pruned; %s",
        len(applied),
        len(failures),
        len(pruned),
        status["phase"],
    )
    return ReconcileResult(result, status, applied, pruned, failures, warnings)


def ensure_token(api: ClusterApi, cfg: config.ClusterConfig, owner: dict, log) -> bool:
    """Create the cluster token Secret when it is absent (a deleted one comes back, with a new
    token); an existing one is never rewritten, so its token changes only when a person
    rotates it. Only `create` on Secrets is needed: the operator reads no Secret."""
    from dualpath.grpc_auth import new_token

    created = api.create_only(token_secret(cfg, owner, new_token()))
    if created:
        log.info("created the cluster token Secret %s", child_name(cfg, "token"))
    return created


def resolve_cert_manager(api: ClusterApi, cfg: config.ClusterConfig) -> config.ClusterConfig:
    """`cfg` with an unset `spec.security.tls.certManager` set to whether the API server serves
    cert-manager's Certificates (its CRDs are installed), so the builders stay pure."""
    tls = cfg.spec.security.tls
    if tls.mode is not config.TlsMode.MTLS or tls.cert_manager is not None:
        return cfg
    found = api.served(CERT_MANAGER, "Certificate")
    security = cfg.spec.security.model_copy(
        update={"tls": tls.model_copy(update={"cert_manager": found})}
    )
    return cfg.model_copy(update={"spec": cfg.spec.model_copy(update={"security": security})})


def ensure_operator_ca(api: ClusterApi, cfg: config.ClusterConfig, owner: dict, log) -> bool:
    """Without cert-manager: create the CA Secret and, only when it was created now, the role
    certificate Secrets it signs (create-only, like the token: the operator reads no Secret,
    so a role Secret deleted alone is not re-issued; delete the CA Secret with it)."""
    ca, *leaves = operator_ca_secrets(cfg, owner)
    if not api.create_only(ca):
        return False
    for secret in leaves:
        api.create_only(secret)
    log.info("created the cluster CA Secret %s and its role certificates", ca["metadata"]["name"])
    return True


def _guard_pool(
    obj: dict, plan: scaling.ReplicaPlan, live: dict | None, generation: int, log: ObjectLog
) -> None:
    """The pool apply carries the merged count, the synced annotations and, when the pool
    exists, the resourceVersion it was read at: a scale landing meanwhile makes it a 409."""
    role = obj["spec"]["role"]
    replicas, annotations = plan.pool_annotations(role)
    obj["spec"]["replicas"] = replicas
    obj["metadata"]["annotations"].update(annotations)
    obj["metadata"]["annotations"][scaling.SYNCED_CLUSTER_GENERATION] = str(generation)
    if live is not None:
        obj["metadata"]["resourceVersion"] = live["metadata"]["resourceVersion"]
        r = plan.roles[role]
        if r.pool != replicas:
            metrics.SCALES.labels("cluster").inc()
            log.info(
                "DualPathPool %s replicas %s -> %s (cluster spec)",
                obj["metadata"]["name"],
                r.pool,
                replicas,
            )


def _prune(api: ClusterApi, ns: str, name: str, uid: str, desired: set[str], log) -> list[str]:
    """Delete children this CR owns (label AND owner uid) that the spec no longer asks for."""
    pruned = []
    for api_version, kind in CHILD_KINDS:
        for obj in api.list(api_version, kind, ns, {CLUSTER_LABEL: name}):
            meta = obj["metadata"]
            owned = any(
                o.get("uid") == uid and o.get("controller")
                for o in meta.get("ownerReferences") or []
            )
            if not owned or f"{kind}/{meta['name']}" in desired:
                continue
            try:
                api.delete(api_version, kind, ns, meta["name"], meta["uid"])
            except Exception as err:
                if not is_not_found(err):
                    raise
            metrics.PRUNED.labels(kind).inc()
            log.info("pruned %s/%s: no longer in the spec", kind, meta["name"])
            pruned.append(f"{kind}/{meta['name']}")
    return pruned


def _write_status(api: ClusterApi, body: dict, status: dict, previous: dict, log) -> None:
    """Status is written here, on success and failure alike; a Degraded change is an event."""
    meta = body["metadata"]
    try:
        api.patch_status(API_VERSION_FULL, KIND, meta["namespace"], meta["name"], status)
    except Exception as err:
        if is_not_found(err):
            return  # deleted meanwhile
        raise
    old_d, new_d = condition(previous, "Degraded"), condition(status, "Degraded")
    if (
        new_d
        and new_d["status"] == "True"
        and (
            not old_d
            or old_d.get("status") != "True"
            or (old_d.get("reason"), old_d.get("message")) != (new_d["reason"], new_d["message"])
        )
    ):
        log.warning("degraded: %s: %s", new_d["reason"], new_d["message"])
        _emit(api, body, "Warning", new_d["reason"], new_d["message"], log)
    old_r, new_r = condition(previous, "Ready"), condition(status, "Ready")
    was_ready = bool(old_r and old_r.get("status") == "True")
    if new_r and (new_r["status"] == "True") != was_ready:
        reason = "Ready" if new_r["status"] == "True" else "NotReady"
        _emit(api, body, "Normal", reason, new_r["message"], log)


def _emit(api: ClusterApi, obj: dict, type_: str, reason: str, message: str, log) -> None:
    """Events are best effort: a failed post is logged, never fails the pass."""
    try:
        api.event(obj, type_, reason, message)
    except Exception as err:
        log.warning("could not post event %s: %s", reason, err)


def observe(api: ClusterApi, cfg: config.ClusterConfig) -> dict[str, WorkloadObservation]:
    out = {}
    for role in (Role.PREFILL, Role.DECODE):
        name = child_name(cfg, role.value)
        out[role.value] = WorkloadObservation.from_object(
            name,
            cfg.spec.pool(role).replicas,
            api.get("apps/v1", "StatefulSet", cfg.namespace, name),
        )
    sched = child_name(cfg, "scheduler")
    out["scheduler"] = WorkloadObservation.from_object(
        sched, cfg.spec.scheduler.replicas, api.get("apps/v1", "Deployment", cfg.namespace, sched)
    )
    if cfg.spec.frontend.replicas:
        fe = child_name(cfg, "frontend")
        out["frontend"] = WorkloadObservation.from_object(
            fe, cfg.spec.frontend.replicas, api.get("apps/v1", "Deployment", cfg.namespace, fe)
        )
    return out


class Backoff:
    """Per-object retry delays after failures: base, 2x base, ... up to `max_s`; reset on
    success. The periodic resync skips an object until its delay has passed."""

    def __init__(self, base_s: float = 10.0, max_s: float = 600.0, clock=time.monotonic) -> None:
        self.base_s, self.max_s, self.clock = base_s, max_s, clock
        self._failures: dict[tuple[str, str], int] = {}
        self._next: dict[tuple[str, str], float] = {}

    def failed(self, key: tuple[str, str]) -> float:
        n = self._failures[key] = self._failures.get(key, 0) + 1
        delay = min(self.base_s * 2 ** (n - 1), self.max_s)
        self._next[key] = self.clock() + delay
        return delay

    def succeeded(self, key: tuple[str, str]) -> None:
        self._failures.pop(key, None)
        self._next.pop(key, None)

    def due(self, key: tuple[str, str]) -> bool:
        return self.clock() >= self._next.get(key, 0.0)

    def failures(self, key: tuple[str, str]) -> int:
        return self._failures.get(key, 0)


@dataclass
class Outcome:
    result: str
    retry_after_s: float | None = None  # set when a retryable API error must be retried
    message: str = ""


class Reconciler:
    """The shell both triggers share (kopf handlers and the periodic resync): one pass per
    object at a time, metrics per result, backoff after failures, and retryable errors
    reported on the CR once they persist."""

    REPORT_AFTER_FAILURES = 3

    def __init__(self, api: ClusterApi, backoff: Backoff | None = None) -> None:
        self.api = api
        self.backoff = backoff or Backoff()
        self.known: set[tuple[str, str]] = set()
        self._locks: dict[tuple[str, str], threading.Lock] = {}
        self._guard = threading.Lock()

    def _lock(self, key: tuple[str, str]) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(key, threading.Lock())

    def due(self) -> list[tuple[str, str]]:
        return sorted(k for k in self.known if self.backoff.due(k))

    def run(self, namespace: str, name: str) -> Outcome:
        key = (namespace, name)
        self.known.add(key)
        started = time.perf_counter()
        with self._lock(key):
            try:
                res = reconcile(self.api, namespace, name)
            except Exception as err:
                return self._retryable(key, failure_of(err), started)
        metrics.RECONCILES.labels(res.result).inc()
        metrics.RECONCILE_SECONDS.labels(res.result).observe(time.perf_counter() - started)
        if res.result == "gone":
            self.known.discard(key)
            self.backoff.succeeded(key)
        elif res.result == "ok":
            self.backoff.succeeded(key)
        else:  # the spec cannot be applied as it is: reported; retried slowly by the resync
            self.backoff.failed(key)
        return Outcome(res.result)

    def _retryable(self, key, failure: ApiFailure, started: float) -> Outcome:
        metrics.API_ERRORS.labels(failure.reason, "true").inc()
        metrics.RECONCILES.labels("error").inc()
        metrics.RECONCILE_SECONDS.labels("error").observe(time.perf_counter() - started)
        delay = self.backoff.failed(key)
        log = object_log(*key)
        log.warning("retry in %.0f s: %s (%s)", delay, failure.message, failure.reason)
        if self.backoff.failures(key) >= self.REPORT_AFTER_FAILURES:
            self._report(key, failure)
        return Outcome("error", delay, failure.message)

    def _report(self, key, failure: ApiFailure) -> None:
        """A retryable error that persists reaches the user too (Degraded, ApiRetrying)."""
        try:
            body = self.api.get(API_VERSION_FULL, KIND, *key)
            if body is None:
                return
            previous = body.get("status") or {}
            status = {
                "conditions": compute_status(
                    body["metadata"].get("generation", 0),
                    "",
                    {},
                    "",
                    previous.get("conditions"),
                    [Problem("ApiRetrying", f"retrying: {failure.message}")],
                )["conditions"]
            }
            _write_status(self.api, body, status, previous, object_log(*key))
        except Exception as err:  # the API is failing: the log line above already says so
            object_log(*key).warning("could not report the failure on the object: %s", err)
