"""What a reconcile pass carries through its phases: the API it reads and writes through
(`ClusterApi`), its state (`Pass`), the retryable error a phase raises (`PhaseError`), its log
lines and events. Below both the phases (`phases.py`) and the reconcile that runs them
(`reconcile.py`), so neither imports the other back.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

from dualpath import config

from . import metrics, scaling
from .k8s_errors import ApiFailure
from .status import ConditionType, PhaseOutcome, Problem, WorkloadObservation

# The lines of a pass keep the reconcile's logger name (log filters select on it).
_log = logging.getLogger("dualpath_operator.reconcile")
FIELD_MANAGER = "dualpath-operator"  # every server-side apply of the operator


class ClusterApi(Protocol):
    def apply(self, obj: dict[str, Any], field_manager: str = FIELD_MANAGER) -> dict[str, Any]:
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

    def event(self, obj: dict[str, Any], type_: str, reason: str, message: str) -> None: ...


class ObjectLog(logging.LoggerAdapter):
    """Every line names the object: `[ns/name] ...`, as kopf's own lines do."""

    def process(self, msg, kwargs):
        return f"[{self.extra['key']}] {msg}", kwargs


def object_log(namespace: str, name: str) -> ObjectLog:
    return ObjectLog(_log, {"key": f"{namespace}/{name}"})


class PhaseError(Exception):
    """A retryable API error met in one phase: named for the log, the backoff and the status
    (the phase's condition goes False with reason ApiRetrying once it persists)."""

    def __init__(self, failure: ApiFailure, condition: ConditionType) -> None:
        super().__init__(failure.message)
        self.failure = failure
        self.condition = condition


@dataclass
class Pass:
    """One pass's state: the cluster as read, then what each phase read and decided."""

    api: ClusterApi
    body: dict[str, Any]
    log: ObjectLog  # every line names the object
    cfg: config.ClusterConfig | None = None
    pools: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    plan: scaling.ReplicaPlan | None = None
    desired: list[dict[str, Any]] = field(default_factory=list)
    applied: list[str] = field(default_factory=list)
    pruned: list[str] = field(default_factory=list)
    failures: list[ApiFailure] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    workloads: dict[str, WorkloadObservation] = field(default_factory=dict)
    ran: list[PhaseOutcome] = field(default_factory=list)
    stopped: bool = False  # the spec cannot be rendered: the later phases do not run

    @property
    def meta(self) -> dict[str, Any]:
        return self.body["metadata"]

    @property
    def owner(self) -> dict[str, str]:
        return {"name": self.meta["name"], "uid": self.meta["uid"]}

    @property
    def ns(self) -> str:
        return self.meta["namespace"]

    def refused(self, failure: ApiFailure, condition: ConditionType, what: str) -> None:
        """A write the API server refused for a reason retrying cannot fix: reported."""
        metrics.API_ERRORS.labels(failure.reason, "false").inc()
        self.log.warning("%s refused: %s", what, failure.message)
        self.failures.append(failure)
        self.problems.append(Problem("ApplyFailed", failure.message, condition=condition))


def emit(api: ClusterApi, obj: dict, type_: str, reason: str, message: str, log) -> None:
    """Events are best effort: a failed post is logged, never fails the pass."""
    try:
        api.event(obj, type_, reason, message)
    except Exception as err:
        log.warning("could not post event %s: %s", reason, err)
