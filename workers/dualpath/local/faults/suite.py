"""What every row shares: the cluster, the client, load while a fault is injected, the
time to serving again."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import yaml

from dualpath.local.faults.client import Client, Result
from dualpath.local.faults.up import Cluster


class Suite:
    def __init__(self, cluster: Cluster, client: Client, quick: bool, mounted: bool) -> None:
        self.cl, self.c, self.quick, self.mounted = cluster, client, quick, mounted
        self.ref_ids = list(client.refs)
        self._next_new = 10_000  # prompts never sent before (no reference, no hit)

    def new_prompt(self) -> int:
        self._next_new += 1
        return self._next_new

    async def load_during(
        self, fault: Callable[[], Awaitable[None]], prompts: list[int] | None = None, n: int = 3
    ) -> list[Result]:
        stop, out = asyncio.Event(), []
        tasks = [
            asyncio.create_task(self.c.loop(prompts or self.ref_ids, stop, out)) for _ in range(n)
        ]
        try:
            await asyncio.sleep(0.5)
            await fault()
        finally:
            stop.set()
            await asyncio.gather(*tasks)
        return out

    async def serving_again(
        self,
        since: float,
        check: Callable[[Result], bool],
        probes: list[Result],
        timeout_s: float = 60.0,
    ) -> float | None:
        """Seconds from `since` to the end of the first turn (sent after `since`) that
        succeeded and passes `check`; every turn sent is added to `probes`."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            res = await self.c.turn(random.choice(self.ref_ids))
            probes.append(res)
            if res.kind == "ok" and not res.wrong and check(res):
                return res.end_s - since
            await asyncio.sleep(0.05)
        return None

    def block_files(self) -> list[Path]:
        return [p for p in self.cl.storage.rglob("*") if p.is_file() and not p.name.startswith(".")]

    async def scheduler_in_flight_settles(self, timeout_s: float = 10.0) -> str:
        from dualpath.local.cluster import run_dir_auth
        from dualpath.scheduler.client import SchedulerClient

        cl = SchedulerClient(self.cl.scheduler, 5.0, run_dir_auth(self.cl.run_dir))
        t0 = time.monotonic()
        try:
            while True:
                n = (await cl.cluster_view()).in_flight
                if n == 0 or time.monotonic() - t0 > timeout_s:
                    return f"{n} after {time.monotonic() - t0:.1f}s"
                await asyncio.sleep(0.2)
        finally:
            await cl.close()

    def worker_auth(self, node: str | None = None):  # noqa: ANN202
        """A decode certificate of the run's CA (mTLS): role-wide, or naming `node`; else the
        run's credentials."""
        from dualpath.local.cluster import run_dir_auth
        from dualpath.tls import ANY_NODE, LocalCA, TlsCredentials

        tls = self.cl.run_dir / "tls"
        if not (tls / "ca").is_dir():
            return run_dir_auth(self.cl.run_dir)
        name = yaml.safe_load((self.cl.run_dir / "cluster.yaml").read_text())["metadata"]["name"]
        who = f"fuzz-{node}" if node else "fuzz"
        return TlsCredentials(LocalCA(tls, name).issue_dir(who, "decode", node or ANY_NODE))

    @property
    def spec(self) -> dict:
        """The cluster's spec as the suite wrote it (camelCase)."""
        return yaml.safe_load(self.cl.cfg_file.read_text())["spec"]

    async def node_address(self, name: str) -> str:
        """A node's gRPC address, from the scheduler's view."""
        from dualpath.local.cluster import run_dir_auth
        from dualpath.scheduler.client import SchedulerClient

        cl = SchedulerClient(self.cl.scheduler, 5.0, run_dir_auth(self.cl.run_dir))
        try:
            view = await cl.cluster_view()
        finally:
            await cl.close()
        return next(n.address for n in view.nodes if n.node_id == name)
