"""Compile and type-check a CRD's CEL rules the way kube-apiserver does, before any cluster sees
them: each rule against the declared type of the node it sits on (cel-expr-python: Google's C++
CEL with its type checker; cel-python, used by crdtools.admit, never type-checks).

The schema becomes protobuf messages built on the fly: object -> message, string -> string,
integer -> int64, number -> double, boolean -> bool, array -> repeated, map -> map<string, X>,
int-or-string / schemaless preserve-unknown -> google.protobuf.Value (dyn). Scalars are proto3
`optional` so `has()` works. A nullable field is its base type, as in the API server (so
`x == null` does not type-check there either). The root also gets apiVersion, kind and
metadata.{name, generateName}, the only metadata a rule may read.

Costs: the API server refuses a rule whose estimated cost exceeds 10M units; `estimated_cost`
follows cel-go's estimates for the calls our rules make on strings and lists (an unbounded
string is taken as long as the 3 MiB request), and `unbounded_operands` lists the strings and
lists a rule scans without maxLength/maxItems.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from typing import Any

from cel_expr_python import cel
from google.protobuf import descriptor_pb2, descriptor_pool, struct_pb2

F = descriptor_pb2.FieldDescriptorProto
PACKAGE = "crd"
COST_LIMIT = 10_000_000  # apiextensions StaticEstimatedCostLimit, per rule
UNBOUNDED_STRING = 3 * 1024 * 1024 - 2  # the API server's max request size, minus quotes
_SCALARS = {
    "string": (F.TYPE_STRING, cel.Type.STRING),
    "integer": (F.TYPE_INT64, cel.Type.INT),
    "number": (F.TYPE_DOUBLE, cel.Type.DOUBLE),
    "boolean": (F.TYPE_BOOL, cel.Type.BOOL),
}
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _dyn(node: dict[str, Any]) -> bool:
    return bool(node.get("x-kubernetes-int-or-string")) or (
        "type" not in node and bool(node.get("x-kubernetes-preserve-unknown-fields"))
    )


class _Declarations:
    """One proto file holding a message per object node; `types[path]` = the CEL type of each
    node that carries rules."""

    def __init__(self, root: dict[str, Any], crd_root: bool) -> None:
        self.file = descriptor_pb2.FileDescriptorProto(
            name="crd.proto",
            package=PACKAGE,
            syntax="proto3",
            dependency=["google/protobuf/struct.proto"],
        )
        self.types: dict[str, cel.Type] = {}
        self._names: set[str] = set()
        if crd_root:  # the API server's view of the root: what the schema says plus these
            meta = {
                "type": "object",
                "properties": {"name": {"type": "string"}, "generateName": {"type": "string"}},
            }
            extra = {"apiVersion": {"type": "string"}, "kind": {"type": "string"}}
            root = {
                **root,
                "properties": {**extra, "metadata": meta, **(root.get("properties") or {})},
            }
        self._node(root, "", "Root")

    def _node(self, node: dict[str, Any], path: str, name: str) -> None:
        """Declare a node with rules (any type) and everything below it."""
        if node.get("type") == "object" and "properties" in node:
            self.types[path] = cel.Type(f"{PACKAGE}.{self._message(node, path, name)}")
            return
        if node.get("x-kubernetes-validations"):
            scalar = _SCALARS.get(node.get("type", ""))
            self.types[path] = scalar[1] if scalar else cel.Type.DYN

    def _message(self, node: dict[str, Any], path: str, name: str) -> str:
        while name in self._names:
            name += "_"
        self._names.add(name)
        msg = self.file.message_type.add(name=name)
        optionals = []
        for number, (prop, sub) in enumerate((node.get("properties") or {}).items(), start=1):
            assert _IDENT.match(prop), f"{path}.{prop}: not a CEL identifier (escape it)"
            field = msg.field.add(name=prop, number=number, json_name=prop)
            self._field(field, sub, f"{path}.{prop}".lstrip("."), name + "_" + prop, msg)
            if field.label != F.LABEL_REPEATED and field.type != F.TYPE_MESSAGE:
                optionals.append(field)
        for field in optionals:  # proto3 `optional`: presence for has(); synthetic oneofs last
            field.proto3_optional = True
            field.oneof_index = len(msg.oneof_decl)
            msg.oneof_decl.add(name=f"_{field.name}")
        return name

    def _field(self, field: F, node: dict[str, Any], path: str, name: str, parent) -> None:
        field.label = F.LABEL_OPTIONAL
        if node.get("type") == "array":
            field.label = F.LABEL_REPEATED
            items = node.get("items") or {}
            if items.get("type") == "array":  # repeated of repeated: no proto for it
                field.type, field.type_name = F.TYPE_MESSAGE, ".google.protobuf.ListValue"
            else:
                self._element(field, items, path + "[*]", name + "_item")
        elif node.get("type") == "object" and isinstance(node.get("additionalProperties"), dict):
            # protoc's name for a map's entry: the field's name in CamelCase + "Entry"
            camel = "".join(w[:1].upper() + w[1:] for w in field.name.split("_"))
            entry = parent.nested_type.add(name=f"{camel}Entry")
            entry.options.map_entry = True
            entry.field.add(name="key", number=1, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
            value = entry.field.add(name="value", number=2, label=F.LABEL_OPTIONAL)
            self._element(value, node["additionalProperties"], path + "[*]", name + "_value")
            field.label, field.type = F.LABEL_REPEATED, F.TYPE_MESSAGE
            field.type_name = f".{PACKAGE}.{parent.name}.{entry.name}"
        else:
            self._element(field, node, path, name)
        if node.get("x-kubernetes-validations") and path not in self.types:
            self._node(node, path, name)

    def _element(self, field: F, node: dict[str, Any], path: str, name: str) -> None:
        if _dyn(node):
            field.type, field.type_name = F.TYPE_MESSAGE, ".google.protobuf.Value"
        elif node.get("type") == "object" and "properties" in node:
            field.type = F.TYPE_MESSAGE
            field.type_name = f".{PACKAGE}.{self._message(node, path, name)}"
            if node.get("x-kubernetes-validations"):
                self.types[path] = cel.Type(field.type_name[1:])
        elif node.get("type") == "object":  # an object with no declared fields
            field.type = F.TYPE_MESSAGE
            field.type_name = f".{PACKAGE}.{self._message(node, path, name)}"
        else:
            field.type = _SCALARS[node["type"]][0]
            if node.get("x-kubernetes-validations"):
                self.types[path] = _SCALARS[node["type"]][1]


def walk(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every schema node with its dotted path ([*] for array items and map values)."""
    yield path, node
    for prop, sub in (node.get("properties") or {}).items():
        yield from walk(sub, f"{path}.{prop}".lstrip("."))
    if isinstance(node.get("items"), dict):
        yield from walk(node["items"], path + "[*]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from walk(node["additionalProperties"], path + "[*]")


def check_rules(root: dict[str, Any], crd_root: bool = True) -> dict[str, list[str]]:
    """Compile every rule against its node's declared type; {path: [errors]} (empty: all ok)."""
    decls = _Declarations(root, crd_root)
    pool = descriptor_pool.DescriptorPool()
    pool.AddSerializedFile(struct_pb2.DESCRIPTOR.serialized_pb)
    pool.Add(decls.file)
    errors: dict[str, list[str]] = {}
    for path, node in walk(root):
        rules = node.get("x-kubernetes-validations") or []
        if not rules:
            continue
        self_type = decls.types[path]
        for rule in rules:
            variables = {"self": self_type}
            if "oldSelf" in rule["rule"]:
                variables["oldSelf"] = self_type
            env = cel.NewEnv(descriptor_pool=pool, variables=variables)
            try:
                compiled = env.compile(rule["rule"])
            except Exception as err:  # the checker's message, as the API server would print it
                errors.setdefault(path, []).append(f"{rule['rule']!r}: {err}")
                continue
            if compiled.return_type() != cel.Type.BOOL:
                errors.setdefault(path, []).append(f"{rule['rule']!r}: not a bool")
    return errors


# `self.a.b.fn(arg)`: the calls whose cost grows with the operand's length.
_CALL = re.compile(
    r"self((?:\.[A-Za-z_][A-Za-z0-9_]*)*)\.(matches|contains|startsWith|endsWith|all|exists|"
    r"exists_one|map|filter)\((?:'([^']*)'|\"([^\"]*)\")?"
)


def _operand(root: dict[str, Any], rule_path: str, fields: str, crd_root: bool) -> dict | None:
    node = root
    for part in filter(None, rule_path.split(".")):
        node = node["properties"][part]
    for part in filter(None, fields.split(".")):
        if crd_root and node is root and part == "metadata":
            return {"type": "object", "properties": {"name": {"type": "string"}}}
        node = (node.get("properties") or {}).get(part)
        if node is None:
            return None
    return node


def _size(node: dict[str, Any]) -> tuple[int, bool]:
    """Largest length cel-go assumes for a string/list/map node, and whether the schema says."""
    for key in ("maxLength", "maxItems", "maxProperties"):
        if key in node:
            return node[key], True
    return UNBOUNDED_STRING, False


def estimated_cost(root: dict[str, Any], crd_root: bool = True) -> dict[str, int]:
    """{rule: estimated cost} of the length-dependent calls, as cel-go's checker estimates them:
    matches ~ 0.1 * (len(string) + 1) * 0.25 * len(regex); contains ~ 0.1 * len(string) *
    0.1 * len(substring); startsWith ~ 0.1 * len(prefix); a comprehension ~ its list's size
    times a body of at most 10."""
    costs = {}
    for path, node in walk(root):
        for rule in node.get("x-kubernetes-validations") or []:
            total = 1
            for fields, fn, single, double in _CALL.findall(rule["rule"]):
                operand = _operand(root, path, fields, crd_root)
                if operand is None:
                    continue
                size, _ = _size(operand)
                arg = len(single or double)
                if fn == "matches":
                    total += math.ceil(0.1 * (size + 1)) * math.ceil(0.25 * arg)
                elif fn == "contains":
                    total += math.ceil(0.1 * size) * math.ceil(0.1 * arg)
                elif fn in ("startsWith", "endsWith"):  # bounded by the affix
                    total += math.ceil(0.1 * arg)
                else:
                    total += size * 10
            costs[rule["rule"]] = total
    return costs


def unbounded_operands(root: dict[str, Any], crd_root: bool = True) -> list[str]:
    """Strings and lists a rule scans (matches, all, exists, ...) without maxLength/maxItems;
    metadata.name is the API server's own (its length is checked by size() first)."""
    found = []
    for path, node in walk(root):
        for rule in node.get("x-kubernetes-validations") or []:
            for fields, *_ in _CALL.findall(rule["rule"]):
                operand = _operand(root, path, fields, crd_root)
                if operand is not None and not _size(operand)[1] and fields != ".metadata.name":
                    found.append(f"{path}{fields} in {rule['rule']!r}")
    return found
