"""Pure spec checks reported as the Degraded condition instead of degrading silently."""

from __future__ import annotations

from dualpath.config import VLLM_MODEL_MESSAGE, ClusterConfig


def spec_warnings(cfg: ClusterConfig) -> list[str]:
    s = cfg.spec
    out = []
    if s.storage.volume is None:
        out.append(
            "storage.volume is not set: each pod gets a private scratch directory, so "
            "KV blocks are not shared and path D cannot read them; mount 3FS/NFS/CephFS"
        )
    if s.network.rdma.count > 0 and s.network.rdma.ib_addr_type is None:
        out.append(
            "network.rdma.ibAddrType is not set: across pods on InfiniBand UCX may pick "
            "the wrong address type; set ib_global (routed) or ib_local"
        )
    if s.network.rdma.count == 0:
        out.append("network.rdma.count is 0: KV transfers fall back to TCP")
    if s.workers.engine == "vllm" and not s.model.checkpoint_path:
        # the CRD refuses it; a cluster admitted by an older CRD gets here
        out.append(VLLM_MODEL_MESSAGE + "; the workers cannot start vLLM without it")
    return out
