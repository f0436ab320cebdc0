"""`workers.engine: vllm`: the operator renders worker pods that run the same `dualpath worker`
in the vLLM image (the worker serves on its own `vllm serve` child with the DualPath KV
connector), valid Kubernetes objects, with the checkpoint volume and a writable cache."""

from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from crdtools import admit
from dualpath import config
from dualpath.cli import build_parser
from dualpath_operator import crd
from dualpath_operator.builders import render

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "dualpathcluster-vllm.yaml"
OWNER = {"name": "agents-vllm", "uid": "u-1"}
ROLES = ("prefill", "decode")


@pytest.fixture
def cfg():
    return config.load(EXAMPLE)


def _workload(objs, kind, name):
    return next(o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name)


def _pod(objs, name):
    kind = "StatefulSet" if name.endswith(ROLES) else "Deployment"
    return _workload(objs, kind, name)["spec"]["template"]["spec"]


def _parsed(container):
    """The container's args as the `dualpath` CLI reads them ($(POD_NAME) stood in)."""
    args = [a.replace("$(POD_NAME)", "pod-0") for a in container["args"]]
    return build_parser(args).parse_args(args)


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


@pytest.mark.parametrize("role", ROLES)
def test_vllm_workers_run_dualpath_worker_in_the_vllm_image(cfg, role):
    objs = render(cfg, OWNER)
    c = _pod(objs, f"agents-vllm-{role}")["containers"][0]
    assert c["image"] == cfg.spec.workers.vllm.image != cfg.spec.model.image
    assert c["command"] == ["dualpath"]
    ns = _parsed(c)
    # what the worker hands its vLLM child's connector: the config file (engine: vllm is in
    # it), its node id, the store, the scheduler and the cluster token
    assert ns.role == role and ns.node_id == "pod-0"
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert ns.storage == mounts["kv-store"] == cfg.spec.storage.path
    assert ns.file.startswith(mounts["config"] + "/")
    assert ns.token_file.startswith(mounts["cluster-token"] + "/")
    port = _workload(objs, "Service", "agents-vllm-scheduler")["spec"]["ports"][0]["port"]
    assert ns.scheduler == f"agents-vllm-scheduler:{port}"
    cm = _workload(objs, "ConfigMap", "agents-vllm-config")
    rendered = config.from_resource(yaml.safe_load(cm["data"]["cluster.yaml"]))
    assert rendered.spec.workers.engine == "vllm" and rendered.config_hash == cfg.config_hash


def test_vllm_pods_keep_rdma_qos_storage_probes_and_get_a_cache(cfg):
    objs = render(cfg, OWNER)
    spec = cfg.to_resource()["spec"]
    spec["workers"]["engine"] = "dualpath"
    dualpath_cfg = config.ClusterConfig(name=cfg.name, spec=config.parse_spec(spec))
    plain = render(dualpath_cfg, OWNER)
    for role in ROLES:
        pod = _pod(objs, f"agents-vllm-{role}")
        c = pod["containers"][0]
        rdma = cfg.spec.network.rdma
        assert c["resources"]["limits"][rdma.resource_name] == str(rdma.count)
        assert c["resources"]["requests"]["cpu"] == "32"
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["UCX_IB_SL"] == str(cfg.spec.network.qos.kv.service_level)
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["kv-store"]["persistentVolumeClaim"]["claimName"] == "kvcache-3fs"
        assert volumes["vllm-cache"]["emptyDir"]["sizeLimit"] == str(16 << 30)
        cache = next(m for m in c["volumeMounts"] if m["name"] == "vllm-cache")["mountPath"]
        assert env["HOME"] == cache and env["VLLM_CACHE_ROOT"].startswith(cache + "/")
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        # the worker's own ports and probes, as with the DualPath engine: only image, cache
        # and environment differ
        other = _pod(plain, f"agents-vllm-{role}")["containers"][0]
        for key in ("command", "args", "ports", "startupProbe", "readinessProbe", "resources"):
            assert c[key] == other[key], key
        assert {e["name"] for e in c["env"]} - {e["name"] for e in other["env"]} == {
            "HOME",
            "XDG_CACHE_HOME",
            "VLLM_CACHE_ROOT",
            "TRITON_CACHE_DIR",
            "VLLM_NO_USAGE_STATS",
            "DO_NOT_TRACK",
        }


def test_the_checkpoint_volume_is_read_only_at_the_checkpoint_path_where_it_is_read(cfg):
    objs = render(cfg, OWNER)
    for name in ("agents-vllm-prefill", "agents-vllm-decode", "agents-vllm-frontend"):
        pod = _pod(objs, name)
        (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "model"]
        assert mount == {"name": "model", "mountPath": cfg.spec.model.checkpoint_path} | {
            "readOnly": True
        }
        (vol,) = [v for v in pod["volumes"] if v["name"] == "model"]
        assert vol["persistentVolumeClaim"] == {"claimName": "llama-3.1-8b-instruct"}
    sched = _pod(objs, "agents-vllm-scheduler")
    assert all(v["name"] != "model" for v in sched["volumes"])  # it never reads the checkpoint


def test_the_scheduler_and_frontend_stay_on_the_dualpath_image(cfg):
    objs = render(cfg, OWNER)
    for name in ("agents-vllm-scheduler", "agents-vllm-frontend"):
        c = _pod(objs, name)["containers"][0]
        assert c["command"] == ["dualpath"] and c["image"] == cfg.spec.model.image
        assert _parsed(c)._command


def test_a_pools_image_overrides_the_vllm_image(cfg):
    spec = cfg.to_resource()["spec"]
    spec["decode"]["image"] = "registry.example.com/dp:custom"
    other = config.ClusterConfig(name=cfg.name, spec=config.parse_spec(spec))
    objs = render(other, OWNER)
    assert _pod(objs, "agents-vllm-decode")["containers"][0]["image"] == spec["decode"]["image"]
    assert (
        _pod(objs, "agents-vllm-prefill")["containers"][0]["image"] == other.spec.workers.vllm.image
    )


def test_the_engine_rolls_the_worker_pods(cfg):
    spec = cfg.to_resource()["spec"]
    spec["workers"]["engine"] = "dualpath"
    other = config.ClusterConfig(name=cfg.name, spec=config.parse_spec(spec))
    assert other.config_hash != cfg.config_hash


def _cr(spec):
    return {
        "apiVersion": "dualpath.io/v1alpha1",
        "kind": "DualPathCluster",
        "metadata": {"name": "x"},
        "spec": spec,
    }


PVC = {"persistentVolumeClaim": {"claimName": "m"}}


@pytest.mark.parametrize(
    "spec, needle",
    [
        (
            {"workers": {"engine": "vllm"}, "model": {"checkpointPath": "/m", "dtype": "float8"}},
            "float16, bfloat16 or float32",
        ),
        ({"workers": {"engine": "sglang"}}, "engine"),
        ({"model": {"volume": PVC}}, "model.volume needs model.checkpointPath"),
        ({"model": {"checkpointPath": "/m", "volume": {"nfz": {}}}}, "volume"),
    ],
)
def test_specs_that_cannot_work_are_refused_by_api_server_and_model(spec, needle):
    errors = admit(_cr(spec), crd.cluster_crd())
    assert errors and any(needle in e for e in errors), errors
    with pytest.raises(config.ConfigError, match=needle):
        config.from_resource(_cr(spec))


@pytest.mark.parametrize("model", [{}, {"checkpointPath": None}])
def test_a_vllm_cluster_without_a_checkpoint_is_refused_by_the_api_server(model):
    """...and reported by the operator (an older CRD), while the model parses it: `dualpath
    up --engine vllm` writes the checkpoint after parsing its config."""
    from dualpath_operator.builders.checks import spec_warnings

    spec = {"workers": {"engine": "vllm"}, "model": model}
    errors = admit(_cr(spec), crd.cluster_crd())
    assert any("needs model.checkpointPath" in e for e in errors), errors
    cfg = config.from_resource(_cr(spec))
    assert any("needs model.checkpointPath" in w for w in spec_warnings(cfg))
    ok = config.from_resource(_cr({**spec, "model": {"checkpointPath": "/m"}}))
    assert not any("checkpointPath" in w for w in spec_warnings(ok))


@pytest.mark.parametrize(
    "spec",
    [
        {"workers": {"engine": "vllm"}, "model": {"checkpointPath": "/models/m"}},
        {"workers": {"engine": "dualpath"}, "model": {"dtype": "float8"}},
        {"workers": {"vllm": {"cacheBytes": 1 << 30}}},
        {"model": {"checkpointPath": "/m", "volume": {"nfs": {"server": "s", "path": "/m"}}}},
    ],
)
def test_specs_that_work_are_admitted(spec):
    assert admit(_cr(spec), crd.cluster_crd()) == []
    config.from_resource(_cr(spec))


def test_dualpath_render_prints_the_vllm_pods(capsys, cfg):
    from dualpath.cli import main

    assert main(["render", "-f", str(EXAMPLE), "--uid", OWNER["uid"]]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert docs == render(cfg, OWNER)
    c = _pod(docs, "agents-vllm-decode")["containers"][0]
    assert c["image"].endswith("-vllm") and c["args"][0] == "worker"
