"""What a worker tells its peers and the scheduler to dial."""

from __future__ import annotations

import asyncio

import pytest
from dualpath.config import ClusterConfig, Role
from dualpath.worker.common import NodeOptions
from dualpath.worker.node import WorkerNode
from dualpath.worker.regions import release_regions


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
    pool = _Pool()
    reading = _Reading()
    release_regions(pool, ["r0", "r1"], 0.0, reading)
    await asyncio.sleep(0.2)
    assert pool.freed == []
    reading.busy = False
    for _ in range(40):
        if pool.freed:
            break
        await asyncio.sleep(0.05)
    assert pool.freed == ["r0", "r1"]
    release_regions(pool, ["r2"], 0.0, reading)  # a read that is done frees at once
    assert pool.freed == ["r0", "r1", "r2"]


async def test_a_node_that_never_started_stops_cleanly():
    # every part exists from __init__ (None until start): stop() needs no getattr
    node = WorkerNode(ClusterConfig(), NodeOptions(Role.DECODE, "decode-0"))
    assert (node.engine, node.store, node.read_queue, node.transfer) == (None,) * 4
    assert node.live() == (False, "starting: loading the model")
    await node.stop()
    assert node.stopping and node.live() == (False, "stopped")
