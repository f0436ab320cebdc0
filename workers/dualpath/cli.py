"""`dualpath`: the one entry point of every process and container (docs/design.md section 7).

Each command lives in its own module exposing `add_arguments(parser)` and `run(args) -> int`;
the module is imported only when its command runs, so `dualpath worker` never imports kopf
and `dualpath operator` never imports torch. The loaders below are plain import statements,
so the import-linter contracts in pyproject.toml see every edge this composition root adds
(the two into `dualpath_operator` are the declared exceptions to "the runtime does not import
the operator").
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType

from dualpath import __version__
from dualpath.lifeline import die_with_parent, follow_make_interrupt
from dualpath.log import setup_logging


@dataclass(frozen=True)
class Command:
    """One `dualpath` command: a one-line help and the loader of its module."""

    help: str
    load: Callable[[], ModuleType]


def _demo() -> ModuleType:
    from dualpath import demo

    return demo


def _up() -> ModuleType:
    from dualpath.local import cli

    return cli


def _faults() -> ModuleType:
    from dualpath.local import faults

    return faults


def _sim() -> ModuleType:
    from dualpath.sim import cli

    return cli


def _trace() -> ModuleType:
    from dualpath import trace_cli

    return trace_cli


def _plan() -> ModuleType:
    from dualpath.sim import plan

    return plan


def _render() -> ModuleType:
    from dualpath_operator import render_cli

    return render_cli


def _operator() -> ModuleType:
    from dualpath_operator import main

    return main


def _model() -> ModuleType:
    from dualpath.local import model

    return model


def _scheduler() -> ModuleType:
    from dualpath.scheduler import cli

    return cli


def _worker() -> ModuleType:
    from dualpath.worker import cli

    return cli


def _frontend() -> ModuleType:
    from dualpath.frontend import cli

    return cli


def _bench_store() -> ModuleType:
    from dualpath.kv import bench

    return bench


def _bench_engine() -> ModuleType:
    from dualpath.engine import bench

    return bench


def _bench_transfer() -> ModuleType:
    from dualpath.transfer import bench

    return bench


def _bench_scheduler() -> ModuleType:
    from dualpath.scheduler import bench

    return bench


def _bench_guidellm() -> ModuleType:
    from dualpath.local import guidellm_bench

    return guidellm_bench


def _bench_local() -> ModuleType:
    from dualpath.local import bench_cli

    return bench_cli


# "bench X" commands are nested under `bench`.
COMMANDS: dict[str, Command] = {
    "demo": Command("run the main job on the embedded local default", _demo),
    "up": Command("start a local cluster (scheduler, workers, frontend) as processes", _up),
    "faults": Command(
        "inject faults into a local cluster and tabulate what its clients saw", _faults
    ),
    "sim": Command("cluster-scale discrete-event simulation of the policies", _sim),
    "trace": Command("import real traces (claude-code, mooncake); print stats", _trace),
    "plan": Command("size P:D from a trace with the simulator, per policy", _plan),
    "render": Command("print the manifests a DualPathCluster turns into", _render),
    "operator": Command("run the kopf operator", _operator),
    "model": Command("write a Llama checkpoint both engines (DualPath, vLLM) load", _model),
    "scheduler": Command("run the gRPC scheduler service", _scheduler),
    "worker": Command("run a prefill or decode worker", _worker),
    "frontend": Command("run the OpenAI-style HTTP frontend", _frontend),
}
BENCHES: dict[str, Command] = {
    "store": Command("KV block store read throughput vs raw reads, SNIC cap", _bench_store),
    "engine": Command("prefill/decode tokens/s and layer-wise load overlap", _bench_engine),
    "transfer": Command("D->P layer stream vs raw NIXL WRITE throughput", _bench_transfer),
    "scheduler": Command("policy decision latency in process and over gRPC", _bench_scheduler),
    "local": Command("replay an agentic trace on a local cluster per policy", _bench_local),
    "guidellm": Command("guidellm's multi-turn load per policy", _bench_guidellm),
}


def _parser(command: str | None, bench: str | None, add_help: bool) -> argparse.ArgumentParser:
    """The full parser, with the arguments of `command` (and `bench`) loaded only."""
    parser = argparse.ArgumentParser(
        prog="dualpath", description=__doc__.splitlines()[0], add_help=add_help
    )
    parser.add_argument("--version", action="version", version=f"dualpath {__version__}")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def add(subs: argparse._SubParsersAction, name: str, cmd: Command, load: bool) -> None:
        p = subs.add_parser(name, help=cmd.help, description=cmd.help, add_help=add_help)
        p.set_defaults(_command=cmd)
        if load:
            cmd.load().add_arguments(p)

    for name, cmd in COMMANDS.items():
        add(sub, name, cmd, load=name == command)
    bench_parser = sub.add_parser(
        "bench", help="benchmarks printing JSON ratios measured in one run", add_help=add_help
    )
    bench_sub = bench_parser.add_subparsers(dest="bench", metavar="BENCH")
    for name, cmd in BENCHES.items():
        add(bench_sub, name, cmd, load=command == "bench" and name == bench)
    return parser


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    """The parser for `argv`: argparse itself finds the command (a first pass that loads no
    command's arguments and ignores what it does not know), then only that command's module
    adds its arguments. So `--log-level DEBUG sim` reads DEBUG as the level, not a command."""
    first, _ = _parser(None, None, add_help=False).parse_known_args(list(argv))
    return _parser(first.command, getattr(first, "bench", None), add_help=True)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    die_with_parent()  # started by a local supervisor: end with it (no-op otherwise)
    follow_make_interrupt()  # started by make: its SIGINT is ours too (no-op otherwise)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    command: Command | None = getattr(args, "_command", None)
    if command is None:
        parser.print_help()
        return 2
    setup_logging(args.log_level)
    try:
        return int(command.load().run(args) or 0)
    except KeyboardInterrupt as stop:  # 128 + the signal, as a shell reports it
        return 128 + int(getattr(stop, "signum", signal.SIGINT))


if __name__ == "__main__":
    sys.exit(main())
