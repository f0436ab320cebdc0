"""The cluster config model: presets, camelCase wire format, errors that name the field."""

import pytest
from dualpath import config


def test_local_default_loads_and_hashes_stably():
    a, b = config.local_default(), config.local_default()
    assert a.spec.prefill.replicas == 1 and a.spec.decode.replicas == 2
    assert a.config_hash == b.config_hash
    assert a.spec.model.preset == "small" and a.spec.model.layers == 8


def test_preset_fills_dims_and_explicit_values_win():
    spec = config.parse_spec({"model": {"preset": "llama3-8b", "blockTokens": 32, "layers": 4}})
    m = spec.model
    assert (m.layers, m.kv_heads, m.head_dim, m.dtype, m.block_tokens) == (4, 8, 128, "float16", 32)
    assert m.kv_bytes_per_token_layer == 2 * 8 * 128 * 2
    assert m.block_bytes == m.kv_bytes_per_token * 32


def test_fingerprint_depends_on_kv_format():
    a = config.parse_spec({"model": {"preset": "tiny"}}).model
    b = config.parse_spec({"model": {"preset": "tiny", "seed": 1}}).model
    assert a.fingerprint != b.fingerprint


@pytest.mark.parametrize(
    "spec, needle",
    [
        ({"prefil": {}}, "spec.prefil"),
        ({"prefill": {"replicas": -1}}, "spec.prefill.replicas"),
        ({"model": {"preset": "nope"}}, "unknown model preset"),
        ({"model": {"kvHeads": 3}}, "multiple of kvHeads"),
        ({"network": {"qos": {"kv": {"serviceLevel": 0, "trafficClass": 0}}}}, "must differ"),
        ({"scheduler": {"heartbeatIntervalMs": 1000, "nodeTimeoutMs": 1500}}, "nodeTimeoutMs"),
        ({"scheduler": {"policy": "fastest"}}, "spec.scheduler.policy"),
    ],
)
def test_bad_specs_name_the_field(spec, needle):
    with pytest.raises(config.ConfigError, match=needle.replace(".", r"\.")):
        config.parse_spec(spec)


def test_resource_round_trip(tmp_path):
    cfg = config.ClusterConfig(name="x", namespace="ns", spec=config.parse_spec({}))
    import yaml

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg.to_resource()))
    back = config.load(path)
    assert back == cfg


def test_wrong_kind_is_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("apiVersion: v1\nkind: Pod\nmetadata: {name: x}\n")
    with pytest.raises(config.ConfigError, match="no DualPathCluster"):
        config.load(path)
    with pytest.raises(config.ConfigError, match="apiVersion"):
        config.from_resource({"apiVersion": "v1", "kind": "DualPathCluster"})
