"""`workers.engine: vllm`: the operator renders vLLM worker pods (`vllm serve` with the DualPath
KV connector) that are valid Kubernetes objects and carry the connector's config."""

import json
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from crdtools import admit
from dualpath import config
from dualpath.integrations.vllm.config import (
    CONNECTOR_CLASS,
    CONNECTOR_MODULE,
    ConnectorSettings,
)
from dualpath_operator import crd
from dualpath_operator.builders import render

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "dualpathcluster-vllm.yaml"
OWNER = {"name": "agents-vllm", "uid": "u-1"}


@pytest.fixture
def cfg():
    return config.load(EXAMPLE)


def _workload(objs, kind, name):
    return next(o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name)


def _container(objs, name):
    kind = "StatefulSet" if name.endswith(("prefill", "decode")) else "Deployment"
    return _workload(objs, kind, name)["spec"]["template"]["spec"]["containers"][0]


def _flag(args, flag):
    return args[args.index(flag) + 1]


@pytest.mark.parametrize("version", ["1.28.0", "1.33.0"])
def test_every_rendered_manifest_is_valid(cfg, version):
    for obj in render(cfg, OWNER):
        if obj["apiVersion"].startswith("dualpath.io"):
            continue
        kubernetes_validate.validate(obj, version, strict=True)


def test_the_example_is_admitted_by_the_crd_and_the_model():
    cr = yaml.safe_load(EXAMPLE.read_text())
    assert admit(cr, crd.cluster_crd()) == []
    assert config.from_resource(cr).spec.workers.engine == "vllm"


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_workers_run_vllm_serve_with_the_dualpath_connector(cfg, role):
    objs = render(cfg, OWNER)
    c = _container(objs, f"agents-vllm-{role}")
    assert c["image"] == cfg.spec.workers.vllm.image
    assert c["command"] == ["vllm"]
    args = c["args"]
    assert args[:2] == ["serve", "meta-llama/Llama-3.1-8B-Instruct"]
    assert _flag(args, "--served-model-name") == cfg.spec.model.name
    assert _flag(args, "--block-size") == str(cfg.spec.model.block_tokens)
    assert _flag(args, "--max-model-len") == "32768"
    assert args[-1] == "--enable-chunked-prefill"  # extraArgs come last

    kv = json.loads(_flag(args, "--kv-transfer-config"))
    assert kv["kv_connector"] == CONNECTOR_CLASS == "DualPathConnector"
    assert kv["kv_connector_module_path"] == CONNECTOR_MODULE
    assert CONNECTOR_MODULE == "dualpath.integrations.vllm.connector"
    assert kv["kv_role"] == "kv_both"  # every node loads hits and saves new blocks
    assert kv["kv_load_failure_policy"] == "recompute"
    settings = ConnectorSettings.from_extra_config(kv["kv_connector_extra_config"])
    assert settings.node_role == role
    # $(POD_NAME) is expanded by the kubelet, from the env the container defines
    assert settings.node_id == "$(POD_NAME)" == kv["engine_id"]
    assert any(e["name"] == "POD_NAME" for e in c["env"])
    # the scheduler's Service, the worker's own headless Service and port, the KV mount
    sched = _workload(objs, "Service", "agents-vllm-scheduler")["spec"]["ports"][0]["port"]
    assert settings.scheduler == f"agents-vllm-scheduler:{sched}"
    http = next(p for p in c["ports"] if p["name"] == "http")["containerPort"]
    assert settings.advertise_address == f"$(POD_NAME).agents-vllm-{role}:{http}"
    assert _flag(args, "--port") == str(http)
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert settings.storage == mounts["kv-store"] == cfg.spec.storage.path
    assert settings.config_file.startswith(mounts["config"] + "/")
    assert settings.token_file.startswith(mounts["cluster-token"] + "/")
    metrics = next(p for p in c["ports"] if p["name"] == "metrics")["containerPort"]
    assert settings.metrics_port == metrics


def test_vllm_pods_keep_rdma_qos_storage_and_probe_vllm_health(cfg):
    objs = render(cfg, OWNER)
    for role in ("prefill", "decode"):
        sts = _workload(objs, "StatefulSet", f"agents-vllm-{role}")
        pod = sts["spec"]["template"]["spec"]
        c = pod["containers"][0]
        rdma = cfg.spec.network.rdma
        assert c["resources"]["limits"][rdma.resource_name] == str(rdma.count)
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["UCX_IB_SL"] == str(cfg.spec.network.qos.kv.service_level)
        assert env["HF_HOME"].startswith(env["HOME"])
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["kv-store"]["persistentVolumeClaim"]["claimName"] == "kvcache-3fs"
        assert volumes["vllm-cache"]["emptyDir"]["sizeLimit"] == "68719476736"
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
        hf = next(e for e in c["env"] if e["name"] == "HF_TOKEN")
        assert hf["valueFrom"]["secretKeyRef"]["name"] == "hf-token"
        annotations = sts["spec"]["template"]["metadata"]["annotations"]
        assert annotations["k8s.v1.cni.cncf.io/networks"] == "ib-cnic-0,ib-snic-0"
        svc = _workload(objs, "Service", f"agents-vllm-{role}")
        assert {"name": "http", "port": 8000, "targetPort": "http"} in svc["spec"]["ports"]


def test_the_scheduler_and_frontend_stay_dualpath_and_reach_the_vllm_port(cfg):
    from dualpath.cli import build_parser

    objs = render(cfg, OWNER)
    for name in ("agents-vllm-scheduler", "agents-vllm-frontend"):
        c = _container(objs, name)
        assert c["command"] == ["dualpath"] and c["image"] == cfg.spec.model.image
        assert build_parser(c["args"]).parse_args(c["args"])._command
    workers_policy = _workload(objs, "NetworkPolicy", "agents-vllm-workers")
    from_control = workers_policy["spec"]["ingress"][0]
    assert from_control["ports"] == [{"protocol": "TCP", "port": 8000}]


def test_the_engine_setting_rolls_the_worker_pods(cfg):
    spec = cfg.to_resource()["spec"]
    spec["workers"]["vllm"]["extraArgs"] = ["--enforce-eager"]
    other = config.ClusterConfig(name=cfg.name, spec=config.parse_spec(spec))
    assert other.config_hash != cfg.config_hash


def _cr(spec):
    return {
        "apiVersion": "dualpath.io/v1alpha1",
        "kind": "DualPathCluster",
        "metadata": {"name": "x"},
        "spec": spec,
    }


@pytest.mark.parametrize(
    "spec, needle",
    [
        ({"workers": {"engine": "vllm"}}, "needs a model to serve"),
        ({"workers": {"engine": "vllm", "vllm": {"model": None}}}, "needs a model to serve"),
        (
            {"workers": {"engine": "vllm", "vllm": {"model": "m"}}, "model": {"dtype": "float8"}},
            "float16, bfloat16 or float32",
        ),
        ({"workers": {"engine": "sglang"}}, "engine"),
    ],
)
def test_a_vllm_cluster_that_cannot_serve_is_refused_by_api_server_and_model(spec, needle):
    errors = admit(_cr(spec), crd.cluster_crd())
    assert errors and any(needle in e for e in errors), errors
    with pytest.raises(config.ConfigError, match=needle):
        config.from_resource(_cr(spec))


@pytest.mark.parametrize(
    "spec",
    [
        {"workers": {"engine": "vllm", "vllm": {"model": "org/m"}}},
        {"workers": {"engine": "vllm"}, "model": {"checkpointPath": "/models/m"}},
        {"workers": {"engine": "dualpath"}, "model": {"dtype": "float8"}},
        {"workers": {"vllm": {"gpuMemoryPercent": 50}}},
    ],
)
def test_servable_specs_are_admitted(spec):
    assert admit(_cr(spec), crd.cluster_crd()) == []
    config.from_resource(_cr(spec))


def test_extra_args_may_not_replace_the_connector_config():
    spec = {"workers": {"engine": "vllm", "vllm": {"model": "m", "extraArgs": ["--x"]}}}
    spec["workers"]["vllm"]["extraArgs"] = ["--kv-transfer-config={}"]
    with pytest.raises(config.ConfigError, match="must not set --kv-transfer-config"):
        config.from_resource(_cr(spec))


def test_kv_cache_bytes_replaces_the_memory_share_and_gpus_become_tensor_parallelism(cfg):
    spec = cfg.to_resource()["spec"]
    spec["workers"]["vllm"]["kvCacheBytes"] = 8 << 30
    spec["decode"]["gpusPerPod"] = 4
    other = config.ClusterConfig(name=cfg.name, spec=config.parse_spec(spec))
    args = _container(render(other, OWNER), "agents-vllm-decode")["args"]
    assert _flag(args, "--kv-cache-memory-bytes") == str(8 << 30)
    assert "--gpu-memory-utilization" not in args
    assert _flag(args, "--tensor-parallel-size") == "4"
    prefill = _container(render(other, OWNER), "agents-vllm-prefill")["args"]
    assert "--tensor-parallel-size" not in prefill  # 1 GPU


def test_the_rendered_args_parse_with_vllms_own_parser(cfg):
    """Where vLLM is installed (scripts/install-vllm.sh): `vllm serve`'s own parser and checks
    accept what the operator renders, and read the connector config back as we wrote it."""
    pytest.importorskip("vllm")
    from vllm.config import KVTransferConfig
    from vllm.entrypoints.cli.serve import ServeSubcommand

    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # older vLLM
        from vllm.utils import FlexibleArgumentParser

    c = _container(render(cfg, OWNER), "agents-vllm-prefill")
    assert c["command"] == ["vllm"]
    parser = FlexibleArgumentParser(prog="vllm")
    serve = ServeSubcommand()
    serve.subparser_init(parser.add_subparsers(dest="subparser"))
    ns = parser.parse_args(c["args"])  # argparse exits on an unknown flag or a bad value
    serve.validate(ns)
    assert ns.model_tag == "meta-llama/Llama-3.1-8B-Instruct" and ns.port == 8000
    assert ns.block_size == 64 and ns.max_model_len == 32768
    assert ns.served_model_name == [cfg.spec.model.name]
    kv = ns.kv_transfer_config
    kv = kv if isinstance(kv, KVTransferConfig) else KVTransferConfig(**json.loads(kv))
    assert kv.kv_connector == CONNECTOR_CLASS and kv.kv_role == "kv_both"
    assert kv.kv_connector_module_path == CONNECTOR_MODULE
    assert kv.is_kv_producer and kv.is_kv_consumer
    settings = ConnectorSettings.from_extra_config(kv.kv_connector_extra_config)
    assert settings.node_role == "prefill" and settings.storage == cfg.spec.storage.path


def test_dualpath_render_prints_the_vllm_pods(capsys, cfg):
    from dualpath.cli import main

    assert main(["render", "-f", str(EXAMPLE), "--uid", OWNER["uid"]]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert docs == render(cfg, OWNER)
    assert _container(docs, "agents-vllm-decode")["command"] == ["vllm"]
