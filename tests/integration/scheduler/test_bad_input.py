"""The scheduler refuses out-of-range Route and Register fields with INVALID_ARGUMENT naming the
field, over real gRPC, and keeps serving well-formed calls."""

import math

import grpc
import pytest
from dualpath import config
from dualpath.scheduler.cli import build
from dualpath.scheduler.service import register_request_problem, route_request_problem
from dualpath.v1 import scheduler_pb2 as pb
from dualpath.v1 import scheduler_pb2_grpc as pb_grpc

GOOD_ROUTE = {"prompt_tokens": 100, "context_bytes": 1 << 20, "max_new_tokens": 16}
GOOD_REG = {"node_id": "d0", "role": pb.ROLE_DECODE, "address": "127.0.0.1:7000"}


@pytest.fixture
async def stub():
    sched = build(config.local_default(), None, "127.0.0.1", 0)
    await sched.start()
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{sched.port}")
    yield pb_grpc.SchedulerStub(ch)
    await ch.close()
    await sched.stop(0.1)


ROUTE_CASES = [
    ({"prompt_tokens": 2**63 - 1}, "prompt_tokens"),
    ({"prompt_tokens": 2**41}, "prompt_tokens"),
    ({"prompt_tokens": -5}, "prompt_tokens"),
    ({"prompt_tokens": 0}, "prompt_tokens"),
    ({"context_bytes": -1}, "context_bytes"),
    ({"context_bytes": 2**63 - 1}, "context_bytes"),
    ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"max_new_tokens": 2**62}, "max_new_tokens"),
    ({"queue_timeout_s": math.nan}, "queue_timeout_s"),
    ({"queue_timeout_s": math.inf}, "queue_timeout_s"),
    ({"queue_timeout_s": -1.0}, "queue_timeout_s"),
    ({"queue_timeout_s": 1e12}, "queue_timeout_s"),
]

REGISTER_CASES = [
    ({"address": ""}, "address"),
    ({"address": "nohost"}, "address"),
    ({"address": "127.0.0.1:0"}, "address"),
    ({"address": "127.0.0.1:99999"}, "address"),
    ({"node_id": ""}, "node_id"),
    ({"role": pb.ROLE_UNSPECIFIED}, "role"),
    ({"snic_bytes_per_s": math.nan}, "snic_bytes_per_s"),
    ({"snic_bytes_per_s": -1.0}, "snic_bytes_per_s"),
    ({"prefill_tokens_per_s": math.inf}, "prefill_tokens_per_s"),
    ({"load": pb.NodeLoad(tokens_queued=-3)}, "load.tokens_queued"),
    ({"load": pb.NodeLoad(buffer_free_bytes=-1)}, "load.buffer_free_bytes"),
    ({"load": pb.NodeLoad(read_pending_bytes=2**62)}, "load.read_pending_bytes"),
]


@pytest.mark.parametrize(("fields", "name"), ROUTE_CASES)
async def test_route_refuses_out_of_range_fields(stub, fields, name) -> None:
    from prometheus_client import REGISTRY

    labels = {"component": "scheduler", "method": "Route", "field": f"RouteRequest.{name}"}
    before = REGISTRY.get_sample_value("dualpath_grpc_invalid_argument_total", labels) or 0.0
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Route(pb.RouteRequest(**{**GOOD_ROUTE, **fields}), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert name in err.value.details()
    assert REGISTRY.get_sample_value("dualpath_grpc_invalid_argument_total", labels) == before + 1


@pytest.mark.parametrize(("fields", "name"), REGISTER_CASES)
async def test_register_refuses_bad_fields_and_lists_no_ghost(stub, fields, name) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Register(pb.RegisterRequest(**{**GOOD_REG, **fields}), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert name in err.value.details()
    view = await stub.ClusterView(pb.ClusterViewRequest(), timeout=5)
    assert not view.nodes  # nothing half-registered
    await stub.Register(pb.RegisterRequest(**GOOD_REG), timeout=5)  # still serving


def test_well_formed_requests_have_no_problem() -> None:
    assert route_request_problem(pb.RouteRequest(**GOOD_ROUTE, queue_timeout_s=2.5)) is None
    reg = pb.RegisterRequest(**GOOD_REG, snic_bytes_per_s=1e9, load=pb.NodeLoad(tokens_queued=9))
    assert register_request_problem(reg) is None
    v6 = pb.RegisterRequest(**{**GOOD_REG, "address": "[::1]:50051"})
    assert register_request_problem(v6) is None


HEARTBEAT_CASES = [
    (pb.Heartbeat(node_id="", load=pb.NodeLoad()), "node_id"),
    (pb.Heartbeat(node_id="d0", load=pb.NodeLoad(tokens_queued=-1)), "load.tokens_queued"),
    (pb.Heartbeat(node_id="d0", load=pb.NodeLoad(requests_running=-2)), "load.requests_running"),
    (pb.Heartbeat(node_id="d0", load=pb.NodeLoad(buffer_free_bytes=2**62)), "buffer_free_bytes"),
]


@pytest.mark.parametrize(("beat", "name"), HEARTBEAT_CASES)
async def test_heartbeat_refuses_out_of_range_loads(stub, beat, name) -> None:
    await stub.Register(pb.RegisterRequest(**GOOD_REG), timeout=5)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in stub.Heartbeats(iter([beat]), timeout=5):
            pass
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert name in err.value.details()
    view = await stub.ClusterView(pb.ClusterViewRequest(), timeout=5)
    assert [n.load.tokens_queued for n in view.nodes] == [0]  # the bad load was not taken


BOUND_CASES = [  # (method, request, the field named): every string and repeated field is bounded
    ("Register", pb.RegisterRequest(**{**GOOD_REG, "node_id": "n" * (1 << 20)}), "node_id"),
    ("Register", pb.RegisterRequest(**{**GOOD_REG, "config_hash": "h" * 513}), "config_hash"),
    ("Route", pb.RouteRequest(**GOOD_ROUTE, session_id="s" * 600), "session_id"),
    ("Route", pb.RouteRequest(**GOOD_ROUTE, exclude_nodes=["d"] * 5000), "exclude_nodes"),
    ("Complete", pb.CompleteRequest(request_id="r" * 4096), "request_id"),
    ("Drain", pb.DrainRequest(node_id="n" * 4096), "node_id"),
    ("KvEvents", pb.KvEventBatch(node_id="n", seq=1, epoch="e" * 999), "epoch"),
]


@pytest.mark.parametrize(("method", "request_", "field"), BOUND_CASES)
async def test_every_rpc_refuses_a_field_over_its_bound_by_name(stub, method, request_, field):
    from prometheus_client import REGISTRY

    def count() -> float:
        labels = {
            "component": "scheduler",
            "method": method,
            "field": f"{type(request_).__name__}.{field}",
        }
        return REGISTRY.get_sample_value("dualpath_grpc_invalid_argument_total", labels) or 0.0

    before = count()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await getattr(stub, method)(request_, timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"{type(request_).__name__}.{field}" in caught.value.details()
    assert count() == before + 1
    view = await stub.ClusterView(pb.ClusterViewRequest(), timeout=10)
    assert not view.nodes  # no registration got through


async def test_a_stream_message_over_its_bound_ends_the_stream_by_name(stub) -> None:
    call = stub.Heartbeats(timeout=10)
    await call.write(pb.Heartbeat(node_id="n" * 100_000))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call.read()
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "Heartbeat.node_id" in caught.value.details()
