"""What a worker tells its peers and the scheduler to dial."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from dualpath.config import ClusterConfig, Role
from dualpath.worker.node import NodeOptions, WorkerNode


@pytest.mark.parametrize(
    "advertise,advertise_host,want",
    [
        ("pod-0.agents-prefill", "", "pod-0.agents-prefill:7000"),  # operator: host, bound port
        ("10.0.0.7:9000", "", "10.0.0.7:9000"),  # host:port taken as is
        ("", "10.0.0.9", "10.0.0.9:7000"),  # $POD_IP
        ("", "", "127.0.0.1:7000"),  # the bind host
    ],
)
def test_advertised_address(advertise, advertise_host, want):
    node = WorkerNode(
        ClusterConfig(),
        NodeOptions(Role.PREFILL, "prefill-0", advertise=advertise, advertise_host=advertise_host),
    )
    node.port = 7000
    assert node.address == want


class _Pool:
    def __init__(self) -> None:
        self.freed: list[str] = []

    def free(self, region: str) -> None:
        self.freed.append(region)


class _Reading:
    busy = True


async def test_a_buffer_waits_for_a_storage_read_still_writing_into_it():
    # a stuck read's pool thread writes into the request's buffer whenever it returns: the
    # regions must not go back to the pool (and to the next request) before it has
    node = WorkerNode(ClusterConfig(), NodeOptions(Role.DECODE, "decode-0"))
    node.transfer = SimpleNamespace(pool=_Pool())
    reading = _Reading()
    node.release(["r0", "r1"], 0.0, reading)
    await asyncio.sleep(0.2)
    assert node.transfer.pool.freed == []
    reading.busy = False
    for _ in range(40):
        if node.transfer.pool.freed:
            break
        await asyncio.sleep(0.05)
    assert node.transfer.pool.freed == ["r0", "r1"]
    node.release(["r2"], 0.0, reading)  # a read that is done frees at once
    assert node.transfer.pool.freed == ["r0", "r1", "r2"]
