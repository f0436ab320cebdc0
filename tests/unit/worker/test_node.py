"""What a worker tells its peers and the scheduler to dial."""

from __future__ import annotations

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
