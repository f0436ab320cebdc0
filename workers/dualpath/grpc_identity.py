"""What each identity may call: the per-method checks of mutual TLS (`dualpath.tls`).

Under mTLS every caller already holds a certificate of the cluster's CA (the handshake refuses
the others, a plaintext client included); this interceptor checks what the certificate's
identity (`tls.Identity`: role and node) may do with each method:

- Scheduler `Register`: a prefill or decode identity, for its own role and, when the
  certificate names a node, its own node id. The scheduler binds a node id to the identity
  that first registered it (`NodeBindings`): a later caller with another identity is refused
  for that id (`Register`, `Heartbeats`, `KvEvents`, `KvSnapshot`, `Drain`). A role-wide
  certificate (node `*`, the operator's fallback without cert-manager) proves the role only.
- `Heartbeats`, `KvEvents`, `KvSnapshot`: a worker, for the node it is bound to (each streamed
  message is checked). A node's other publishers (`node_publisher`: engine vllm's connector,
  `<node>/vllm`) speak for the node.
- `Route`, `Complete`: the frontend (or `admin`, an operator's tool).
- `Drain`: the node itself, or `admin`. `ClusterView`: any cluster identity.
- Worker `Prefill`: a decode identity, for itself (`decode_node`, and the NIXL agent it names:
  a decode worker's agent is named after its node id) -- no pod has KV meant for another pod
  sent to itself, nor KV sent to another pod in its name.
- Worker `Generate`: the frontend or `admin`. `GetTransferInfo`: prefill or decode.

Refusals are PERMISSION_DENIED, counted (`dualpath_grpc_identity_refused_total`) and logged.
Health and reflection stay open (they need no identity, only the handshake).
"""

from __future__ import annotations

import inspect
import logging
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
from prometheus_client import Counter

from dualpath.log import clip
from dualpath.tls import Identity, peer_identity_of

log = logging.getLogger(__name__)

REFUSED = Counter(
    "dualpath_grpc_identity_refused_total",
    "gRPC calls refused because the caller's certificate may not make them, by component and "
    "method",
    ["component", "method"],
)

WORKERS = frozenset({"prefill", "decode"})
CLIENTS = frozenset({"frontend", "admin"})
ANY = frozenset({"scheduler", "prefill", "decode", "frontend", "admin"})


class NodeBindings:
    """Node id -> the identity (certificate URI) that registered it first. Never unbound: a
    node id keeps its identity for the scheduler's life (a restarted pod has the same one)."""

    def __init__(self) -> None:
        self._by_node: dict[str, str] = {}

    def bind(self, node_id: str, who: Identity) -> str | None:
        """Bind `node_id` to `who` (or check it); the problem when another identity holds it."""
        held = self._by_node.setdefault(node_id, who.uri)
        if held != who.uri:
            return f"node_id {clip(node_id)} is bound to {clip(held)}, not {clip(who.uri)}"
        return None

    def check(self, node_id: str, who: Identity) -> str | None:
        """Whether `who` may speak for `node_id` (registered by it, or not registered yet)."""
        held = self._by_node.get(node_id)
        if held is not None and held != who.uri:
            return f"node_id {clip(node_id)} is bound to {clip(held)}, not {clip(who.uri)}"
        return None

    def __len__(self) -> int:
        return len(self._by_node)


def own_node(who: Identity, node_id: str) -> str | None:
    if who.names_node and node_id != who.node:
        return f"{clip(who.uri)} may not act for node_id {clip(node_id)}"
    return None


@dataclass(frozen=True, slots=True)
class Rule:
    roles: frozenset[str]
    # the node a message speaks for (checked against the identity and, on the scheduler, the
    # bindings); None: the method speaks for no node
    node_of: Callable[[object], str] | None = None
    binds: bool = False  # Register: the first call binds the node id
    admin_any_node: bool = False  # Drain: an operator's tool may drain any node
    extra: Callable[[Identity, object], str | None] | None = None


def _register_role(who: Identity, request) -> str | None:  # noqa: ANN001
    from dualpath.v1 import scheduler_pb2 as pb

    # the proto's own enum names (ROLE_PREFILL -> prefill): this module sits below the
    # scheduler's wire module, which maps the same enum
    name = pb.Role.Name(request.role) if request.role in pb.Role.values() else ""
    role = name.removeprefix("ROLE_").lower() if name not in ("", "ROLE_UNSPECIFIED") else None
    if role is not None and role != who.role:
        return f"{clip(who.uri)} may not register a {role} node"
    return None


def _prefill_agent(who: Identity, request) -> str | None:  # noqa: ANN001
    # a node's NIXL agent is named `<node id>-<pid>-<random>` (transfer.engine): its own only,
    # matched whole (a prefix match let `decode-0` name `decode-0-evil`'s agent)
    agent = request.decode_agent
    if who.names_node and agent and not is_agent_of(agent, who.node):
        return f"{clip(who.uri)} may not have KV sent to agent {clip(agent)}"
    return None


def is_agent_of(agent: str, node_id: str) -> bool:
    """Whether `agent` is a NIXL agent name of node `node_id`: the node id itself, or
    `<node id>-<pid>-<6 hex>` (`transfer.engine`) or `<node id>-vllm-<pid>-<6 hex>` (the vLLM
    connector's `KvAgent`) -- matched whole, not by prefix."""
    own = rf"{re.escape(node_id)}-(vllm-)?\d+-[0-9a-f]{{6}}"
    return agent == node_id or re.fullmatch(own, agent) is not None


def _node_id(msg) -> str:  # noqa: ANN001
    return msg.node_id


PUBLISHER_SEP = "/"  # no node a certificate names holds one (its URI's last segment)


def node_publisher(node_id: str, name: str) -> str:
    """The KV event publisher id of another process of node `node_id` (engine vllm: its
    connector inside vLLM, `<node>/vllm`): its own event stream (epoch, seq) in the
    scheduler's index, speaking for the node with the node's certificate."""
    return f"{node_id}{PUBLISHER_SEP}{name}"


def _publisher_node(msg) -> str:  # noqa: ANN001
    return msg.node_id.split(PUBLISHER_SEP, 1)[0]


RULES: dict[str, Rule] = {
    "/dualpath.v1.Scheduler/Register": Rule(WORKERS, _node_id, binds=True, extra=_register_role),
    "/dualpath.v1.Scheduler/Heartbeats": Rule(WORKERS, _node_id),
    "/dualpath.v1.Scheduler/KvEvents": Rule(WORKERS, _publisher_node),
    "/dualpath.v1.Scheduler/KvSnapshot": Rule(WORKERS, _publisher_node),
    "/dualpath.v1.Scheduler/Drain": Rule(WORKERS | {"admin"}, _node_id, admin_any_node=True),
    "/dualpath.v1.Scheduler/Route": Rule(CLIENTS),
    "/dualpath.v1.Scheduler/Complete": Rule(CLIENTS),
    "/dualpath.v1.Scheduler/ClusterView": Rule(ANY),
    "/dualpath.v1.Worker/Prefill": Rule(
        frozenset({"decode"}), lambda r: r.decode_node, extra=_prefill_agent
    ),
    "/dualpath.v1.Worker/Generate": Rule(CLIENTS),
    "/dualpath.v1.Worker/GetTransferInfo": Rule(WORKERS),
}
OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


class Denied(Exception):
    pass


class IdentityInterceptor(grpc.aio.ServerInterceptor):
    """Checks each call's peer identity against `RULES`; `bindings` (the scheduler's) binds
    node ids at Register. A method without a rule needs a cluster identity of `cluster`."""

    def __init__(self, component: str, cluster: str, bindings: NodeBindings | None = None) -> None:
        self.component = component
        self.cluster = cluster
        self.bindings = bindings

    # -- the checks (pure) --------------------------------------------------------------
    def problem(self, method: str, who: Identity | None, message: object | None) -> str | None:
        """Why `who` may not make this call with `message` (None: it may). `message` None:
        the call's start, before a streamed request's messages."""
        if who is None:
            return "no DualPath client certificate"
        if who.cluster != self.cluster:
            return f"{clip(who.uri)} is of another cluster than {self.cluster!r}"
        rule = RULES.get(method)
        if rule is None:
            return None
        if who.role not in rule.roles:
            return f"a {who.role} may not call {method.rsplit('/', 1)[-1]}"
        if message is None or rule.node_of is None:
            return None
        if rule.admin_any_node and who.role == "admin":
            return None
        node_id = rule.node_of(message)
        problem = own_node(who, node_id)
        if problem is None and rule.extra is not None:
            problem = rule.extra(who, message)
        if problem is None and self.bindings is not None:
            bind = self.bindings.bind if rule.binds else self.bindings.check
            problem = bind(node_id, who)
        return problem

    # -- the shell ----------------------------------------------------------------------
    def _refuse(self, method: str, who: Identity | None, problem: str) -> Denied:
        REFUSED.labels(self.component, method.rsplit("/", 1)[-1]).inc()
        # `problem` echoes the caller's values clipped (`log.clip`): bounded under any input
        log.warning(
            "%s: refused %s from %s: %s",
            self.component,
            method,
            clip(who.uri if who else None),
            problem,
        )
        return Denied(f"{method}: {problem}")

    def _check(self, method: str, context, message: object | None) -> Identity | None:  # noqa: ANN001
        who = peer_identity_of(context.auth_context())
        problem = self.problem(method, who, message)
        if problem is not None:
            raise self._refuse(method, who, problem)
        return who

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        method = details.method
        if handler is None or method.startswith(OPEN_PREFIXES):
            return handler
        return _wrap(handler, method, self)


def _wrap(handler: grpc.RpcMethodHandler, method: str, ic: IdentityInterceptor):
    """`handler` with the identity checked at the call's start (a unary request) or on each
    request message (a streamed one)."""

    async def checked_stream(requests: AsyncIterator, context) -> AsyncIterator:  # noqa: ANN001
        # checked as each message is read, not before: a refusal before the server reads the
        # first message races the client's write of it, which grpc reports as INTERNAL
        seen = False
        async for msg in requests:
            seen = True
            try:
                ic._check(method, context, msg)
            except Denied as err:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(err))
            yield msg
        if not seen:  # an empty stream: its caller is checked all the same
            await start(None, context)

    async def start(request, context) -> bool:  # noqa: ANN001
        try:
            ic._check(method, context, request)
        except Denied as err:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(err))
        return True

    if handler.request_streaming and handler.response_streaming:
        inner = handler.stream_stream

        async def behaviour(requests, context):  # noqa: ANN001, ANN202
            async for out in inner(checked_stream(requests, context), context):
                yield out

        make = grpc.stream_stream_rpc_method_handler
    elif handler.request_streaming:
        inner = handler.stream_unary

        async def behaviour(requests, context):  # noqa: ANN001, ANN202
            return await inner(checked_stream(requests, context), context)

        make = grpc.stream_unary_rpc_method_handler
    elif handler.response_streaming and inspect.isasyncgenfunction(handler.unary_stream):
        inner = handler.unary_stream

        async def behaviour(request, context):  # noqa: ANN001, ANN202
            await start(request, context)
            async for out in inner(request, context):
                yield out

        make = grpc.unary_stream_rpc_method_handler
    elif handler.response_streaming:  # a handler that writes with `context.write`
        inner = handler.unary_stream

        async def behaviour(request, context):  # noqa: ANN001, ANN202
            await start(request, context)
            return await inner(request, context)

        make = grpc.unary_stream_rpc_method_handler
    else:
        inner = handler.unary_unary

        async def behaviour(request, context):  # noqa: ANN001, ANN202
            await start(request, context)
            return await inner(request, context)

        make = grpc.unary_unary_rpc_method_handler
    return make(
        behaviour,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
