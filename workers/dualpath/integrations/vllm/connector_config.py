"""The connector's settings (`kv_connector_extra_config`): one dataclass, written by the worker
adapter (`server.kv_transfer_config`) and read by the connector inside vLLM (`of`).

`config_file` is the DualPathCluster YAML (model, storage and its SNIC cap; empty: the embedded
default), `storage` the KV directory (empty: spec.storage.path), `node_id` the read queue's and
the KV event publisher's name, `scheduler` host:port (empty: no KV events), `token_file` /
`tls_dir` how the connector authenticates to the scheduler, and `rendezvous_port` the loopback
port its worker half answers the adapter's "is request X ready to receive, and where" on
(0: not served; `rendezvous.py`). `hit_load` is how a request's hit reaches vLLM's cache, from
the store or (path D on a prefill instance) streamed from the decode's cache: `async` (default)
moves it while vLLM parks the request, so one request's hit overlaps the other requests'
compute; `layerwise` moves it inside the request's own forward, layer l+1 while layer l
computes (the lower TTFT on an idle instance, but vLLM's forward then blocks on its batch's
hits: load + compute, one after the other, across requests).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

HIT_LOADS = ("async", "layerwise")


@dataclass(frozen=True)
class ConnectorConfig:
    config_file: str = ""
    storage: str = ""
    node_id: str = "vllm"
    scheduler: str = ""
    token_file: str = ""
    tls_dir: str = ""
    rendezvous_port: int = 0
    hit_load: str = "async"

    def to_extra_config(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def of(cls, extra: dict[str, Any] | None) -> ConnectorConfig:
        """The settings of vLLM's `kv_connector_extra_config`; refuses a bad one naming the
        field (unknown keys are refused too: a typo must not silently mean the default)."""
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"kv_connector_extra_config: unknown field(s) {unknown}")
        port = extra.get("rendezvous_port", 0) or 0
        if not isinstance(port, int) or not 0 <= port < 65536:
            raise ValueError("kv_connector_extra_config.rendezvous_port must be an int port")
        out = {k: str(v or "") for k, v in extra.items() if k != "rendezvous_port"}
        if not out.get("node_id"):
            out["node_id"] = "vllm"
        out["hit_load"] = out.get("hit_load") or "async"
        if out["hit_load"] not in HIT_LOADS:
            raise ValueError(
                f"kv_connector_extra_config.hit_load must be one of {HIT_LOADS}, got "
                f"{out['hit_load']!r}"
            )
        return cls(**out, rendezvous_port=port)
