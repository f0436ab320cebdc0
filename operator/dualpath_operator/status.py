"""Pure: observed children -> the DualPathCluster status (conditions + observedGeneration).

Kubernetes API conventions: a top-level `Ready` condition `kubectl wait` can read, plus
`Progressing` and `Degraded`, each with a CamelCase reason and a sentence for people. Below
them one condition per reconcile phase (`ConditionType`, in phase order), False with the
phase's reason when that phase failed, as Cluster API reports each step of its reconcile.

The status is a typed model (`ClusterStatus`, `PoolStatus`, `Condition`, and `DualPathPool`'s
`PoolObjectStatus`); `crd.py` generates the CRDs' status schemas from these models, as it does
the spec's from the config model, so what the operator writes and what the API server accepts
are one definition.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel


class ConditionType(StrEnum):
    """Every condition type the operator writes on a DualPathCluster."""

    READY = "Ready"
    PROGRESSING = "Progressing"
    DEGRADED = "Degraded"
    # One per reconcile phase (`phases.PHASES`), in the order they run:
    SPEC_VALID = "SpecValid"
    SCALE_ACCEPTED = "ScaleAccepted"
    TOKEN_READY = "TokenReady"
    CHILDREN_APPLIED = "ChildrenApplied"
    CHILDREN_PRUNED = "ChildrenPruned"
    CHILDREN_OBSERVED = "ChildrenObserved"
    POOLS_REPORTED = "PoolsReported"


SUMMARY_CONDITIONS = (ConditionType.READY, ConditionType.PROGRESSING, ConditionType.DEGRADED)
PHASE_CONDITIONS = tuple(t for t in ConditionType if t not in SUMMARY_CONDITIONS)


class _Status(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, frozen=True)


class Condition(_Status):
    type: str = Field(
        description="Ready, Progressing, Degraded, or the reconcile phase it reports on."
    )
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field("", description="Why, in one CamelCase word.")
    message: str = Field("", description="Why, for a person.")
    last_transition_time: str = Field(
        "", description="When status last changed.", json_schema_extra={"format": "date-time"}
    )
    observed_generation: int = Field(
        0, description="The metadata.generation this condition is about."
    )


class PoolStatus(_Status):
    replicas: int = Field(0, description="Pods that exist.")
    ready_replicas: int = Field(0, description="Pods that are ready.")
    updated_replicas: int = Field(0, description="Pods running the current template.")


class ClusterStatus(_Status):
    """What the operator last observed; written by the operator only."""

    observed_generation: int = Field(0, description="The metadata.generation last reconciled.")
    phase: str = Field(
        "", description="Ready, Progressing or Degraded (the conditions are authoritative)."
    )
    # None: the key is dropped by the merge patch (e.g. frontendEndpoint after replicas: 0)
    config_hash: str | None = Field(None, description="Hash of the rendered config the pods run.")
    scheduler_endpoint: str | None = Field(
        None, description="host:port of the scheduler's gRPC Service."
    )
    frontend_endpoint: str | None = Field(
        None, description="host:port of the frontend's HTTP Service."
    )
    prefill: PoolStatus = Field(PoolStatus(), description="The prefill StatefulSet's pods.")
    decode: PoolStatus = Field(PoolStatus(), description="The decode StatefulSet's pods.")
    conditions: list[Condition] = Field(
        default_factory=list,
        description="Ready, Progressing, Degraded and one per reconcile phase.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )


class PoolObjectStatus(_Status):
    """The workers' StatefulSet as last observed."""

    replicas: int = Field(0, description="Workers that exist.")
    ready_replicas: int = Field(0, description="Workers that are ready.")
    selector: str = Field(
        "", description="Label selector of the workers (for the scale subresource)."
    )


@dataclass(frozen=True)
class WorkloadObservation:
    """What the operator saw of one StatefulSet/Deployment."""

    name: str
    desired: int
    replicas: int = 0
    ready: int = 0
    updated: int = 0
    exists: bool = True

    @classmethod
    def from_object(cls, name: str, desired: int, obj: dict[str, Any] | None):
        if not obj:
            return cls(name, desired, exists=False)
        st = obj.get("status") or {}
        return cls(
            name,
            desired,
            st.get("replicas", 0),
            st.get("readyReplicas", 0),
            st.get("updatedReplicas", st.get("replicas", 0)),
        )

    @property
    def settled(self) -> bool:
        # Ready only when every pod runs the current template: old pods must not serve.
        return (
            self.exists
            and self.ready >= self.desired
            and self.updated >= self.desired
            and (self.replicas == self.desired)
        )


def _condition(
    ctype: str,
    ok: bool,
    reason: str,
    message: str,
    generation: int,
    previous: dict[str, dict],
    now: str,
) -> Condition:
    status = "True" if ok else "False"
    prev = previous.get(ctype)
    since = prev["lastTransitionTime"] if prev and prev.get("status") == status else now
    return Condition(
        type=ctype,
        status=status,
        reason=reason,
        message=message,
        last_transition_time=since,
        observed_generation=generation,
    )


@dataclass(frozen=True)
class Problem:
    """Why the cluster is Degraded: a CamelCase reason and a sentence naming child and field."""

    reason: str  # InvalidSpec, ApplyFailed, ApiRetrying, UnsafeScale, StartupChecks
    message: str
    blocks_ready: bool = True  # the children could not be (fully) applied
    condition: ConditionType | None = None  # the phase condition it makes False


@dataclass(frozen=True)
class PhaseOutcome:
    """A phase that ran: its condition is False with its problems, else True."""

    condition: ConditionType
    ok_message: str  # what True means, for people


def compute_status(
    generation: int,
    config_hash: str,
    workloads: dict[str, WorkloadObservation],
    scheduler_endpoint: str,
    previous_conditions: list[dict] | None = None,
    problems: list[Problem] | None = None,
    warnings: list[str] | None = None,
    frontend_endpoint: str | None = None,
    now: datetime | None = None,
    phases: list[PhaseOutcome] | None = None,
) -> dict[str, Any]:
    """The whole status. Keys whose object no longer exists are None, so a merge patch drops
    them (e.g. `frontendEndpoint` after `frontend.replicas: 0`). `phases`: those that ran
    this pass; the condition of a phase that did not run is carried over as it was (its
    `observedGeneration` says which generation it is about)."""
    stamp = (now or datetime.now(UTC)).strftime("%Y-%m-%dT%H:%M:%SZ")
    previous = {c["type"]: c for c in (previous_conditions or [])}
    problems = list(problems or [])
    if warnings:
        problems.append(Problem("StartupChecks", "; ".join(warnings), blocks_ready=False))
    failed = [p for p in problems if p.blocks_ready]
    missing = [w.name for w in workloads.values() if not w.exists]
    waiting = [w for w in workloads.values() if w.exists and not w.settled]
    ready = not failed and not missing and not waiting
    if failed:
        r_reason, r_msg = failed[0].reason, "; ".join(p.message for p in failed)
    elif missing:
        r_reason, r_msg = "ChildrenMissing", "not yet created: " + ", ".join(sorted(missing))
    elif waiting:
        r_reason = "RolloutInProgress"
        r_msg = "; ".join(
            f"{w.name}: {w.ready}/{w.desired} ready, {w.updated} updated" for w in waiting
        )
    else:
        r_reason, r_msg = "AllReplicasReady", "every pool and service is ready"
    d_reason = problems[0].reason if problems else "AsExpected"
    d_msg = "; ".join(p.message for p in problems) if problems else "no problems seen"
    conditions = [
        _condition("Ready", ready, r_reason, r_msg, generation, previous, stamp),
        _condition(
            "Progressing",
            not ready and not failed,
            r_reason if not ready else "Settled",
            r_msg if not ready else "nothing to roll out",
            generation,
            previous,
            stamp,
        ),
        _condition("Degraded", bool(problems), d_reason, d_msg, generation, previous, stamp),
    ]
    conditions += _phase_conditions(phases or [], problems, generation, previous, stamp)

    def pool(key: str) -> PoolStatus:
        w = workloads.get(key)
        if w is None:
            return PoolStatus()
        return PoolStatus(replicas=w.replicas, ready_replicas=w.ready, updated_replicas=w.updated)

    return ClusterStatus(
        observed_generation=generation,
        phase="Ready" if ready else ("Failed" if failed else "Progressing"),
        config_hash=config_hash or None,
        scheduler_endpoint=scheduler_endpoint or None,
        frontend_endpoint=frontend_endpoint,
        prefill=pool("prefill"),
        decode=pool("decode"),
        conditions=conditions,
    ).model_dump(by_alias=True)


def _phase_conditions(
    ran: list[PhaseOutcome],
    problems: list[Problem],
    generation: int,
    previous: dict[str, dict],
    now: str,
) -> list[Condition]:
    outcomes = {o.condition: o for o in ran}
    out = []
    for ctype in PHASE_CONDITIONS:
        outcome = outcomes.get(ctype)
        if outcome is None:
            if ctype in previous:  # not run this pass: as it was
                out.append(Condition.model_validate(previous[ctype]))
            continue
        failed = [p for p in problems if p.condition == ctype]
        reason = failed[0].reason if failed else "Succeeded"
        message = "; ".join(p.message for p in failed) if failed else outcome.ok_message
        out.append(_condition(ctype, not failed, reason, message, generation, previous, now))
    return out


def condition(status: dict[str, Any] | None, ctype: str) -> dict[str, Any] | None:
    for c in (status or {}).get("conditions") or []:
        if c.get("type") == ctype:
            return c
    return None
