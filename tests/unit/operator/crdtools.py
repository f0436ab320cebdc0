"""What the API server does with a CRD schema, for tests: pruning nulls, defaulting, the schema
check (with kubectl's strict field validation) and the CEL rules."""

from __future__ import annotations

import copy
import json
from typing import Any

import celpy
import jsonschema
from celcheck import walk


def apply_defaults(obj: Any, schema: dict[str, Any]) -> Any:
    """Structural defaulting as the API server does it: object by object, top down, only inside
    objects that are present, into array items and map values too. A null where the schema is
    not nullable is pruned first (and then defaulted); a null where it is nullable stays."""
    if isinstance(obj, dict) and schema.get("type") == "object":
        props = schema.get("properties") or {}
        for key, sub in props.items():
            if key in obj and obj[key] is None and not sub.get("nullable"):
                del obj[key]
            if key not in obj and "default" in sub:
                obj[key] = copy.deepcopy(sub["default"])
            if key in obj:
                obj[key] = apply_defaults(obj[key], sub)
        values = schema.get("additionalProperties")
        if isinstance(values, dict):
            for key in list(obj):
                obj[key] = apply_defaults(obj[key], values)
    elif isinstance(obj, list) and "items" in schema:
        return [apply_defaults(x, schema["items"]) for x in obj]
    return obj


def _to_draft4(schema: Any) -> Any:
    if isinstance(schema, list):
        return [_to_draft4(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {
        k: _to_draft4(v) if k in ("items", "additionalProperties") else v
        for k, v in schema.items()
        if not k.startswith("x-kubernetes") and k not in ("default", "properties", "nullable")
    }
    if "properties" in schema:
        out["properties"] = {k: _to_draft4(v) for k, v in schema["properties"].items()}
        if not schema.get("x-kubernetes-preserve-unknown-fields"):
            # kubectl (1.27+) asks for strict field validation: an unknown field is an error
            out.setdefault("additionalProperties", False)
    if schema.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    return out


def schema_errors(obj: dict[str, Any], schema: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft4Validator(_to_draft4(schema))
    return [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(obj)]


def cel_errors(obj: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Evaluate every x-kubernetes-validations rule on the (defaulted) object, every node."""
    env = celpy.Environment()
    errors = []
    if obj is None:
        return errors
    for rule in schema.get("x-kubernetes-validations", []):
        if "oldSelf" in rule["rule"]:
            continue  # transition rules need an old object
        program = env.program(env.compile(rule["rule"]))
        try:
            ok = program.evaluate({"self": celpy.json_to_cel(obj)})
        except celpy.CELEvalError as err:  # cel-go: "no such key: port evaluating rule: ..."
            errors.append(f"{path or '<root>'}: {err.args[0]} evaluating rule: {rule['message']}")
            continue
        if not ok:
            errors.append(f"{path or '<root>'}: {rule['message']}")
    if isinstance(obj, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key in obj:
                errors += cel_errors(obj[key], sub, f"{path}.{key}".lstrip("."))
        values = schema.get("additionalProperties")
        if isinstance(values, dict):
            for key, value in obj.items():
                errors += cel_errors(value, values, f"{path}[{key}]")
    elif isinstance(obj, list) and "items" in schema:
        for i, value in enumerate(obj):
            errors += cel_errors(value, schema["items"], f"{path}[{i}]")
    return errors


def default_errors(schema: dict[str, Any], path: str = "") -> list[str]:
    """What the API server answers when the CRD is created: every default, as written (no
    defaulting inside it first), against its node's schema and every rule at that node and
    below it (apiextensions' ValidateDefaults). [] = the CRD is accepted on this count."""
    errors = []
    for where, node in walk(schema, path):
        if "default" not in node:
            continue
        value = copy.deepcopy(node["default"])
        errors += [f"{where}.default: {e}" for e in schema_errors(value, node)]
        errors += [f"{where}.default: {e}" for e in cel_errors(value, node, where)]
    return errors


def crd_schema(crd: dict[str, Any]) -> dict[str, Any]:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def defaulted(cr: dict[str, Any], crd: dict[str, Any]) -> dict[str, Any]:
    """The object as the API server stores it and the operator reads it: defaulted, and every
    map's keys sorted (Go's JSON encoding of an unstructured object)."""
    obj = apply_defaults(copy.deepcopy(cr), crd_schema(crd))
    return json.loads(json.dumps(obj, sort_keys=True))


def admit(cr: dict[str, Any], crd: dict[str, Any]) -> list[str]:
    """Errors the API server would answer for this CR (schema, then CEL); [] = accepted."""
    schema = crd_schema(crd)
    obj = defaulted(cr, crd)
    # apiVersion, kind and metadata are the API server's own (metadata.name: see the CEL rules)
    body = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind", "metadata")}
    errs = schema_errors(body, schema)
    return errs or cel_errors(obj, schema)
