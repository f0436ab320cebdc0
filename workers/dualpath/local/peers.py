"""`dualpath bench local --engine vllm --peers`: what users deploy instead of DualPath, on the
bench's trace in the same run (docs/benchmarks.md "Peers").

Each peer is plain `vllm serve` processes (`server.vllm_serve`, the command line the DualPath
workers' vLLM uses, with the peer's own KV connector and vLLM's prefix cache on, its default)
with its KV cache capped below the trace's working set (`kv_cap`, `--peer-kv-blocks`: its
DRAM prefix cache cannot keep every agent's context between turns, as on a cluster whose
agents' KV far exceeds memory), behind the router of `peer_router` that the bench's replay
drives: the same agents, turns, warm-up turns and greedy requests, the same node count
(P + D instances), the same `summarize` figures. A peer's row says what it ran, its throughput and TTFT, the bytes its
vLLM counters moved per path, its failed turns, how many answers equal the reference's
(the DualPath phase and its warm-up) and the load average while it ran. A peer that does not
start, or that logs errors while it serves, shows the error lines captured from its own logs.
Nothing here stands in for a peer that did not run.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dualpath import config
from dualpath.local.bench import (
    PolicyResult,
    Progress,
    TurnResult,
    replay_on,
    scrape_counters,
    summarize,
)
from dualpath.local.cluster import local_worker_env
from dualpath.trace import Trajectory

# vLLM's counters a peer's bytes per path come from (summed over its instances)
PREFIX_HITS = "vllm:prefix_cache_hits"  # tokens served from the instance's own cache (DRAM)
EXTERNAL_HITS = "vllm:external_prefix_cache_hits"  # tokens its KV connector loaded
NIXL_BYTES = "vllm:nixl_bytes_transferred"  # NIXL's bytes moved between instances
PEER_COUNTERS = (PREFIX_HITS, EXTERNAL_HITS, NIXL_BYTES)
ROOT = Path(__file__).resolve().parents[3]  # the repository (its .venv-* peers' venvs)
LMCACHE_VENV = ROOT / ".venv-lmcache"  # scripts/install-lmcache.sh
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Peer:
    """One peer's configuration: `kv_transfer(i, run_dir, snic_gbps)` instance i's
    `--kv-transfer-config` (None: none; `snic_gbps` the DualPath node's SNIC cap), `env(i,
    run_dir)` its extra environment; `pd`: the first P instances prefill and the rest decode
    (vLLM's P/D), else every instance serves whole turns;
    `venv`: where its vLLM is (None: the project's); `known_limit`: why it may fail on vLLM's
    CPU build, printed only beside an error it logged."""

    name: str
    what: str
    kv_transfer: Callable[[int, Path, float], dict | None] = lambda i, d, g: None
    env: Callable[[int, Path], dict[str, str]] = lambda i, d: {}
    pd: bool = False
    venv: Path | None = None
    known_limit: str = ""


def _lmcache_env(i: int, run_dir: Path) -> dict[str, str]:
    """LMCache's local disk backend, as its docs configure it (one disk per instance)."""
    cfg = run_dir / f"lmcache-{i}.yaml"
    disk = run_dir / f"lmcache-disk-{i}"
    disk.mkdir(parents=True, exist_ok=True)
    cfg.write_text(
        "chunk_size: 256\nlocal_cpu: false\n"
        f'local_disk: "file://{disk}/"\nmax_local_disk_size: 2.0\n'
    )
    return {"LMCACHE_CONFIG_FILE": str(cfg)}


def _nixl_env(i: int, run_dir: Path) -> dict[str, str]:
    """vLLM imports NIXL as `nixl` (the meta package, which also pulls in nixl-cu13); the
    project has nixl-cu12, aliased as `nixl` as the meta package does with no CUDA present.
    Each instance its own side-channel port (the handshake)."""
    shim = run_dir / "nixl-alias" / "nixl"
    shim.mkdir(parents=True, exist_ok=True)
    (shim / "__init__.py").write_text(NIXL_ALIAS)
    path = os.pathsep.join(p for p in (str(shim.parent), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(NIXL_SIDE_PORT + i)}


NIXL_SIDE_PORT = 15600
# How long a prefill keeps a prompt's KV for its decode to pull (vLLM's default 30 s): with the
# capped KV cache a decode queues turns for blocks, on a loaded machine past 30 s, and the
# prefill then frees blocks the decode still reads ("Potentially invalid KV blocks ... may
# have expired", seen at load 19)
NIXL_LEASE_S = 600
NIXL_ALIAS = """# written by dualpath bench local --peers: `nixl` is nixl_cu12 (no CUDA here)
import importlib, sys
for _sub in ("_bindings", "_utils", "logging", "_api"):
    _m = importlib.import_module("nixl_cu12." + _sub)
    sys.modules["nixl." + _sub] = _m
    globals()[_sub] = _m
"""

PEERS: dict[str, Peer] = {
    p.name: p
    for p in (
        Peer(
            "lmcache",
            "vLLM + LMCache (LMCacheConnectorV1, local disk backend), prefix cache on; its "
            "disk reads are not SNIC-capped (that needs a change inside LMCache)",
            kv_transfer=lambda i, d, g: {
                "kv_connector": "LMCacheConnectorV1",
                "kv_role": "kv_both",
            },
            env=_lmcache_env,
            venv=LMCACHE_VENV,
            known_limit="LMCache's vLLM integration has paged-memory connectors for cuda, xpu, "
            "musa and hpu only (lmcache/v1/gpu_connector): on vLLM's CPU build its engine does "
            "not start and vLLM serves from its own prefix cache",
        ),
        Peer(
            "disk",
            "vLLM + CappedDiskConnector (vLLM's ExampleConnector, its KV-to-disk connector, "
            "subclassed: hits on the longest saved block prefix, saves only computed KV, loads "
            "through the DualPath node's SNIC cap; the closest to LMCache's local disk backend "
            "that runs here), prefix cache on",
            kv_transfer=lambda i, d, g: {
                "kv_connector": "CappedDiskConnector",
                "kv_connector_module_path": "dualpath.integrations.vllm.disk_connector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {
                    "shared_storage_path": str(d / f"disk-kv-{i}"),
                    "snic_gbps": g,
                },
            },
        ),
        Peer(
            "nixl-pd",
            "vLLM P/D, NixlConnector (UCX, kv_buffer_device cpu, kv_lease_duration "
            f"{NIXL_LEASE_S} s), prefix cache on, no storage",
            kv_transfer=lambda i, d, g: {
                "kv_connector": "NixlConnector",
                "kv_role": "kv_both",
                "kv_buffer_device": "cpu",
                "kv_connector_extra_config": {"kv_lease_duration": NIXL_LEASE_S},
            },
            env=_nixl_env,
            pd=True,
        ),
        Peer("vllm", "plain vLLM, prefix cache on, recompute on a miss"),
    )
}


@dataclass(frozen=True)
class KvCap:
    """A peer instance's KV cache (`kv_cap`): `blocks` usable blocks of `block_tokens` (None:
    vLLM's default, CPU_KVCACHE_GIB of memory), against the trace's largest turn and the
    agents' contexts its smallest instance keeps (`working_set_blocks`)."""

    blocks: int | None
    block_tokens: int
    largest_turn_blocks: int
    working_set_blocks: int
    bytes: int
    how: str

    @property
    def below_working_set(self) -> bool:
        return self.blocks is not None and self.blocks < self.working_set_blocks

    def describe(self) -> str:
        if self.blocks is None:
            return f"KV cache {self.how}"
        return (
            f"KV cache {self.blocks} blocks of {self.block_tokens} tokens "
            f"({self.bytes / 1e6:.0f} MB; {self.how}; largest turn {self.largest_turn_blocks}, "
            f"an instance's agents' contexts {self.working_set_blocks})"
        )


def kv_cap(
    trajectories: list[Trajectory],
    instances: int,
    block_tokens: int,
    kv_bytes_per_token: int,
    requested: str = "auto",
) -> KvCap:
    """The KV cache each peer instance gets (`--peer-kv-blocks`), the one place it is sized.

    `auto`: half the contexts the instance's agents keep (the smallest instance's: the
    router sends agents round-robin, an agent's turns to one instance), but never less than
    the largest turn (prompt + generation), which must fit. vLLM's prefix cache evicts the
    least recently used blocks, and the agents' turns come round in turn: a cache below
    their contexts drops an agent's context before its next turn, as on a cluster whose
    agents' KV far exceeds memory, while the turns in flight still fit. `off`: vLLM's
    default (CPU_KVCACHE_GIB of memory, every hit in DRAM on a small trace). N: N blocks."""
    from dualpath.integrations.vllm.server import CPU_KVCACHE_GIB

    def blocks(tokens: int) -> int:
        return -(-tokens // block_tokens)

    agents = [t for root in trajectories for t in root.walk()]
    largest = max(
        (
            blocks(t.prompt_tokens(i) + turn.gen_tokens)
            for t in agents
            for i, turn in enumerate(t.turns)
        ),
        default=0,
    )
    kept = [0] * max(1, instances)
    for k, t in enumerate(agents):
        kept[k % len(kept)] += blocks(t.final_context_tokens)
    working = min(kept)
    if requested == "off" or not largest:  # no turns: nothing to size it from
        n, how = None, f"vLLM's default, {CPU_KVCACHE_GIB} GiB (--peer-kv-blocks {requested})"
    elif requested == "auto":
        n, how = max(largest, working // 2), "--peer-kv-blocks auto"
    else:
        n, how = int(requested), f"--peer-kv-blocks {requested}"
        if n < largest:
            raise ValueError(
                f"--peer-kv-blocks {n} holds {n * block_tokens} tokens; the trace's largest "
                f"turn needs {largest} blocks of {block_tokens}"
            )
    nbytes = CPU_KVCACHE_GIB << 30 if n is None else n * block_tokens * kv_bytes_per_token
    return KvCap(n, block_tokens, largest, working, nbytes, how)


def kv_blocks_arg(value: str) -> str:
    """`--peer-kv-blocks`: auto, off or a positive number of blocks."""
    if value in ("auto", "off") or (value.isdigit() and int(value) > 0):
        return value
    raise argparse.ArgumentTypeError(
        f"--peer-kv-blocks takes auto, off or blocks > 0, not {value!r}"
    )


def peer_names(value: str) -> list[str]:
    """`--peers` as a list: 'all' or names of PEERS, comma-separated."""
    names = list(PEERS) if value in ("all", "") else [v.strip() for v in value.split(",")]
    bad = [n for n in names if n not in PEERS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown peer {bad[0]!r}; known: {', '.join(PEERS)}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--peers",
        nargs="?",
        const="all",
        default=None,
        type=peer_names,
        help="engine vllm: after the policies, replay the same trace on what users deploy "
        f"instead ({', '.join(PEERS)}; default all), each on as many vLLM instances, and "
        "tabulate them beside the dualpath phase",
    )
    parser.add_argument(
        "--peer-kv-blocks",
        default="auto",
        type=kv_blocks_arg,
        help="--peers: each peer instance's KV cache (its DRAM prefix cache) in vLLM blocks: "
        "auto (default) half the contexts an instance's agents keep, at least the largest "
        "turn, so an agent's context leaves DRAM before its next turn and hits come from the "
        "peer's storage; off: vLLM's default 1 GiB (the whole trace in DRAM); N: N blocks",
    )


@dataclass
class PeerRow:
    """One row of the peers table (the JSON's `peers`)."""

    peer: str
    what: str
    ran: bool  # its instances started and it replayed the trace
    result: dict[str, Any] | None = None  # `summarize`'s figures (PolicyResult)
    bytes_by_path: dict[str, int] = field(default_factory=dict)
    answers_equal: int = 0
    answers_compared: int = 0
    errors: list[str] = field(default_factory=list)  # captured from its logs, verbatim
    kv_cache: dict[str, Any] = field(default_factory=dict)  # each instance's (KvCap)
    snic_gbps: float = 0.0  # the cap its storage loads went through (0: none)
    why: str = ""  # the known limit behind an error on vLLM's CPU build
    loadavg: list[float] = field(default_factory=list)  # 1-min load at its start and end
    logs: list[str] = field(default_factory=list)


ANSI = re.compile(r"\x1b\[[0-9;]*m")  # LMCache colours its log levels
ERROR_LINE = re.compile(r"\bERROR\b|^\w+(\.\w+)*(Error|Exception): |\bError: ")
# vLLM's and LMCache's log prefix (time, level, file:line): the message is what stays
LOG_PREFIX = re.compile(r"^(\(\w+ pid=\d+\) )?(\[[^\]]*\] )*")


def captured_errors(log_text: str, limit: int = 4) -> list[str]:
    """The error lines of a log, verbatim and in order, each once: lines at level ERROR and
    the exception lines (`SomethingError: ...`) that end tracebacks; at most `limit`, the
    last exception line always among them (the one that ended a process)."""
    found: list[str] = []
    last_exc = None
    for raw in log_text.splitlines():
        line = ANSI.sub("", raw).strip()
        if not line or not ERROR_LINE.search(line):
            continue
        if re.match(r"^\w+(\.\w+)*(Error|Exception): ", line):
            last_exc = line
        if line not in found:
            found.append(line)
    out = found[:limit]
    if last_exc is not None and last_exc not in out:
        out[-1:] = [last_exc]
    return out


def answers_equal(
    reference: dict[tuple[str, int], list[int]], mine: dict[tuple[str, int], list[int]]
) -> tuple[int, int]:
    """(equal, compared): the turns both answered, and of them those with the same tokens."""
    keys = set(reference) & set(mine)
    return sum(1 for k in keys if list(reference[k]) == list(mine[k])), len(keys)


def counter_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in set(before) | set(after)}


def bytes_by_path(counters: dict[str, float], kv_bytes_per_token: int) -> dict[str, int]:
    """A peer's bytes per path from its vLLM counters over the measured window."""
    return {
        "prefix_cache": int(counters.get(PREFIX_HITS, 0.0) * kv_bytes_per_token),
        "connector": int(counters.get(EXTERNAL_HITS, 0.0) * kv_bytes_per_token),
        "nixl": int(counters.get(NIXL_BYTES, 0.0)),
    }


def dualpath_row(res: PolicyResult, reference_equal: tuple[int, int]) -> PeerRow:
    """The bench's dualpath phase as the table's first row (the reference of the answers):
    its instances keep vLLM's default KV cache, which serves no hit (prefix cache off)."""
    from dualpath.integrations.vllm.server import CPU_KVCACHE_GIB

    return PeerRow(
        "dualpath",
        f"vLLM + DualPath connector (the dualpath phase above), prefix cache off, KV cache "
        f"vLLM's default {CPU_KVCACHE_GIB} GiB (no hit served from it), every hit read "
        f"through the SNIC cap {res.snic_gbps:.3g} Gbit/s per node",
        True,
        asdict(res),
        {f"store_{role}": b for role, b in res.bytes_read.items()},
        reference_equal[0],
        reference_equal[1],
        loadavg=list(res.loadavg),
        kv_cache={"bytes": CPU_KVCACHE_GIB << 30, "prefix_cache": False},
        snic_gbps=res.snic_gbps,
    )


def peers_table(rows: list[PeerRow]) -> str:
    """The peers table: one line a row, then each row's captured errors (verbatim)."""
    base = next((r.result["tokens_per_s"] for r in rows if r.peer == "dualpath" and r.result), 0)
    head = (
        f"{'peer':<10}{'tok/s':>8}{'vs DP':>7}{'turns':>7}{'TTFT p50':>10}{'TTFT p99':>10}"
        f"{'fail':>6}{'same ans':>11}{'load':>9}  bytes per path (MB)"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        load = f"{r.loadavg[0]:.0f}-{r.loadavg[-1]:.0f}" if r.loadavg else "-"
        if not r.ran or not r.result:
            lines.append(f"{r.peer:<10}{'did not run':>8}  (errors below){'':>33}{load:>9}")
            continue
        res = r.result
        vs = f"{res['tokens_per_s'] / base:.2f}" if base else "-"
        paths = ", ".join(f"{k} {v / 1e6:.0f}" for k, v in r.bytes_by_path.items() if v) or "0"
        lines.append(
            f"{r.peer:<10}{res['tokens_per_s']:>8.0f}{vs:>7}{res['turns']:>7}"
            f"{res['ttft_p50_s']:>10.3f}{res['ttft_p99_s']:>10.3f}{res['failed']:>6}"
            f"{f'{r.answers_equal}/{r.answers_compared}':>11}{load:>9}  {paths}"
        )
    for r in rows:
        lines.append(f"  {r.peer}: {r.what}")
        for e in r.errors:
            lines.append(f"    error (its log): {e}")
        if r.errors and r.why:
            lines.append(f"    why: {r.why}")
    return "\n".join(lines)


# ---- the shell: start a peer's instances, replay, stop them ----------------------------------


class Instances:
    """A peer's `vllm serve` processes (each its own process group: vLLM's engine core and
    workers are its children), started on entry, stopped on exit."""

    def __init__(self, cmds: list[tuple[list[str], dict[str, str]]], logs: list[Path]) -> None:
        self.cmds, self.logs = cmds, logs
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> Instances:
        for (argv, env), log in zip(self.cmds, self.logs, strict=True):
            with log.open("w") as out:
                self.procs.append(
                    subprocess.Popen(
                        argv,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        env={**os.environ, **env},
                        start_new_session=True,
                    )
                )
        return self

    def served(self) -> str:
        """The logs up to now: what the instances wrote while serving (read before the stop,
        whose teardown logs errors of its own, e.g. vLLM's `AsyncLLM output_handler failed`)."""
        return "\n".join(p.read_text(errors="replace") for p in self.logs)

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    def wait_ready(self, urls: list[str], timeout_s: float) -> str | None:
        """None once every instance answers /health; else why not (one exited, or the time)."""
        end = time.monotonic() + timeout_s
        waiting = list(urls)
        while waiting:
            for p, log in zip(self.procs, self.logs, strict=True):
                if p.poll() is not None:
                    return f"{log.name} exited with status {p.returncode} before it was ready"
            if time.monotonic() > end:
                return f"not ready in {timeout_s:.0f} s: {', '.join(waiting)}"
            try:
                with urllib.request.urlopen(waiting[0] + "/health", timeout=2) as r:  # noqa: S310
                    if r.status == 200:
                        waiting.pop(0)
                        continue
            except OSError:
                pass
            time.sleep(2)
        return None


def scrape(urls: list[str]) -> dict[str, float]:
    total: dict[str, float] = dict.fromkeys(PEER_COUNTERS, 0.0)
    for url in urls:
        for k, v in scrape_counters(url + "/metrics", set(PEER_COUNTERS)).items():
            total[k] += v
    return total


def run_peer(
    peer: Peer,
    cfg: config.ClusterConfig,
    trajectories: list[Trajectory],
    args: argparse.Namespace,
    reference: dict[tuple[str, int], list[int]],
    phase: str,
    snic_gbps: float = 0.0,
) -> PeerRow:
    """Start `peer` on P + D instances, each with the KV cache `kv_cap` sizes and its storage
    loads (if its connector reads storage through ours) capped at `snic_gbps`, replay the
    trace (its warm-up turns too: its caches start empty), stop it; its row."""
    from dualpath.integrations.vllm.server import VLLM_BLOCK_TOKENS, vllm_serve
    from dualpath.local.cluster import VLLM_READY_TIMEOUT_S
    from dualpath.local.supervisor import free_port

    run_dir = (Path(args.out) / "peers" / peer.name).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    n = cfg.spec.prefill.replicas + cfg.spec.decode.replicas
    p = cfg.spec.prefill.replicas if peer.pd else 0
    try:
        cap = kv_cap(
            trajectories,
            n - p,
            VLLM_BLOCK_TOKENS,
            cfg.spec.model.kv_bytes_per_token,
            getattr(args, "peer_kv_blocks", "auto"),
        )
    except ValueError as e:
        return PeerRow(peer.name, peer.what, False, errors=[f"ValueError: {e}"])
    transfer = [peer.kv_transfer(i, run_dir, snic_gbps) for i in range(n)]
    reads = any(t and "snic_gbps" in t.get("kv_connector_extra_config", {}) for t in transfer)
    capped = f"its storage loads capped at {snic_gbps:.3g} Gbit/s an instance" if reads else ""
    row = PeerRow(peer.name, "; ".join(x for x in (peer.what, cap.describe(), capped) if x), False)
    row.kv_cache = {**asdict(cap), "below_working_set": cap.below_working_set}
    row.snic_gbps = snic_gbps if reads else 0.0
    if not cap.below_working_set:
        print(
            f"[{phase}] warning: the peers' KV cache ({cap.describe()}) holds an instance's "
            "agents' contexts: its hits stay in DRAM (more agents than instances fix it)",
            file=sys.stderr,
        )
    ports = [free_port() for _ in range(n)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    logs = [run_dir / f"vllm-{i}.log" for i in range(n)]
    row.logs = [str(p) for p in logs]
    row.loadavg = [round(os.getloadavg()[0], 2)]
    try:
        cmds = []
        for i, port in enumerate(ports):
            cmd = vllm_serve(
                cfg,
                port=port,
                kv_transfer=transfer[i],
                prefix_caching=True,
                venv=peer.venv,
                kv_blocks=cap.blocks,
            )
            # the environment the DualPath instances run in (one torch thread each: many
            # processes share the cores; UCX on loopback), then the peer's own
            cmds.append((cmd.argv, {**local_worker_env(), **cmd.env, **peer.env(i, run_dir)}))
    except (FileNotFoundError, ValueError) as e:
        row.errors = [f"{type(e).__name__}: {e}"]
        return row
    print(f"[{phase}] starting {n} vLLM instances: {row.what}", file=sys.stderr, flush=True)
    results: list[TurnResult] = []
    with Instances(cmds, logs) as inst:
        why = inst.wait_ready(urls, VLLM_READY_TIMEOUT_S)
        if why is None:
            row.ran = True
            mark: dict[str, Any] = {}

            def on_warm() -> None:
                mark["before"], mark["t0"] = scrape(urls), time.perf_counter()

            from dualpath.local.peer_router import PeerRouter

            router = PeerRouter(urls[p:], urls[:p], path=peer.name)
            total = sum(len(t.turns) for t in trajectories)
            try:
                replay_on(
                    "http://peer",
                    cfg,
                    trajectories,
                    args,
                    Progress(total, peer.name, phase=phase),
                    on_warm=on_warm,
                    results=results,
                    transport=router,
                )
            except Exception as e:  # noqa: BLE001 (the bench's own fault, shown in the row)
                log.exception("peer %s: the replay failed", peer.name)
                why = f"the bench's replay failed: {type(e).__name__}: {e}"
            if "t0" in mark:
                ends = [r.end_s for r in results if r.ok and not r.warmup]
                elapsed = (max(ends) if ends else time.perf_counter()) - mark["t0"]
                delta = counter_delta(mark["before"], scrape(urls))
                row.bytes_by_path = bytes_by_path(delta, cfg.spec.model.kv_bytes_per_token)
                res = summarize(peer.name, results, elapsed, {}, 0.0)
                res.loadavg = [row.loadavg[0], round(os.getloadavg()[0], 2)]
                row.result = asdict(res)
        row.loadavg.append(round(os.getloadavg()[0], 2))
        logged = captured_errors(inst.served())
    row.errors = ([why] if why else []) + logged
    row.why = peer.known_limit if row.errors else ""
    mine = {(t.agent, t.turn): t.generated for t in results if t.ok}
    row.answers_equal, row.answers_compared = answers_equal(reference, mine)
    return row
