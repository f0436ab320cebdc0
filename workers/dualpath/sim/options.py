"""Command-line options both simulator commands share (`dualpath sim`, `dualpath plan`): below
both, so neither command imports the other."""

from __future__ import annotations

import argparse

from dualpath.config import ModelSpec
from dualpath.sim.engine import CONTEXT_RULE_EFFECT, CONTEXT_RULES
from dualpath.sim.model import context_limit


def add_context_arguments(parser: argparse.ArgumentParser) -> None:
    """`--max-context` and `--context-rule`: what a turn over the model's context does (`dualpath
    sim` and `dualpath sim plan`); `context_limit_of` reads them."""
    parser.add_argument(
        "--max-context",
        type=int,
        help="context limit in tokens (default: the model's, e.g. 131072; 0 = none)",
    )
    parser.add_argument(
        "--context-rule",
        choices=CONTEXT_RULES,
        default="truncate",
        help="a turn whose prompt + output exceeds --max-context: "
        + "; ".join(f"{rule}: {effect}" for rule, effect in CONTEXT_RULE_EFFECT.items())
        + " (default truncate; `dualpath plan` says how many turns were over the limit)",
    )


def context_limit_of(args: argparse.Namespace, model: ModelSpec) -> int:
    """`--max-context`, or the model's own context limit when it is not given."""
    return context_limit(model.preset) if args.max_context is None else args.max_context
