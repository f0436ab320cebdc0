"""A transfer engine in a child process, driven over a pipe: the far end of the transfer
benchmark and of the multi-process transfer tests (the workers exchange the same metadata
over their gRPC API instead).

    with PeerProcess(pool_bytes=64 << 20) as peer:
        name = engine.add_peer(peer.metadata)
        await engine.write(name, src, n, peer.address, notif=b"x/0")
        peer.call("wait", prefix="x/", count=1)   # -> {"t_last": monotonic seconds, ...}
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
from typing import Any


def _serve(conn, node_id: str, pool_bytes: int, link_gbps: float) -> None:  # noqa: ANN001
    """Child: run an engine; answer commands until 'stop' or the parent goes away."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from dualpath.transfer.engine import TransferEngine

    async def main() -> None:
        link = None
        if link_gbps:
            from dualpath.transfer.link import ComputeLink

            link = ComputeLink(link_gbps, name=node_id)
        engine = TransferEngine(node_id, pool_bytes, link=link, deadline_s=10).start()
        conn.send(
            {
                "metadata": engine.metadata,
                "name": engine.name,
                "address": engine.pool.address,
                "nbytes": engine.pool.nbytes,
            }
        )
        loop = asyncio.get_running_loop()
        try:
            while True:
                cmd = await loop.run_in_executor(None, _recv, conn)
                if cmd is None or cmd["op"] == "stop":
                    break
                try:
                    conn.send({"ok": True, **(await _handle(engine, cmd))})
                except Exception as err:  # reported to the parent, which raises it
                    conn.send({"ok": False, "error": f"{type(err).__name__}: {err}"})
        finally:
            await engine.aclose()

    asyncio.run(main())


def _recv(conn) -> dict | None:  # noqa: ANN001
    try:
        return conn.recv()
    except EOFError:
        return None


async def _handle(engine, cmd: dict) -> dict:  # noqa: ANN001
    import time

    op = cmd["op"]
    if op == "add_peer":
        return {"name": engine.add_peer(cmd["metadata"])}
    if op == "wait":  # notifications prefix0..prefix{count-1} from `peer`
        await asyncio.gather(
            *(
                engine.wait_notif(
                    cmd["peer"], f"{cmd['prefix']}{i}".encode(), cmd.get("deadline_s")
                )
                for i in range(cmd["count"])
            )
        )
        return {"t_last": time.monotonic()}
    if op == "read":  # bytes of our buffer, to check what a peer wrote
        off, n = cmd["offset"], cmd["nbytes"]
        return {"data": engine.pool.tensor[off : off + n].numpy().tobytes()}
    if op == "fill":
        engine.pool.tensor[cmd["offset"] : cmd["offset"] + cmd["nbytes"]] = cmd["value"]
        return {}
    if op == "write":  # we write to `peer`
        t0 = time.monotonic()
        await engine.write(
            cmd["peer"],
            engine.pool.address + cmd["offset"],
            cmd["nbytes"],
            cmd["dst"],
            notif=cmd.get("notif", b""),
            traffic_class=cmd.get("traffic_class", "kv"),
        )
        return {"seconds": time.monotonic() - t0}
    raise ValueError(f"unknown peer command {op!r}")


class PeerProcess:
    """Owns the child; `close()` (or the context manager) stops it, killing it if needed."""

    def __init__(
        self,
        node_id: str = "peer",
        pool_bytes: int = 64 << 20,
        link_gbps: float = 0.0,
        start_timeout_s: float = 60.0,
    ) -> None:
        ctx = mp.get_context("spawn")  # never fork a process holding NIXL/UCX state
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_serve, args=(child, node_id, pool_bytes, link_gbps), daemon=True
        )
        self.process.start()
        child.close()
        if not self._conn.poll(start_timeout_s):
            self.close()
            raise RuntimeError(f"peer process did not start within {start_timeout_s}s")
        info = self._conn.recv()
        self.metadata: bytes = info["metadata"]
        self.name: str = info["name"]
        self.address: int = info["address"]
        self.nbytes: int = info["nbytes"]

    def call(self, op: str, timeout_s: float = 60.0, **kw: Any) -> dict:
        """Send a command and wait for its answer."""
        self.send(op, **kw)
        return self.result(timeout_s, op)

    def send(self, op: str, **kw: Any) -> None:
        """Send a command without waiting (collect the answer with `result()`)."""
        self._conn.send({"op": op, **kw})

    def result(self, timeout_s: float = 60.0, op: str = "") -> dict:
        """The answer to the last command sent; raises the peer's error."""
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"peer did not answer {op or 'its command'} within {timeout_s}s")
        reply = self._conn.recv()
        if not reply.pop("ok"):
            raise RuntimeError(f"{f'peer {op}' if op else 'peer'}: {reply['error']}")
        return reply

    def kill(self) -> None:
        self.process.kill()
        self.process.join(5)

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self._conn.send({"op": "stop"})
            except (BrokenPipeError, OSError):
                pass
            self.process.join(10)
            if self.process.is_alive():
                self.kill()
        self._conn.close()

    def __enter__(self) -> PeerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
