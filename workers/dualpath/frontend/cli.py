"""`dualpath frontend`: the OpenAI-style HTTP frontend over the scheduler and decode workers."""

from __future__ import annotations

import argparse
import logging

from dualpath import config
from dualpath.grpc_auth import add_token_argument
from dualpath.log import name_process

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-f", "--file", help="DualPathCluster YAML (default: embedded local)")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, help="HTTP port (default: spec.frontend.port)")
    parser.add_argument(
        "--scheduler",
        default=None,
        help="scheduler host:port (default: 127.0.0.1:spec.scheduler.port)",
    )
    parser.add_argument(
        "--api-keys",
        default=None,
        help="file (one key a line) or directory (a mounted Secret) of API keys every /v1 call "
        "must present as 'Authorization: Bearer <key>'; re-read when it changes (default: "
        "$DUALPATH_API_KEYS_FILE; unset: the API is open)",
    )
    add_token_argument(parser)
    parser.add_argument(
        "--fake",
        action="store_true",
        help="serve from the in-memory fake backend (no cluster; for trying the API)",
    )


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from dualpath.frontend.app import create_app
    from dualpath.frontend.auth import ApiKeys, ApiKeysError, default_keys_path
    from dualpath.frontend.backend import FakeBackend
    from dualpath.frontend.http_guard import ConnectionLimits, dropped_counter, guarded_protocol

    name_process("frontend")
    cfg = config.load_or_default(args.file)
    if args.fake:
        backend = FakeBackend(cfg.spec.model)
    else:
        from dualpath.frontend.grpc_backend import GrpcBackend

        sched = args.scheduler or f"127.0.0.1:{cfg.spec.scheduler.port}"
        from dualpath.grpc_auth import load_auth

        auth = load_auth(args.token_file, args.tls_dir, "frontend")
        backend = GrpcBackend(cfg, sched, token=auth)
    port = args.port if args.port is not None else cfg.spec.frontend.port
    keys_path = args.api_keys or default_keys_path()
    try:
        keys = ApiKeys(keys_path) if keys_path else None
    except ApiKeysError as err:
        raise SystemExit(f"dualpath frontend: {err}") from None
    if keys is None:
        log.warning("frontend: no API keys (--api-keys): the HTTP API is open")
    else:
        log.info("frontend: %d API keys from %s", len(keys), keys_path)
    app = create_app(cfg, backend, api_keys=keys)
    fe = cfg.spec.frontend
    limits = ConnectionLimits(
        fe.header_timeout_seconds, fe.body_timeout_seconds, fe.max_connections
    )
    http = guarded_protocol(limits, dropped_counter(app.state.frontend.registry))
    print(f"READY frontend http={port}", flush=True)
    uvicorn.run(app, host=args.host, port=port, http=http, log_level="warning", access_log=False)
    return 0
