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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ROLES = ("prefill", "decode")


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
