"""`dualpath`: the one entry point of every process and container (DESIGN section 7).

Each command lives in its own module exposing `add_arguments(parser)` and `run(args) -> int`;
the module is imported only when its command runs, so `dualpath worker` never imports kopf
and `dualpath operator` never imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from dualpath import __version__
from dualpath.log import setup_logging

# command -> (module, one-line help). "bench X" commands are nested under `bench`.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("dualpath.demo", "run the main job on the embedded local default"),
    "up": (
        "dualpath.local.cli",
        "start a local cluster (scheduler, workers, frontend) as processes",
    ),
    "faults": (
        "dualpath.local.faults",
        "inject faults into a local cluster and tabulate what its clients saw",
    ),
    "sim": ("dualpath.sim.cli", "cluster-scale discrete-event simulation of the policies"),
    "render": ("dualpath_operator.render_cli", "print the manifests a DualPathCluster turns into"),
    "operator": ("dualpath_operator.main", "run the kopf operator"),
    "scheduler": ("dualpath.scheduler.cli", "run the gRPC scheduler service"),
    "worker": ("dualpath.worker.cli", "run a prefill or decode worker"),
    "frontend": ("dualpath.frontend.cli", "run the OpenAI-style HTTP frontend"),
}
BENCHES: dict[str, tuple[str, str]] = {
    "store": ("dualpath.kv.bench", "KV block store read throughput vs raw reads, SNIC cap"),
    "engine": ("dualpath.engine.bench", "prefill/decode tokens/s and layer-wise load overlap"),
    "transfer": ("dualpath.transfer.bench", "D->P layer stream vs raw NIXL WRITE throughput"),
    "scheduler": ("dualpath.scheduler.bench", "policy decision latency in process and over gRPC"),
    "local": ("dualpath.local.bench", "replay an agentic trace on a local cluster per policy"),
}


def _add(sub: argparse._SubParsersAction, name: str, module: str, help_: str, load: bool) -> None:
    parser = sub.add_parser(name, help=help_, description=help_)
    parser.set_defaults(_module=module)
    if load:
        importlib.import_module(module).add_arguments(parser)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dualpath", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"dualpath {__version__}")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    positionals = [a for a in argv if not a.startswith("-")]
    chosen = positionals[0] if positionals else None
    for name, (module, help_) in COMMANDS.items():
        _add(sub, name, module, help_, load=(name == chosen))
    bench = sub.add_parser("bench", help="benchmarks printing JSON ratios measured in one run")
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCH")
    which = positionals[1] if chosen == "bench" and len(positionals) > 1 else None
    for name, (module, help_) in BENCHES.items():
        _add(bench_sub, name, module, help_, load=(name == which))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not getattr(args, "_module", None):
        parser.print_help()
        return 2
    setup_logging(args.log_level)
    module = importlib.import_module(args._module)
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
