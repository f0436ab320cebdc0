"""Every CEL rule of both CRDs compiles and type-checks against the schema's declared types, the
way kube-apiserver checks them when the CRD is created, and stays within its cost budget."""

import copy

import celpy
import pytest
from celcheck import COST_LIMIT, check_rules, estimated_cost, unbounded_operands, walk
from crdtools import (
    admit,
    apply_defaults,
    cel_errors,
    crd_schema,
    default_errors,
    schema_errors,
)
from dualpath_operator import crd

CRDS = {"clusters": crd.cluster_crd, "pools": crd.pool_crd}


@pytest.mark.parametrize("which", CRDS)
def test_every_rule_compiles_and_type_checks(which):
    schema = crd_schema(CRDS[which]())
    rules = [r for _, node in walk(schema) for r in node.get("x-kubernetes-validations", [])]
    assert rules, "no rules found: the walk is broken"
    assert check_rules(schema) == {}


def _with_model_rule(rule):
    schema = copy.deepcopy(crd_schema(crd.cluster_crd()))
    schema["properties"]["spec"]["properties"]["model"]["x-kubernetes-validations"] = [
        {"rule": rule, "message": "m"}
    ]
    return schema


def test_the_checker_refuses_the_rule_the_api_server_refused():
    # the rule of issue 14: "found no matching overload for '_==_' applied to '(string, null)'"
    old = '!has(self.preset) || self.preset == null || self.preset in ["tiny"]'
    errors = check_rules(_with_model_rule(old))
    assert list(errors) == ["spec.model"]
    assert "no matching overload for '_==_'" in errors["spec.model"][0]
    fixed = crd.CEL_RULES["spec.model"][0][0]
    assert "null_type" in fixed and check_rules(_with_model_rule(fixed)) == {}


@pytest.mark.parametrize(
    "rule, needle",
    [
        ("self.layers > 0.5", "no matching overload"),  # int vs double: no cross-type compare
        ("self.layerz > 0", "undefined field 'layerz'"),
        ("self.name + 1 == 'x'", "no matching overload"),
        ("self.layers", "not a bool"),
        ("self.preset.frobnicate()", "undeclared reference"),
    ],
)
def test_the_checker_refuses_ill_typed_rules(rule, needle):
    errors = check_rules(_with_model_rule(rule))
    assert needle in " ".join(errors.get("spec.model", [])), errors


@pytest.mark.parametrize(
    "path, rule",
    [
        ("spec.prefill", "self.nodeSelector.all(k, self.nodeSelector[k] != '')"),
        ("spec.prefill", "self.tolerations.all(t, !has(t.key) || t.operator == 'Equal')"),
        ("spec.prefill", "self.resources.limits.all(k, k.startsWith('n'))"),
        ("spec.prefill", "!has(self.resources.limits.cpu) || self.resources.limits.cpu != 0"),
        ("spec.storage", "!has(self.volume) || has(self.volume.nfs) || size(self.path) > 0"),
        ("spec.model", "!has(self.ropeScaling) || self.ropeScaling.factor > 0.0"),
        ("", "self.kind == 'DualPathCluster' && self.spec.decode.replicas >= 0"),
    ],
)
def test_maps_lists_int_or_string_and_nested_objects_are_declared(path, rule):
    schema = copy.deepcopy(crd_schema(crd.cluster_crd()))
    node = schema
    for part in filter(None, path.split(".")):
        node = node["properties"][part]
    node["x-kubernetes-validations"] = [{"rule": rule, "message": "m"}]
    assert check_rules(schema) == {}


def test_rules_are_within_the_api_servers_cost_budget():
    for make in CRDS.values():
        schema = crd_schema(make())
        assert unbounded_operands(schema) == []
        costs = estimated_cost(schema)
        assert costs and max(costs.values()) <= COST_LIMIT, costs


def test_an_unbounded_string_under_matches_is_caught():
    rule = "self.image.matches('^[a-z]+(/[a-z]+)*$')"
    schema = _with_model_rule(rule)
    assert any("spec.model.image" in u for u in unbounded_operands(schema))
    assert estimated_cost(schema)[rule] > 1_000_000  # as long as a 3 MiB request
    schema["properties"]["spec"]["properties"]["model"]["properties"]["image"]["maxLength"] = 253
    assert unbounded_operands(schema) == []
    assert estimated_cost(schema)[rule] < 1_000


def test_preset_null_with_explicit_dims_passes_the_fixed_rule_at_runtime():
    dims = {"layers": 2, "hiddenSize": 16, "heads": 2, "kvHeads": 1, "headDim": 8}
    cr = {
        "apiVersion": "dualpath.io/v1alpha1",
        "kind": "DualPathCluster",
        "metadata": {"name": "x"},
        "spec": {"model": {"preset": None, "vocabSize": 32, **dims}},
    }
    assert admit(cr, crd.cluster_crd()) == []


@pytest.mark.parametrize("which", CRDS)
def test_every_default_as_written_passes_its_nodes_schema_and_rules(which):
    # the API server validates each default when the CRD is created, as written (a `{}` has no
    # keys: no defaulting inside it first), against its node's schema and every rule at that
    # node and below: issue 32's "no such key: port evaluating rule" came from there
    schema = crd_schema(CRDS[which]())
    assert default_errors(schema) == []


@pytest.mark.parametrize("which", CRDS)
def test_every_default_once_filled_in_satisfies_its_rules(which):
    # what a stored object holds when a field is left out: the default, then defaulting
    # inside it; the guards of when_set() must not let a default break a rule there
    schema = crd_schema(CRDS[which]())
    checked = 0
    for path, node in walk(schema):
        if "default" in node:
            value = apply_defaults(copy.deepcopy(node["default"]), node)
            assert schema_errors(value, node) == [], path
            assert cel_errors(value, node, path) == [], path
            checked += 1
    assert checked >= (10 if which == "clusters" else 0)


def _with_rule(path, rule, message="m"):
    schema = copy.deepcopy(crd_schema(crd.cluster_crd()))
    node = schema
    for part in filter(None, path.split(".")):
        node = node["properties"][part]
    node["x-kubernetes-validations"] = [{"rule": rule, "message": message}]
    return schema


def test_the_default_check_refuses_the_rule_the_api_server_refused():
    # issue 32, as kube-apiserver v1.28 printed it: "properties[spec].properties[frontend]
    # .default: Invalid value: "object": no such key: port evaluating rule: frontend.port must
    # not be the metrics port 9090"; the default was {} and the rule unguarded
    message = "frontend.port must not be the metrics port 9090"
    broken = _with_rule("spec.frontend", "self.port != 9090", message)
    assert (
        crd_schema(crd.cluster_crd())["properties"]["spec"]["properties"]["frontend"]["default"]
        == {}
    )
    errors = default_errors(broken)
    assert len(errors) == 1, errors
    assert errors[0].startswith("spec.frontend.default: spec.frontend: ")
    assert "port" in errors[0] and f"evaluating rule: {message}" in errors[0]
    fixed = _with_rule("spec.frontend", crd.when_set("self.port != 9090"), message)
    assert default_errors(fixed) == []


def test_the_default_check_reaches_rules_below_a_default():
    # a default of {"qos": {}} at spec.network runs the qos rule on {}: a rule is checked
    # against every default above it that holds its node, not only its own
    broken = _with_rule("spec.network.qos", "!self.enabled || self.model.serviceLevel != 1")
    broken["properties"]["spec"]["properties"]["network"]["default"] = {"qos": {}}
    paths = {e.split(": ", 1)[0] for e in default_errors(broken)}
    assert paths == {"spec.network.default", "spec.network.qos.default"}


@pytest.mark.parametrize("path, rules", list(crd.CEL_RULES.items()), ids=lambda v: str(v)[:30])
def test_every_rule_that_reads_a_field_holds_on_an_empty_object(path, rules):
    if not path:
        return  # the root always has metadata.name
    env = celpy.Environment()
    for rule, _ in rules:
        program = env.program(env.compile(rule))
        assert program.evaluate({"self": celpy.json_to_cel({})}), rule


@pytest.mark.parametrize(
    "rule, full, verdict",
    [
        ("self.port != 9090", {"port": 9090}, False),
        ("self.path.startsWith('/')", {"path": "rel"}, False),
        ("!self.enabled || self.model.serviceLevel != self.kv.serviceLevel", None, True),
        ("self.a <= self.b", {"a": 2, "b": 1}, False),
        ("self.a <= self.b", {"a": 1}, True),
        ("self.a > 0 ? self.b > 0 : true", {"a": 1, "b": 0}, False),
        ("self.a > 0 ? self.b > 0 : true", {"a": 0}, True),
    ],
)
def test_when_set_guards_only_absent_fields(rule, full, verdict):
    env = celpy.Environment()
    guarded = env.program(env.compile(crd.when_set(rule)))
    assert guarded.evaluate({"self": celpy.json_to_cel({})})
    if full is not None:
        assert bool(guarded.evaluate({"self": celpy.json_to_cel(full)})) is verdict
