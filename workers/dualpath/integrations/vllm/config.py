"""The `--kv-transfer-config` of a vLLM worker: the one place its keys are defined.

The operator's pods and the local cluster write it (through `dualpath.process.process_command`);
the connector reads it back with `ConnectorSettings.from_extra_config`, so the two sides cannot
disagree on a key (an unknown one is an error naming it). Pure: no vLLM import (the operator and
its tests run without vLLM).

vLLM's `KVTransferConfig` fields used: `kv_connector` + `kv_connector_module_path` (vLLM imports
the connector class from this package), `kv_role`, `kv_load_failure_policy`, `engine_id` (the
node id: vLLM's logs and the scheduler's name one node alike) and `kv_connector_extra_config`
(ours: `ConnectorSettings`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from dualpath.config import Role

CONNECTOR_CLASS = "DualPathConnector"
CONNECTOR_MODULE = "dualpath.integrations.vllm.connector"
# Every node both loads hit blocks from the store and saves its new blocks to it, whatever its
# DualPath role: vLLM's kv_both.
KV_ROLE = "kv_both"
# A block that fails to load is recomputed, never an error to the client.
KV_LOAD_FAILURE_POLICY = "recompute"


@dataclass(frozen=True)
class ConnectorSettings:
    """`kv_connector_extra_config`: what the DualPath connector needs beyond vLLM's own config.
    Field names are the JSON keys; an empty value means the default given with it."""

    config_file: str = ""  # the DualPathCluster YAML (model, storage); "": the embedded default
    storage: str = ""  # the KV block store's directory; "": the config's spec.storage.path
    node_id: str = ""  # the node's name (read queue, KV events, scheduler); "": "vllm"
    scheduler: str = ""  # host:port of the DualPath scheduler's gRPC; "": no KV events
    token_file: str = ""  # the cluster token presented on gRPC; "": unauthenticated
    node_role: str = ""  # prefill or decode (the pool it runs in); "": either
    advertise_address: str = ""  # host:port the frontend and peers reach this vLLM server at
    metrics_port: int = 0  # where the connector serves dualpath_* metrics; 0: not served

    def __post_init__(self) -> None:
        if self.node_role and self.node_role not in {r.value for r in Role}:
            raise ValueError(
                f"kv_connector_extra_config.node_role: must be prefill or decode "
                f"(got {self.node_role!r})"
            )

    def to_extra_config(self) -> dict[str, Any]:
        """The set keys only (a short command line; absent and empty mean the same)."""
        return {k: v for k, v in asdict(self).items() if v not in ("", 0)}

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        """Read back what `to_extra_config` wrote (None or {}: every default); an unknown key
        or a value of the wrong type is a ValueError naming it."""
        extra = dict(extra or {})
        types = {f.name: f.type for f in fields(cls)}
        unknown = sorted(set(extra) - set(types))
        if unknown:
            raise ValueError(
                f"kv_connector_extra_config: unknown keys {unknown}; known: {sorted(types)}"
            )
        for key, value in extra.items():
            want = int if types[key] == "int" else str
            if not isinstance(value, want) or isinstance(value, bool):
                raise ValueError(
                    f"kv_connector_extra_config.{key}: must be a{'n int' if want is int else ' string'}"
                    f" (got {value!r})"
                )
        return cls(**extra)


def kv_transfer_config(settings: ConnectorSettings) -> dict[str, Any]:
    """vLLM's `--kv-transfer-config` for one node."""
    out: dict[str, Any] = {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": KV_ROLE,
        "kv_load_failure_policy": KV_LOAD_FAILURE_POLICY,
        "kv_connector_extra_config": settings.to_extra_config(),
    }
    if settings.node_id:
        out["engine_id"] = settings.node_id
    return out


def kv_transfer_config_arg(settings: ConnectorSettings) -> str:
    """The same, as the one command-line argument (compact, keys sorted: a stable pod template)."""
    return json.dumps(kv_transfer_config(settings), sort_keys=True, separators=(",", ":"))
