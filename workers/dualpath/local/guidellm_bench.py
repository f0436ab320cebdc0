"""`dualpath bench guidellm`: a standard benchmark client, guidellm (PyPI), against a local
cluster per policy, or against a running `dualpath up` (`--url`).

guidellm runs its own multi-turn, prefix-sharing synthetic chat load (`turns` turns per
conversation, each replaying the conversation so far, every prompt starting with one of
`prefix_count` shared system prefixes), asks for exactly `output_tokens` per request
(`max_completion_tokens` + `ignore_eos`), counts tokens with the tokenizer directory the
cluster wrote (`--tokenizer`), and writes its JSON report. This module builds that command
and reads that report: requests failed, output tokens per request, the share of prompt tokens
served from cache (`usage.prompt_tokens_details.cached_tokens`, as guidellm recorded it), TTFT,
ITL and throughput. It never measures anything itself.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dualpath import config

log = logging.getLogger(__name__)

POLICIES = ("prefill-read", "dualpath")


@dataclass(frozen=True)
class Load:
    """guidellm's synthetic multi-turn chat load (its `--data kind=synthetic_text`)."""

    streams: int = 2  # concurrent conversations
    turns: int = 3
    prompt_tokens: int = 96  # appended per turn
    output_tokens: int = 8
    prefix_tokens: int = 64  # a shared system prefix
    prefix_count: int = 2
    requests: int = 6  # then stop (max_requests)

    def data(self) -> str:
        return (
            f"kind=synthetic_text,prompt_tokens={self.prompt_tokens},"
            f"output_tokens={self.output_tokens},turns={self.turns},"
            f"prefix_tokens={self.prefix_tokens},prefix_count={self.prefix_count}"
        )


def guidellm_command(url: str, model: str, tokenizer: str | Path, load: Load, report: Path):
    """The guidellm CLI call (this interpreter's guidellm) against an OpenAI endpoint."""
    return [
        sys.executable,
        "-m",
        "guidellm",
        "run",
        "--backend",
        f"kind=openai_http,target={url},model={model},request_format=/v1/chat/completions",
        "--tokenizer",
        f"kind=hf_auto,model={tokenizer}",
        "--profile",
        f"kind=concurrent,streams={load.streams}",
        "--data",
        load.data(),
        "--constraint",
        f"kind=max_requests,count={load.requests}",
        "--output",
        f"kind=json,path={report}",
        "--disable-console",
    ]


def run_guidellm(
    url: str, model: str, tokenizer: str | Path, load: Load, workdir: Path, timeout_s: float
) -> dict[str, Any]:
    """Run guidellm once and return its JSON report; its console goes to workdir/guidellm.log."""
    workdir.mkdir(parents=True, exist_ok=True)
    report = workdir / "guidellm.json"
    report.unlink(missing_ok=True)
    # offline: the tokenizer is a local directory, nothing to fetch
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    env.setdefault("HF_HOME", str(workdir / "hf"))
    # its default spawns 10 worker processes that each import it (tens of seconds on 2 cores);
    # one asyncio worker drives these few streams
    env.setdefault("GUIDELLM__MAX_WORKER_PROCESSES", "1")
    cmd = guidellm_command(url, model, tokenizer, load, report)
    log.info("guidellm: %s", " ".join(cmd[1:]))
    with open(workdir / "guidellm.log", "w") as out:
        done = subprocess.run(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=timeout_s, cwd=workdir
        )
    if done.returncode or not report.is_file():
        tail = (workdir / "guidellm.log").read_text()[-2000:]
        raise RuntimeError(f"guidellm exited with code {done.returncode}:\n{tail}")
    return json.loads(report.read_text())


def _stat(metrics: dict, name: str) -> dict[str, float]:
    s = metrics[name]["successful"]
    pct = s.get("percentiles") or {}
    return {
        "mean": round(s["mean"], 2),
        "p50": round(pct.get("p50", s["median"]), 2),
        "p95": round(pct.get("p95", 0.0), 2),
    }


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    """What guidellm's own report says of its one benchmark."""
    (bench,) = report["benchmarks"]
    reqs = bench["requests"]
    ok = reqs["successful"]
    prompt = sum(r["input_metrics"]["text_tokens"] or 0 for r in ok)
    cached = sum(r["input_metrics"]["cached_tokens"] or 0 for r in ok)
    outputs = [r["output_metrics"]["text_tokens"] for r in ok]
    duration = bench["duration"]
    totals = bench["metrics"]["request_totals"]
    return {
        "requests": totals["successful"],
        "errored": totals["errored"],
        "incomplete": totals["incomplete"],
        "output_tokens_per_request": sorted(set(outputs)),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cached_share": round(cached / prompt, 4) if prompt else 0.0,
        "cached_share_after_first_turn": _later_share(ok),
        "ttft_ms": _stat(bench["metrics"], "time_to_first_token_ms"),
        "itl_ms": _stat(bench["metrics"], "inter_token_latency_ms"),
        "output_tokens_per_s": round(sum(outputs) / duration, 2) if duration else 0.0,
        "requests_per_s": round(len(ok) / duration, 3) if duration else 0.0,
        "duration_s": round(duration, 2),
    }


def _later_share(ok: list[dict]) -> float:
    later = [r for r in ok if r["info"].get("turn_index", 0) > 0]
    prompt = sum(r["input_metrics"]["text_tokens"] or 0 for r in later)
    cached = sum(r["input_metrics"]["cached_tokens"] or 0 for r in later)
    return round(cached / prompt, 4) if prompt else 0.0


def _machine(before: float) -> dict[str, float]:
    """The 1-minute load average around a run: on a shared machine it shows how much of the
    figures is other work."""
    return {"loadavg_before": round(before, 1), "loadavg_after": round(os.getloadavg()[0], 1)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-f", "--file", help="DualPathCluster YAML (default: embedded local)")
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    parser.add_argument("--out", default="out/bench/guidellm", help="run directory")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument(
        "--url",
        default=None,
        help="a running frontend (e.g. `dualpath up`'s) instead of a fresh cluster per policy; "
        "needs --tokenizer",
    )
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory for --url")
    d = Load()
    parser.add_argument("--streams", type=int, default=d.streams)
    parser.add_argument("--turns", type=int, default=d.turns)
    parser.add_argument("--prompt-tokens", type=int, default=d.prompt_tokens)
    parser.add_argument("--output-tokens", type=int, default=d.output_tokens)
    parser.add_argument("--prefix-tokens", type=int, default=d.prefix_tokens)
    parser.add_argument("--prefix-count", type=int, default=d.prefix_count)
    parser.add_argument("--requests", type=int, default=d.requests)
    parser.add_argument(
        "--snic-gbps",
        type=float,
        default=0.0,
        help="emulated SNIC cap per node for the clusters started (0: spec.storage.snicGbps)",
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="run the policies in turn this many times"
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="per guidellm run, s")


def run(args: argparse.Namespace) -> int:
    from dualpath.local.cluster import LocalCluster, with_overrides

    load = Load(
        args.streams,
        args.turns,
        args.prompt_tokens,
        args.output_tokens,
        args.prefix_tokens,
        args.prefix_count,
        args.requests,
    )
    cfg = config.load(args.file) if args.file else config.local_default()
    if args.snic_gbps > 0:
        cfg = with_overrides(cfg, **{"storage.snicGbps": args.snic_gbps})
    out = Path(args.out).resolve()
    results: dict[str, Any] = {}
    if args.url:
        if not args.tokenizer:
            raise SystemExit("dualpath bench guidellm: --url needs --tokenizer <dir>")
        before = os.getloadavg()[0]
        report = run_guidellm(
            args.url, cfg.spec.model.name, args.tokenizer, load, out, args.timeout
        )
        results["url"] = {**summarize(report), **_machine(before)}
    policies = [p for p in args.policies.split(",") if p]
    runs = [] if args.url else [(r, p) for r in range(1, args.rounds + 1) for p in policies]
    for rnd, policy in runs:
        name = policy if rnd == 1 else f"{policy}#{rnd}"
        pcfg = with_overrides(
            cfg, **{"scheduler.policy": policy, "storage.path": str(out / f"kv-{policy}")}
        )
        sink = io.StringIO() if args.json else None
        with LocalCluster(pcfg, out / name, sink=sink, fresh_storage=True) as cluster:
            before = os.getloadavg()[0]
            report = run_guidellm(
                cluster.endpoints.frontend,
                pcfg.spec.model.name,
                cluster.tokenizer_dir,
                load,
                out / name,
                args.timeout,
            )
        results[name] = {**summarize(report), **_machine(before)}
    doc = {"client": "guidellm", "model": cfg.spec.model.name, "load": asdict(load), **results}
    print(json.dumps(doc, indent=None if args.json else 2))
    failed = [k for k, v in results.items() if v["errored"] or v["incomplete"]]
    return 1 if failed else 0
