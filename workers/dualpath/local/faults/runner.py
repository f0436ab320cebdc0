"""Runs the rows on one cluster: the row registry, `run_rows`, the command's arguments."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from pathlib import Path

import yaml

from dualpath.local.faults import bad_input, holds, load, restarts, store
from dualpath.local.faults.client import Client
from dualpath.local.faults.report import Row, keep_evidence, table
from dualpath.local.faults.suite import Suite
from dualpath.local.faults.up import Cluster, fault_config, mount_tmpfs
from dualpath.local.interrupt import interruptible, run_interruptible

log = logging.getLogger(__name__)


# name -> the row: each is a function of the suite (one module per group of rows); in this order
RowFn = Callable[[Suite], Awaitable[Row]]
ROW_FNS: dict[str, RowFn] = {
    "decode-kill": lambda s: restarts.restart_row(s, "decode-kill", "decode-0"),
    "prefill-kill": lambda s: restarts.restart_row(s, "prefill-kill", "prefill-0"),
    "scheduler-kill": lambda s: restarts.restart_row(s, "scheduler-kill", "scheduler"),
    "corrupt-blocks": lambda s: store.store_row(s, "corrupt-blocks"),
    "truncated-blocks": lambda s: store.store_row(s, "truncated-blocks"),
    "read-only-store": store.read_only_row,
    "full-store": store.full_store_row,
    "disconnects": load.disconnect_row,
    "overload": load.overload_row,
    "http-fuzz": bad_input.http_fuzz_row,
    "grpc-fuzz": bad_input.grpc_fuzz_row,
    "oversized-refusals": holds.oversized_refusals_row,
    "bad-prefill-addresses": holds.bad_prefill_addresses_row,
    "prefill-kills": holds.prefill_kills_row,
    "slow-clients": holds.slow_clients_row,
    "long-prompt": holds.long_prompt_row,
    "sigint": restarts.sigint_row,  # stops the cluster: the last row
}
ROWS = tuple(ROW_FNS)
QUICK_ROWS = ("scheduler-kill", "decode-kill", "corrupt-blocks", "disconnects", "http-fuzz")


async def run_rows(
    rows: list[str], out: Path, quick: bool = False, deadline_s: float = 30.0
) -> list[Row]:
    out.mkdir(parents=True, exist_ok=True)
    storage = out / "kv"
    if storage.exists():
        while os.path.ismount(storage):  # an earlier run's, if it was killed
            if subprocess.run(["umount", "-l", str(storage)], capture_output=True).returncode:
                break
        shutil.rmtree(storage)
    storage.mkdir()
    mounted = mount_tmpfs(storage, 96 << 20)
    cfg_file = out / "faults.yaml"
    res = fault_config(storage, capacity_bytes=80 << 20)
    cfg_file.write_text(yaml.safe_dump(res, sort_keys=False))
    cluster = Cluster(out / "run", cfg_file, storage, out / "cluster.log")
    done: list[Row] = []
    try:
        t0 = time.monotonic()
        await asyncio.to_thread(cluster.start)
        await asyncio.to_thread(cluster.wait_zygote)
        log.info(
            "cluster up in %.1fs (store on %s)",
            time.monotonic() - t0,
            "tmpfs" if mounted else "disk",
        )
        client = Client(cluster.frontend, res["spec"]["model"]["name"], deadline_s)
        try:
            await client.learn(range(8))
            suite = Suite(cluster, client, quick, mounted)
            for name in rows:
                t0 = time.monotonic()
                try:
                    row = await ROW_FNS[name](suite)
                except Exception as err:  # a fault the suite itself did not survive: a row
                    log.exception("fault %s: the suite failed", name)
                    row = Row(name, note=f"suite error: {type(err).__name__}: {err}")
                    row.bars.append("suite_error")
                row.judge()
                log.info("%s: %s (%.1fs)", name, asdict(row), time.monotonic() - t0)
                done.append(row)
                if name != "sigint":
                    await asyncio.sleep(1.0)  # let breakers and queues settle between rows
        finally:
            await client.close()
    finally:
        cluster.stop()
        while mounted and os.path.ismount(storage):  # the tmpfs (and a bind left over)
            if subprocess.run(["umount", "-l", str(storage)], capture_output=True).returncode:
                break
        if any(r.bars for r in done):
            keep_evidence(out, done)
    return done


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--rows",
        default=",".join(ROWS),
        help=f"comma-separated faults, in order (default: all: {', '.join(ROWS)})",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"fewer requests; rows {', '.join(QUICK_ROWS)} unless --rows",
    )
    parser.add_argument("--json", action="store_true", help="print the rows as JSON only")
    parser.add_argument(
        "--out", default="out/faults", help="run directory (config, store, cluster.log)"
    )
    parser.add_argument(
        "--deadline", type=float, default=30.0, help="a request's deadline (s): longer is hung"
    )


def run(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    given = args.rows != ",".join(ROWS)
    rows = args.rows.split(",") if given or not args.quick else list(QUICK_ROWS)
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        print(f"unknown fault(s): {', '.join(unknown)}; one of {', '.join(ROWS)}", file=sys.stderr)
        return 2
    if "sigint" in rows and rows[-1] != "sigint":
        print("sigint stops the cluster: it must be the last row", file=sys.stderr)
        return 2
    # SIGINT/SIGTERM: the rows' tasks unwind by cancellation (the cluster stopped on the way
    # out), then `Interrupted` exits with 128 + the signal (`dualpath.cli.main`)
    with interruptible():
        done = run_interruptible(run_rows(rows, Path(args.out), args.quick, args.deadline))
    if args.json:
        print(json.dumps([asdict(r) for r in done], indent=2))
    else:
        print(table(done))
        print(f"\ncluster log: {Path(args.out) / 'cluster.log'}")
        if any(r.bars for r in done):
            print(f"evidence of the failed rows: {Path(args.out) / 'failures'}/<latest>/")
    return 0 if all(not r.bars for r in done) else 1
