"""The cluster token: who may call the scheduler's and the workers' gRPC services.

Every process of one DualPathCluster holds the same token file (`--token-file`, default
`$DUALPATH_TOKEN_FILE`): in a pod the operator-made Secret `<cluster>-token` mounted read-only,
under `dualpath up` a file (mode 0600) in the run directory. Servers refuse every call whose
`authorization: Bearer <token>` metadata is missing or wrong with UNAUTHENTICATED
(`server_interceptors`); clients add the header to every call of their channel (`channel`), so
channels are made here and nowhere else.

Open without the token: the standard health service (it says only SERVING or not, and probes and
`grpc_health_probe` carry no token) and server reflection (the service schema, public in
`proto/`). Everything else, `Register`, `Route`, `Prefill`, `Generate`, `TransferInfo`, ..., needs
the token: a node id is bound to a token holder, and among holders the scheduler's incarnation
check keeps an alive node id from a second process.

Mutual TLS (`spec.security.tls.mode: mtls`, the default; `dualpath.tls`) replaces the token:
a process given `--tls-dir` (default `$DUALPATH_TLS_DIR`) serves and dials mutual TLS with its
own certificate, and `dualpath.grpc_identity` checks what each caller's identity may do. The
token remains where mTLS is off by choice (mode `token`). `Auth` is either; the helpers below
(`channel`, `server_interceptors`, `add_port`) take it, so call sites do not tell them apart.

Rotation without a restart: the file holds one token a line. Servers accept every line, clients
present the first; the file is re-read when it changes (the kubelet swaps a mounted Secret in
place), as the frontend's API keys are (both read by `keyfile.py`).
Rotate by adding the new token as a second line, then (once every pod has the file) moving it
first, then removing the old one.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
from collections.abc import Sequence
from pathlib import Path

import grpc
from prometheus_client import Counter

from dualpath.keyfile import KeyFile, KeyFileError
from dualpath.tls import TLS_ENV, TlsCredentials, TlsError

log = logging.getLogger(__name__)

TOKEN_ENV = "DUALPATH_TOKEN_FILE"  # the default of every process's --token-file
TOKEN_KEY = "token"  # the Secret's data key, so the mounted file is <mount>/token
# Services any caller may use (see the module docstring).
OPEN_SERVICES = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)
TOKEN_BYTES = 32

REFUSED = Counter(
    "dualpath_grpc_unauthenticated_total",
    "gRPC calls refused for a missing or wrong cluster token, by component and method",
    ["component", "method"],
)


class TokenError(KeyFileError):
    """The token file cannot be used; the message names the flag and path."""


class ClusterToken(KeyFile):
    """The current token(s) of a file, re-read when it changes."""

    def __init__(self, path: str | Path, recheck_s: float = 1.0, **kw) -> None:
        try:
            super().__init__(path, recheck_s, flag="--token-file", **kw)
        except KeyFileError as err:
            raise TokenError(str(err)) from None

    def accepts(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
        for key, value in metadata or ():
            if key == "authorization" and isinstance(value, str):
                scheme, _, presented = value.partition(" ")
                return scheme.lower() == "bearer" and self.match(presented.strip()) is not None
        return False


def new_token() -> str:
    return secrets.token_urlsafe(TOKEN_BYTES)


def write_token_file(path: str | Path, token: str | None = None) -> Path:
    """A fresh token file readable by its owner only (0600 from its creation on)."""
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write((token or new_token()) + "\n")
    os.chmod(path, 0o600)  # an existing file keeps its mode through O_CREAT
    return path


Auth = ClusterToken | TlsCredentials  # what a process authenticates its gRPC with


def add_token_argument(parser: argparse.ArgumentParser) -> None:
    """`--token-file` and `--tls-dir` (mutual TLS, which wins when both are given)."""
    parser.add_argument(
        "--tls-dir",
        default=None,
        help="this process's mutual TLS directory (ca.crt, tls.crt, tls.key: cert-manager's "
        f"layout; re-read when it changes) (default: ${TLS_ENV}; unset: --token-file)",
    )
    parser.add_argument(
        "--token-file",
        default=None,
        help="the cluster token file (one token a line: accepts every line, presents the "
        "first; re-read when it changes) every gRPC call between DualPath processes carries "
        f"(default: ${TOKEN_ENV}; unset: gRPC is not authenticated)",
    )


def load(path: str | None, component: str) -> ClusterToken | None:
    """The token of `--token-file` (or `$DUALPATH_TOKEN_FILE`); None, with a warning, when
    neither is given: the component's gRPC is then open to anyone who reaches it."""
    path = path or os.environ.get(TOKEN_ENV) or None
    if not path:
        log.warning("%s: no --token-file: gRPC calls are not authenticated", component)
        return None
    try:
        token = ClusterToken(path)
    except TokenError as err:
        raise SystemExit(f"dualpath {component}: {err}") from None
    log.info("%s: gRPC authenticated with the cluster token at %s", component, path)
    return token


def load_auth(token_file: str | None, tls_dir: str | None, component: str) -> Auth | None:
    """Mutual TLS from `--tls-dir` (or `$DUALPATH_TLS_DIR`), else the token (`load`)."""
    tls_dir = tls_dir or os.environ.get(TLS_ENV) or None
    if not tls_dir:
        return load(token_file, component)
    try:
        creds = TlsCredentials(tls_dir)
    except TlsError as err:
        raise SystemExit(f"dualpath {component}: {err}") from None
    log.info("%s: gRPC over mutual TLS as %s", component, creds.identity)
    return creds


def auth_files(auth: Auth | None) -> tuple[str, str]:
    """(token file, TLS directory) that `load_auth` loads `auth` from again, "" where unused:
    what a child process of this one (engine vllm's connector) is given to speak as it."""
    if isinstance(auth, TlsCredentials):
        return "", str(auth.dir)
    if isinstance(auth, ClusterToken):
        return str(auth.path), ""
    return "", ""


# ---- server ------------------------------------------------------------------------------------


def _refusal(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s kind that refuses the call."""

    async def refuse(_request, context: grpc.aio.ServicerContext):
        await context.abort(
            grpc.StatusCode.UNAUTHENTICATED,
            f"{method}: missing or wrong cluster token ('authorization: Bearer <token>')",
        )

    kind = (
        (handler.request_streaming and "stream" or "unary")
        + "_"
        + (handler.response_streaming and "stream" or "unary")
    )
    make = getattr(grpc, f"{kind}_rpc_method_handler")
    return make(
        refuse,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call but the open services' without the cluster token."""

    def __init__(self, token: ClusterToken, component: str) -> None:
        self.token = token
        self.component = component

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        method = details.method
        if handler is None or method.startswith(OPEN_SERVICES):
            return handler
        if self.token.accepts(details.invocation_metadata):
            return handler
        REFUSED.labels(self.component, method.rsplit("/", 1)[-1]).inc()
        log.warning("%s: refused %s: missing or wrong cluster token", self.component, method)
        return _refusal(handler, method)


def server_interceptors(auth: Auth | None, component: str, bind_nodes: bool = False) -> list:
    """What `grpc.aio.server(interceptors=...)` gets: the token check, the identity check
    (`bind_nodes`: the scheduler's, which binds node ids to identities at Register), or
    nothing."""
    if isinstance(auth, TlsCredentials):
        from dualpath.grpc_identity import IdentityInterceptor, NodeBindings

        bindings = NodeBindings() if bind_nodes else None
        return [IdentityInterceptor(component, auth.identity.cluster, bindings)]
    return [TokenInterceptor(auth, component)] if auth is not None else []


def add_port(server: grpc.aio.Server, address: str, auth: Auth | None) -> int:
    """Bind `address`: mutual TLS (client certificates required) or plaintext; the port."""
    if isinstance(auth, TlsCredentials):
        return server.add_secure_port(address, auth.server_credentials())
    return server.add_insecure_port(address)


# ---- client ------------------------------------------------------------------------------------


class _WithToken:
    """A multi-callable that adds the token to each call's metadata, then returns the plain call
    object: no per-message cost on streams (grpc.aio's client interceptors wrap every streamed
    message, which cost the local benchmark's turns measurably)."""

    __slots__ = ("_call", "_token")

    def __init__(self, multicallable, token: ClusterToken) -> None:  # noqa: ANN001
        self._call = multicallable
        self._token = token

    def __call__(self, request=None, *, metadata=None, **kwargs):  # noqa: ANN001, ANN204
        # request None: a streaming call written with `call.write()` (grpc.aio's own default)
        header = ("authorization", f"Bearer {self._token.first}")
        return self._call(request, metadata=(*(metadata or ()), header), **kwargs)


class TokenChannel:
    """A `grpc.aio.Channel` whose every call presents the cluster token (the stubs only ask a
    channel for multi-callables; everything else is the channel's own)."""

    def __init__(self, channel: grpc.aio.Channel, token: ClusterToken) -> None:
        self._channel = channel
        self.token = token

    def unary_unary(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        return _WithToken(self._channel.unary_unary(*args, **kwargs), self.token)

    def unary_stream(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        return _WithToken(self._channel.unary_stream(*args, **kwargs), self.token)

    def stream_unary(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        return _WithToken(self._channel.stream_unary(*args, **kwargs), self.token)

    def stream_stream(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        return _WithToken(self._channel.stream_stream(*args, **kwargs), self.token)

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self._channel, name)  # close, channel_ready, get_state, ...

    async def __aenter__(self) -> TokenChannel:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._channel.close()


RECONNECT_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)


# How long a channel that is not READY may take to connect to a peer that is up: it tries
# again within the reconnect backoff's cap (RECONNECT_OPTIONS, plus gRPC's 20% jitter).
CONNECT_WAIT_S = 1.5 * dict(RECONNECT_OPTIONS)["grpc.max_reconnect_backoff_ms"] / 1000


async def connected(ch: grpc.aio.Channel, wait_s: float = CONNECT_WAIT_S) -> bool:
    """Wait, at most `wait_s`, for a channel that is not READY to connect; False if it did not.

    A call on a channel between two reconnect attempts fails at once ("failed to connect to all
    addresses"), also when its peer is back up: a worker restarted after a crash, registered and
    routed to, failed its first turn that way and was held out by the scheduler's breaker for a
    cool-down. A dead peer costs its caller this wait, then the call fails as before."""
    if ch.get_state(try_to_connect=True) == grpc.ChannelConnectivity.READY:
        return True
    try:
        await asyncio.wait_for(ch.channel_ready(), wait_s)
    except TimeoutError:
        return False
    return True


def channel(
    address: str,
    token: Auth | None,
    options: Sequence[tuple[str, object]] = (),
    server_role: str | None = None,
) -> grpc.aio.Channel:
    """A channel to a DualPath gRPC service: mutual TLS with this process's certificate
    (the server must hold one of the cluster, of `server_role` when given), or plaintext whose
    every call presents the cluster token.

    Reconnects back off at most 1 s: gRPC's default climbs to 120 s, so a peer restarted after
    a crash (a scheduler, a worker) went unreached for tens of seconds after it was back."""
    opts = [*RECONNECT_OPTIONS, *options]
    if isinstance(token, TlsCredentials):
        opts += token.channel_options(server_role)
        return grpc.aio.secure_channel(address, token.channel_credentials(), options=opts)
    plain = grpc.aio.insecure_channel(address, options=opts)
    return plain if token is None else TokenChannel(plain, token)
