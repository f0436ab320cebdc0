"""Start-up checks of the RDMA environment: each problem is named with its fix."""

from __future__ import annotations

import resource

from dualpath.config import ClusterSpec, Role
from dualpath.worker.checks import (
    check_ib_addr_type,
    check_memlock,
    check_shm,
    has_effective_ipc_lock,
    run_checks,
)


def test_memlock_below_the_buffer_is_reported_only_with_rdma():
    bad = check_memlock(64 << 10, 1 << 30, rdma_devices=1)
    assert not bad.ok and "CAP_IPC_LOCK is not effective" in bad.message
    assert check_memlock(64 << 10, 1 << 30, rdma_devices=0).ok
    assert check_memlock(resource.RLIM_INFINITY, 1 << 30, rdma_devices=1).ok
    assert check_memlock(2 << 30, 1 << 30, rdma_devices=1).ok


def test_a_non_root_worker_with_a_low_memlock_is_told_ipc_lock_does_not_help():
    # the added capability is not effective for a non-root uid: only the limit counts
    bad = check_memlock(64 << 10, 1 << 30, rdma_devices=1, uid=65532, ipc_lock=False)
    assert not bad.ok
    assert "uid 65532 (not root)" in bad.message and "runAsNonRoot: false" in bad.message
    # root with an effective CAP_IPC_LOCK may lock beyond the limit
    assert check_memlock(64 << 10, 1 << 30, rdma_devices=1, uid=0, ipc_lock=True).ok


def test_effective_ipc_lock_is_read_from_the_capability_set(tmp_path):
    status = tmp_path / "status"
    status.write_text("Name:\tx\nCapEff:\t0000000000004000\n")  # bit 14: CAP_IPC_LOCK
    assert has_effective_ipc_lock(str(status))
    status.write_text("Name:\tx\nCapEff:\t00000000a80425fb\n")  # docker's default set
    assert not has_effective_ipc_lock(str(status))
    assert not has_effective_ipc_lock(str(tmp_path / "missing"))


def test_shm_missing_or_small_is_reported():
    assert not check_shm(None).ok
    small = check_shm(64 << 20)
    assert not small.ok and "64 MiB" in small.message
    assert check_shm(8 << 30).ok


def test_ib_addr_type_must_match_the_spec_when_set():
    assert check_ib_addr_type({}, 1, None).ok
    assert check_ib_addr_type({"UCX_IB_ADDR_TYPE": "ib_global"}, 1, "ib_global").ok
    bad = check_ib_addr_type({}, 1, "ib_global")
    assert not bad.ok and "unset" in bad.message
    assert check_ib_addr_type({}, 0, "ib_global").ok


def test_run_checks_reports_every_check():
    names = {c.name for c in run_checks(ClusterSpec(), Role.DECODE)}
    assert names == {"memlock", "shm", "ucx_ib_addr_type"}
