"""`dualpath faults`: inject faults into a real local cluster and tell what its clients saw.

Starts `dualpath up` (a subprocess: the supervisor that restarts crashed processes is the real
one) on a small config (tiny model, 1 prefill + 2 decode), learns reference answers on a
healthy cluster (each prompt's first turn: a recompute, nothing read from the store), then
injects one fault per row into the real processes and files while clients send requests:

| row | what is done |
|---|---|
| decode-kill | SIGKILL decode-0 while streams decode on both decode nodes |
| prefill-kill | SIGKILL prefill-0 while turns with store hits are read and relayed |
| scheduler-kill | SIGKILL the scheduler under load (its block index is rebuilt from scans) |
| corrupt-blocks | bytes flipped in the middle of every stored block file |
| truncated-blocks | every stored block file cut to half its size |
| read-only-store | the store made read-only (as root: a read-only remount of its tmpfs, EROFS; else the directories and files chmod a-w, EACCES) |
| full-store | the store's filesystem filled (as root: a small tmpfs plus a filler file, real ENOSPC; without root the row is skipped) |
| disconnects | 100 streams cut by their client after the first chunk, then normal turns |
| overload | a burst of concurrent turns far above what the nodes hold at once |
| http-fuzz | 320 seeded malformed bodies (`dualpath.local.fuzz.http_cases`) |
| grpc-fuzz | seeded malformed Scheduler and Worker calls with the cluster's credentials (`grpc_cases`): every RPC, Prefill's agent metadata and regions included; under mTLS the methods workers call go with a role-wide decode certificate, so malformed input reaches validation rather than the identity check |
| sigint | SIGINT to `dualpath up` while streams run: they must finish, no process left |

Per row: requests sent, succeeded, failed cleanly (an HTTP error with a JSON body, or a
stream's error event), lost (a connection cut or a stream that ended with neither `[DONE]`
nor an error event), hung (no answer within the request deadline), wrong (greedy tokens
differ from the healthy recompute of the same prompt), empty successes, 5xx from bad input,
and the time from the killed process's restart to serving again.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from dualpath import config
from dualpath.local.interrupt import interruptible, run_interruptible
from dualpath.local.openai_client import stream_completion
from dualpath.local.supervisor import process_tree

log = logging.getLogger(__name__)

ROWS = (
    "decode-kill",
    "prefill-kill",
    "scheduler-kill",
    "corrupt-blocks",
    "truncated-blocks",
    "read-only-store",
    "full-store",
    "disconnects",
    "overload",
    "http-fuzz",
    "grpc-fuzz",
    "sigint",
)
QUICK_ROWS = ("scheduler-kill", "decode-kill", "corrupt-blocks", "disconnects", "http-fuzz")
PROMPT_TOKENS = 96  # 6 blocks of 16 tokens
GEN_TOKENS = 8
STREAM_DEADLINES = 4
# Bars of issue 19: a restarted decode or prefill serves again within 5 s, a scheduler 10 s.
RECOVER_BAR_S = {"decode-kill": 5.0, "prefill-kill": 5.0, "scheduler-kill": 10.0}


# ---- the cluster: `dualpath up` as a subprocess ---------------------------------------------


def fault_config(storage: Path, capacity_bytes: int = 64 << 20) -> dict:
    """The suite's DualPathCluster: the tiny model (fast on a CPU), 1 prefill + 2 decode; the
    store at `storage` made absolute (the config's storage.path is every pod's mount path)."""
    res = config.local_default().to_resource()
    spec = res["spec"]
    spec["model"] = {"name": "dualpath-tiny", "preset": "tiny", "blockTokens": 16}
    spec["prefill"]["kvBufferBytes"] = 32 << 20
    spec["decode"]["kvBufferBytes"] = 32 << 20
    spec["storage"].update(path=str(storage.resolve()), capacityBytes=capacity_bytes, snicGbps=1)
    spec.setdefault("workers", {})["drainSeconds"] = 20
    # admission: at most 24 turns in flight per node (the one prefill node: the cluster); an
    # overload burst beyond is refused with a 429 after the scheduler's queue timeout
    spec.setdefault("scheduler", {})["maxInFlightPerNode"] = 24
    return res


class Cluster:
    """`dualpath up -f CONFIG` in its own process group; its children found by their
    command lines (each runs in its own group too, so a SIGKILL takes one process)."""

    def __init__(self, run_dir: Path, cfg_file: Path, storage: Path, log_file: Path) -> None:
        self.run_dir, self.cfg_file, self.storage, self.log_file = (
            run_dir,
            cfg_file,
            storage,
            log_file,
        )
        self.proc: subprocess.Popen | None = None
        self.frontend = self.scheduler = ""

    def start(self, timeout_s: float = 240.0) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self._log = open(self.log_file, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dualpath.cli", "up", "-f", str(self.cfg_file)]
            + ["--run-dir", str(self.run_dir), "--storage-dir", str(self.storage)],
            stdout=subprocess.PIPE,
            stderr=self._log,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout_s
        assert self.proc.stdout is not None
        os.set_blocking(self.proc.stdout.fileno(), False)
        buf = b""
        while time.monotonic() < deadline:
            chunk = self.proc.stdout.read() or b""
            buf += chunk
            m = re.search(rb"READY up frontend=(\S+) scheduler=(\S+)", buf)
            if m:
                self.frontend, self.scheduler = m.group(1).decode(), m.group(2).decode()
                return
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"dualpath up exited with {self.proc.returncode}: see {self.log_file}"
                )
            time.sleep(0.1)
        raise RuntimeError(f"dualpath up not ready within {timeout_s:.0f}s: see {self.log_file}")

    def wait_zygote(self, timeout_s: float = 180.0) -> bool:
        """Wait until the supervisor's zygote has done its imports (restarts fork from it)."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if "zygote (pid" in self.log_file.read_text(errors="replace"):
                return True
            time.sleep(0.2)
        log.warning("the zygote is not ready after %.0fs: restarts start afresh", timeout_s)
        return False

    def pids(self) -> dict[str, int]:
        """name (scheduler, frontend, prefill-0, decode-1, ...) -> pid of its latest process,
        from the supervisor's log lines (a restart forked from the zygote has the zygote's
        command line, so /proc cannot name it)."""
        text = self.log_file.read_text(errors="replace")
        found = re.finditer(r"(?:started|forked from the zygote) (\S+) \(pid (\d+)\)", text)
        return {m.group(1): int(m.group(2)) for m in found}

    def pid(self, name: str) -> int | None:
        pid = self.pids().get(name)
        return pid if pid is not None and _alive(pid) else None

    def descendants(self) -> list[int]:
        """Every live process under `dualpath up` (its children, the zygote's children)."""
        return [] if self.proc is None else process_tree(self.proc.pid)

    def ready_url(self, name: str) -> str:
        """From the process's own READY line (its command line is its title: `dualpath
        decode:decode-0`; a restart keeps the port)."""
        text = self.log_file.read_text(errors="replace")
        ports = re.findall(rf"\[{re.escape(name)}\]\s+ready .*\bmetrics=(\d+)", text)
        if not ports:
            raise RuntimeError(f"{name} has said no READY line with its metrics port")
        return f"http://127.0.0.1:{ports[-1]}/readyz"

    def kill(self, name: str) -> int:
        pid = self.pid(name)
        if pid is None:
            raise RuntimeError(f"no process {name}")
        os.killpg(pid, signal.SIGKILL)
        return pid

    def wait_restarted(self, name: str, old_pid: int, timeout_s: float = 30.0) -> float | None:
        """Monotonic time at which a new process of `name` was seen (None: not within)."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            pid = self.pid(name)
            if pid is not None and pid != old_pid:
                return time.monotonic()
            time.sleep(0.02)
        return None

    def stop(self, sig: int = signal.SIGINT, timeout_s: float = 60.0) -> float:
        """Signal `dualpath up` and wait for it; seconds it took."""
        t0 = time.monotonic()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if getattr(self, "_log", None):
            self._log.close()
        return time.monotonic() - t0


def http_ok(url: str, timeout_s: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:  # noqa: S310 (loopback)
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


# ---- clients ---------------------------------------------------------------------------------


@dataclass(slots=True)
class Result:
    kind: str  # ok | failed | lost | hung | cancelled
    status: int = 0
    start_s: float = 0.0
    end_s: float = 0.0
    retry_after: bool = False
    empty: bool = False
    wrong: bool = False
    cached: int = 0
    decode_node: str = ""
    error: str = ""
    # a wrong answer's whole story (`wrong_answer`): what one occurrence is diagnosed from
    evidence: dict[str, Any] | None = None


def wrong_answer(
    i: int,
    ids: list[int] | None,
    ref: tuple[list[int], str],
    cached: int,
    dualpath: dict[str, Any],
    text: str | None = None,
) -> tuple[str, dict[str, Any]]:
    """A wrong answer to prompt `i` against its reference (token ids, text): the one-line
    error (the first differing token, the turn's cached tokens, read path and nodes) and the
    evidence kept with the row (both answers' token ids and texts too)."""
    ref_ids, ref_text = ref
    at = None
    if ids is not None:
        at = next((k for k, (a, b) in enumerate(zip(ids, ref_ids, strict=False)) if a != b), None)
        if at is None and len(ids) != len(ref_ids):
            at = min(len(ids), len(ref_ids))
    where = (
        f"{cached} cached tokens read via path {dualpath.get('read_path')}, prefill "
        f"{dualpath.get('prefill_node')}, decode {dualpath.get('decode_node')}"
    )
    if at is not None:
        assert ids is not None
        error = (
            f"prompt {i}: token {at} differs (got {ids[at : at + 3]}, reference "
            f"{ref_ids[at : at + 3]}); {where}"
        )
    else:
        error = f"prompt {i}: text {text!r}, reference {ref_text!r} (same token ids); {where}"
    evidence = {
        "prompt": i,
        "first_differing_token": at,
        "cached_tokens": cached,
        "read_path": dualpath.get("read_path"),
        "prefill_node": dualpath.get("prefill_node"),
        "decode_node": dualpath.get("decode_node"),
        "policy": dualpath.get("policy"),
        "session_id": dualpath.get("session_id"),
        "token_ids": ids,
        "reference_token_ids": ref_ids,
        "text": text,
        "reference_text": ref_text,
    }
    return error, evidence


def prompt_ids(i: int, n: int = PROMPT_TOKENS) -> list[int]:
    rng = random.Random(1000 + i)
    return [rng.randrange(3, 500) for _ in range(n)]


class Client:
    """Sends turns to the frontend and classifies each answer; `refs` (prompt index ->
    (token ids, text)) are the healthy recomputes wrong answers are judged against."""

    def __init__(self, base: str, model: str, deadline_s: float) -> None:
        self.base, self.model, self.deadline_s = base, model, deadline_s
        self.refs: dict[int, tuple[list[int], str]] = {}
        self.http = httpx.AsyncClient(
            base_url=base,
            timeout=httpx.Timeout(deadline_s, connect=5.0),
            # a connection per request: no reuse of one the server is closing as idle (a
            # keep-alive race of the client's, not a fault of the cluster's)
            limits=httpx.Limits(max_connections=400, max_keepalive_connections=0),
        )

    async def close(self) -> None:
        await self.http.aclose()

    def body(self, i: int, max_tokens: int = GEN_TOKENS, stream: bool = False) -> dict:
        body = {
            "model": self.model,
            "prompt": prompt_ids(i),
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": stream,
        }
        if stream:  # the usage chunk: a streamed turn's cached tokens, for its evidence
            body["stream_options"] = {"include_usage": True}
        return body

    async def turn(
        self,
        i: int,
        max_tokens: int = GEN_TOKENS,
        stream: bool = False,
        on_chunk: Callable[[], None] | None = None,
        cut_after_first: bool = False,
    ) -> Result:
        res = Result("lost", start_s=time.monotonic())
        # a turn is hung when nothing comes for the deadline (httpx's read timeout); a whole
        # answer may take longer while it streams, up to STREAM_DEADLINES deadlines
        limit = self.deadline_s * (STREAM_DEADLINES if stream else 1)
        try:
            await asyncio.wait_for(
                self._turn(res, i, max_tokens, stream, on_chunk, cut_after_first), limit
            )
        except (TimeoutError, httpx.TimeoutException):
            res.kind, res.error = "hung", f"no answer within {self.deadline_s:.0f}s"
        except httpx.ConnectError as err:
            res.kind, res.error = "failed", f"connection refused: {err}"  # known at once
        except (httpx.TransportError, json.JSONDecodeError) as err:
            res.kind, res.error = "lost", f"{type(err).__name__}: {err}"
        res.end_s = time.monotonic()
        return res

    async def _turn(self, res, i, max_tokens, stream, on_chunk, cut_after_first) -> None:  # noqa: ANN001
        body = self.body(i, max_tokens, stream)
        if not stream:
            r = await self.http.post("/v1/completions", json=body)
            self._status(res, r)
            if r.status_code != 200:
                return
            obj = r.json()
            choice = obj["choices"][0]
            ids = obj["dualpath"]["token_ids"]
            res.cached = obj["usage"]["prompt_tokens_details"]["cached_tokens"]
            res.decode_node = obj["dualpath"].get("decode_node", "")
            res.kind = "ok"
            res.empty = not choice.get("finish_reason") or (
                not ids and choice.get("finish_reason") == "length"
            )
            ref = self.refs.get(i)  # judged when asked for as many tokens as the reference
            res.wrong = ref is not None and max_tokens == GEN_TOKENS and ids != ref[0]
            if res.wrong:
                assert ref is not None
                res.error, res.evidence = wrong_answer(
                    i, ids, ref, res.cached, obj["dualpath"], choice.get("text")
                )
                log.warning("wrong answer: %s; got %s, reference %s", res.error, ids, ref[0])
            return
        st = await stream_completion(
            self.http, body, on_chunk=on_chunk, cut_after_first=cut_after_first
        )
        if st.response is not None:
            self._status(res, st.response)
            return
        res.status = st.status
        if st.cut:
            res.kind = "cancelled"
        elif st.error:
            res.kind, res.error = "failed", st.error
        elif st.done:
            res.kind = "ok"
            res.empty = not st.finish_reason or (not st.text and st.finish_reason == "length")
            dp = (st.final or {}).get("dualpath") or {}
            ids = dp.get("token_ids")
            res.cached = ((st.usage or {}).get("prompt_tokens_details") or {}).get(
                "cached_tokens", 0
            )
            res.decode_node = dp.get("decode_node", "")
            ref = self.refs.get(i)
            res.wrong = (
                ref is not None
                and max_tokens == GEN_TOKENS
                and (ref[1] != st.text or (ids is not None and ids != ref[0]))
            )
            if res.wrong:
                assert ref is not None
                res.error, res.evidence = wrong_answer(i, ids, ref, res.cached, dp, st.text)
                log.warning(
                    "wrong streamed answer: %s; got %s, reference %s", res.error, ids, ref[0]
                )
        else:
            res.kind, res.error = "lost", "stream ended without [DONE] or an error event"

    def _status(self, res: Result, r: httpx.Response) -> None:
        res.status = r.status_code
        res.retry_after = "retry-after" in r.headers
        if r.status_code != 200:
            res.kind = "failed"
            try:
                res.error = r.json()["error"]["message"]
            except Exception:  # noqa: BLE001 (a body that is not our JSON error: still refused)
                res.error = f"HTTP {r.status_code}"

    async def learn(self, ids: range) -> None:
        """Reference answers: each prompt's first turn (GEN_TOKENS), a recompute (nothing
        read)."""
        for i in ids:
            r = await self.http.post("/v1/completions", json=self.body(i, GEN_TOKENS))
            r.raise_for_status()
            obj = r.json()
            if obj["usage"]["prompt_tokens_details"]["cached_tokens"]:
                raise RuntimeError(f"prompt {i} was a hit on a fresh store: no reference")
            self.refs[i] = (obj["dualpath"]["token_ids"], obj["choices"][0]["text"])

    async def loop(
        self, prompts: list[int], stop: asyncio.Event, out: list[Result], gap_s: float = 0.02
    ) -> None:
        """Turns one after another (a prompt from `prompts` each) until `stop`."""
        k = 0
        while not stop.is_set():
            res = await self.turn(prompts[k % len(prompts)])
            out.append(res)
            k += 1
            if res.kind != "ok":
                await asyncio.sleep(0.2)  # a client backs off a little after an error
            else:
                await asyncio.sleep(gap_s)


# ---- rows ------------------------------------------------------------------------------------


MAX_EVIDENCE = 20  # bad answers kept per row
WORKER_METHODS = frozenset({"Register", "Heartbeats", "KvEvents", "KvSnapshot"})


@dataclass
class Row:
    fault: str
    sent: int = 0
    succeeded: int = 0
    failed_clean: int = 0
    lost: int = 0
    hung: int = 0
    wrong: int = 0
    empty: int = 0
    bad_input_5xx: int = 0
    recover_s: float | None = None
    note: str = ""
    bars: list[str] = field(default_factory=list)  # bars this row missed (empty: all held)
    first_bad: str = ""  # the first lost, hung or wrong answer's error, for the note
    # each lost, hung or wrong answer (the first MAX_EVIDENCE): kept with the run's logs
    evidence: list[dict[str, Any]] = field(default_factory=list)

    def add(self, results: list[Result], bad_input: bool = False) -> None:
        for r in results:
            bad_5xx = bad_input and r.status >= 500
            if r.kind in ("lost", "hung") or r.wrong or bad_5xx:
                kind = "wrong" if r.wrong else "5xx" if bad_5xx else r.kind
                if not self.first_bad:
                    self.first_bad = f"first {kind}: {r.error[:160]}"
                if len(self.evidence) < MAX_EVIDENCE:
                    self.evidence.append(
                        {"kind": kind, "error": r.error, "status": r.status, **(r.evidence or {})}
                    )
            self.sent += 1
            if r.kind == "ok":
                self.succeeded += 1
                self.empty += r.empty
                self.wrong += r.wrong
            elif r.kind == "failed":
                self.failed_clean += 1
            elif r.kind == "lost":
                self.lost += 1
            elif r.kind == "hung":
                self.hung += 1
            if bad_input and r.status >= 500:
                self.bad_input_5xx += 1

    def judge(self) -> None:
        if self.first_bad:
            self.note = f"{self.note}; {self.first_bad}" if self.note else self.first_bad
        for name in ("lost", "hung", "wrong", "empty", "bad_input_5xx"):
            if getattr(self, name):
                self.bars.append(f"{name}={getattr(self, name)}")
        bar = RECOVER_BAR_S.get(self.fault)
        if bar is not None and (self.recover_s is None or self.recover_s > bar):
            self.bars.append(f"recover_s>{bar:g}")


class Suite:
    def __init__(self, cluster: Cluster, client: Client, quick: bool, mounted: bool) -> None:
        self.cl, self.c, self.quick, self.mounted = cluster, client, quick, mounted
        self.ref_ids = list(client.refs)
        self._next_new = 10_000  # prompts never sent before (no reference, no hit)

    def new_prompt(self) -> int:
        self._next_new += 1
        return self._next_new

    async def _load_during(
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

    async def _serving_again(
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

    async def restart_row(self, fault: str, name: str) -> Row:
        row = Row(fault)
        info: dict[str, Any] = {}
        probes: list[Result] = []

        async def inject() -> None:
            if name.startswith("decode"):  # streams decoding on both nodes when it dies
                started: set[int] = set()
                streams = [
                    asyncio.create_task(
                        self.c.turn(
                            i, max_tokens=160, stream=True, on_chunk=lambda i=i: started.add(i)
                        )
                    )
                    for i in self.ref_ids[:6]
                ]
                info["streams"] = streams
                t0 = time.monotonic()
                while len(started) < len(streams) and time.monotonic() - t0 < 20:
                    await asyncio.sleep(0.01)
            elif name.startswith("prefill"):  # hits being read and relayed when it dies
                info["inflight"] = [asyncio.create_task(self.c.turn(i)) for i in self.ref_ids[:6]]
                await asyncio.sleep(0.05)
            old = self.cl.kill(name)
            t_kill = time.monotonic()
            t_up = await asyncio.to_thread(self.cl.wait_restarted, name, old)
            info["t_kill"], info["t_up"] = t_kill, t_up
            if t_up is None:
                return
            if name.startswith("decode"):
                url = self.cl.ready_url(name)
                while not http_ok(url) and time.monotonic() - t_up < 60:
                    await asyncio.sleep(0.05)
                info["ready_s"] = time.monotonic() - t_up
                info["recover"] = await self._serving_again(
                    t_up, lambda r: r.decode_node == name, probes
                )
            else:
                info["recover"] = await self._serving_again(t_up, lambda r: True, probes)
            if name == "scheduler":
                info["hit_s"] = await self._serving_again(t_up, lambda r: r.cached > 0, probes)
            await asyncio.sleep(1.0)  # a second of load after recovery

        results = await self._load_during(inject)
        extra: list[Result] = []
        for key in ("streams", "inflight"):
            if key in info:
                extra += await asyncio.gather(*info[key])
        row.add(results + extra + probes)
        t_up = info.get("t_up")
        row.recover_s = info.get("recover")
        notes = [
            f"restarted {t_up - info['t_kill']:.1f}s after the kill" if t_up else "not restarted"
        ]
        if "ready_s" in info:
            notes.append(f"ready {info['ready_s']:.1f}s after restart")
        if info.get("hit_s") is not None:
            notes.append(f"first hit {info['hit_s']:.1f}s after restart")
        if name.startswith("decode"):
            failed = [r for r in extra + results if r.kind == "failed"]
            elsewhere = [r for r in failed if name not in r.error]
            streams = info.get("streams", [])
            notes.append(
                f"{sum(1 for s in streams if s.result().kind == 'failed')}/{len(streams)} "
                f"streams cut (those on {name})"
            )
            if elsewhere:
                row.bars.append(f"failed_elsewhere={len(elsewhere)}")
                notes.append(f"{len(elsewhere)} failures not on {name}: {elsewhere[0].error[:80]}")
        row.note = "; ".join(notes)
        return row

    def block_files(self) -> list[Path]:
        return [p for p in self.cl.storage.rglob("*") if p.is_file() and not p.name.startswith(".")]

    async def store_row(self, fault: str) -> Row:
        row = Row(fault)
        files = sorted(self.block_files())[::2]  # every other block: some hits only shortened
        rng = random.Random(7)
        if fault == "corrupt-blocks":
            for p in files:
                size = p.stat().st_size
                with open(p, "r+b") as f:
                    f.seek(size // 2)
                    f.write(bytes(rng.randrange(256) for _ in range(64)))
        else:
            for p in files:
                os.truncate(p, p.stat().st_size // 2)
        results = [await self.c.turn(i) for i in self.ref_ids]
        row.add(results)
        hits = sum(1 for r in results if r.cached)
        row.note = f"{len(files)} block files {fault.split('-')[0]}; {hits} turns still read a (shortened) hit"
        return row

    async def read_only_row(self) -> Row:
        row = Row("read-only-store")
        undo = self._read_only()
        try:
            results = [await self.c.turn(i) for i in self.ref_ids]
            results += [await self.c.turn(self.new_prompt()) for _ in range(4)]  # writes fail
        finally:
            undo()
        row.add(results)
        if self.mounted:
            how = "EROFS (read-only bind mount)"
        elif os.geteuid() == 0:
            how = "chmod a-w, which root ignores: NOT a read-only store here (no mount allowed)"
        else:
            how = "EACCES (chmod a-w, not root)"
        hits = sum(1 for r in results if r.cached)
        row.note = f"{how}; {hits} turns read hits, new blocks not written"
        return row

    def _read_only(self) -> Callable[[], None]:
        root = self.cl.storage
        if self.mounted:
            # a read-only bind mount over the store: EROFS for every write through its path,
            # while the tmpfs itself stays writable (a remount of the tmpfs is refused while a
            # worker holds a deleted block file open)
            subprocess.run(["mount", "--bind", str(root), str(root)], check=True)
            try:
                subprocess.run(["mount", "-o", "remount,bind,ro", str(root)], check=True)
            except subprocess.CalledProcessError:
                subprocess.run(["umount", str(root)], check=False)
                raise
            # lazily: workers hold block files open through it; those keep working
            return lambda: subprocess.run(["umount", "-l", str(root)], check=True)
        modes = {p: p.stat().st_mode for p in [root, *root.rglob("*")]}
        for p, mode in modes.items():
            p.chmod(mode & ~0o222)
        return lambda: [p.chmod(mode) for p, mode in modes.items()]

    async def full_store_row(self) -> Row:
        row = Row("full-store")
        if not self.mounted:
            row.note = "skipped: filling a filesystem needs the store on a tmpfs (root)"
            return row
        filler = self.cl.storage / ".filler"
        st = os.statvfs(self.cl.storage)
        free = st.f_bavail * st.f_frsize
        with open(filler, "wb") as f:  # leave about 8 blocks' room
            try:
                f.write(b"\0" * max(0, free - 8 * 17 * 1024))
            except OSError:
                pass
        try:
            results = [
                await self.c.turn(self.new_prompt()) for _ in range(12 if self.quick else 30)
            ]
            results += [await self.c.turn(i) for i in self.ref_ids]
        finally:
            filler.unlink()
        row.add(results)
        row.note = "real ENOSPC: tmpfs filled but for ~8 blocks; the store evicts to make room"
        return row

    async def disconnect_row(self) -> Row:
        row = Row("disconnects")
        n = 30 if self.quick else 100
        cut: list[Result] = []
        for wave in range(0, n, 20):  # 20 at a time: under the in-flight cap, none refused
            cut += await asyncio.gather(
                *(
                    self.c.turn(
                        self.new_prompt(), max_tokens=200, stream=True, cut_after_first=True
                    )
                    for _ in range(wave, min(n, wave + 20))
                )
            )
        after = await asyncio.gather(*(self.c.turn(i) for i in self.ref_ids * 2))
        row.add(after)
        row.add([r for r in cut if r.kind != "cancelled"])  # a cut stream is neither
        row.sent += sum(r.kind == "cancelled" for r in cut)
        codes = [r.status for r in after if r.kind != "ok"]
        inflight = await self._scheduler_in_flight_settles()
        row.note = (
            f"{sum(r.kind == 'cancelled' for r in cut)} streams cut by their client, then "
            f"{len(after)} turns ({codes.count(503)} 503s); scheduler in-flight {inflight}"
        )
        if codes.count(503):
            row.bars.append("503_burst")
        return row

    async def _scheduler_in_flight_settles(self, timeout_s: float = 10.0) -> str:
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

    async def overload_row(self) -> Row:
        row = Row("overload")
        n = 100 if self.quick else 300
        results = await asyncio.gather(
            *(self.c.turn(self.new_prompt(), max_tokens=32) for _ in range(n))
        )
        row.add(results)
        refused = [r for r in results if r.kind == "failed"]
        without = [r for r in refused if r.status not in (429, 503) or not r.retry_after]
        if without:
            row.bars.append(f"refused_without_retry_after={len(without)}")
        slowest = max(r.end_s - r.start_s for r in results)
        row.note = (
            f"{n} at once; {sum(r.status == 429 for r in refused)} 429, "
            f"{sum(r.status == 503 for r in refused)} 503, all with Retry-After: {not without}; "
            f"slowest answer {slowest:.1f}s"
        )
        return row

    async def http_fuzz_row(self) -> Row:
        from dualpath.local.fuzz import http_cases

        row = Row("http-fuzz")
        cases = http_cases(320, self.c.model)
        results = []
        for endpoint, body in cases:
            res = Result("lost", start_s=time.monotonic())
            path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
            try:
                r = await asyncio.wait_for(
                    self.c.http.post(
                        path, content=body, headers={"content-type": "application/json"}
                    ),
                    self.c.deadline_s,
                )
                res.status = r.status_code
                if r.status_code >= 400:
                    res.kind = "failed"
                    try:
                        r.json()["error"]["message"]
                    except Exception:  # noqa: BLE001
                        res.kind = "lost"  # not our JSON error: something else answered
                elif r.headers.get("content-type", "").startswith("text/event-stream"):
                    events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
                    res.kind = "ok" if events and events[-1] == "[DONE]" else "failed"
                    res.empty = res.kind == "ok" and len(events) < 2
                else:
                    res.kind = "ok"
                    res.empty = not r.json()["choices"][0].get("finish_reason")
            except TimeoutError:
                res.kind = "hung"
            except httpx.TransportError as err:
                res.kind, res.error = "lost", str(err)
            results.append(res)
        after = [await self.c.turn(i) for i in self.ref_ids[:4]]
        row.add(results, bad_input=True)
        row.add(after)
        codes: dict[int, int] = {}
        for r in results:
            codes[r.status] = codes.get(r.status, 0) + 1
        row.note = f"{len(cases)} bodies: " + ", ".join(
            f"{k}x{v}" for k, v in sorted(codes.items())
        )
        row.note += "; then 4 good turns"
        return row

    async def grpc_fuzz_row(self) -> Row:
        import grpc

        from dualpath.grpc_auth import channel as worker_channel
        from dualpath.local.cluster import run_dir_auth
        from dualpath.local.fuzz import WORKER_METHODS as WORKER_SERVICE_ROLES
        from dualpath.local.fuzz import grpc_cases
        from dualpath.scheduler.client import channel
        from dualpath.v1 import scheduler_pb2 as pb
        from dualpath.v1 import scheduler_pb2_grpc as pb_grpc
        from dualpath.v1 import worker_pb2 as wpb
        from dualpath.v1 import worker_pb2_grpc as wpb_grpc

        row = Row("grpc-fuzz")
        admin = run_dir_auth(self.cl.run_dir)
        ch = channel(self.cl.scheduler, admin)
        stub = pb_grpc.SchedulerStub(ch)
        # the scheduler methods workers call, with a role-wide decode certificate of the run's CA
        # (under mTLS): malformed input reaches the scheduler's validation, not the identity check
        wauth = self._worker_auth()
        wch = channel(self.cl.scheduler, wauth)
        stubs = (stub, pb_grpc.SchedulerStub(wch))
        # one worker of each role, from the scheduler's view; a real decode agent, so some
        # Prefill calls fail on their regions rather than on the agent
        view = await stub.ClusterView(pb.ClusterViewRequest(), timeout=5)
        roles = {pb.ROLE_PREFILL: "prefill", pb.ROLE_DECODE: "decode"}
        addresses = {roles[n.role]: n.address for n in view.nodes if n.role in roles}
        # Generate is the frontend's (admin may make it); Prefill and GetTransferInfo a worker's
        channels = {
            (role, who): worker_channel(a, admin if who == "admin" else wauth, server_role=role)
            for role, a in addresses.items()
            for who in ("admin", "worker")
        }
        workers = {key: wpb_grpc.WorkerStub(c) for key, c in channels.items()}
        agent = None
        if ("decode", "worker") in workers:
            info = await workers["decode", "worker"].GetTransferInfo(
                wpb.TransferInfoRequest(), timeout=5
            )
            agent = (info.agent, info.metadata)
        bad = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNAVAILABLE}
        codes: dict[str, int] = {}
        results = []
        cases = grpc_cases(120 if self.quick else 400, decode_agent=agent)
        try:
            for case in cases:
                res = Result("ok", start_s=time.monotonic())
                if case.service == "Worker":
                    who = "admin" if case.method == "Generate" else "worker"
                    target = workers.get((WORKER_SERVICE_ROLES[case.method], who))
                    if target is None:
                        continue
                    call = getattr(target, case.method)
                else:
                    call = getattr(stubs[case.method in WORKER_METHODS], case.method)
                try:
                    if case.method in ("Heartbeats", "KvSnapshot"):
                        await _stream_call(call(timeout=5), case.request)
                    elif case.method in ("Generate", "Prefill"):  # server streams
                        async for _ in call(case.request, timeout=5):
                            pass
                    else:
                        await call(case.request, timeout=5)
                    code = "OK"
                except grpc.aio.AioRpcError as err:
                    code = err.code().name
                    res.kind = "failed"
                    if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                        res.kind = "hung"
                    if err.code() in bad:
                        res.status = 500
                        res.error = f"{case.method}: {code}: {err.details()}"
                codes[f"{case.method}:{code}"] = codes.get(f"{case.method}:{code}", 0) + 1
                res.end_s = time.monotonic()
                results.append(res)
        finally:
            await ch.close()
            await wch.close()
            for c in channels.values():
                await c.close()
        after = [await self.c.turn(i) for i in self.ref_ids[:4]]
        row.add(results, bad_input=True)
        row.add(after)
        worst = sorted(codes.items(), key=lambda kv: -kv[1])
        row.note = (
            f"{len(cases)} calls: "
            + ", ".join(f"{k}x{v}" for k, v in worst)
            + "; then 4 good turns"
        )
        return row

    def _worker_auth(self):  # noqa: ANN202
        """A role-wide decode certificate of the run's CA (mTLS), else the run's credentials."""
        from dualpath.local.cluster import run_dir_auth
        from dualpath.tls import LocalCA, TlsCredentials

        tls = self.cl.run_dir / "tls"
        if not (tls / "ca").is_dir():
            return run_dir_auth(self.cl.run_dir)
        name = yaml.safe_load((self.cl.run_dir / "cluster.yaml").read_text())["metadata"]["name"]
        return TlsCredentials(LocalCA(tls, name).issue_dir("fuzz", "decode"))

    async def sigint_row(self) -> Row:
        row = Row("sigint")
        pids = self.cl.descendants()
        streams = [
            asyncio.create_task(self.c.turn(i, max_tokens=300, stream=True))
            for i in self.ref_ids[:6]
        ]
        await asyncio.sleep(0.5)
        took = await asyncio.to_thread(self.cl.stop, signal.SIGINT)
        results = await asyncio.gather(*streams)
        row.add(results)
        left = [p for p in pids if _alive(p)]
        row.note = (
            f"dualpath up stopped in {took:.1f}s (exit {self.cl.proc.returncode if self.cl.proc else '?'}); "
            f"{len(left)} processes left"
        )
        if left:
            row.bars.append(f"processes_left={len(left)}")
        if row.failed_clean:
            row.bars.append("in_flight_cut")
        return row


async def _stream_call(call, messages: list) -> None:  # noqa: ANN001
    """A client-streaming call as a well-behaved client makes it (bidi: one message, then its
    answer, as a heartbeat does), writing nothing once the server has ended the call; raises
    the call's AioRpcError."""
    import grpc

    bidi = hasattr(call, "read")
    try:
        for msg in messages:
            await call.write(msg)
            if bidi and await call.read() is grpc.aio.EOF:
                break
        await call.done_writing()
        if not bidi:
            await call
    except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError):
        pass
    code = await call.code()
    if code != grpc.StatusCode.OK:
        raise grpc.aio.AioRpcError(
            code, grpc.aio.Metadata(), grpc.aio.Metadata(), await call.details()
        )


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# ---- running it ------------------------------------------------------------------------------


def _mount_tmpfs(path: Path, size_bytes: int) -> bool:
    """A tmpfs of `size_bytes` at `path` (root only): a store whose filesystem can really be
    filled (ENOSPC) and remounted read-only (EROFS). False when this process cannot mount."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)],
        capture_output=True,
    )
    return proc.returncode == 0


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
    mounted = _mount_tmpfs(storage, 96 << 20)
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
                    row = await _row(suite, name)
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


def keep_evidence(out: Path, rows: list[Row]) -> Path:
    """A failed run's evidence, where the next run does not overwrite it:
    `out/failures/<UTC time>/` with the cluster log, the config, the run directory's
    `cluster.yaml` and `evidence.json` (each failed row's bars, note and bad answers)."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dest = out / "failures" / stamp
    dest.mkdir(parents=True, exist_ok=True)
    for src in (out / "cluster.log", out / "faults.yaml", out / "run" / "cluster.yaml"):
        if src.exists():
            shutil.copy2(src, dest / src.name)
    failed = [asdict(r) for r in rows if r.bars]
    (dest / "evidence.json").write_text(json.dumps(failed, indent=2))
    log.warning("a row failed: its evidence and the cluster log are kept in %s", dest)
    return dest


async def _row(s: Suite, name: str) -> Row:
    if name == "decode-kill":
        return await s.restart_row(name, "decode-0")
    if name == "prefill-kill":
        return await s.restart_row(name, "prefill-0")
    if name == "scheduler-kill":
        return await s.restart_row(name, "scheduler")
    if name in ("corrupt-blocks", "truncated-blocks"):
        return await s.store_row(name)
    if name == "read-only-store":
        return await s.read_only_row()
    if name == "full-store":
        return await s.full_store_row()
    if name == "disconnects":
        return await s.disconnect_row()
    if name == "overload":
        return await s.overload_row()
    if name == "http-fuzz":
        return await s.http_fuzz_row()
    if name == "grpc-fuzz":
        return await s.grpc_fuzz_row()
    if name == "sigint":
        return await s.sigint_row()
    raise ValueError(f"unknown fault {name!r}; one of {', '.join(ROWS)}")


COLUMNS = (
    ("fault", "fault"),
    ("sent", "sent"),
    ("ok", "succeeded"),
    ("failed clean", "failed_clean"),
    ("lost", "lost"),
    ("hung", "hung"),
    ("wrong", "wrong"),
    ("empty", "empty"),
    ("5xx bad input", "bad_input_5xx"),
    ("recover s", "recover_s"),
)


def table(rows: list[Row]) -> str:
    def cell(row: Row, key: str) -> str:
        v = getattr(row, key)
        if key == "recover_s":
            return "-" if v is None else f"{v:.1f}"
        return str(v)

    head = "| " + " | ".join(h for h, _ in COLUMNS) + " | bars | note |"
    sep = "|" + "---|" * (len(COLUMNS) + 2)
    lines = [head, sep]
    for r in rows:
        bars = "ok" if not r.bars else "MISSED " + ", ".join(r.bars)
        lines.append("| " + " | ".join(cell(r, k) for _, k in COLUMNS) + f" | {bars} | {r.note} |")
    return "\n".join(lines)


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
