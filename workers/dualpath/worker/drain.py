"""A worker's drain: tell the scheduler first (it routes nothing new here), let the work in
flight finish within `spec.workers.drainSeconds`, then stop."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from dualpath.worker import metrics

if TYPE_CHECKING:
    from dualpath.worker.common import Node

log = logging.getLogger(__name__)

# After telling the scheduler it drains, a worker keeps serving at least this long even when
# idle: a request the scheduler routed here just before the drain may still be on its way.
DRAIN_SETTLE_S = 1.0
# How often a draining worker asks the scheduler how many requests routed to it are still open.
DRAIN_POLL_S = 0.2


async def drain_and_stop(node: Node) -> None:
    """Tell the scheduler this node drains, let the work in flight finish for at most
    `spec.workers.drainSeconds`, then stop. In flight: this node's Prefill and Generate calls
    (storage reads, D->P relays, prefill->decode handoffs, decoding) and the requests the
    scheduler routed here before the drain and that are not completed yet (their calls may
    still be on their way)."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    deadline = t0 + node.drain_s
    node.draining = True  # every heartbeat from now on says so too
    routed = await node.registration.drain()
    log.info(
        "worker %s draining: %d calls in flight, %d routed requests open, up to %.0fs",
        node.node_id,
        node.inflight,
        routed,
        node.drain_s,
    )
    settle = min(deadline, loop.time() + DRAIN_SETTLE_S)
    next_ask = loop.time() + DRAIN_POLL_S
    while loop.time() < deadline and (node.inflight or routed or loop.time() < settle):
        await asyncio.sleep(0.02)
        if routed and loop.time() >= next_ask:
            routed = await node.registration.drain()
            next_ask = loop.time() + DRAIN_POLL_S
    if node.inflight or routed:
        metrics.DRAINS.labels("timed_out").inc()
        log.warning(
            "worker %s: drain time %.0fs over with %d calls in flight and %d routed "
            "requests open: stopping them",
            node.node_id,
            node.drain_s,
            node.inflight,
            routed,
        )
    else:
        metrics.DRAINS.labels("clean").inc()
        log.info("worker %s drained in %.1fs", node.node_id, loop.time() - t0)
    await node.stop()
