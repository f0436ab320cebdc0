"""The loopback rendezvous between a decode worker adapter and the connector inside its vLLM.

The connector's worker half serves one question on 127.0.0.1 (`kv_connector_extra_config.
rendezvous_port`, chosen by the adapter): "transfer X: wait until it is ready to receive, then
tell me where" (a JSON line `{"xfer_id": X, "timeout_s": T}`). Ready means vLLM has allocated
X's blocks and parked it, and, on path D, this node has read the hit into them. The answer is
one JSON line: `{"target": KvTarget.params(), "hit_tokens": n}` (the NIXL agent, layer
addresses and X's vLLM block ids; n the hit tokens in the cache: the route's, or fewer when a
block failed) or `{"error": "..."}` (not ready within T). The adapter then hands the target to
the prefill node's `Prefill` call: the only cross-pod hops are that authenticated gRPC call and
the NIXL transfer itself; this socket never leaves the pod.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socketserver
import threading
from collections.abc import Callable
from dataclasses import dataclass

from dualpath.integrations.vllm.plan import KvTarget

log = logging.getLogger(__name__)

MAX_LINE_BYTES = 4096
MAX_WAIT_S = 600.0


class RendezvousError(RuntimeError):
    pass


@dataclass(frozen=True)
class Ready:
    target: KvTarget
    hit_tokens: int


# xfer_id, timeout_s -> Ready (raises RendezvousError when not ready in time)
WaitFn = Callable[[str, float], Ready]


class RendezvousServer:
    """Answers the question on a daemon thread per connection (loopback only)."""

    def __init__(self, port: int, wait_ready: WaitFn) -> None:
        wait = wait_ready

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:  # noqa: D102
                try:
                    line = self.rfile.readline(MAX_LINE_BYTES)
                    q = json.loads(line)
                    xfer_id = q["xfer_id"]
                    timeout_s = min(float(q.get("timeout_s", 30.0)), MAX_WAIT_S)
                    if not isinstance(xfer_id, str) or not xfer_id:
                        raise ValueError("xfer_id must be a non-empty string")
                    r = wait(xfer_id, timeout_s)
                    out = {"target": r.target.params(), "hit_tokens": r.hit_tokens}
                except RendezvousError as err:
                    out = {"error": str(err)}
                except (ValueError, KeyError, TypeError) as err:
                    out = {"error": f"bad question: {err}"}
                self.wfile.write(json.dumps(out).encode() + b"\n")

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server(("127.0.0.1", port), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="dualpath-rendezvous", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


async def ask(port: int, xfer_id: str, timeout_s: float) -> Ready:
    """The adapter's side: wait (at most `timeout_s`, plus a connect margin) for transfer
    `xfer_id` to be ready on the vLLM behind `port`."""
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection("127.0.0.1", port), timeout=10.0
        )
    except (OSError, TimeoutError) as err:
        raise RendezvousError(f"vLLM's connector rendezvous on port {port}: {err}") from err
    try:
        writer.write(json.dumps({"xfer_id": xfer_id, "timeout_s": timeout_s}).encode() + b"\n")
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), timeout=timeout_s + 10.0)
    except (OSError, TimeoutError) as err:
        raise RendezvousError(f"transfer {xfer_id}: rendezvous failed: {err!r}") from err
    finally:
        writer.close()
    try:
        msg = json.loads(line)
    except ValueError:
        raise RendezvousError(f"transfer {xfer_id}: the rendezvous closed unanswered") from None
    if "error" in msg:
        raise RendezvousError(f"transfer {xfer_id}: {msg['error']}")
    try:
        return Ready(KvTarget.of(msg["target"], "target"), int(msg["hit_tokens"]))
    except (KeyError, TypeError, ValueError) as err:
        raise RendezvousError(f"transfer {xfer_id}: bad answer: {err}") from err
