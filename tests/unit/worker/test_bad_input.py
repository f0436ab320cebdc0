"""Worker RPCs under bad input (issue 29): every field a worker cannot serve is refused
INVALID_ARGUMENT naming it, before any buffer is taken or transfer posted, and counted; never
INTERNAL. Over the real gRPC service of the two in-process nodes (conftest's `cluster`)."""

from __future__ import annotations

import grpc
import pytest
from dualpath.config import ModelSpec
from dualpath.grpc_bounds import MAX_ID_CHARS, problem
from dualpath.sampling import SamplingParams
from dualpath.v1 import scheduler_pb2 as spb
from dualpath.v1 import worker_pb2 as wpb
from dualpath.v1 import worker_pb2_grpc as wpb_grpc
from dualpath.worker.wire import BadField, Turn, generate_from_pb, generate_to_pb, prefill_from_pb
from prometheus_client import REGISTRY

BT = 16


def _invalid(component: str, method: str, field: str) -> float:
    labels = {"component": component, "method": method, "field": field}
    return REGISTRY.get_sample_value("dualpath_grpc_invalid_argument_total", labels) or 0.0


def _prefill_request(decode, **over) -> wpb.PrefillRequest:
    """A well-formed Prefill of 20 new tokens into a real region of the decode node's buffer."""
    t = decode.transfer
    nbytes = 20 * decode.cfg.spec.model.kv_bytes_per_token
    fields = dict(
        request_id="bad-1",
        prompt_tokens=[5] * 20,
        decode_node=decode.node_id,
        decode_agent=t.name,
        decode_agent_metadata=t.metadata,
        decode_new=wpb.Region(address=t.pool.address, length=nbytes),
    )
    return wpb.PrefillRequest(**{**fields, **over})


async def _call_prefill(prefill, request) -> grpc.aio.AioRpcError:
    async with grpc.aio.insecure_channel(prefill.address) as ch:
        call = wpb_grpc.WorkerStub(ch).Prefill(request, timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in call:
                pass
    return caught.value


@pytest.mark.parametrize(
    ("field", "over"),
    [
        ("decode_agent_metadata", dict(decode_agent="stranger", decode_agent_metadata=b"\x00junk")),
        ("decode_agent", dict(decode_agent="")),
        ("decode_new", dict(decode_new=wpb.Region(address=8, length=1 << 20))),  # not its buffer
        ("decode_new", dict(decode_new=wpb.Region(address=1 << 40, length=1))),  # too short
        ("decode_new", dict(decode_new=None)),
        ("hit_tokens", dict(hit_tokens=7)),  # not whole blocks
        ("prompt_tokens", dict(prompt_tokens=[10**6])),  # outside the vocabulary
        ("read_path", dict(hit_tokens=BT, read_path=9)),
        ("request_id", dict(request_id="")),
    ],
)
async def test_a_prefill_no_transfer_could_serve_is_refused_by_field_before_any_is_posted(
    cluster, field, over
):
    prefill, decode, _, _ = cluster
    writes, before = prefill.transfer.stats.writes, _invalid("prefill-worker", "Prefill", field)
    err = await _call_prefill(prefill, _prefill_request(decode, **over))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert f"PrefillRequest.{field}" in err.details()
    assert _invalid("prefill-worker", "Prefill", field) == before + 1
    assert prefill.transfer.stats.writes == writes  # nothing posted
    assert prefill.transfer.pool.regions == 0  # nothing taken


async def test_a_region_outside_the_peers_buffer_is_refused_even_past_its_end(cluster):
    prefill, decode, _, _ = cluster
    t = decode.transfer
    nbytes = 20 * decode.cfg.spec.model.kv_bytes_per_token
    past = wpb.Region(address=t.pool.address + t.pool.nbytes - 8, length=nbytes)
    err = await _call_prefill(prefill, _prefill_request(decode, decode_new=past))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "lies outside" in err.details() and "decode_new" in err.details()


async def test_a_generate_with_bad_fields_is_refused_by_name_and_counted(cluster):
    prefill, decode, _, _ = cluster
    good = dict(
        request_id="g",
        prompt_tokens=[5] * 20,
        max_new_tokens=2,
        prefill_node=prefill.node_id,
        prefill_address=prefill.address,
    )
    cases = {
        "prompt_tokens": dict(prompt_tokens=[]),
        "max_new_tokens": dict(max_new_tokens=0),
        "temperature": dict(temperature=float("nan")),
        "top_p": dict(top_p=1.5),
        "top_k": dict(top_k=-2),
        "min_tokens": dict(min_tokens=5),
        "stop_tokens": dict(stop_tokens=[-1]),
        "hit_tokens": dict(hit_tokens=-16),
        "read_path": dict(hit_tokens=BT, read_path=7),
        "GenerateRequest.cache_salt": dict(cache_salt=b"s" * 65),  # the bounds' (interceptor)
        "GenerateRequest.session_id": dict(session_id="x" * (MAX_ID_CHARS + 1)),
    }
    async with grpc.aio.insecure_channel(decode.address) as ch:
        stub = wpb_grpc.WorkerStub(ch)
        for field, over in cases.items():
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for _ in stub.Generate(wpb.GenerateRequest(**{**good, **over}), timeout=10):
                    pass
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
            assert field in caught.value.details()
        chunks = [c async for c in stub.Generate(wpb.GenerateRequest(**good), timeout=30)]
    assert chunks[-1].finish_reason  # the node still serves a good turn


def test_the_wire_reads_back_what_it_writes():
    model = ModelSpec(preset="tiny", block_tokens=BT)
    turn = Turn(
        "r",
        "s",
        (5, 6, 7),
        0,
        "decode",
        "p0",
        "h:1",
        b"salt",
        SamplingParams(
            temperature=0.5,
            max_tokens=9,
            stop_tokens=(3,),
            seed=4,
            top_p=0.9,
            top_k=2,
            min_tokens=1,
        ),
    )
    assert generate_from_pb(generate_to_pb(turn), model) == turn
    with pytest.raises(BadField, match="decode_agent"):
        prefill_from_pb(wpb.PrefillRequest(request_id="x", prompt_tokens=[1, 2]), model)


def test_every_string_bytes_and_repeated_field_has_a_bound():
    big = "n" * (1 << 20)
    found = problem(spb.RegisterRequest(node_id=big, address="h:1"))
    assert found is not None and found[0] == "RegisterRequest.node_id"
    assert "1048576 characters; at most" in found[1]
    nested = spb.ClusterViewResponse(nodes=[spb.NodeInfo(node_id="a"), spb.NodeInfo(group=big)])
    assert problem(nested)[0] == "NodeInfo.group"
    assert problem(spb.RouteRequest(exclude_nodes=["a"] * 2000))[0] == "RouteRequest.exclude_nodes"
    assert problem(spb.RouteRequest(exclude_nodes=[big]))[0] == "RouteRequest.exclude_nodes"
    assert problem(wpb.PrefillRequest(decode_agent_metadata=b"m" * (2 << 20)))[0] == (
        "PrefillRequest.decode_agent_metadata"
    )
    assert problem(wpb.GenerateRequest(prompt_tokens=[1] * 100_000, request_id="r")) is None
