"""An in-memory Kubernetes API with the semantics the operator relies on.

- Every write bumps a global resourceVersion; spec changes bump `metadata.generation`.
- An apply carrying `metadata.resourceVersion` is a precondition: a stale
  one fails with 409 Conflict, as on a real API server.
- Errors are `ApiException`s with a `Status` body, the shape the real client raises.
- Server-side apply owns what it applies, per field manager, in `metadata.managedFields`
  (top-level `spec` keys: the granularity the operator's writes need): a key the applier
  never set (written by a create or a person, e.g. a pool's `replicas`) is kept; one it set
  before and now omits is removed unless another applier owns it too. A person's write that
  changes a key takes it from every applier, as an update does on a real API server.
- `hook(op)` runs before every call, so a test can interleave user writes (a `kubectl scale`)
  or kill the operator (raise) between any two of the operator's calls.
"""

from __future__ import annotations

import copy
import itertools
import json
from collections.abc import Callable
from typing import Any

from kubernetes.client.exceptions import ApiException


def api_error(code: int, reason: str, message: str, causes: list[dict] | None = None, **details):
    err = ApiException(status=code, reason=reason)
    status = {"kind": "Status", "status": "Failure", "message": message, "reason": reason}
    if causes or details:
        status["details"] = {**details, **({"causes": causes} if causes else {})}
    status["code"] = code
    err.body = json.dumps(status)
    return err


class Killed(BaseException):
    """The operator process died between two API calls (a BaseException, like SystemExit, so
    no `except Exception` in the operator can swallow it)."""


class FakeApi:
    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str, str], dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []
        self.writes = 0
        self.calls: list[str] = []
        self.hook: Callable[[str], None] | None = None
        # (kind, name) -> exception raised by apply: a child the API server refuses
        self.refuse: dict[tuple[str, str], Exception] = {}
        # (kind, name, spec before, spec after) of every apply that changed an existing spec
        self.applied_spec_changes: list[tuple[str, str, dict, dict]] = []
        # Stale reads: with this probability a get returns an older version of the object, as
        # a cache or a lagging watch would (`rng` decides; `history` keeps the versions).
        self.stale_reads = 0.0
        self.rng = None
        self.history: dict[tuple, list[dict]] = {}
        self._rv = itertools.count(1)
        self._uid = itertools.count(1)

    # -- helpers for tests (not part of ClusterApi) --------------------------------------------
    @staticmethod
    def key(api_version, kind, ns, name):
        return (api_version, kind, ns, name)

    def _store(self, new: dict, spec_changed: bool) -> None:
        """Replace the stored object by `new` (a modified copy), keeping the old in history."""
        m = new["metadata"]
        key = self.key(new["apiVersion"], new["kind"], m["namespace"], m["name"])
        if key in self.objects:
            self.history.setdefault(key, []).append(self.objects[key])
        m["resourceVersion"] = str(next(self._rv))
        if spec_changed:
            m["generation"] = m.get("generation", 0) + 1
        self.objects[key] = new
        self.writes += 1

    def create(self, obj: dict) -> dict:
        obj = copy.deepcopy(obj)
        m = obj["metadata"]
        m.setdefault("namespace", "default")
        m["uid"] = m.get("uid") or f"uid-{next(self._uid)}"
        m["generation"] = 1
        m["resourceVersion"] = str(next(self._rv))
        self.objects[self.key(obj["apiVersion"], obj["kind"], m["namespace"], m["name"])] = obj
        return copy.deepcopy(obj)

    def obj(self, api_version, kind, name, ns="default") -> dict:
        return self.objects[self.key(api_version, kind, ns, name)]

    def user_patch_spec(self, api_version, kind, name, spec_patch, ns="default") -> None:
        """A person's write (kubectl scale / edit): unconditional, no hook."""
        obj = copy.deepcopy(self.obj(api_version, kind, name, ns))
        before = copy.deepcopy(obj.get("spec") or {})
        _merge(obj.setdefault("spec", {}), spec_patch)
        changed = {k for k in set(before) | set(obj["spec"]) if before.get(k) != obj["spec"].get(k)}
        for manager, keys in _apply_owners(obj).items():
            _set_owner(obj, manager, keys - changed)
        self._store(obj, True)

    def _call(self, op: str) -> None:
        self.calls.append(op)
        if self.hook:
            self.hook(op)

    def _check_rv(self, current: dict | None, wanted: str | None, what: str) -> None:
        if wanted is None:
            return
        if current is None or current["metadata"]["resourceVersion"] != wanted:
            raise api_error(
                409,
                "Conflict",
                f"Operation cannot be fulfilled on {what}: the object has been modified; "
                "please apply your changes to the latest version and try again",
            )

    # -- ClusterApi ----------------------------------------------------------------------------
    def apply(self, obj, field_manager="dualpath-operator"):
        self._call(f"apply {obj['kind']}/{obj['metadata']['name']}")
        m = obj["metadata"]
        refused = self.refuse.get((obj["kind"], m["name"]))
        if refused is not None:
            raise refused
        key = self.key(obj["apiVersion"], obj["kind"], m["namespace"], m["name"])
        current = self.objects.get(key)
        self._check_rv(current, m.get("resourceVersion"), f"{obj['kind']} {m['name']}")
        applied_spec = obj.get("spec") or {}
        if current is None:
            fresh = copy.deepcopy(obj)
            fresh["metadata"].pop("resourceVersion", None)
            _set_owner(fresh, field_manager, set(applied_spec))
            return self.create(fresh)
        merged = copy.deepcopy(current)
        for k, v in obj.items():
            if k not in ("metadata", "status", "spec"):
                merged[k] = copy.deepcopy(v)
        owners = _apply_owners(current)
        owned_before = owners.pop(field_manager, set())
        kept_by_others = set().union(*owners.values())
        dropped = owned_before - set(applied_spec) - kept_by_others
        if "spec" in obj or dropped:
            spec = {k: v for k, v in (current.get("spec") or {}).items() if k not in dropped}
            merged["spec"] = {**spec, **copy.deepcopy(applied_spec)}
        _set_owner(merged, field_manager, set(applied_spec))
        for k in ("labels", "annotations"):
            if k in m:
                merged["metadata"].setdefault(k, {}).update(m[k])
        if "ownerReferences" in m:
            merged["metadata"]["ownerReferences"] = copy.deepcopy(m["ownerReferences"])
        if merged.get("spec") != current.get("spec"):
            self.applied_spec_changes.append(
                (obj["kind"], m["name"], copy.deepcopy(current.get("spec")), merged.get("spec"))
            )
        if merged != current:
            self._store(merged, merged.get("spec") != current.get("spec"))
        return copy.deepcopy(self.objects[key])

    def create_only(self, obj):
        self._call(f"create {obj['kind']}/{obj['metadata']['name']}")
        m = obj["metadata"]
        refused = self.refuse.get((obj["kind"], m["name"]))
        if refused is not None:
            raise refused
        if self.key(obj["apiVersion"], obj["kind"], m["namespace"], m["name"]) in self.objects:
            return False
        self.create(obj)
        return True

    def get(self, api_version, kind, ns, name):
        self._call(f"get {kind}/{name}")
        key = self.key(api_version, kind, ns, name)
        old = self.history.get(key)
        if old and key in self.objects and self.rng and self.rng.random() < self.stale_reads:
            return copy.deepcopy(self.rng.choice(old[-4:]))
        return copy.deepcopy(self.objects.get(key))

    def list(self, api_version, kind, ns, labels):
        self._call(f"list {kind}")
        return [
            copy.deepcopy(o)
            for (av, k, n, _), o in sorted(self.objects.items())
            if (av, k, n) == (api_version, kind, ns)
            and all((o["metadata"].get("labels") or {}).get(a) == b for a, b in labels.items())
        ]

    def delete(self, api_version, kind, ns, name, uid):
        self._call(f"delete {kind}/{name}")
        key = self.key(api_version, kind, ns, name)
        current = self.objects.get(key)
        if current is None:
            raise api_error(404, "NotFound", f"{kind} {name} not found")
        if current["metadata"]["uid"] != uid:
            raise api_error(409, "Conflict", f"Precondition failed: UID in precondition: {uid}")
        del self.objects[key]
        self.writes += 1

    def patch_status(self, api_version, kind, ns, name, status):
        self._call(f"status {kind}/{name}")
        obj = self.objects.get(self.key(api_version, kind, ns, name))
        if obj is None:
            raise api_error(404, "NotFound", f"{kind} {name} not found")
        new = copy.deepcopy(obj)
        new.setdefault("status", {})
        _merge(new["status"], status)
        if new["status"] != (obj.get("status") or {}):
            self._store(new, False)

    def event(self, obj, type_, reason, message):
        self._call(f"event {reason}")
        self.events.append(
            {
                "kind": obj["kind"],
                "name": obj["metadata"]["name"],
                "type": type_,
                "reason": reason,
                "message": message,
            }
        )


def _apply_owners(obj: dict) -> dict[str, set[str]]:
    """manager -> the top-level spec keys its applies own, from `metadata.managedFields`."""
    return {
        e["manager"]: {k.removeprefix("f:") for k in e["fieldsV1"].get("f:spec", {})}
        for e in obj["metadata"].get("managedFields") or []
        if e.get("operation") == "Apply"
    }


def _set_owner(obj: dict, manager: str, keys: set[str]) -> None:
    entries = [
        e
        for e in obj["metadata"].get("managedFields") or []
        if not (e["manager"] == manager and e.get("operation") == "Apply")
    ]
    if keys:
        entries.append(
            {
                "manager": manager,
                "operation": "Apply",
                "apiVersion": obj["apiVersion"],
                "fieldsType": "FieldsV1",
                "fieldsV1": {"f:spec": {f"f:{k}": {} for k in sorted(keys)}},
            }
        )
    if entries:
        obj["metadata"]["managedFields"] = entries
    else:
        obj["metadata"].pop("managedFields", None)


def _merge(into: dict, patch: dict) -> None:
    """JSON merge patch (RFC 7386): None deletes a key, mappings merge, the rest replaces."""
    for k, v in patch.items():
        if v is None:
            into.pop(k, None)
        elif isinstance(v, dict) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        else:
            into[k] = copy.deepcopy(v)
