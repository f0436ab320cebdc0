"""The worker's gRPC service: `WorkerServicer` (a thin adapter: each call is converted and
checked by `wire.py`, served by a role, its answer converted back; errors become statuses) and
`WorkerServer` (the grpc.aio server with the Worker and health services, the cluster token and
the bounds of every field)."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from dualpath.grpc_auth import Auth, add_port, server_interceptors
from dualpath.grpc_bounds import BoundsInterceptor, refuse
from dualpath.grpc_channels import Unreachable
from dualpath.log import clip
from dualpath.scheduler.wire import ROLE_TO_PB
from dualpath.v1 import worker_pb2 as wpb
from dualpath.v1 import worker_pb2_grpc as wpb_grpc
from dualpath.worker.common import MAX_MESSAGE_BYTES
from dualpath.worker.wire import (
    BadField,
    chunk_to_pb,
    generate_from_pb,
    prefill_from_pb,
    prefill_message_to_pb,
)

if TYPE_CHECKING:
    from dualpath.worker.common import Node

log = logging.getLogger(__name__)


class WorkerServicer(wpb_grpc.WorkerServicer):
    """Thin adapter: role objects do the work; errors become gRPC statuses."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.component = f"{node.role.value}-worker"

    async def _accept(self, context, method: str, role, parse, request):  # noqa: ANN001, ANN202
        """What every call passes before a role sees it: this node has the role that serves
        `method`, it is not stopping (a draining node still serves what the scheduler routed
        before it learned of the drain), and the request converts (`wire`)."""
        n = self.node
        if role is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"{n.node_id} is a {n.role.value} node"
            )
        if n.stopping:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{n.node_id} is stopping")
        try:
            return parse(request, n.cfg.spec.model)
        except BadField as err:
            await self._refuse(context, method, err)

    async def _refuse(self, context, method: str, err: BadField) -> None:  # noqa: ANN001
        message = f"{method}Request.{err}"
        await refuse(context, self.component, method, err.field, message)

    async def GetTransferInfo(self, request, context):  # noqa: N802, ANN001, ANN201
        n = self.node
        return wpb.TransferInfo(
            agent=n.transfer.name,
            metadata=n.transfer.metadata,
            node_id=n.node_id,
            role=ROLE_TO_PB[n.role.value],
            config_hash=n.cfg.config_hash,
        )

    async def Prefill(self, request, context):  # noqa: N802, ANN001, ANN201
        from dualpath.worker.prefill import (
            VALID_HIT_KEY,
            WRITES_IN_FLIGHT_KEY,
            HitUnavailable,
            PrefillOutcome,
        )

        n = self.node
        order = await self._accept(context, "Prefill", n.prefill, prefill_from_pb, request)
        outcome = PrefillOutcome()
        n.inflight += 1  # a drain waits for it: its reads, relays and handoff to decode
        n.registration.claim(order.request_id)
        try:
            with n.transfer.active():
                async for message in n.prefill.serve(order, outcome):
                    yield prefill_message_to_pb(message)
        except BadField as err:  # the decode agent's metadata or regions (checked first)
            await self._refuse(context, "Prefill", err)
        except HitUnavailable as err:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"hit KV unavailable: {err}",
                trailing_metadata=(
                    (VALID_HIT_KEY, str(err.valid_tokens)),
                    *(((WRITES_IN_FLIGHT_KEY, "1"),) if outcome.writes_in_flight else ()),
                ),
            )
        except asyncio.CancelledError:
            raise
        except Exception as err:
            log.exception("prefill %s failed", request.request_id)
            await context.abort(
                grpc.StatusCode.INTERNAL,
                f"prefill failed: {err}",
                # the decode node holds its regions while a WRITE of ours may still land
                trailing_metadata=((WRITES_IN_FLIGHT_KEY, "1"),)
                if outcome.writes_in_flight
                else (),
            )
        finally:
            n.inflight -= 1

    async def Generate(self, request, context):  # noqa: N802, ANN001, ANN201
        from dualpath.worker import FAILED_NODE_KEY
        from dualpath.worker.decode import PrefillFailed

        n = self.node
        turn = await self._accept(context, "Generate", n.decode, generate_from_pb, request)
        n.inflight += 1
        n.registration.claim(turn.request_id)
        try:
            async for chunk in n.decode.generate(turn):
                yield chunk_to_pb(chunk)
        except asyncio.CancelledError:
            raise
        except Exception as err:
            log.warning("request %s failed: %s", request.request_id, clip(str(err), 300))
            # which side failed, for the frontend's retry and the scheduler's breaker
            on_prefill = isinstance(err, PrefillFailed | Unreachable)
            culprit = request.prefill_node if on_prefill else n.node_id
            context.set_trailing_metadata(((FAILED_NODE_KEY, culprit),))
            await context.abort(generate_status(err), f"{n.node_id}: {err}")
        finally:
            n.inflight -= 1


def generate_status(err: Exception) -> grpc.StatusCode:
    """A failed Generate's status by its cause (docs/status-codes.md): RESOURCE_EXHAUSTED
    when the turn's KV is larger than the whole buffer (capacity: only a larger buffer
    serves it), FAILED_PRECONDITION when the prefill node it names does not connect (a bad
    target; the frontend routes again, waiting for a restarting node), UNAVAILABLE for what
    the same call may do once retried (a node that failed mid-turn, a buffer busy now)."""
    from dualpath.transfer.pool import BufferTooSmall  # torch: the decode role's
    from dualpath.worker.decode import PrefillUnreachable

    if isinstance(err, BufferTooSmall):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(err, Unreachable | PrefillUnreachable):
        return grpc.StatusCode.FAILED_PRECONDITION
    return grpc.StatusCode.UNAVAILABLE


class WorkerServer:
    """The node's grpc.aio server: the Worker service and the standard health service."""

    def __init__(
        self,
        node: Node,
        token: Auth | None,
        servicer: wpb_grpc.WorkerServicer | None = None,
    ) -> None:
        """`servicer`: the Worker service (default `WorkerServicer(node)`; engine vllm's is
        `worker.vllm.VllmServicer`), behind the same authentication and field bounds."""
        self.token = token
        component = f"{node.role.value}-worker"
        self.server = grpc.aio.server(
            # bounds first: an oversized field is refused before the identity check echoes it
            interceptors=[BoundsInterceptor(component), *server_interceptors(token, component)],
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ],
        )
        wpb_grpc.add_WorkerServicer_to_server(servicer or WorkerServicer(node), self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)

    async def start(self, host: str, port: int) -> int:
        """Serve on host:port (0: any free port); returns the bound port."""
        bound = add_port(self.server, f"{host}:{port}", self.token)
        await self.server.start()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self.health.set("dualpath.v1.Worker", health_pb2.HealthCheckResponse.SERVING)
        return bound

    async def stop(self, grace_s: float = 1.0) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace=grace_s)
