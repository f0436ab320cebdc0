"""The vLLM worker's command: `process_command` builds `vllm serve` for any placement (a pod's
or a local one), and the connector's extra config round-trips through its one definition."""

from __future__ import annotations

import json

import pytest
from dualpath import config
from dualpath.integrations.vllm.config import (
    ConnectorSettings,
    kv_transfer_config,
    kv_transfer_config_arg,
)
from dualpath.process import Component, Placement, process_command


def _vllm_cfg(**vllm) -> config.ClusterConfig:
    spec = config.local_default().to_resource()["spec"]
    spec["workers"] = {"engine": "vllm", "vllm": {"model": "/models/small", **vllm}}
    return config.ClusterConfig(spec=config.parse_spec(spec))


def _local(**kw) -> Placement:
    base = dict(
        config_file="/run/cluster.yaml",
        scheduler="127.0.0.1:40001",
        host="127.0.0.1",
        port=40123,
        metrics_port=40124,
        storage="/tmp/kv",
        node_id="decode-0",
        advertise="127.0.0.1",
    )
    return Placement(**{**base, **kw})


def test_a_local_vllm_worker_gets_its_placement_in_the_connector_config():
    cfg = _vllm_cfg()
    cmd = process_command(cfg, Component.DECODE, _local())
    assert cmd.command == ("vllm",)
    assert cmd.args[:2] == ("serve", "/models/small")
    assert cmd.env == {"DUALPATH_COMPONENT": "decode", "DUALPATH_CONFIG_HASH": cfg.config_hash}
    args = list(cmd.args)
    assert args[args.index("--port") + 1] == "40123"
    kv = json.loads(args[args.index("--kv-transfer-config") + 1])
    got = ConnectorSettings.from_extra_config(kv["kv_connector_extra_config"])
    assert got == ConnectorSettings(
        config_file="/run/cluster.yaml",
        storage="/tmp/kv",
        node_id="decode-0",
        scheduler="127.0.0.1:40001",
        node_role="decode",
        advertise_address="127.0.0.1:40123",
        metrics_port=40124,
    )
    assert kv["engine_id"] == "decode-0"


def test_the_control_processes_are_dualpaths_whatever_the_engine():
    cfg = _vllm_cfg()
    at = Placement(config_file="/c", scheduler="s:1", host="h", port=1, metrics_port=2)
    for comp in (Component.SCHEDULER, Component.FRONTEND):
        assert process_command(cfg, comp, at).command == ("dualpath",)


def test_the_model_defaults_to_the_checkpoint_path():
    spec = config.local_default().to_resource()["spec"]
    spec["workers"] = {"engine": "vllm"}
    spec["model"]["checkpointPath"] = "/ckpt/small"
    cfg = config.ClusterConfig(spec=config.parse_spec(spec))
    assert process_command(cfg, "prefill", _local()).args[1] == "/ckpt/small"


def test_memory_percent_is_vllms_fraction():
    args = list(process_command(_vllm_cfg(gpuMemoryPercent=85), "prefill", _local()).args)
    assert args[args.index("--gpu-memory-utilization") + 1] == "0.85"


def test_the_extra_config_refuses_unknown_keys_and_bad_values():
    good = _settings().to_extra_config()
    assert ConnectorSettings.from_extra_config(good) == _settings()
    with pytest.raises(ValueError, match=r"unknown keys \['nod_id'\]"):
        ConnectorSettings.from_extra_config({**good, "nod_id": "x"})
    with pytest.raises(ValueError, match="metrics_port: must be an int"):
        ConnectorSettings.from_extra_config({**good, "metrics_port": "9090"})
    with pytest.raises(ValueError, match="storage: must be a string"):
        ConnectorSettings.from_extra_config({**good, "storage": 5})
    with pytest.raises(ValueError, match="'router'"):
        ConnectorSettings.from_extra_config({**good, "node_role": "router"})


def test_unset_keys_are_left_out_and_read_back_as_defaults():
    # a local vLLM with the embedded config and no scheduler: an empty extra config
    assert ConnectorSettings().to_extra_config() == {}
    assert ConnectorSettings.from_extra_config(None) == ConnectorSettings()
    short = ConnectorSettings(storage="/kv", node_id="d-0")
    assert ConnectorSettings.from_extra_config(short.to_extra_config()) == short
    assert "engine_id" not in kv_transfer_config(ConnectorSettings())


def _settings() -> ConnectorSettings:
    return ConnectorSettings(
        config_file="/c",
        scheduler="s:1",
        node_role="prefill",
        node_id="p-0",
        advertise_address="p-0.svc:8000",
        storage="/kv",
        metrics_port=9090,
        token_file="/t",
    )


def test_the_argument_is_the_config_as_compact_sorted_json():
    s = _settings()
    assert json.loads(kv_transfer_config_arg(s)) == kv_transfer_config(s)
    assert kv_transfer_config(s)["kv_role"] == "kv_both"
    assert " " not in kv_transfer_config_arg(s)
