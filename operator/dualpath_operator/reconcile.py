"""The reconcile: a fresh read of the cluster, the phases in order (`phases.py`), the status.

Level-triggered and idempotent: every pass reads the cluster, its pools and StatefulSets from
the API, renders the whole desired state, applies it with server-side apply, deletes children
it no longer asks for, and writes the status itself (also when an apply fails). It keeps no
state of its own (each replica count has one writer, `scaling.py`), so an operator restart
loses nothing. The API is behind `ClusterApi` (`pass_state.py`) so tests run against an
in-memory fake; the `Reconciler` is the shell both triggers share (kopf handlers and the
periodic resync).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from dualpath.config import API_VERSION_FULL, KIND

from . import metrics
from .builders import child_name
from .builders.checks import spec_warnings
from .builders.pods import scheduler_address
from .k8s_errors import ApiFailure, describe, is_not_found
from .pass_state import ClusterApi, ObjectLog, Pass, PhaseError, emit, object_log
from .phases import PHASE_OF_CONDITION, run_phases
from .status import ConditionType, Problem, compute_status, condition

CONFLICT_ATTEMPTS = 5  # 409s in a row before the pass is handed to the retry backoff


@dataclass
class ReconcileResult:
    result: str  # ok, apply_failed, invalid_spec, gone
    status: dict[str, Any] = field(default_factory=dict)
    applied: list[str] = field(default_factory=list)
    pruned: list[str] = field(default_factory=list)
    failures: list[ApiFailure] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def failure_of(err: Exception) -> ApiFailure:
    return err.failure if isinstance(err, PhaseError) else describe(err)


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
    """Read the cluster, run the phases in order (`phases.PHASES`), write the status."""
    body = api.get(API_VERSION_FULL, KIND, ns, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return ReconcileResult("gone")  # garbage collection deletes the children
    p = run_phases(Pass(api, body, log))
    previous = body.get("status") or {}
    generation = body["metadata"].get("generation", 0)
    if p.cfg is None:  # the spec does not parse: only the conditions say something
        status = compute_status(
            generation, "", {}, "", previous.get("conditions"), p.problems, phases=p.ran
        )
        _write_status(api, body, status, previous, log)
        return ReconcileResult("invalid_spec", status)
    cfg = p.cfg
    warnings = spec_warnings(cfg)
    status = compute_status(
        generation,
        cfg.config_hash,
        p.workloads,
        scheduler_address(cfg),
        previous.get("conditions"),
        p.problems,
        warnings,
        f"{child_name(cfg, 'frontend')}:{cfg.spec.frontend.port}"
        if cfg.spec.frontend.replicas
        else None,
        phases=p.ran,
    )
    _write_status(api, body, status, previous, log)
    _report_unsafe_scale(p, previous, log)
    log.info(
        "reconciled: %d applied, %d refused, %d pruned; %s",
        len(p.applied),
        len(p.failures),
        len(p.pruned),
        status["phase"],
    )
    result = "apply_failed" if p.failures else "ok"
    return ReconcileResult(result, status, p.applied, p.pruned, p.failures, warnings)


def _report_unsafe_scale(p: Pass, previous: dict, log: ObjectLog) -> None:
    """A Warning event on each pool asking for the refused count, once per refusal."""
    plan = p.plan
    if plan is None or not plan.refused:
        return
    old_degraded = (condition(previous, "Degraded") or {}).get("message") or ""
    if plan.refused in old_degraded:  # reported already: once per refusal, not per pass
        return
    metrics.SCALES_REFUSED.inc()
    for role in plan.pools_asking():
        pool = p.pools.get(role)
        if pool is not None:
            emit(p.api, pool, "Warning", "UnsafeScale", plan.refused, log)


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
        emit(api, body, "Warning", new_d["reason"], new_d["message"], log)
    old_r, new_r = condition(previous, "Ready"), condition(status, "Ready")
    was_ready = bool(old_r and old_r.get("status") == "True")
    if new_r and (new_r["status"] == "True") != was_ready:
        reason = "Ready" if new_r["status"] == "True" else "NotReady"
        emit(api, body, "Normal", reason, new_r["message"], log)


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
                return self._retryable(key, err, started)
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

    def _retryable(self, key, err: Exception, started: float) -> Outcome:
        failure = failure_of(err)
        metrics.API_ERRORS.labels(failure.reason, "true").inc()
        metrics.RECONCILES.labels("error").inc()
        metrics.RECONCILE_SECONDS.labels("error").observe(time.perf_counter() - started)
        delay = self.backoff.failed(key)
        log = object_log(*key)
        log.warning("retry in %.0f s: %s (%s)", delay, failure.message, failure.reason)
        if self.backoff.failures(key) >= self.REPORT_AFTER_FAILURES:
            self._report(key, failure, getattr(err, "condition", None))
        return Outcome("error", delay, failure.message)

    def _report(self, key, failure: ApiFailure, ctype: ConditionType | None) -> None:
        """A retryable error that persists reaches the user too: Degraded, and the condition
        of the phase it stopped in, with reason ApiRetrying (the others as they were)."""
        try:
            body = self.api.get(API_VERSION_FULL, KIND, *key)
            if body is None:
                return
            previous = body.get("status") or {}
            phase = PHASE_OF_CONDITION.get(ctype) if ctype else None
            status = {
                "conditions": compute_status(
                    body["metadata"].get("generation", 0),
                    "",
                    {},
                    "",
                    previous.get("conditions"),
                    [Problem("ApiRetrying", f"retrying: {failure.message}", condition=ctype)],
                    phases=[phase.outcome] if phase else None,
                )["conditions"]
            }
            _write_status(self.api, body, status, previous, object_log(*key))
        except Exception as err:  # the API is failing: the log line above already says so
            object_log(*key).warning("could not report the failure on the object: %s", err)
