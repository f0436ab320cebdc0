"""The vLLM server a DualPath worker runs on engine vllm: its command line and environment.

`vllm_command` is the one place that turns the config into a `vllm serve` command: the served
checkpoint (`spec.model.checkpointPath`, written by `dualpath model write`), its dtype, and the
DualPath connector line (`kv_transfer_config`) with this node's store, read queue name and
scheduler. The worker on engine vllm (`dualpath.worker.vllm`) starts it as its child on a
loopback port.
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from dualpath.config import ClusterConfig
from dualpath.integrations.vllm.connector_config import ConnectorConfig

CONNECTOR_MODULE = "dualpath.integrations.vllm.connector"
# vLLM's CPU KV cache of one instance, GiB (VLLM_CPU_KVCACHE_SPACE): a small local cluster
CPU_KVCACHE_GIB = 1
MAX_MODEL_LEN = 16384
# vLLM's KV block on CPU (its default, given explicitly: the adapter rounds hits to it)
VLLM_BLOCK_TOKENS = 128


@dataclass(frozen=True)
class VllmCommand:
    argv: list[str]
    env: dict[str, str]


def kv_transfer_config(cc: ConnectorConfig) -> dict:
    """The connector line of a vLLM that serves DualPath (docs/vllm.md)."""
    return {
        "kv_connector": "DualPathConnector",
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": cc.to_extra_config(),
    }


def vllm_executable(venv: Path | None = None) -> str:
    """The `vllm` command of `venv`, else the one next to this interpreter (the venv's), else
    on PATH."""
    here = (venv / "bin" if venv else Path(sys.executable).parent) / "vllm"
    found = str(here) if here.exists() else None if venv else shutil.which("vllm")
    if not found:
        raise FileNotFoundError(
            f"no `vllm` command in {venv}"
            if venv
            else "workers.engine is vllm but no `vllm` "
            "command is installed: run scripts/install-vllm.sh <venv> (make venv does)"
        )
    return found


def vllm_serve(
    cfg: ClusterConfig,
    *,
    port: int,
    kv_transfer: dict | None,
    prefix_caching: bool = False,
    venv: Path | None = None,
    kv_blocks: int | None = None,
) -> VllmCommand:
    """`vllm serve` of the config's checkpoint on a loopback port, as every vLLM here runs
    (the DualPath workers' and the peers' of `bench local --peers`): `kv_transfer` its
    `--kv-transfer-config` (None: none), `prefix_caching` vLLM's own prefix cache, `venv`
    where its `vllm` is (default: this interpreter's). `kv_blocks`: its KV cache in usable
    blocks of VLLM_BLOCK_TOKENS (default: CPU_KVCACHE_GIB of memory), with the context cut to
    what they hold (vLLM refuses a cache smaller than one request at its context)."""
    model = cfg.spec.model
    if not model.checkpoint_path:
        raise ValueError(
            "workers.engine vllm needs model.checkpointPath: write one with "
            "`dualpath model write --out DIR` (dualpath up --engine vllm does)"
        )
    argv = [
        vllm_executable(venv),
        "serve",
        model.checkpoint_path,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        model.name,
        "--dtype",
        model.dtype,
        "--max-model-len",
        str(
            MAX_MODEL_LEN
            if kv_blocks is None
            else min(MAX_MODEL_LEN, kv_blocks * VLLM_BLOCK_TOKENS)
        ),
        "--block-size",
        str(VLLM_BLOCK_TOKENS),
        "--enforce-eager",
        "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--disable-uvicorn-access-log",
    ]
    if kv_blocks is not None:  # vLLM holds one block back (its null block)
        argv += ["--num-gpu-blocks-override", str(kv_blocks + 1)]
    if kv_transfer is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_transfer)]
    env = {
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": str(CPU_KVCACHE_GIB),
        # many processes share this machine's cores: no thread pinning
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    }
    return VllmCommand(argv, env)


def vllm_command(cfg: ClusterConfig, *, port: int, connector: ConnectorConfig) -> VllmCommand:
    """A DualPath worker's vLLM. `connector`: the connector's settings (its `token_file`,
    `tls_dir`: how it authenticates to the scheduler, the worker's own,
    `grpc_auth.auth_files`). Every hit is DualPath's: vLLM's own prefix cache would serve a
    node's repeats itself."""
    return vllm_serve(cfg, port=port, kv_transfer=kv_transfer_config(connector))
