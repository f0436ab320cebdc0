"""Failure-aware routing and node identity over real gRPC: a fake frontend (the real
`GrpcBackend`) and fake decode workers (a tiny `Worker` servicer) around the real scheduler."""

import asyncio
import time

import grpc
import pytest
from dualpath import config
from dualpath.frontend.app import create_app
from dualpath.frontend.backend import BackendError, Finished, Routed, Tokens, TurnRequest
from dualpath.frontend.grpc_backend import GrpcBackend, continuation
from dualpath.sampling import SamplingParams
from dualpath.scheduler.cli import build
from dualpath.scheduler.client import NodeAgent, Registration, SchedulerClient
from dualpath.scheduler.policy import NodeLoad
from dualpath.v1 import scheduler_pb2 as pb
from dualpath.v1 import worker_pb2 as wpb
from dualpath.v1 import worker_pb2_grpc as wpb_grpc
from prometheus_client import CollectorRegistry, generate_latest


class FakeDecode(wpb_grpc.WorkerServicer):
    """`fail`: "instant" (UNAVAILABLE before any token), "midway" (after 2 tokens), "cut" (the
    stream ends after 2 tokens with status OK but no finish reason), "hang" (no answer), ""
    (ok); `delay_s` between tokens. Its answer to a 70-token prompt is 5, 6, 7, ...; a longer
    prompt (a resumed turn's: the answer so far joined to it) continues that answer."""

    def __init__(self, fail: str = "", delay_s: float = 0.0) -> None:
        self.fail, self.delay_s, self.calls = fail, delay_s, 0

    async def Generate(self, request, context):  # noqa: N802
        self.calls += 1
        if self.fail == "instant":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "decode engine is gone")
        if self.fail == "hang":  # a node that takes the call and never answers
            await asyncio.sleep(3600)
        start = 5 + len(request.prompt_tokens) - 70
        for i in range(request.max_new_tokens):
            if self.fail == "midway" and i == 2:
                await context.abort(grpc.StatusCode.INTERNAL, "decode step failed")
            if self.fail == "cut" and i == 2:
                return
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            last = i == request.max_new_tokens - 1
            yield wpb.GenerateChunk(tokens=[start + i], finish_reason="length" if last else "")


async def _worker(servicer):
    srv = grpc.aio.server()
    wpb_grpc.add_WorkerServicer_to_server(servicer, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    await srv.start()
    return srv, f"127.0.0.1:{port}"


@pytest.fixture
async def cluster():
    """Scheduler + p0 (never called: the fake decodes answer alone) + decodes d0, d1."""
    cfg = config.local_default()
    sched = build(cfg, None, "127.0.0.1", 0)
    await sched.start()
    addr = f"127.0.0.1:{sched.port}"
    made = {"servers": [], "agents": [], "sched": sched, "addr": addr, "cfg": cfg}

    async def add_decode(node_id, servicer):
        srv, waddr = await _worker(servicer)
        made["servers"].append(srv)
        agent = NodeAgent(
            addr,
            Registration(node_id, "decode", waddr),
            lambda: NodeLoad(buffer_free_bytes=1 << 40),
        ).start()
        made["agents"].append(agent)
        return servicer

    made["add_decode"] = add_decode
    p0 = NodeAgent(addr, Registration("p0", "prefill", "127.0.0.1:1"), lambda: NodeLoad()).start()
    made["agents"].append(p0)
    yield made
    for a in made["agents"]:
        await a.stop()
    for s in made["servers"]:
        await s.stop(0)
    await sched.stop(0)


async def _ready(addr, n):
    client = SchedulerClient(addr, timeout_s=5)
    deadline = time.monotonic() + 10
    try:
        while time.monotonic() < deadline:
            view = await client.cluster_view()
            if sum(x.healthy for x in view.nodes) >= n:
                return
            await asyncio.sleep(0.02)
    finally:
        await client.close()
    raise AssertionError("nodes did not register")


async def _turn(backend, i, tokens=4):
    events = []
    async for ev in backend.generate(
        TurnRequest(f"t{i}", f"s{i}", [7] * 70, SamplingParams(max_tokens=tokens))
    ):
        events.append(ev)
    return events


async def _settle(state, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while state.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return len(state.in_flight)


async def test_a_turn_failing_before_its_first_token_is_retried_on_another_pair(cluster):
    bad = await cluster["add_decode"]("d0", FakeDecode("instant"))
    good = await cluster["add_decode"]("d1", FakeDecode())
    await _ready(cluster["addr"], 3)
    backend = GrpcBackend(cluster["cfg"], cluster["addr"], timeout_s=10)
    await backend.start()
    state = cluster["sched"].servicer.state
    try:
        for i in range(12):
            events = await _turn(backend, i)
            assert isinstance(events[0], Routed) and events[0].decode_node == "d1"
            assert [e.ids for e in events if isinstance(e, Tokens)] == [[5], [6], [7], [8]]
            assert events[-1] == Finished("length", 4)
        assert await _settle(state) == 0
        # the instant failures opened d0's breaker: it stops getting turns at all
        assert state.open_breakers() == 1
        assert bad.calls == 3 and good.calls == 12
        registry = CollectorRegistry()  # the frontend's /metrics shows the backend's retries
        create_app(cluster["cfg"], backend, registry)
        assert b"dualpath_frontend_retries_total 3.0" in generate_latest(registry)
    finally:
        await backend.close()


async def test_a_turn_failing_mid_answer_resumes_after_its_last_token(cluster):
    bad = await cluster["add_decode"]("d0", FakeDecode("midway"))
    await cluster["add_decode"]("d1", FakeDecode())
    await _ready(cluster["addr"], 3)
    backend = GrpcBackend(cluster["cfg"], cluster["addr"], timeout_s=10)
    await backend.start()
    try:
        for i in range(8):
            events = await _turn(backend, i, tokens=6)
            # one answer: its first route, every token once and in order, the whole count
            assert [type(e) for e in events].count(Routed) == 1, events
            assert [t for e in events if isinstance(e, Tokens) for t in e.ids] == list(range(5, 11))
            assert events[-1] == Finished("length", 6)
        assert await _settle(cluster["sched"].servicer.state) == 0
        assert bad.calls > 0  # some turns did start on the failing node
        registry = CollectorRegistry()
        create_app(cluster["cfg"], backend, registry)
        resumed = f"dualpath_frontend_resumed_turns_total {float(bad.calls)}"
        assert resumed.encode() in generate_latest(registry)
    finally:
        await backend.close()


@pytest.mark.parametrize(
    ("fail", "max_tokens", "error", "tokens"),
    [
        # resumed on the only node, which fails again every 2 tokens: MAX_ATTEMPTS, then the error
        ("midway", 40, "INTERNAL", list(range(5, 17))),
        # a stream that ends OK but without a finish reason is the node's bug: not resumed
        ("cut", 8, "without a finish reason", [5, 6]),
    ],
)
async def test_a_mid_stream_failure_is_an_error_never_an_empty_success(
    cluster, fail, max_tokens, error, tokens
):
    await cluster["add_decode"]("d0", FakeDecode(fail))
    await _ready(cluster["addr"], 2)
    backend = GrpcBackend(cluster["cfg"], cluster["addr"], timeout_s=10)
    await backend.start()
    events = []
    try:
        with pytest.raises(BackendError, match=error):
            async for ev in backend.generate(
                TurnRequest("t", "s", [7] * 70, SamplingParams(max_tokens=max_tokens))
            ):
                events.append(ev)
        assert not any(isinstance(e, Finished) for e in events)
        assert [t for e in events if isinstance(e, Tokens) for t in e.ids] == tokens
        assert await _settle(cluster["sched"].servicer.state) == 0
    finally:
        await backend.close()


def test_a_continuation_joins_the_answer_so_far_to_the_prompt_and_spends_the_budgets():
    req = TurnRequest("t", "s", [7] * 3, SamplingParams(max_tokens=5, min_tokens=3, seed=9))
    assert continuation(req, []) is req
    cont = continuation(req, [1, 2])
    assert cont.prompt_ids == [7, 7, 7, 1, 2] and req.prompt_ids == [7, 7, 7]
    assert (cont.sampling.max_tokens, cont.sampling.min_tokens, cont.sampling.seed) == (3, 1, 9)
    assert continuation(req, [1, 2, 3, 4]).sampling.min_tokens == 0
    assert continuation(req, [1, 2, 3, 4, 5]) is None  # nothing left: the turn is finished


async def test_cancelled_turns_end_their_in_flight_entries_and_do_not_open_breakers(cluster):
    await cluster["add_decode"]("d0", FakeDecode(delay_s=0.05))
    await cluster["add_decode"]("d1", FakeDecode(delay_s=0.05))
    await _ready(cluster["addr"], 3)
    backend = GrpcBackend(cluster["cfg"], cluster["addr"], timeout_s=10)
    await backend.start()
    state = cluster["sched"].servicer.state
    try:
        tasks = [asyncio.create_task(_turn(backend, i, tokens=50)) for i in range(20)]
        while len(state.in_flight) < 20:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # streaming
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert await _settle(state) == 0
        assert state.open_breakers() == 0
        t0 = time.monotonic()
        events = await _turn(backend, 99)  # served at once, nothing held
        assert isinstance(events[-1], Finished) and time.monotonic() - t0 < 2.0
    finally:
        await backend.close()


async def test_a_second_process_under_a_live_node_id_is_refused(cluster):
    await cluster["add_decode"]("d0", FakeDecode())
    await _ready(cluster["addr"], 2)
    ch = grpc.aio.insecure_channel(cluster["addr"])
    stub = __import__("dualpath.v1.scheduler_pb2_grpc", fromlist=["x"]).SchedulerStub(ch)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Register(
                pb.RegisterRequest(
                    node_id="d0", role=pb.ROLE_DECODE, address="evil:1", incarnation="other"
                ),
                timeout=5,
            )
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        view = await stub.ClusterView(pb.ClusterViewRequest(), timeout=5)
        assert {n.node_id: n.address for n in view.nodes}["d0"] != "evil:1"
        route = await stub.Route(
            pb.RouteRequest(prompt_tokens=100, context_bytes=1 << 20, exclude_nodes=["d0"]),
            timeout=0.5,
        )
        raise AssertionError(f"routed to {route.decode_node} though d0 was excluded")
    except grpc.aio.AioRpcError as err:
        # d0 excluded leaves no decode: said at once, not after a queue timeout
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        await ch.close()


async def test_with_no_other_pair_the_only_node_is_waited_for_within_the_deadline(cluster):
    """The failed node is the only one of its role: routed again with it (a restarting node
    serves within seconds), backing off; a node that keeps failing ends the turn with its own
    error after MAX_ATTEMPTS, within the retry window."""
    from dualpath.frontend.grpc_backend import MAX_ATTEMPTS

    only = FakeDecode("instant")
    await cluster["add_decode"]("d0", only)
    await _ready(cluster["addr"], 2)
    backend = GrpcBackend(cluster["cfg"], cluster["addr"], timeout_s=30)
    await backend.start()
    try:
        with pytest.raises(BackendError, match="decode engine is gone"):
            await _turn(backend, 0)
        assert only.calls == MAX_ATTEMPTS  # never refused for want of another node
        assert await _settle(cluster["sched"].servicer.state) == 0
        only.fail = ""  # back: the first retry is served
        only.calls = 0
        events = await _turn(backend, 1)
        assert events[-1] == Finished("length", 4) and only.calls == 1
    finally:
        await backend.close()


async def test_a_restarting_only_node_is_served_by_a_retry_not_refused(cluster):
    flaky = FakeDecode("instant")
    await cluster["add_decode"]("d0", flaky)
    await _ready(cluster["addr"], 2)
    backend = GrpcBackend(cluster["cfg"], cluster["addr"], timeout_s=30)
    await backend.start()

    async def back_after_two_calls() -> None:
        while flaky.calls < 2:
            await asyncio.sleep(0.01)
        flaky.fail = ""

    try:
        healer = asyncio.create_task(back_after_two_calls())
        events = await _turn(backend, 0)
        await healer
        assert events[-1] == Finished("length", 4) and flaky.calls == 3
    finally:
        await backend.close()


async def test_a_duplicate_agent_waits_refused_then_replaces_the_stopped_one(cluster):
    first = NodeAgent(
        cluster["addr"], Registration("d9", "decode", "127.0.0.1:2"), lambda: NodeLoad()
    ).start()
    await _ready(cluster["addr"], 2)
    second = NodeAgent(
        cluster["addr"], Registration("d9", "decode", "127.0.0.1:3"), lambda: NodeLoad()
    ).start()
    state = cluster["sched"].servicer.state
    try:
        deadline = time.monotonic() + 5
        while second.refusals < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert second.refusals >= 2 and not second.registrations
        assert state.nodes["d9"].address == "127.0.0.1:2"
        await first.stop()  # its heartbeats stop: after the node timeout the id is free
        deadline = time.monotonic() + 10
        while not second.registrations and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert state.nodes["d9"].address == "127.0.0.1:3"
        assert state.nodes["d9"].incarnation == second.incarnation
    finally:
        await second.stop()


async def test_a_hung_node_is_blamed_at_the_deadline_a_slow_one_is_not(cluster):
    """DEADLINE_EXCEEDED before any token: the decode node hung (a failure against it); after
    tokens: it was serving, only slow (no blame); neither is a cancel of the client's."""
    hung = await cluster["add_decode"]("d0", FakeDecode(fail="hang"))
    await cluster["add_decode"]("d1", FakeDecode(delay_s=0.5))
    await _ready(cluster["addr"], 3)
    backend = GrpcBackend(cluster["cfg"], cluster["addr"], timeout_s=0.8)
    await backend.start()
    state = cluster["sched"].servicer.state
    try:
        for i in range(8):
            with pytest.raises(BackendError):
                await _turn(backend, i, tokens=4)  # d0: no token; d1: too slow for 0.8 s
        assert await _settle(state) == 0
        assert hung.calls >= 1
        assert state.breakers["d0"].failures >= 1 or state.breakers["d0"].open
        assert "d1" not in state.breakers or state.breakers["d1"].failures == 0
    finally:
        await backend.close()
