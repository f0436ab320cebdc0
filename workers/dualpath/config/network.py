"""`spec.network`: the worker pods' RDMA device, Multus networks and InfiniBand QoS, the compute
NIC's emulated bandwidth, and the NetworkPolicies of who may reach whom."""

from __future__ import annotations

import ipaddress
from typing import Literal

from pydantic import Field, field_validator, model_validator

from dualpath.config.common import _Model


class TrafficClassSpec(_Model):
    """An InfiniBand service level and a RoCE/IP traffic class."""

    service_level: int = Field(ge=0, le=15)
    """InfiniBand service level (SL), 0-15."""
    traffic_class: int = Field(ge=0, le=255)
    """Traffic class (RoCE DSCP << 2), 0-255."""


class QosSpec(_Model):
    """IB QoS of docs/design.md section 5: model traffic high priority, KV traffic low priority."""

    enabled: bool = True
    """Separate model and KV traffic by service level and virtual lane."""
    model: TrafficClassSpec = TrafficClassSpec(service_level=0, traffic_class=0)
    """Model collectives (NCCL): high priority."""
    kv: TrafficClassSpec = TrafficClassSpec(service_level=2, traffic_class=64)
    """KV transfers (UCX/NIXL): low priority."""
    kv_virtual_lane: int = Field(default=2, ge=0, le=14)
    """Virtual lane the KV service level maps to."""
    high_weight: int = Field(default=99, ge=1, le=255)
    """VL arbitration weight of model traffic."""
    low_weight: int = Field(default=1, ge=1, le=255)
    """VL arbitration weight of KV traffic."""

    @model_validator(mode="after")
    def _distinct(self) -> QosSpec:
        if self.enabled and self.model.service_level == self.kv.service_level:
            raise ValueError(
                "qos.model.serviceLevel and qos.kv.serviceLevel must differ, otherwise KV "
                "traffic is not isolated from the model's collectives"
            )
        return self


class RdmaSpec(_Model):
    """The RDMA device every worker pod requests."""

    resource_name: str = Field(default="rdma/hca_shared_devices_a", min_length=1, max_length=253)
    """Device-plugin resource of the RDMA NIC."""
    count: int = Field(default=1, ge=0, le=64)
    """Devices per worker pod (0: no RDMA, TCP fallback)."""
    ib_addr_type: Literal["ib_global", "ib_local", "eth"] | None = None
    """UCX_IB_ADDR_TYPE: ib_global (routed IB), ib_local, eth (RoCE); unset: UCX's choice."""

    @model_validator(mode="after")
    def _device_plugin_resource(self) -> RdmaSpec:
        if self.count and "/" not in self.resource_name:
            raise ValueError(
                "network.rdma.resourceName must be a device-plugin resource such as "
                "rdma/hca_shared_devices_a"
            )
        return self


class PolicyPeerSpec(_Model):
    """Pods allowed to reach the frontend: those matching podSelector in the namespaces matching
    namespaceSelector."""

    namespace_selector: dict[str, str] | None = None
    """matchLabels of the namespaces, e.g. {kubernetes.io/metadata.name: ingress-nginx}; {}:
    every namespace; unset: the cluster's own namespace."""
    pod_selector: dict[str, str] = Field(default_factory=dict)
    """matchLabels of the pods in those namespaces; {}: every pod."""


class NetworkPoliciesSpec(_Model):
    """Kubernetes NetworkPolicies of the cluster's pods (ingress only; egress stays open)."""

    enabled: bool = True
    """Render NetworkPolicies: the scheduler reachable only from this cluster's frontend and
    workers, the workers only from the scheduler, the frontend and each other, the frontend
    from frontendFrom and frontendFromCidrs, metrics from monitoringNamespaceSelector."""
    frontend_from: list[PolicyPeerSpec] = Field(default_factory=list, max_length=32)
    """Pods that may call the frontend's HTTP API; empty: every pod of the cluster's
    namespace (add your ingress controller's namespace here, or CIDRs below)."""
    frontend_from_cidrs: list[str] = Field(default_factory=list, max_length=32)
    """IP ranges that may call the frontend's HTTP API, e.g. a load balancer's source range
    (0.0.0.0/0: anyone that can reach the Service)."""
    monitoring_namespace_selector: dict[str, str] = Field(
        default_factory=lambda: {"kubernetes.io/metadata.name": "monitoring"}
    )
    """matchLabels of the namespaces whose pods may scrape the metrics ports (and the
    frontend's /metrics); {}: every namespace."""

    @field_validator("frontend_from_cidrs")
    @classmethod
    def _cidrs(cls, cidrs: list[str]) -> list[str]:
        for cidr in cidrs:
            try:
                ipaddress.ip_network(cidr, strict=False)
            except ValueError:
                raise ValueError(
                    f"network.policies.frontendFromCidrs: {cidr!r} is not a CIDR such as 10.0.0.0/8"
                ) from None
        return cidrs


class NetworkSpec(_Model):
    """Compute and storage networks of the worker pods."""

    rdma: RdmaSpec = RdmaSpec()
    """RDMA device requested by every worker pod."""
    multus_networks: list[str] = Field(default_factory=list, max_length=16)
    """Multus networks attached to every worker pod (k8s.v1.cni.cncf.io/networks)."""
    qos: QosSpec = QosSpec()
    """InfiniBand QoS: service levels, traffic classes, VL arbitration."""
    cnic_gbps: float = Field(default=0.0, ge=0.0)
    """Compute NIC bandwidth per node for local emulation and the simulator; 0: uncapped."""
    policies: NetworkPoliciesSpec = NetworkPoliciesSpec()
    """NetworkPolicies: who may reach the scheduler, the workers, the frontend and metrics."""
