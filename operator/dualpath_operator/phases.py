"""The phases of one reconcile pass, run in order over a `Pass` (the reads and decisions so far).

    parse -> replicas -> token (credentials) -> apply -> prune -> observe -> pool status   (then the status)

Each phase is a small function `phase(p: Pass) -> None` that reads what earlier phases left on
`p`, does its API calls, and records what went wrong as `Problem`s naming its condition
(`status.ConditionType`), so `status.conditions` says which phase failed and why, as Cluster
API and controller-runtime reconcilers report each step. A phase that finds the spec unusable
stops the pass (`p.stopped`); the status is written either way. A retryable API error is
raised as `PhaseError`, naming the phase's condition, for the retry backoff to report.

No kopf here, and the builders stay pure: a phase gathers inputs, calls them, applies outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dualpath import config
from dualpath.config import Role

from . import metrics, scaling
from .builders import (
    CERT_MANAGER,
    CHILD_KINDS,
    CLUSTER_LABEL,
    POOL_KIND,
    child_name,
    needs_cert_manager_answer,
    operator_ca_secrets,
    pool_for_apply,
    render,
    with_cert_manager,
)
from .builders import token_secret as build_token_secret
from .builders.common import selector_labels
from .k8s_errors import ApiFailure, describe, is_not_found
from .pass_state import FIELD_MANAGER, ClusterApi, Pass, PhaseError, emit
from .status import ConditionType, PhaseOutcome, PoolObjectStatus, Problem, WorkloadObservation

API_VERSION_FULL = config.API_VERSION_FULL
SPEC_VALID = ConditionType.SPEC_VALID
SCALE_ACCEPTED = ConditionType.SCALE_ACCEPTED
TOKEN_READY = ConditionType.TOKEN_READY
CHILDREN_APPLIED = ConditionType.CHILDREN_APPLIED
CHILDREN_PRUNED = ConditionType.CHILDREN_PRUNED
CHILDREN_OBSERVED = ConditionType.CHILDREN_OBSERVED
POOLS_REPORTED = ConditionType.POOLS_REPORTED


def _raise_if_retryable(failure: ApiFailure, condition: ConditionType, err: Exception) -> None:
    if failure.retryable:  # counted by the Reconciler with the other retried errors
        raise PhaseError(failure, condition) from err


def _key(obj: dict) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


# -- the phases, in the order they run -------------------------------------------------------


def parse_spec(p: Pass) -> None:
    """The spec through the one config model; a spec that does not parse stops the pass."""
    try:
        p.cfg = config.from_resource(p.body)
    except config.ConfigError as err:
        p.problems.append(Problem("InvalidSpec", f"invalid spec: {err}", condition=SPEC_VALID))
        p.stopped = True
        return
    p.cfg = resolve_cert_manager(p.api, p.cfg)


def resolve_cert_manager(api: ClusterApi, cfg: config.ClusterConfig) -> config.ClusterConfig:
    """`cfg` with an unset `spec.security.tls.certManager` set to whether the API server serves
    cert-manager's Certificates (its CRDs are installed), so the builders stay pure."""
    if not needs_cert_manager_answer(cfg):
        return cfg
    return with_cert_manager(cfg, api.served(CERT_MANAGER, "Certificate"))


def resolve_replicas(p: Pass) -> None:
    """Read the pools and the worker StatefulSets; each StatefulSet gets its pool's count
    (`scaling.py`), unless the counts asked together are unsafe (refused, not done)."""
    cfg = p.cfg
    assert cfg is not None
    p.pools = {
        r.value: p.api.get(API_VERSION_FULL, POOL_KIND, p.ns, child_name(cfg, r.value))
        for r in Role
    }
    live = {}
    for r in Role:
        sts = p.api.get("apps/v1", "StatefulSet", p.ns, child_name(cfg, r.value))
        live[r.value] = None if sts is None else int(sts["spec"].get("replicas", 1))
    p.plan = scaling.plan({r.value: cfg.spec.pool(r).replicas for r in Role}, p.pools, live)
    if p.plan.refused:
        p.problems.append(
            Problem("UnsafeScale", p.plan.refused, blocks_ready=False, condition=SCALE_ACCEPTED)
        )


def ensure_token(p: Pass) -> None:
    """The cluster's gRPC credentials (`spec.security.tls.mode`). token: create the cluster
    token Secret when it is absent (a deleted one comes back, with a new token); an existing
    one is never rewritten, so its token changes only when a person rotates it. mtls without
    cert-manager: the operator's CA (`ensure_operator_ca`). Only `create` on Secrets is
    needed: the operator reads no Secret."""
    from dualpath.grpc_auth import new_token

    cfg = p.cfg
    assert cfg is not None
    tls = cfg.spec.security.tls
    if tls.mode is config.TlsMode.MTLS and not tls.cert_manager:
        name = child_name(cfg, "ca")
        make = ensure_operator_ca
    elif tls.mode is config.TlsMode.TOKEN:
        name = child_name(cfg, "token")

        def make(p: Pass) -> None:
            if p.api.create_only(build_token_secret(cfg, p.owner, new_token())):
                p.log.info("created the cluster token Secret %s", name)
    else:
        return  # cert-manager issues the certificates (applied with the children), or off
    try:
        make(p)
    except Exception as err:
        failure = describe(err, f"Secret/{name}")
        _raise_if_retryable(failure, TOKEN_READY, err)
        p.refused(failure, TOKEN_READY, "credentials Secret")


def ensure_operator_ca(p: Pass) -> None:
    """Without cert-manager: create the CA Secret and, only when it was created now, the role
    certificate Secrets it signs (create-only, like the token: the operator reads no Secret,
    so a role Secret deleted alone is not re-issued; delete the CA Secret with it)."""
    assert p.cfg is not None
    ca, *leaves = operator_ca_secrets(p.cfg, p.owner)
    if not p.api.create_only(ca):
        return
    for secret in leaves:
        p.api.create_only(secret)
    p.log.info("created the cluster CA Secret %s and its role certificates", ca["metadata"]["name"])


def apply_children(p: Pass) -> None:
    """Render every child with each StatefulSet at its planned count and apply it. A pool is
    created with the cluster spec's count and applied without `spec.replicas` after that: the
    operator never writes a count people or HPAs own."""
    cfg, plan = p.cfg, p.plan
    assert cfg is not None and plan is not None
    p.desired = render(cfg, p.owner, {r: plan.target(r) for r in scaling.ROLES})
    for obj in p.desired:
        try:
            if obj["kind"] == POOL_KIND:
                _apply_pool(p, obj)
            else:
                if obj["kind"] == "StatefulSet":
                    _log_scale(p, obj)
                p.api.apply(obj)
            p.applied.append(_key(obj))
        except Exception as err:
            failure = describe(err, _key(obj))
            _raise_if_retryable(failure, CHILDREN_APPLIED, err)
            p.refused(failure, CHILDREN_APPLIED, "apply")


def _apply_pool(p: Pass, obj: dict[str, Any]) -> None:
    name, role = obj["metadata"]["name"], obj["spec"]["role"]
    live = p.pools.get(role)
    if live is None and p.api.create_only(obj):
        p.log.info("created DualPathPool %s with %s replicas", name, obj["spec"]["replicas"])
        return
    if live is not None and scaling.applies_count(live, FIELD_MANAGER):
        _hand_over_count(p, obj, live)
    p.api.apply(pool_for_apply(obj))


def _hand_over_count(p: Pass, obj: dict[str, Any], live: dict[str, Any]) -> None:
    """A pool an older operator applied with its count: the same count applied once by the
    handover manager, so it keeps the field when the operator's applies drop it. Guarded by
    the resourceVersion read: a scale landing meanwhile makes it a 409 (pass redone)."""
    handover = {
        "apiVersion": obj["apiVersion"],
        "kind": obj["kind"],
        "metadata": {
            "name": obj["metadata"]["name"],
            "namespace": obj["metadata"]["namespace"],
            "resourceVersion": live["metadata"]["resourceVersion"],
        },
        "spec": {**obj["spec"], "replicas": scaling.pool_count(live, obj["spec"]["replicas"])},
    }
    p.api.apply(handover, field_manager=scaling.COUNT_HANDOVER_MANAGER)
    p.log.info(
        "DualPathPool %s: count %s handed over to %s (applied by an older operator)",
        obj["metadata"]["name"],
        handover["spec"]["replicas"],
        scaling.COUNT_HANDOVER_MANAGER,
    )


def _log_scale(p: Pass, sts: dict[str, Any]) -> None:
    """One line, a metric and a `Scaled` event when a StatefulSet's count changes."""
    assert p.plan is not None and p.cfg is not None
    name = sts["metadata"]["name"]
    role = next(r for r in scaling.ROLES if child_name(p.cfg, r) == name)
    old, new = p.plan.live.get(role), sts["spec"]["replicas"]
    if old is None or old == new:
        return
    msg = f"StatefulSet {name} replicas {old} -> {new}: DualPathPool {name} asks {new}"
    metrics.SCALES.inc()
    p.log.info("%s", msg)
    emit(p.api, p.body, "Normal", "Scaled", msg, p.log)


def prune_children(p: Pass) -> None:
    """Delete children this CR owns (label AND controller owner uid) that it no longer renders."""
    desired = {_key(o) for o in p.desired}
    uid, name = p.meta["uid"], p.meta["name"]
    try:
        for api_version, kind in CHILD_KINDS:
            for obj in p.api.list(api_version, kind, p.ns, {CLUSTER_LABEL: name}):
                meta = obj["metadata"]
                owned = any(
                    o.get("uid") == uid and o.get("controller")
                    for o in meta.get("ownerReferences") or []
                )
                if not owned or f"{kind}/{meta['name']}" in desired:
                    continue
                try:
                    p.api.delete(api_version, kind, p.ns, meta["name"], meta["uid"])
                except Exception as err:
                    if not is_not_found(err):
                        raise
                metrics.PRUNED.labels(kind).inc()
                p.log.info("pruned %s/%s: no longer in the spec", kind, meta["name"])
                p.pruned.append(f"{kind}/{meta['name']}")
    except Exception as err:  # e.g. a name no label selector can hold: report, do not stop
        failure = describe(err, "pruning")
        _raise_if_retryable(failure, CHILDREN_PRUNED, err)
        p.refused(failure, CHILDREN_PRUNED, "pruning")


def observe_children(p: Pass) -> None:
    """What the workloads have now, against what this pass asked of them."""
    cfg, plan = p.cfg, p.plan
    assert cfg is not None and plan is not None
    p.workloads = observe(p.api, cfg, {r: plan.target(r) for r in scaling.ROLES})


def report_pools(p: Pass) -> None:
    """Each pool's status (its StatefulSet's counts and selector): what `kubectl get dpp`, the
    scale subresource and HPAs read."""
    cfg = p.cfg
    assert cfg is not None
    for role in Role:
        w = p.workloads[role.value]
        selector = ",".join(f"{k}={v}" for k, v in selector_labels(cfg, role.value).items())
        status = PoolObjectStatus(replicas=w.replicas, ready_replicas=w.ready, selector=selector)
        try:
            p.api.patch_status(
                API_VERSION_FULL,
                POOL_KIND,
                p.ns,
                child_name(cfg, role.value),
                status.model_dump(by_alias=True),
            )
        except Exception as err:
            if not is_not_found(err):  # a pool whose apply failed above: already reported
                raise


def observe(
    api: ClusterApi, cfg: config.ClusterConfig, worker_replicas: dict[str, int] | None = None
) -> dict[str, WorkloadObservation]:
    """Each workload as read, against its desired count (the workers': `worker_replicas`, the
    pools' counts as planned; without it the cluster spec's)."""
    out = {}
    for role in (Role.PREFILL, Role.DECODE):
        name = child_name(cfg, role.value)
        desired = (worker_replicas or {}).get(role.value, cfg.spec.pool(role).replicas)
        out[role.value] = WorkloadObservation.from_object(
            name, desired, api.get("apps/v1", "StatefulSet", cfg.namespace, name)
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


@dataclass(frozen=True)
class Phase:
    name: str
    run: Callable[[Pass], None]
    outcome: PhaseOutcome  # its condition, and what True means


PHASES: tuple[Phase, ...] = (
    Phase("parse", parse_spec, PhaseOutcome(SPEC_VALID, "the spec parses")),
    Phase(
        "replicas",
        resolve_replicas,
        PhaseOutcome(SCALE_ACCEPTED, "each StatefulSet gets its DualPathPool's count"),
    ),
    Phase(
        "token",  # the name of the phase since the token; it makes the CA Secret too
        ensure_token,
        PhaseOutcome(TOKEN_READY, "the cluster's gRPC credentials exist (token or CA Secret)"),
    ),
    Phase("apply", apply_children, PhaseOutcome(CHILDREN_APPLIED, "every child applied")),
    Phase(
        "prune",
        prune_children,
        PhaseOutcome(CHILDREN_PRUNED, "no child the spec no longer asks for is left"),
    ),
    Phase("observe", observe_children, PhaseOutcome(CHILDREN_OBSERVED, "every workload read")),
    Phase(
        "pool status",
        report_pools,
        PhaseOutcome(POOLS_REPORTED, "each DualPathPool's status is its StatefulSet's"),
    ),
)
PHASE_OF_CONDITION = {ph.outcome.condition: ph for ph in PHASES}


def run_phases(p: Pass, phases: tuple[Phase, ...] = PHASES) -> Pass:
    """Each phase in order until one stops the pass; `p.ran` lists those that ran. An error a
    phase did not handle leaves as `PhaseError`, naming that phase's condition."""
    for phase in phases:
        try:
            phase.run(p)
        except PhaseError:
            raise
        except Exception as err:
            raise PhaseError(describe(err, phase.name), phase.outcome.condition) from err
        p.ran.append(phase.outcome)
        if p.stopped:
            break
    return p
