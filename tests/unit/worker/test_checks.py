"""Start-up checks of the RDMA environment: each problem is named with its fix."""

from __future__ import annotations

import resource

from dualpath.config import ClusterSpec, Role
from dualpath.worker.checks import (
    check_ib_addr_type,
    check_memlock,
    check_shm,
    run_checks,
)


def test_memlock_below_the_buffer_is_reported_only_with_rdma():
    bad = check_memlock(64 << 10, 1 << 30, rdma_devices=1)
    assert not bad.ok and "IPC_LOCK alone" in bad.message
    assert check_memlock(64 << 10, 1 << 30, rdma_devices=0).ok
    assert check_memlock(resource.RLIM_INFINITY, 1 << 30, rdma_devices=1).ok
    assert check_memlock(2 << 30, 1 << 30, rdma_devices=1).ok


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
