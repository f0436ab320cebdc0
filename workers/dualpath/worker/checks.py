"""Start-up checks of a worker's RDMA environment (docs/design.md section 9): report, never degrade
silently.

`IPC_LOCK` alone does not raise the memlock limit of a non-root container (Kubernetes grants
no ambient capabilities, so the added capability is not effective for a non-root uid):
registering the KV buffer with the NIC then fails or NCCL silently falls back to TCP. A private, small
`/dev/shm` starves UCX's shared-memory transport and NCCL. Across pods on InfiniBand UCX needs
`UCX_IB_ADDR_TYPE` set right. Each check is a pure function of what it reads, so it is tested
without the host having the problem; `run_checks` logs each failure and exports
`dualpath_worker_startup_check_ok{check}`.
"""

from __future__ import annotations

import logging
import os
import resource
from dataclasses import dataclass

from prometheus_client import Gauge

from dualpath.config import ClusterSpec, Role

log = logging.getLogger(__name__)

CHECK_OK = Gauge(
    "dualpath_worker_startup_check_ok",
    "1 if a start-up check of the RDMA environment passed, 0 if it found a problem",
    ["check"],
)
MIN_SHM_BYTES = 1 << 30


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    message: str


IPC_LOCK_BIT = 14  # CAP_IPC_LOCK in the capability sets of /proc/self/status


def check_memlock(
    soft_limit: int, buffer_bytes: int, rdma_devices: int, uid: int = 0, ipc_lock: bool = False
) -> Check:
    """Locking the KV buffer needs a memlock limit covering it, or an effective CAP_IPC_LOCK
    (which a container's added IPC_LOCK only gives to root: no ambient capabilities)."""
    if rdma_devices == 0 or soft_limit == resource.RLIM_INFINITY or soft_limit >= buffer_bytes:
        return Check("memlock", True, "memlock limit covers the KV buffer")
    if ipc_lock:
        return Check("memlock", True, "CAP_IPC_LOCK is effective: the memlock limit is waived")
    who = (
        f"running as uid {uid} (not root), so an added IPC_LOCK capability is not effective"
        if uid != 0
        else "CAP_IPC_LOCK is not effective (add IPC_LOCK to the container)"
    )
    return Check(
        "memlock",
        False,
        f"memlock limit {soft_limit} bytes is below the {buffer_bytes}-byte KV buffer and {who}: "
        "RDMA registration may fail and NCCL fall back to TCP. Raise the runtime's memlock "
        "ulimit (e.g. unlimited) or run the workers as root (spec.workers.runAsNonRoot: false)",
    )


def has_effective_ipc_lock(status_path: str = "/proc/self/status") -> bool:
    """CAP_IPC_LOCK in this process's effective capability set (Linux; False elsewhere)."""
    try:
        with open(status_path) as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> IPC_LOCK_BIT & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def check_shm(shm_bytes: int | None) -> Check:
    if shm_bytes is None:
        return Check("shm", False, "/dev/shm is missing: mount a memory-backed emptyDir there")
    if shm_bytes < MIN_SHM_BYTES:
        return Check(
            "shm",
            False,
            f"/dev/shm holds {shm_bytes >> 20} MiB (< {MIN_SHM_BYTES >> 30} GiB): UCX and NCCL "
            "shared-memory transports may fail; mount a memory-backed emptyDir with a size",
        )
    return Check("shm", True, f"/dev/shm holds {shm_bytes >> 20} MiB")


def check_ib_addr_type(env: dict[str, str], rdma_devices: int, configured: str | None) -> Check:
    have = env.get("UCX_IB_ADDR_TYPE", "")
    if rdma_devices == 0 or not configured or have == configured:
        return Check("ucx_ib_addr_type", True, f"UCX_IB_ADDR_TYPE={have or 'default'}")
    return Check(
        "ucx_ib_addr_type",
        False,
        f"network.rdma.ibAddrType is {configured} but UCX_IB_ADDR_TYPE={have or 'unset'}: "
        "UCX may not reach peers in other pods",
    )


def shm_size(path: str = "/dev/shm") -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_blocks * st.f_frsize


def run_checks(spec: ClusterSpec, role: Role) -> list[Check]:
    rdma = spec.network.rdma.count
    checks = [
        check_memlock(
            resource.getrlimit(resource.RLIMIT_MEMLOCK)[0],
            spec.pool(role).kv_buffer_bytes,
            rdma,
            uid=os.geteuid(),
            ipc_lock=has_effective_ipc_lock(),
        ),
        check_shm(shm_size()),
        check_ib_addr_type(dict(os.environ), rdma, spec.network.rdma.ib_addr_type),
    ]
    for c in checks:
        CHECK_OK.labels(c.name).set(1 if c.ok else 0)
        if not c.ok:
            log.warning("start-up check %s: %s", c.name, c.message)
    return checks
