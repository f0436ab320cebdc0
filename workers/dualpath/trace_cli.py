"""`dualpath trace`: import real traces into the trajectory model, and print their statistics.

    dualpath trace import claude-code ../shared/traces/claude-code -o out/cc.jsonl
    dualpath trace import mooncake ../shared/traces/mooncake/conversation_trace.jsonl.gz -o mc.jsonl
    dualpath trace stats out/cc.jsonl                       # a dualpath trace file
    dualpath trace stats --format mooncake ../shared/traces/mooncake   # straight from the source

What the importers infer (hits of re-sent outputs, shared prefixes, subagent starts, Mooncake
sessions) is in `dualpath.trace_import`; `stats` prints the tally from the file's meta line.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from dualpath import trace
from dualpath.trace_import import FORMATS, import_paths

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="trace_cmd", metavar="SUBCOMMAND")
    imp = sub.add_parser("import", help="convert a public trace format into a dualpath trace")
    imp.add_argument("format", choices=FORMATS, help="source format")
    imp.add_argument("paths", nargs="+", type=Path, help="files or directories of the source")
    imp.add_argument("-o", "--output", required=True, type=Path, help="dualpath JSONL to write")
    imp.add_argument(
        "--no-shared-prefix",
        action="store_true",
        help="claude-code: turn 0 misses entirely (default: its system+tool prefix hits)",
    )
    imp.add_argument("--limit", type=int, default=0, help="at most N sessions (mooncake: requests)")
    st = sub.add_parser("stats", help="turns, token distributions, hit ratio, think times")
    st.add_argument(
        "path", type=Path, nargs="+", help="a dualpath trace (or sources with --format)"
    )
    st.add_argument("--format", choices=FORMATS, help="read the source format directly")
    st.add_argument("--no-shared-prefix", action="store_true", help="as for import")
    st.add_argument("--limit", type=int, default=0, help="as for import")
    st.add_argument(
        "--block-tokens", type=int, help="growth-model block size (default: the source's, or 64)"
    )
    st.add_argument("--json", action="store_true", help="print JSON")


def load_any(
    paths: list[Path], fmt: str | None, shared_prefix: bool = True, limit: int = 0
) -> tuple[dict[str, Any], list[trace.Trajectory]]:
    """(meta, trajectories) of a dualpath trace file, or of sources in `fmt`."""
    for p in paths:
        if not p.exists():
            raise ValueError(f"path {p}: does not exist")
    if fmt:
        trs, meta = import_paths(fmt, paths, shared_prefix, limit)
        return meta, trs
    if len(paths) != 1 or paths[0].is_dir():
        raise ValueError("path: give one dualpath trace file, or the sources with --format")
    meta, trs = trace.load_trace(paths[0])
    meta.setdefault("name", paths[0].name)
    return meta, trs


def _fmt(q: dict[str, Any]) -> str:
    if not q.get("n"):
        return "-"
    return (
        f"p50 {q['p50']:,.0f}  p90 {q['p90']:,.0f}  p99 {q['p99']:,.0f}  max {q['max']:,.0f}  "
        f"mean {q['mean']:,.0f}"
    )


def _print(meta: dict[str, Any], d: dict[str, Any]) -> None:
    print(
        f"trace {meta.get('name', '?')}: {d['sessions']} sessions, {d['subagents']} subagents, "
        f"{d['turns']} turns"
    )
    print(f"  turns/session   {_fmt(d['turns_per_session'])}")
    print(f"  prompt tokens   {_fmt(d['prompt_tokens'])}  ({d['turns_over_128k']} turns > 128K)")
    print(
        f"  append tokens   {_fmt(d['append_tokens'])}  ({d['negative_append_turns']} negative: "
        f"{d['compacted_turns']} compacted below the previous prompt, "
        f"{d['output_trimmed_turns']} re-sent the previous output shortened)"
    )
    print(f"  output tokens   {_fmt(d['output_tokens'])}")
    t = d["think_s"]
    if t.get("n"):
        print(
            f"  think s         p50 {t['p50']:.1f}  p90 {t['p90']:.1f}  p99 {t['p99']:.1f}  "
            f"max {t['max']:.0f}"
        )
    inf = meta.get("inferred") or {}
    shared = inf.get("shared_prefix_turns")
    print(
        f"  hit ratio       {d['hit_ratio_tokens']:.4f} of prompt tokens; "
        f"{d['partial_hit_turns']} partial-hit turns; first turns (sessions and subagents): "
        f"{d['first_turns_prefix_hit']} hit a prefix"
        + (f" ({shared} given the shared system+tool prefix by the import)" if shared else "")
        + f", {d['first_turns_full_miss']} miss"
    )
    at_import = meta.get("counts")
    if at_import:
        differ = {k: (v, d.get(k)) for k, v in at_import.items() if k != "turns" and d.get(k) != v}
        if differ:
            print(f"  differs from the import's counts (file edited?): {differ}")
    if inf:
        said = ", ".join(f"{k}={v}" for k, v in inf.items() if v)
        print(f"  inferred        {said or 'nothing'}")
    else:
        print("  inferred        nothing recorded (no import meta: a synthetic or hand-made file)")


def run(args: argparse.Namespace) -> int:
    if not getattr(args, "trace_cmd", None):
        print("dualpath trace: choose a subcommand: import or stats", file=sys.stderr)
        return 2
    try:
        if args.trace_cmd == "import":
            meta, trs = load_any(args.paths, args.format, not args.no_shared_prefix, args.limit)
            args.output.parent.mkdir(parents=True, exist_ok=True)
            n = trace.save_jsonl(args.output, trs, meta)
            log.info("trace imported: %s sessions from %s into %s", n, meta["name"], args.output)
            print(json.dumps({"output": str(args.output), **meta}))
            return 0
        meta, trs = load_any(args.path, args.format, not args.no_shared_prefix, args.limit)
    except ValueError as err:
        print(f"dualpath trace: {err}", file=sys.stderr)
        return 2
    block = args.block_tokens or int(meta.get("source_block_tokens") or 64)  # type: ignore[arg-type]
    d = trace.describe(trs, block)
    if args.json:
        print(json.dumps({"meta": meta, **d}, indent=2))
    else:
        _print(meta, d)
    return 0
