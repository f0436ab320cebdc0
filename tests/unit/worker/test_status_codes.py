"""A failed Generate's status says its cause (docs/status-codes.md): INVALID_ARGUMENT for a
target no node could be (an empty or malformed prefill_address), FAILED_PRECONDITION for a
prefill node that does not answer (its channel closed at once: no connect loop left behind),
RESOURCE_EXHAUSTED for KV larger than the whole buffer; UNAVAILABLE only for what a retry may
fix. Over the real gRPC service of the two in-process nodes (conftest's `cluster`)."""

from __future__ import annotations

import grpc
import pytest
from dualpath.v1 import worker_pb2 as wpb
from dualpath.v1 import worker_pb2_grpc as wpb_grpc
from dualpath.worker import FAILED_NODE_KEY


async def _generate(decode, **over) -> grpc.aio.AioRpcError:
    fields = dict(
        request_id="s", prompt_tokens=[5] * 20, max_new_tokens=2, prefill_node="prefill-0"
    )
    async with grpc.aio.insecure_channel(decode.address) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in wpb_grpc.WorkerStub(ch).Generate(
                wpb.GenerateRequest(**{**fields, **over}), timeout=30
            ):
                pass
    return caught.value


@pytest.mark.parametrize("address", ["", "no-port", "host:0", "host:99999", "a b:1", "h:1:2"])
async def test_a_malformed_prefill_address_is_invalid_argument(cluster, address):
    _, decode, _, _ = cluster
    err = await _generate(decode, prefill_address=address)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert "prefill_address" in err.details()


async def test_an_unreachable_prefill_is_failed_precondition_and_its_channel_closed(cluster):
    prefill, decode, _, _ = cluster
    err = await _generate(decode, prefill_address="127.0.0.1:1")
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err.details()
    assert dict(err.trailing_metadata())[FAILED_NODE_KEY] == "prefill-0"
    assert "127.0.0.1:1" not in decode._prefills  # nothing left reconnecting
    # the node still serves a turn with a good target
    async with grpc.aio.insecure_channel(decode.address) as ch:
        req = wpb.GenerateRequest(
            request_id="ok",
            prompt_tokens=[5] * 20,
            max_new_tokens=2,
            prefill_node=prefill.node_id,
            prefill_address=prefill.address,
        )
        chunks = [c async for c in wpb_grpc.WorkerStub(ch).Generate(req, timeout=30)]
    assert chunks[-1].finish_reason


async def test_kv_larger_than_the_whole_buffer_is_resource_exhausted(cluster):
    prefill, decode, _, _ = cluster
    too_many = decode.transfer.pool.nbytes // decode.cfg.spec.model.kv_bytes_per_token + 64
    err = await _generate(decode, prompt_tokens=[5] * too_many, prefill_address=prefill.address)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()
    assert "kvBufferBytes" in err.details()
