"""The `--kv-transfer-config` of a vLLM worker: the one place its keys are defined.

The operator's pods and the local cluster write it (through `dualpath.process.process_command`)
and the connector reads it back (`ConnectorSettings.from_extra_config`), so the two sides cannot
disagree on a key. Pure: no vLLM import (the operator and the tests run without vLLM).

vLLM's `KVTransferConfig` fields used: `kv_connector` + `kv_connector_module_path` (vLLM imports
the connector class from our package), `kv_role`, `engine_id` (the node id: vLLM's logs and the
scheduler's name one node alike) and `kv_connector_extra_config` (ours, below).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from dualpath.config import Role

CONNECTOR_CLASS = "DualPathConnector"
CONNECTOR_MODULE = "dualpath.integrations.vllm.connector"
# vLLM's roles: prefill produces the KV a decode node consumes (the handoff's direction; both
# roles also read hit blocks from, and write new blocks to, the shared store).
KV_ROLES: dict[Role, str] = {Role.PREFILL: "kv_producer", Role.DECODE: "kv_consumer"}


@dataclass(frozen=True)
class ConnectorSettings:
    """What the DualPath connector needs beyond vLLM's own config: `kv_connector_extra_config`.
    Field names are the JSON keys."""

    config_file: str  # the rendered DualPathCluster YAML (model, storage, scheduler knobs)
    scheduler_address: str  # host:port of the DualPath scheduler's gRPC service
    node_role: str  # prefill or decode
    node_id: str  # the id the scheduler knows this node by
    advertise_address: str  # host:port the frontend and peers reach this vLLM server at
    store_path: str  # the KV block store's directory (the storage volume's mount point)
    metrics_port: int  # where the connector serves dualpath_* metrics
    token_file: str = ""  # the cluster token presented on gRPC ("": unauthenticated)

    def __post_init__(self) -> None:
        Role(self.node_role)  # ValueError naming the bad role
        for f in fields(self):
            if f.name != "token_file" and getattr(self, f.name) in ("", None):
                raise ValueError(f"kv_connector_extra_config.{f.name}: required")

    def to_extra_config(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> ConnectorSettings:
        """Read back what `to_extra_config` wrote; a missing or unknown key is a ValueError
        naming it (a connector of another version than the operator's)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"kv_connector_extra_config: unknown keys {unknown}")
        missing = sorted(
            f.name for f in fields(cls) if f.name not in extra and f.name != "token_file"
        )
        if missing:
            raise ValueError(f"kv_connector_extra_config: missing keys {missing}")
        values = dict(extra)
        values["metrics_port"] = int(values["metrics_port"])
        return cls(**values)


def kv_transfer_config(settings: ConnectorSettings) -> dict[str, Any]:
    """vLLM's `--kv-transfer-config` for one node."""
    return {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": KV_ROLES[Role(settings.node_role)],
        "engine_id": settings.node_id,
        "kv_connector_extra_config": settings.to_extra_config(),
    }


def kv_transfer_config_arg(settings: ConnectorSettings) -> str:
    """The same, as the one command-line argument (compact, keys sorted: a stable pod template)."""
    return json.dumps(kv_transfer_config(settings), sort_keys=True, separators=(",", ":"))
