"""The ``autockpt`` command line: demo, plan, show, verify, frontier, fit and bench.

A model is named ``package.module:factory`` (importable from the current directory); the
factory returns ``(model, example_inputs)``. Built-in factories live in ``autockpt.zoo``
(e.g. ``autockpt.zoo:gpt``). User errors print one line and exit with a distinct code:

====  =====================================================
code  meaning
====  =====================================================
0     success
1     ``verify`` found a check that does not hold
2     bad command-line usage
3     budget below the minimum feasible (the line says it)
4     plan file corrupt, or made for another model/version
5     the model SPEC cannot be imported or called
6     the model cannot be captured as a graph
7     an output file cannot be written
8     an optional dependency (matplotlib, for plots) is missing
130   interrupted (Ctrl-C)
====  =====================================================

Every command takes ``--json`` (one JSON object on stdout, for scripts) and ``--quiet``.
Work that runs longer than :data:`PROGRESS_DELAY_S` shows a progress line on stderr when
stderr is a terminal and neither flag is given.

This package holds :func:`main` and the top-level parser; each command is a module of its
own (its options and its handler), and what several share lives in ``exits`` (codes and
errors), ``options``, ``loading``, ``output`` and ``progress``. Nothing here imports torch:
``autockpt --help`` answers without it, and :func:`main` sets torch's environment first.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from autockpt.cli import bench, demo, fit, frontier, plan, show, verify
from autockpt.cli.bench import BENCHMARKS
from autockpt.cli.exits import (
    EXIT_BUDGET,
    EXIT_DEPENDENCY,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_OUTPUT,
    EXIT_PLAN,
    EXIT_SPEC,
    EXIT_TRACE,
    EXIT_USAGE,
    EXIT_VERIFY,
    OutputError,
    SpecError,
    run_command,
)
from autockpt.cli.loading import load_factory, load_spec
from autockpt.cli.options import OPTIMIZERS, SOLVERS
from autockpt.cli.progress import PROGRESS_DELAY_S, Progress

__all__ = [
    "BENCHMARKS",
    "EXIT_BUDGET",
    "EXIT_DEPENDENCY",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_OUTPUT",
    "EXIT_PLAN",
    "EXIT_SPEC",
    "EXIT_TRACE",
    "EXIT_USAGE",
    "EXIT_VERIFY",
    "OPTIMIZERS",
    "PROGRESS_DELAY_S",
    "SOLVERS",
    "OutputError",
    "Progress",
    "SpecError",
    "load_factory",
    "load_spec",
    "main",
]

COMMANDS = (demo, plan, show, verify, frontier, fit, bench)  # in the order --help lists them


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line on ``argv`` (default: ``sys.argv[1:]``); return the exit code."""
    # Before torch loads: quiet profiler logging, and OpenMP workers that sleep rather than
    # spin (spinning threads starve each other on small shared machines).
    os.environ.setdefault("KINETO_LOG_LEVEL", "5")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    parser = _parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "run"):
        parser.print_help()
        return EXIT_USAGE
    return run_command(args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autockpt",
        description="Place activation checkpoints so that training fits a memory budget.",
        epilog="SPEC is package.module:factory, importable from the current directory; the "
        "factory returns (model, example_inputs) or (model, example_inputs, loss_fn). Exit codes: 0 ok, 1 a check failed, "
        "2 usage, 3 budget too small, 4 bad plan file, 5 bad SPEC, 6 model not "
        "capturable, 7 output not writable, 8 matplotlib missing.",
    )
    sub = parser.add_subparsers(metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    return parser
