"""A lost scheduler, seen from both sides over real gRPC: a worker whose scheduler stops
acknowledging heartbeats gives it up and registers again on a new connection; a restarted
scheduler has every worker back within a bounded time; a worker whose heartbeat stream closes
leaves the pool at once, not after the node timeout."""

import asyncio
import time

import grpc
from dualpath import config
from dualpath.scheduler.cli import build
from dualpath.scheduler.client import REGISTER_BACKOFF_MAX_S, NodeAgent, Registration
from dualpath.scheduler.policy import NodeLoad
from dualpath.v1 import scheduler_pb2 as pb
from dualpath.v1 import scheduler_pb2_grpc as pb_grpc
from schedtools import free_port


def agent(address: str, node_id: str, role: str = "decode") -> NodeAgent:
    reg = Registration(node_id, role, f"127.0.0.1:{7000 + len(node_id)}", snic_bytes_per_s=1e9)
    return NodeAgent(address, reg, lambda: NodeLoad(buffer_free_bytes=1 << 40))


class HungScheduler(pb_grpc.SchedulerServicer):
    """Registers anyone, then reads heartbeats and never answers one (a hung process, or a
    host gone without closing its connections)."""

    def __init__(self) -> None:
        self.peers: list[str] = []

    async def Register(self, request, context):  # noqa: N802
        self.peers.append(context.peer())
        return pb.RegisterResponse(heartbeat_interval_ms=20, node_timeout_ms=300)

    async def Heartbeats(self, request_iterator, context):  # noqa: N802
        async for _ in request_iterator:
            pass
        if False:  # an async generator that never yields
            yield pb.HeartbeatAck()


async def test_a_scheduler_that_stops_acking_is_given_up_and_registered_with_again() -> None:
    servicer = HungScheduler()
    server = grpc.aio.server()
    pb_grpc.add_SchedulerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    a = agent(f"127.0.0.1:{port}", "d0").start()
    try:
        t0 = time.monotonic()
        # the server sees a registration before the agent has its answer (and counts it)
        while (len(servicer.peers) < 3 or a.registrations < 3) and time.monotonic() - t0 < 5:
            await asyncio.sleep(0.02)
        took = time.monotonic() - t0
        assert a.lost >= 2 and a.registrations >= 3
        # each give-up is the ack timeout (300 ms) plus a capped backoff, not tens of seconds
        assert took < 3 * (0.3 + REGISTER_BACKOFF_MAX_S) + 1.0, took
        assert len(set(servicer.peers)) >= 2  # registered again over a new connection
    finally:
        await a.stop()
        await server.stop(0)


async def test_a_restarted_scheduler_has_every_worker_back_within_a_second() -> None:
    cfg = config.local_default()
    port = free_port()
    addr = f"127.0.0.1:{port}"
    sched = build(cfg, None, "127.0.0.1", port)
    await sched.start()
    agents = [agent(addr, f"p{i}", "prefill").start() for i in range(2)]
    agents += [agent(addr, f"d{i}").start() for i in range(2)]
    try:
        while len(sched.servicer.state.nodes) < 4:
            await asyncio.sleep(0.02)
        await sched.stop(0)
        await asyncio.sleep(0.5)  # down for a while: the workers' channels back off
        sched = build(cfg, None, "127.0.0.1", port)  # a new scheduler, an empty view
        await sched.start()
        t0 = time.monotonic()
        state = sched.servicer.state
        # the scheduler's view and the agents' own count: the server holds a registration
        # before its answer reaches the agent
        while sum(n.state.healthy for n in state.nodes.values()) < 4 or not all(
            a.registrations == 2 and a.registered for a in agents
        ):
            assert time.monotonic() - t0 < 5, (list(state.nodes), [a.registrations for a in agents])
            await asyncio.sleep(0.01)
        # Back through the closed stream and the reconnect backoff (<= 1 s + the registration
        # backoff), not through the ack timeout: no agent counted a lost scheduler. The time
        # itself is the fault suite's figure (`dualpath faults`, scheduler kill row): a bound
        # on wall time here would only measure how loaded the test machine is.
        assert [a.lost for a in agents] == [0, 0, 0, 0]
    finally:
        for a in agents:
            await a.stop()
        await sched.stop(0)


async def test_a_closed_heartbeat_stream_takes_the_node_out_before_its_timeout() -> None:
    cfg = config.local_default()  # node timeout 2 s
    sched = build(cfg, None, "127.0.0.1", 0)
    await sched.start()
    addr = f"127.0.0.1:{sched.port}"
    gone, stays = agent(addr, "d0").start(), agent(addr, "d1").start()
    state = sched.servicer.state
    try:
        while not all(n in state.nodes and state.nodes[n].stream for n in ("d0", "d1")):
            await asyncio.sleep(0.02)
        t0 = time.monotonic()
        await gone.stop()
        while state.nodes["d0"].state.healthy:
            assert time.monotonic() - t0 < 1.0, "still in the pool"
            await asyncio.sleep(0.01)
        assert state.nodes["d1"].state.healthy
    finally:
        await stays.stop()
        await sched.stop(0)
