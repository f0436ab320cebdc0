"""Bounds on every string, bytes and repeated field of every gRPC request, checked at the edge.

`BoundsInterceptor` checks each request message (each message of a stream too) of every method
of the server it is given to, the scheduler's and the workers', before the servicer sees it: a
field over its bound is refused INVALID_ARGUMENT naming it (`RegisterRequest.node_id is 1048576
characters; at most 512`) and counted in `dualpath_grpc_invalid_argument_total` by component,
method and field. Nested messages are walked, so a new field of any message is bounded the day
it is added (by its kind's default, or by `LIMITS`). What a field means (a token in the
vocabulary, a region inside a buffer) is the servicers' to check; they count their refusals in
the same counter through `refuse`.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from prometheus_client import Counter

from dualpath.kv.ids import MAX_SALT_BYTES

log = logging.getLogger(__name__)

# A node id, agent name, request or session id, address, hash: far above any real one.
MAX_ID_CHARS = 512
MAX_BYTES = 1 << 20  # metadata blobs (a NIXL agent's is a few KiB)
MAX_ITEMS = 1 << 10  # a repeated field's entries unless LIMITS says otherwise
MAX_PROMPT_TOKENS = 1 << 22  # 4M: above any served context (a frontend's is 64K by default)
MAX_PACKED_BYTES = 16 << 20  # packed int64 keys of one message (above gRPC's 4 MiB default)

# By full field name; every other field takes its kind's default above.
LIMITS: dict[str, int] = {
    "dualpath.v1.GenerateRequest.prompt_tokens": MAX_PROMPT_TOKENS,
    "dualpath.v1.PrefillRequest.prompt_tokens": MAX_PROMPT_TOKENS,
    "dualpath.v1.GenerateRequest.cache_salt": MAX_SALT_BYTES,
    "dualpath.v1.PrefillRequest.cache_salt": MAX_SALT_BYTES,
    "dualpath.v1.RouteRequest.block_keys": MAX_PACKED_BYTES,
    "dualpath.v1.KvEventBatch.stored_keys": MAX_PACKED_BYTES,
    "dualpath.v1.KvEventBatch.stored_parents": MAX_PACKED_BYTES,
    "dualpath.v1.KvEventBatch.stored_depths": MAX_PACKED_BYTES,
    "dualpath.v1.KvEventBatch.removed_keys": MAX_PACKED_BYTES,
    "dualpath.v1.KvSnapshotChunk.keys": MAX_PACKED_BYTES,
}

INVALID = Counter(
    "dualpath_grpc_invalid_argument_total",
    "gRPC requests refused INVALID_ARGUMENT, by component, method and the field named",
    ["component", "method", "field"],
)


def _repeated(fd: FieldDescriptor) -> bool:
    is_repeated = getattr(fd, "is_repeated", None)  # protobuf >= 5.29; `label` before
    return bool(is_repeated) if is_repeated is not None else fd.label == fd.LABEL_REPEATED


def _limit(fd: FieldDescriptor) -> int:
    if fd.full_name in LIMITS:
        return LIMITS[fd.full_name]
    if _repeated(fd):
        return MAX_ITEMS
    return MAX_BYTES if fd.type == FieldDescriptor.TYPE_BYTES else MAX_ID_CHARS


def _name(fd: FieldDescriptor) -> str:
    return f"{fd.containing_type.name}.{fd.name}"


def problem(msg: Message) -> tuple[str, str] | None:
    """(field, what is wrong) for the first field of `msg` (or of a message in it) over its
    bound; None when every field is within bounds."""
    for fd, value in msg.ListFields():
        limit = _limit(fd)
        repeated = _repeated(fd)
        if repeated and len(value) > limit:
            return _name(fd), f"{_name(fd)} has {len(value)} entries; at most {limit}"
        for item in value if repeated else (value,):
            if fd.type == FieldDescriptor.TYPE_MESSAGE:
                found = problem(item)
                if found is not None:
                    return found
            elif fd.type in (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES):
                cap = MAX_ID_CHARS if repeated and fd.full_name not in LIMITS else limit
                if len(item) > cap:
                    unit = "characters" if fd.type == FieldDescriptor.TYPE_STRING else "bytes"
                    return _name(fd), f"{_name(fd)} is {len(item)} {unit}; at most {cap}"
    return None


async def refuse(context: Any, component: str, method: str, field: str, message: str) -> None:
    """Abort the call INVALID_ARGUMENT with `message` (it names `field`), counted."""
    INVALID.labels(component, method, field).inc()
    log.debug("%s %s refused: %s", component, method, message)
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)


class BoundsInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every request (every message of a request stream) with a field over its bound."""

    def __init__(self, component: str) -> None:
        self.component = component

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None:
            return handler
        method = details.method.rsplit("/", 1)[-1]
        component = self.component

        async def check(msg: Any, context: Any) -> None:
            found = problem(msg) if isinstance(msg, Message) else None
            if found is not None:
                await refuse(context, component, method, *found)

        def checked(requests: AsyncIterator, context: Any) -> AsyncIterator:
            async def each() -> AsyncIterator:
                async for msg in requests:
                    await check(msg, context)
                    yield msg

            return each()

        streaming_in = handler.request_streaming
        fn = (
            (handler.stream_unary or handler.stream_stream)
            if streaming_in
            else (handler.unary_unary or handler.unary_stream)
        )

        async def first(request, context):  # noqa: ANN001, ANN202
            if streaming_in:
                return checked(request, context)
            await check(request, context)
            return request

        # the wrapper is of the handler's own kind: grpc.aio tells an async generator handler
        # from one that writes (`context.write`) by the function itself
        if inspect.isasyncgenfunction(fn):

            async def behaviour(request, context):  # noqa: ANN001, ANN202
                async for item in fn(await first(request, context), context):
                    yield item

        else:

            async def behaviour(request, context):  # noqa: ANN001, ANN202
                return await fn(await first(request, context), context)

        kind = ("stream" if handler.request_streaming else "unary") + (
            "_stream" if handler.response_streaming else "_unary"
        )
        make = getattr(grpc, f"{kind}_rpc_method_handler")
        return make(
            behaviour,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
