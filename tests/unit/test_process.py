"""The one function that builds every process's command: its refusals, and the worker knobs
that reach a worker through `spec.workers` (with CLI flags only as overrides)."""

from __future__ import annotations

import pytest
from dualpath import config
from dualpath.cli import build_parser
from dualpath.process import Component, Placement, process_command
from dualpath.worker.common import NodeOptions
from dualpath.worker.node import WorkerNode


def _at(**kw) -> Placement:
    base = dict(config_file="/c.yaml", scheduler="s:1", host="h", port=1, metrics_port=2)
    return Placement(**{**base, **kw})


def test_storage_goes_to_the_storage_users_only():
    cfg = config.local_default()
    with pytest.raises(ValueError, match="frontend: never touches storage"):
        process_command(cfg, "frontend", _at(storage="/kv"))
    with pytest.raises(ValueError, match="scheduler: never touches storage"):
        process_command(cfg, "scheduler", _at(storage="/kv"))
    with pytest.raises(ValueError, match="prefill: reads and writes KV blocks"):
        process_command(cfg, "prefill", _at(node_id="p", advertise="h"))
    with pytest.raises(ValueError, match="node id"):
        process_command(cfg, "decode", _at(storage="/kv"))


def test_every_command_parses_and_names_its_component():
    cfg = config.local_default()
    for comp in Component:
        worker = comp.role is not None
        at = _at(storage="/kv" if worker else None, node_id="n" if worker else "", advertise="h")
        cmd = process_command(cfg, comp, at)
        assert cmd.command == ("dualpath",)
        ns = build_parser(list(cmd.args)).parse_args(list(cmd.args))
        assert ns.file == "/c.yaml" and ns.port == 1
        assert (ns.role if worker else ns.command) == comp.value
        assert cmd.env["DUALPATH_COMPONENT"] == comp.value


def test_worker_knobs_come_from_spec_workers_and_flags_override():
    spec = config.local_default().to_resource()["spec"]
    spec["workers"] = {
        "drainSeconds": 42,
        "transferDeadlineSeconds": 7,
        "requestTimeoutSeconds": 99,
        "kvCacheTokens": 1024,
    }
    cfg = config.ClusterConfig(spec=config.parse_spec(spec))
    node = WorkerNode(cfg, NodeOptions(role=config.Role.DECODE, node_id="d"))
    assert (node.drain_s, node.deadline_s, node.request_timeout_s, node.kv_cache_tokens) == (
        42,
        7,
        99,
        1024,
    )
    node = WorkerNode(cfg, NodeOptions(role=config.Role.DECODE, node_id="d", drain_s=1.5))
    assert node.drain_s == 1.5


def test_a_request_timeout_shorter_than_a_transfer_is_refused_naming_the_field():
    with pytest.raises(config.ConfigError, match="requestTimeoutSeconds"):
        config.parse_spec({"workers": {"transferDeadlineSeconds": 60, "requestTimeoutSeconds": 5}})


def test_a_process_says_what_it_is_in_ps_and_in_its_log_lines():
    """`name_process`: the title ps and pgrep -f show (a zygote fork's command line would be the
    zygote's) and the prefix of every log line."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import logging, sys; from dualpath.log import setup_logging, name_process\n"
        "setup_logging('INFO'); name_process('decode:decode-7')\n"
        "logging.getLogger('dualpath.worker').info('serving'); print('named', flush=True)\n"
        "sys.stdin.read()\n"
    )
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={"PYTHONPATH": str(root / "workers"), "PATH": "/usr/bin:/bin"},
    )
    try:
        assert proc.stdout.readline().strip() == "named"
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        assert cmdline.strip() == "dualpath decode:decode-7"
    finally:
        _, err = proc.communicate("", timeout=30)
    assert " I decode:decode-7 dualpath.worker: serving" in err
