"""What the API server does with a CRD schema, for tests: defaulting, schema and CEL checks."""

from __future__ import annotations

import copy
from typing import Any

import celpy
import jsonschema


def apply_defaults(obj: Any, schema: dict[str, Any]) -> Any:
    """Structural defaulting as the API server does it (object by object, leaves last)."""
    if isinstance(obj, dict) and schema.get("type") == "object":
        for key, sub in (schema.get("properties") or {}).items():
            if key not in obj and "default" in sub:
                obj[key] = copy.deepcopy(sub["default"])
            if key in obj:
                obj[key] = apply_defaults(obj[key], sub)
    elif isinstance(obj, list) and "items" in schema:
        return [apply_defaults(x, schema["items"]) for x in obj]
    return obj


def _to_draft4(schema: Any) -> Any:
    if isinstance(schema, list):
        return [_to_draft4(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {
        k: _to_draft4(v)
        for k, v in schema.items()
        if not k.startswith("x-kubernetes") and k not in ("default",)
    }
    if out.pop("nullable", False) and "type" in out:
        out["type"] = [out["type"], "null"]
    return out


def schema_errors(obj: dict[str, Any], schema: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft4Validator(_to_draft4(schema))
    return [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(obj)]


def cel_errors(obj: Any, schema: dict[str, Any], path: str = "spec") -> list[str]:
    """Evaluate every x-kubernetes-validations rule on the (defaulted) object."""
    env = celpy.Environment()
    errors = []
    for rule in schema.get("x-kubernetes-validations", []):
        if "oldSelf" in rule["rule"]:
            continue  # transition rules need an old object
        program = env.program(env.compile(rule["rule"]))
        if not program.evaluate({"self": celpy.json_to_cel(obj)}):
            errors.append(f"{path}: {rule['message']}")
    if isinstance(obj, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if isinstance(obj.get(key), dict):
                errors += cel_errors(obj[key], sub, f"{path}.{key}")
    return errors


def admit(cr: dict[str, Any], crd: dict[str, Any]) -> list[str]:
    """Errors the API server would answer for this CR (schema, then CEL); [] = accepted."""
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    spec_schema = schema["properties"]["spec"]
    spec = apply_defaults(copy.deepcopy(cr.get("spec") or {}), spec_schema)
    errs = schema_errors(spec, spec_schema)
    return errs or cel_errors(spec, spec_schema)
