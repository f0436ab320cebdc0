"""Every CEL rule of both CRDs compiles and type-checks against the schema's declared types, the
way kube-apiserver checks them when the CRD is created, and stays within its cost budget."""

import copy

import pytest
from celcheck import COST_LIMIT, check_rules, estimated_cost, unbounded_operands, walk
from crdtools import admit, apply_defaults, cel_errors, crd_schema, schema_errors
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
def test_every_default_passes_its_nodes_schema_and_rules(which):
    # the API server validates each default (after defaulting inside it) when the CRD is
    # created, rules included: that is where issue 14's compile error surfaced
    schema = crd_schema(CRDS[which]())
    checked = 0
    for path, node in walk(schema):
        if "default" in node:
            value = apply_defaults(copy.deepcopy(node["default"]), node)
            assert schema_errors(value, node) == [], path
            assert cel_errors(value, node, path) == [], path
            checked += 1
    assert checked >= (10 if which == "clusters" else 0)
