"""Pure: the count each worker StatefulSet gets, from the one object that owns it.

One writer per count, as in Kubernetes (a Deployment owns its ReplicaSet's count, an HPA its
target's):

- `DualPathPool.spec.replicas`: people and HPAs, through the pool's scale subresource
  (`kubectl scale dpp/...`). The operator writes it once, when it creates the pool, from the
  cluster spec; its applies after that never carry the field.
- `DualPathCluster.spec.<role>.replicas`: the initial count, read only when the pool is created
  (again after a pool is deleted). Editing it later scales nothing.
- the worker `StatefulSet.spec.replicas`: the operator, from the pool's count only.

No merge, no bookkeeping annotations: the operator never writes a count a person or an HPA
writes, so it can never undo a scale, and a restart loses nothing.

A pool applied by an older operator carries its count in the operator's server-side-apply
field set; an apply that omits a field it owns alone deletes it. Such a pool's count is first
handed over to a field manager that never applies again (`COUNT_HANDOVER_MANAGER`, the
Kubernetes docs' "handover" for an HPA taking over a Deployment's replicas), once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ROLES = ("prefill", "decode")
COUNT_HANDOVER_MANAGER = "dualpath-pool-count-handover"


def unsafe_reason(prefill: int, decode: int) -> str | None:
    if prefill > 0 and decode == 0:
        return (
            f"decode replicas 0 with prefill replicas {prefill}: every prefill hands its KV to "
            "a decode worker; keep decode at 1 or more, or scale prefill to 0 first"
        )
    return None


def pool_count(pool: dict[str, Any] | None, initial: int) -> int:
    """The pool's count; `initial` (the cluster spec's) for a pool not created yet."""
    if pool is None:
        return initial
    replicas = (pool.get("spec") or {}).get("replicas")
    return initial if replicas is None else int(replicas)


@dataclass(frozen=True)
class ReplicaPlan:
    """Per role: the count asked (the pool's), what the StatefulSet has, and whether the asked
    counts are refused together (unsafe)."""

    asked: dict[str, int]
    live: dict[str, int | None]  # None: no StatefulSet yet
    initial: dict[str, int]  # the cluster spec's counts (valid together: the spec parsed)
    refused: str | None  # why, for a condition and an event

    def target(self, role: str) -> int:
        """The count the StatefulSet gets this pass: the pool's, or, while the pools ask for
        something unsafe, what the StatefulSet already has (not done, and not undone)."""
        if not self.refused:
            return self.asked[role]
        live = self.live[role]
        return self.initial[role] if live is None else live

    def pools_asking(self) -> list[str]:
        """Roles whose pool asks for a count their StatefulSet does not have."""
        return [r for r in ROLES if self.asked[r] != self.live[r]]


def plan(
    initial: dict[str, int],
    pools: dict[str, dict[str, Any] | None],
    live: dict[str, int | None],
) -> ReplicaPlan:
    """`initial`: the cluster spec's counts; `pools`: the DualPathPools read (None: absent);
    `live`: the StatefulSets' `spec.replicas` read (None: absent)."""
    asked = {r: pool_count(pools.get(r), initial[r]) for r in ROLES}
    why = unsafe_reason(asked["prefill"], asked["decode"])
    if why:
        movers = [f"DualPathPool {r}" for r in ROLES if pools.get(r) and asked[r] != live.get(r)]
        why = f"scale refused ({', '.join(movers) or 'pools'}): {why}"
    return ReplicaPlan(asked, {r: live.get(r) for r in ROLES}, dict(initial), why)


def applies_count(pool: dict[str, Any] | None, field_manager: str) -> bool:
    """Whether `field_manager`'s server-side applies own the pool's `spec.replicas` (read from
    `metadata.managedFields`, as the API server records it)."""
    for entry in ((pool or {}).get("metadata") or {}).get("managedFields") or []:
        if entry.get("manager") == field_manager and entry.get("operation") == "Apply":
            spec = (entry.get("fieldsV1") or {}).get("f:spec") or {}
            if "f:replicas" in spec:
                return True
    return False
