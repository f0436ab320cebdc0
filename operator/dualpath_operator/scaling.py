"""Pure: who owns a role's replica count, the DualPathPool or the DualPathCluster spec.

Both can be written by people: `kubectl scale dpp/...` and HPAs write the pool's scale
subresource, `kubectl edit dpc/...` writes `spec.<role>.replicas`. A three-way merge against
what the operator last synced (annotations on the pool, so an operator restart loses nothing)
tells which side moved:

- pool == cluster: agreed.
- the pool moved (its `metadata.generation` is newer than the one last synced; generations
  only grow, so a scale back to an old value still counts as a move): the pool wins, also
  over a cluster edit made within the same sync.
- otherwise only the cluster moved: the cluster wins.

Every write that follows carries the resourceVersion it was decided from, so a write raced
by a newer one fails with 409 and the pass is redone from fresh reads: no scale is lost.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SYNCED_REPLICAS = "dualpath.io/synced-replicas"  # the count, for people
# The pool generation that count was synced at: a different generation means a scale.
SYNCED_POOL_GENERATION = "dualpath.io/synced-pool-generation"
# The cluster generation it was synced from: a cluster read older than it is stale (a cache,
# a lagging watch) and must not be taken for a cluster edit.
SYNCED_CLUSTER_GENERATION = "dualpath.io/synced-cluster-generation"
# On the cluster, per role: "<pool uid>/<pool generation>" whose count the cluster spec took
# (written in the same guarded patch): a pool read older than it is stale.
ABSORBED_POOL = "dualpath.io/{role}-pool-absorbed"
ROLES = ("prefill", "decode")


def _annotation_int(obj: dict[str, Any] | None, key: str) -> int | None:
    raw = (((obj or {}).get("metadata") or {}).get("annotations") or {}).get(key)
    return int(raw) if raw is not None and str(raw).isdigit() else None


@dataclass(frozen=True)
class RoleReplicas:
    """One role's values and the merge of them."""

    role: str
    cluster: int
    pool: int | None  # None: no pool object yet
    pool_generation: int = 0
    synced_pool_generation: int | None = None  # None: a pool written by an older operator
    synced: int | None = None
    absorbed_generation: int | None = None  # the pool generation the cluster spec took

    @property
    def pool_moved(self) -> bool:
        """Scaled since the last sync: its generation is newer than both the one the operator
        wrote on it and the one the cluster took (either can lag the other by a pass)."""
        known = max(self.synced_pool_generation or 0, self.absorbed_generation or 0)
        return self.pool_generation > known

    @property
    def source(self) -> str:
        if self.pool is None:
            return "cluster"
        if self.pool == self.cluster:
            return "agreed"
        return "pool" if self.pool_moved else "cluster"

    @property
    def value(self) -> int:
        return self.pool if self.source == "pool" and self.pool is not None else self.cluster


@dataclass(frozen=True)
class ReplicaPlan:
    """What to write: the cluster spec (pool moved), the pools, or nothing (refused)."""

    roles: dict[str, RoleReplicas]
    refused: str | None  # why the merged counts were not taken, for a condition and an event

    def target(self, role: str) -> int:
        """The count the StatefulSet gets this pass."""
        r = self.roles[role]
        return r.cluster if self.refused else r.value

    def cluster_patch(self) -> dict[str, Any]:
        """`spec` merge patch carrying the pools' moves into the cluster ({} for none)."""
        if self.refused:
            return {}
        return {
            role: {"replicas": r.value} for role, r in self.roles.items() if r.value != r.cluster
        }

    def pool_annotations(self, role: str) -> tuple[int, dict[str, str]]:
        """(spec.replicas, synced annotations) to apply on the pool. Writing a new count
        bumps the pool's generation by one, which is the generation synced. A refused pool
        keeps the count asked and its old annotations, so the ask stays visible and moved."""
        r = self.roles[role]
        if self.refused and r.pool is not None:
            return r.pool, {
                SYNCED_REPLICAS: str(r.synced if r.synced is not None else r.cluster),
                SYNCED_POOL_GENERATION: str(r.synced_pool_generation or 0),
            }
        if r.pool is None:
            generation = 1
        else:
            generation = r.pool_generation + (r.value != r.pool)
        return r.value, {
            SYNCED_REPLICAS: str(r.value),
            SYNCED_POOL_GENERATION: str(generation),
        }


def unsafe_reason(prefill: int, decode: int) -> str | None:
    if prefill > 0 and decode == 0:
        return (
            f"decode replicas 0 with prefill replicas {prefill}: every prefill hands its KV to "
            "a decode worker; keep decode at 1 or more, or scale prefill to 0 first"
        )
    return None


class StaleRead(Exception):
    """The cluster was read at an older generation than a pool already synced from."""

    status = 409  # handled like a write conflict: redo the pass from fresh reads


def absorbed(pool: dict[str, Any]) -> str:
    meta = pool["metadata"]
    return f"{meta.get('uid')}/{meta.get('generation', 0)}"


def plan(
    cluster: dict[str, int],
    pools: dict[str, dict[str, Any] | None],
    cluster_generation: int = 0,
    cluster_annotations: dict[str, str] | None = None,
) -> ReplicaPlan:
    """Merge each role's cluster spec count, pool object and synced annotations (reads).
    Raises StaleRead when one read predates what the other object was already synced from:
    a pass must never decide from it (it would revert a newer count)."""
    absorbed_gen = {}
    for role, pool in pools.items():
        synced_at = _annotation_int(pool, SYNCED_CLUSTER_GENERATION) or 0
        if synced_at > cluster_generation:
            raise StaleRead(
                f"cluster read at generation {cluster_generation}, DualPathPool {role} synced "
                f"from generation {synced_at}"
            )
        took = (cluster_annotations or {}).get(ABSORBED_POOL.format(role=role), "")
        uid, _, gen = took.rpartition("/")
        meta = (pool or {}).get("metadata") or {}
        if pool and uid == meta.get("uid") and gen.isdigit():
            absorbed_gen[role] = int(gen)
            if int(gen) > meta["generation"]:
                raise StaleRead(
                    f"DualPathPool {role} read at generation {meta['generation']}, the cluster "
                    f"took its count at generation {gen}"
                )
    roles = {}
    for role in ROLES:
        pool = pools.get(role)
        roles[role] = RoleReplicas(
            role,
            cluster[role],
            None if pool is None else int((pool.get("spec") or {}).get("replicas") or 0),
            int(((pool or {}).get("metadata") or {}).get("generation") or 0),
            _annotation_int(pool, SYNCED_POOL_GENERATION),
            _annotation_int(pool, SYNCED_REPLICAS),
            absorbed_gen.get(role),
        )
    why = unsafe_reason(roles["prefill"].value, roles["decode"].value)
    if why:
        movers = [f"DualPathPool {r.role}" for r in roles.values() if r.source == "pool"]
        why = f"scale refused ({', '.join(movers) or 'pools'}): {why}"
    return ReplicaPlan(roles, why)
