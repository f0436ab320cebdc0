"""What each pod runs: the process arguments `dualpath up` runs (one source), the storage
volume where a process uses storage and nowhere else, probes and grace from `spec.workers`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
import yaml
from dualpath import config
from dualpath.cli import build_parser
from dualpath.local.cluster import LOCAL_WORKER_ENV, LocalCluster
from dualpath.process import STORAGE_USERS, Component, termination_grace_seconds, uses_storage
from dualpath_operator.builders import render
from dualpath_operator.builders.common import (
    CONFIG_FILE,
    METRICS_PORT,
    TLS_MOUNT,
    TOKEN_MOUNT,
    WORKER_GRPC_PORT,
)
from dualpath_operator.builders.pods import PROBE_PERIOD_SECONDS, scheduler_address
from dualpath_operator.builders.qos import qos_env

ROOT = Path(__file__).resolve().parents[3]
OWNER = {"name": "agents", "uid": "0c8f-uid"}


@pytest.fixture
def example() -> config.ClusterConfig:
    return config.load(ROOT / "examples" / "dualpathcluster.yaml")


def _parse(args: list[str]) -> argparse.Namespace:
    return build_parser(args).parse_args(args)


def _component(ns: argparse.Namespace) -> Component:
    return Component(ns.role if ns.command == "worker" else ns.command)


def pods(cfg: config.ClusterConfig) -> dict[Component, dict]:
    """Each component's pod template, keyed by what its container's args say it runs."""
    out = {}
    for obj in render(cfg, OWNER):
        if obj["kind"] in ("StatefulSet", "Deployment"):
            tpl = obj["spec"]["template"]
            (container,) = tpl["spec"]["containers"]
            out[_component(_parse(container["args"]))] = tpl
    assert set(out) == set(Component)
    return out


def test_every_process_that_uses_storage_mounts_it_and_no_other_gets_it(example):
    """Which processes use storage is read from the code (the process-arguments function and
    the CLI parse of each pod's args), not from a list written here."""
    storage_path = example.spec.storage.path
    users = set()
    for comp, tpl in pods(example).items():
        (c,) = tpl["spec"]["containers"]
        ns = _parse(c["args"])
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in tpl["spec"]["volumes"]}
        if getattr(ns, "storage", None):
            users.add(comp)
            assert ns.storage == storage_path  # the worker opens the store where it is mounted
            assert mounts[storage_path] == "kv-store"
            assert volumes["kv-store"]["persistentVolumeClaim"]["claimName"] == "kvcache-3fs"
        else:
            # served without storage: no storage path in the argv, no volume in the pod
            assert not any(storage_path in a for a in c["args"]), c["args"]
            assert "kv-store" not in volumes and storage_path not in mounts
    assert users == set(STORAGE_USERS) == {c for c in Component if uses_storage(c)}
    assert Component.FRONTEND not in users and Component.SCHEDULER not in users


def test_only_the_storage_users_can_be_pointed_at_storage():
    """No process outside STORAGE_USERS accepts a storage path (the frontend takes its hits
    from the scheduler's block index, issue 15 item 1)."""
    for comp in Component:
        args = ["worker", "--role", comp.value] if comp.role else [comp.value]
        accepts = "storage" in vars(_parse(args))
        assert accepts == uses_storage(comp), comp


def test_probes_and_grace_period_come_from_spec_workers(example, tmp_path):
    spec = example.to_resource()["spec"]
    spec["workers"] = {"startupSeconds": 900, "drainSeconds": 300}
    cfg = config.ClusterConfig(name="agents", spec=config.parse_spec(spec))
    for comp, tpl in pods(cfg).items():
        (c,) = tpl["spec"]["containers"]
        if comp.role is None:
            assert "startupProbe" not in c
            continue
        startup, live, ready = c["startupProbe"], c["livenessProbe"], c["readinessProbe"]
        # a model may load for startupSeconds before liveness can kill the pod
        assert startup["httpGet"]["path"] == live["httpGet"]["path"] == "/livez"
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 900
        assert startup["periodSeconds"] == PROBE_PERIOD_SECONDS
        assert "initialDelaySeconds" not in live  # startupProbe gates it
        assert ready["httpGet"]["path"] == "/readyz"
        # the kubelet's SIGKILL comes after the worker's whole drain plus its stop
        assert tpl["spec"]["terminationGracePeriodSeconds"] == termination_grace_seconds(cfg)
        assert termination_grace_seconds(cfg) > 300
        # ... and the drain time reaches the process through the config, not a flag
        ns = _parse(c["args"])
        assert ns.drain_seconds is None and ns.deadline is None and ns.kv_cache_tokens is None
    cm = next(
        o for o in render(cfg, OWNER) if o["kind"] == "ConfigMap" and "cluster.yaml" in o["data"]
    )
    rendered = config.from_resource(yaml.safe_load(cm["data"]["cluster.yaml"]))
    assert rendered.spec.workers.drain_seconds == 300
    assert rendered.spec.workers.startup_seconds == 900


def _strip_local(argv: list[str]) -> tuple[list[str], str]:
    """`python -m dualpath.cli --log-level=X <args>` -> (args, X)."""
    assert argv[:3] == [sys.executable, "-m", "dualpath.cli"], argv
    assert argv[3].startswith("--log-level=")
    return argv[4:], argv[3].split("=", 1)[1]


def test_pods_run_what_dualpath_up_runs_modulo_the_placement(example, tmp_path):
    """Each local process's arguments, with the documented local -> pod mapping applied (config
    file, bind host, ports, scheduler address, node id, advertised host, storage directory),
    parse to exactly what the rendered container's arguments parse to; the process environment
    is the same too."""
    cluster = LocalCluster(example, tmp_path / "run", storage_dir=tmp_path / "kv", grace_s=1)
    rendered = pods(example)
    pod_port = {
        Component.SCHEDULER: example.spec.scheduler.port,
        Component.FRONTEND: example.spec.frontend.port,
        Component.PREFILL: WORKER_GRPC_PORT,
        Component.DECODE: WORKER_GRPC_PORT,
    }
    qos = {e["name"] for e in qos_env(example.spec.network)}
    seen = set()
    for spec in cluster.specs:
        args, level = _strip_local(spec.argv)
        local = vars(_parse(args))
        comp = _component(argparse.Namespace(**local))
        seen.add(comp)
        (c,) = rendered[comp]["spec"]["containers"]
        assert c["command"] == ["dualpath"]
        pod = vars(_parse(c["args"]))
        # the local forms, then the mapping to the pod's
        want = {"file": (str(cluster.cfg_path), CONFIG_FILE), "host": ("127.0.0.1", "0.0.0.0")}
        want["log_level"] = (level, "INFO")
        if comp is not Component.SCHEDULER:
            want["scheduler"] = (cluster.endpoints.scheduler, scheduler_address(example))
        if comp is not Component.FRONTEND:
            want["metrics_port"] = (local["metrics_port"], METRICS_PORT)
        if comp.role:
            want["node_id"] = (spec.name, "$(POD_NAME)")
            want["advertise"] = ("127.0.0.1", f"$(POD_NAME).agents-{comp.value}")
            want["storage"] = (str(tmp_path / "kv"), example.spec.storage.path)
        want["port"] = (local["port"], pod_port[comp])
        # every process has its own TLS directory: the run directory's, the mounted one's
        want["tls_dir"] = (str(cluster.run_dir / "tls" / spec.name), TLS_MOUNT)
        assert local["token_file"] is None and pod["token_file"] is None  # mTLS: no token
        for key, (local_value, pod_value) in want.items():
            assert local[key] == local_value, (comp, key)
            local[key] = pod_value
        assert local["port"] > 0 and (comp is Component.FRONTEND or local["metrics_port"] > 0)
        assert local == pod, comp
        env = {e["name"]: e["value"] for e in c["env"] if "value" in e and e["name"] not in qos}
        local_env = {k: v for k, v in spec.env.items() if k not in LOCAL_WORKER_ENV}
        assert local_env == env, comp
    assert seen == set(Component)
    # the pods' storage path stays the config's; only the workers were given the local dir
    assert cluster.cfg.spec.storage.path == example.spec.storage.path


def _mode(cfg: config.ClusterConfig, mode: str) -> config.ClusterConfig:
    res = cfg.to_resource()
    res["spec"]["security"] = {"tls": {"mode": mode}}
    return config.from_resource(res)


def test_every_pod_mounts_the_cluster_token_and_passes_it_to_its_process(example):
    """Under mode token: scheduler, workers and frontend read the token from the
    `<cluster>-token` Secret, mounted as a directory (so a rotation reaches the running
    process), and parse `--token-file`."""
    from dualpath_operator.builders.pods import token_secret_name

    example = _mode(example, "token")
    rendered = pods(example)
    for comp, tpl in rendered.items():
        (c,) = tpl["spec"]["containers"]
        assert _parse(c["args"]).token_file == f"{TOKEN_MOUNT}/token", comp
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == "cluster-token"]
        assert mount == {"name": "cluster-token", "mountPath": TOKEN_MOUNT, "readOnly": True}
        (vol,) = [v for v in tpl["spec"]["volumes"] if v["name"] == "cluster-token"]
        assert vol["secret"]["secretName"] == token_secret_name(example) == "agents-token"


def test_every_pod_mounts_its_tls_directory_and_no_token_under_mtls(example):
    """Without cert-manager each pod mounts its role's Secret: exactly the Secrets the operator
    (or `dualpath render --tls-secrets`) creates, the CA's key in none of the mounted ones."""
    from dualpath_operator.builders import operator_ca_secrets

    rendered = pods(example)
    ca, *leaves = operator_ca_secrets(example, OWNER)
    mounted = {
        v["secret"]["secretName"]
        for tpl in rendered.values()
        for v in tpl["spec"]["volumes"]
        if v["name"] == "tls"
    }
    assert mounted == {s["metadata"]["name"] for s in leaves}
    assert ca["metadata"]["name"] not in mounted
    assert all("ca.key" not in s["stringData"] for s in leaves)
    for comp, tpl in rendered.items():
        (c,) = tpl["spec"]["containers"]
        ns = _parse(c["args"])
        assert ns.tls_dir == TLS_MOUNT and ns.token_file is None, comp
        assert {"name": "tls", "mountPath": TLS_MOUNT, "readOnly": True} in c["volumeMounts"]
        assert not any(v["name"] == "cluster-token" for v in tpl["spec"]["volumes"])
    off = pods(_mode(example, "off"))
    for comp, tpl in off.items():
        ns = _parse(tpl["spec"]["containers"][0]["args"])
        assert ns.tls_dir is None and ns.token_file is None, comp


def test_the_local_cluster_gives_each_process_its_own_certificate(example, tmp_path):
    """`dualpath up` under mtls: a directory per process, named by its node id, its key
    private; the CA's key is in no process's directory; a new CA per start."""
    from dualpath.tls import Identity, TlsCredentials

    first = LocalCluster(example, tmp_path / "run", storage_dir=tmp_path / "kv", grace_s=1)
    assert first.token_file is None
    tls = tmp_path / "run" / "tls"
    for spec in first.specs:
        ns = _parse(_strip_local(spec.argv)[0])
        creds = TlsCredentials(ns.tls_dir)
        assert creds.identity == Identity(example.name, _component(ns).value, spec.name)
        assert (Path(ns.tls_dir) / "tls.key").stat().st_mode & 0o777 == 0o600
    assert TlsCredentials(tls / "admin").identity.role == "admin"
    ca_key = (tls / "ca" / "tls.key").read_bytes()
    assert all(p.read_bytes() != ca_key for p in tls.glob("*/tls.key") if p.parent.name != "ca")
    again = LocalCluster(example, tmp_path / "run", storage_dir=tmp_path / "kv", grace_s=1)
    assert again.ca is not None and (tls / "ca" / "tls.key").read_bytes() != ca_key


def test_the_local_token_file_is_private_and_new_per_start(example, tmp_path):
    example = _mode(example, "token")
    first = LocalCluster(example, tmp_path / "run", storage_dir=tmp_path / "kv", grace_s=1)
    assert first.token_file == tmp_path / "run" / "token"
    assert first.token_file.stat().st_mode & 0o777 == 0o600
    token = first.token_file.read_text().strip()
    assert len(token) >= 40
    again = LocalCluster(example, tmp_path / "run", storage_dir=tmp_path / "kv", grace_s=1)
    assert again.token_file.read_text().strip() != token
    assert again.token_file.stat().st_mode & 0o777 == 0o600
