"""The `dualpath` CLI: argparse finds the command (so a flag's value is never taken for one),
and every command's loader yields a module with `add_arguments` and `run`."""

from __future__ import annotations

import logging

import pytest
from dualpath import cli


@pytest.mark.parametrize(
    "argv",
    [
        ["--log-level", "DEBUG", "sim", "--preset", "tiny"],
        ["--log-level=DEBUG", "sim", "--preset", "tiny"],
        ["sim", "--preset", "tiny"],
    ],
)
def test_the_log_level_flag_takes_its_value_in_either_spelling(argv):
    ns = cli.build_parser(argv).parse_args(argv)
    assert ns.command == "sim" and ns.preset == "tiny"
    assert ns.log_level == ("DEBUG" if "DEBUG" in " ".join(argv) else "INFO")


def test_a_nested_bench_command_loads_its_own_arguments():
    argv = ["--log-level", "WARNING", "bench", "scheduler", "--nodes", "4"]
    ns = cli.build_parser(argv).parse_args(argv)
    assert (ns.command, ns.bench, ns.nodes, ns.log_level) == ("bench", "scheduler", 4, "WARNING")
    assert ns._command is cli.BENCHES["scheduler"]


def test_an_unknown_flag_of_the_chosen_command_is_still_refused(capsys):
    argv = ["--log-level", "DEBUG", "sim", "--no-such-flag"]
    with pytest.raises(SystemExit):
        cli.build_parser(argv).parse_args(argv)
    assert "--no-such-flag" in capsys.readouterr().err


def test_main_sets_the_log_level_before_running(monkeypatch):
    seen = {}

    class Fake:
        @staticmethod
        def add_arguments(parser):
            parser.add_argument("--x", type=int, default=0)

        @staticmethod
        def run(args):
            seen["level"] = logging.getLogger().level
            return args.x

    monkeypatch.setitem(cli.COMMANDS, "sim", cli.Command("fake", lambda: Fake))
    assert cli.main(["--log-level", "DEBUG", "sim", "--x", "3"]) == 3
    assert seen["level"] == logging.DEBUG
    assert cli.main([]) == 2  # no command: help, and a usage error code


@pytest.mark.parametrize(
    "name", sorted(set(cli.COMMANDS) - {"operator"}) + [f"bench {b}" for b in cli.BENCHES]
)
def test_every_command_loads_a_module_with_arguments_and_run(name):
    words = name.split()
    cmd = cli.BENCHES[words[1]] if words[0] == "bench" else cli.COMMANDS[words[0]]
    module = cmd.load()
    assert callable(module.add_arguments) and callable(module.run)


def test_the_operator_command_loads_when_kopf_is_installed():
    pytest.importorskip("kopf")
    module = cli.COMMANDS["operator"].load()
    assert callable(module.add_arguments) and callable(module.run)
