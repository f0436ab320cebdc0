"""IB QoS of docs/design.md section 5: per-traffic-class pod environment and the SM policy ConfigMap."""

from __future__ import annotations

from typing import Any

from dualpath.config import ClusterConfig, NetworkSpec

from .common import child_name, metadata


def qos_env(network: NetworkSpec) -> list[dict[str, str]]:
    """Model collectives (NCCL) on the high-priority SL, the KV engine (UCX) on the low one."""
    env: list[dict[str, str]] = []
    q = network.qos
    if q.enabled:
        env += [
            {"name": "NCCL_IB_SL", "value": str(q.model.service_level)},
            {"name": "NCCL_IB_TC", "value": str(q.model.traffic_class)},
            {"name": "UCX_IB_SL", "value": str(q.kv.service_level)},
            {"name": "UCX_IB_TRAFFIC_CLASS", "value": str(q.kv.traffic_class)},
            {"name": "DUALPATH_KV_VIRTUAL_LANE", "value": str(q.kv_virtual_lane)},
        ]
    if network.rdma.ib_addr_type:
        env.append({"name": "UCX_IB_ADDR_TYPE", "value": network.rdma.ib_addr_type})
    return env


def opensm_qos_policy(network: NetworkSpec) -> str:
    """OpenSM QoS settings for the fabric team (the paper's: KV on a low-weight VL)."""
    q = network.qos
    vl = q.kv_virtual_lane
    high = ",".join(f"{i}:{0 if i == vl else 192}" for i in range(4))
    low = ",".join(f"{i}:{64 if i == vl else 192}" for i in range(4))
    sl2vl = ",".join(str(vl if sl == q.kv.service_level else min(sl, 3)) for sl in range(16))
    return "\n".join(
        [
            "# DualPath IB QoS: model traffic (high priority) vs KV traffic (low priority).",
            f"# Weights high:low = {q.high_weight}:{q.low_weight}; apply on the subnet manager.",
            "qos TRUE",
            "qos_max_vls 4",
            "qos_high_limit 240",
            f"qos_vlarb_high {high}",
            f"qos_vlarb_low {low}",
            f"qos_sl2vl {sl2vl}",
            f"# model: SL {q.model.service_level} TC {q.model.traffic_class}; "
            f"kv: SL {q.kv.service_level} TC {q.kv.traffic_class} -> VL {vl}",
            "",
        ]
    )


def qos_config_map(cfg: ClusterConfig, owner: dict[str, Any] | None) -> dict[str, Any]:
    q = cfg.spec.network.qos
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(cfg, child_name(cfg, "ib-qos"), "network", owner),
        "data": {
            "opensm-qos.conf": opensm_qos_policy(cfg.spec.network),
            "weights": f"high={q.high_weight} low={q.low_weight}",
            # RoCE: the same classes as DSCP -> traffic class, PFC on the KV priority.
            "roce-dscp": f"model={q.model.traffic_class >> 2} kv={q.kv.traffic_class >> 2}",
        },
    }
