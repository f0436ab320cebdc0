"""The API server's schema defaults never beat the model: what the operator reads (the CR after
structural defaulting) renders exactly what `dualpath render -f` renders from the file."""

import argparse
import copy
import io
import types
import typing
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import yaml
from crdtools import apply_defaults, crd_schema, defaulted
from dualpath import config
from dualpath_operator import crd, render_cli
from dualpath_operator.builders import render, with_cert_manager
from pydantic import BaseModel, TypeAdapter
from pydantic.alias_generators import to_camel

ROOT = Path(__file__).resolve().parents[3]
CRD = crd.cluster_crd()


def _cr(spec, name="x"):
    return {
        "apiVersion": config.API_VERSION_FULL,
        "kind": config.KIND,
        "metadata": {"name": name, "namespace": "ns"},
        "spec": spec,
    }


def _files():
    paths = sorted((ROOT / "examples").glob("*.yaml")) + [ROOT / "workers/dualpath/data/local.yaml"]
    return [
        p
        for p in paths
        if any(d and d.get("kind") == config.KIND for d in yaml.safe_load_all(p.read_text()))
    ]


SPECS = {
    **{f"preset-{p}": {"model": {"preset": p}} for p in config.MODEL_PRESETS},
    "empty": {},
    "qwen-fp16-override": {"model": {"preset": "qwen2.5-32b", "dtype": "float16", "layers": 8}},
    "deepseek-named": {"model": {"preset": "deepseek-v3.2", "name": "ds"}, "decode": {}},
    "no-preset": {
        "model": {"preset": None, "layers": 2, "hiddenSize": 32, "heads": 4, "kvHeads": 2}
        | {"headDim": 8, "vocabSize": 64, "dtype": "bfloat16"},
    },
    "pools-and-tolerations": {
        "prefill": {"replicas": 3, "tolerations": [{"key": "gpu", "effect": "NoSchedule"}]},
        "decode": {"gpusPerPod": 1, "resources": {"requests": {"cpu": 4, "memory": "16Gi"}}},
        "network": {
            "qos": {"kv": {"serviceLevel": 3, "trafficClass": 96}},
            "rdma": {},
            "multusNetworks": ["b", "a"],
        },
        "storage": {"volume": {"nfs": {"server": "nfs.local", "path": "/kv"}}},  # unsorted
    },
}


def _render_text(cfg):
    """What the operator applies on a cluster that serves no cert-manager (render's default)."""
    cfg = with_cert_manager(cfg, False)
    return yaml.safe_dump_all(render(cfg, {"name": cfg.name, "uid": "u-1"}), sort_keys=False)


def _render_cli(path):
    out = io.StringIO()
    with redirect_stdout(out):
        rc = render_cli.run(argparse.Namespace(file=str(path), uid="u-1", crds=False))
    assert rc == 0
    return out.getvalue()


def _same(raw_cr, tmp_path):
    raw = config.from_resource(raw_cr)
    served = config.from_resource(defaulted(raw_cr, CRD))  # what the operator reads
    assert served == raw
    assert served.config_hash == raw.config_hash
    assert served.spec_json() == raw.spec_json()
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(raw_cr, sort_keys=False))  # keys as written
    assert _render_cli(path) == _render_text(served)  # dualpath render == the operator, bytes
    return served


@pytest.mark.parametrize("path", _files(), ids=lambda p: p.name)
def test_files_render_the_same_after_api_server_defaulting(path, tmp_path):
    for doc in yaml.safe_load_all(path.read_text()):
        if doc and doc.get("kind") == config.KIND:
            _same(doc, tmp_path)


@pytest.mark.parametrize("name", SPECS)
def test_specs_render_the_same_after_api_server_defaulting(name, tmp_path):
    _same(_cr(copy.deepcopy(SPECS[name])), tmp_path)


def test_a_preset_is_not_overridden_by_schema_defaults(tmp_path):
    qwen = _same(_cr({"model": {"preset": "qwen2.5-32b"}}), tmp_path).spec.model
    assert (qwen.name, qwen.dtype, qwen.layers) == ("qwen2.5-32b", "bfloat16", 64)
    ds = _same(_cr({"model": {"preset": "deepseek-v3.2"}}), tmp_path).spec.model
    assert (ds.name, ds.attention, ds.kv_lora_rank) == ("deepseek-v3.2", "mla", 512)


def test_defaulting_is_structural():
    schema = {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {"x": {"type": "integer", "default": 1}},
            },
            "b": {
                "type": "object",
                "default": {},
                "properties": {"y": {"type": "string", "default": "y"}},
            },
            "list": {
                "type": "array",
                "items": {"type": "object", "properties": {"z": {"type": "integer", "default": 3}}},
            },
            "map": {
                "type": "object",
                "additionalProperties": {
                    "type": "object",
                    "properties": {"w": {"type": "integer", "default": 4}},
                },
            },
            "n": {"type": "string", "default": "n"},
            "m": {"type": "string", "nullable": True, "default": "m"},
        },
    }
    # absent parent `a`: nothing inside it is defaulted; `b` is created, then filled
    assert apply_defaults({}, schema) == {"b": {"y": "y"}, "n": "n", "m": "m"}
    got = apply_defaults(
        {"a": {}, "list": [{}, {"z": 0}], "map": {"k": {}}, "n": None, "m": None}, schema
    )
    # a null where not nullable is pruned then defaulted; where nullable it stays null
    assert got == {
        "a": {"x": 1},
        "b": {"y": "y"},
        "list": [{"z": 3}, {"z": 0}],
        "map": {"k": {"w": 4}},
        "n": "n",
        "m": None,
    }


def _unwrap(annotation):
    """(model class or None, how to step into the schema) for a field's type."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _unwrap(args[0])
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return _unwrap(inner[0]) if len(inner) == 1 else (None, None)
    if origin is list:
        return _unwrap(args[0])[0], "items"
    if origin is dict:
        return _unwrap(args[1])[0], "additionalProperties"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, None
    return None, None


def _check_defaults(model, schema, path, seen):
    for name, field in model.model_fields.items():
        alias = field.alias or to_camel(name)
        sub = schema["properties"][alias]
        where = f"{path}.{alias}"
        if "default" in sub:
            # the value the API server writes, as the model reads it, is the model's default
            served = apply_defaults(copy.deepcopy(sub["default"]), sub)
            got = TypeAdapter(field.annotation).validate_python(served)
            assert got == field.get_default(call_default_factory=True), where
            seen.append(where)
        elif field.default is not None and field.default_factory is None:
            if not field.is_required():
                assert model is config.ModelSpec and name in config.PRESET_FIELDS, (
                    f"{where}: the model has a default the schema does not"
                )
        nested, step = _unwrap(field.annotation)
        if nested is not None:
            _check_defaults(nested, sub[step] if step else sub, where, seen)


def test_every_schema_default_is_the_models_default():
    seen = []
    spec = crd_schema(CRD)["properties"]["spec"]
    _check_defaults(config.ClusterSpec, spec, "spec", seen)
    assert len(seen) > 40  # the walk reached the leaves
    model = spec["properties"]["model"]["properties"]
    assert not any("default" in model[to_camel(f)] for f in config.PRESET_FIELDS)
