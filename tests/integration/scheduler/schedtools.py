"""Helpers shared by the scheduler's integration tests."""

from __future__ import annotations

import asyncio
import time

from dualpath.local.supervisor import free_port  # below the ephemeral range, never twice

__all__ = ["free_port", "wait_nodes"]


async def wait_nodes(client, n: int, timeout_s: float = 10.0):  # noqa: ANN001
    """The cluster view once at least `n` nodes are healthy."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        view = await client.cluster_view()
        if sum(1 for x in view.nodes if x.healthy) >= n:
            return view
        await asyncio.sleep(0.05)
    raise AssertionError(f"fewer than {n} healthy nodes after {timeout_s}s")
