"""``autockpt bench NAME``: run one of the repository's benchmarks (``benchmarks/``).

:data:`BENCHMARKS` names each one; its module's ``run(quick, out)`` does the work. The
benchmarks live in a source checkout next to the package, not in the installed package, so
the handler looks for them there.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys

from autockpt.cli.exits import EXIT_OK, SpecError
from autockpt.cli.options import _common
from autockpt.cli.output import _say

# ``autockpt bench NAME`` runs ``run(quick, out)`` of the module named here (in the
# repository's benchmarks/ folder): a new benchmark is one more entry.
BENCHMARKS = {
    "solvers": ("benchmarks.solvers_bench", "solve time and quality on synthetic and zoo chains"),
    "budgets": ("benchmarks.budgets", "measured peak and step time across budgets on the zoo"),
    "e2e": (
        "benchmarks.e2e",
        "autockpt against per-block checkpointing, checkpoint_sequential, "
        "torch.compile memory budgets and other planners",
    ),
    "planning": (
        "benchmarks.planning",
        "planning's own resident memory and time against the "
        "budget, the plan's peak and one eager step",
    ),
    "fit": (
        "benchmarks.fit",
        "the largest batch under a budget: autockpt's fit_batch against measuring by hand",
    ),
    "large": (
        "benchmarks.plan_large",
        "planning time and memory of Llama 3 1B/8B/70B built on meta, for an H100 (before launch)",
    ),
    "survey": (
        "benchmarks.survey",
        "every Hugging Face architecture built from a config: "
        "capture path, train = eager, measured peak within budget, prediction error",
    ),
}


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``bench`` and its options to the command line."""
    bench = sub.add_parser("bench", help="run a benchmark: " + " | ".join(BENCHMARKS))
    bench.add_argument(
        "which",
        choices=tuple(BENCHMARKS),
        help="; ".join(f"{name}: {text}" for name, (_, text) in BENCHMARKS.items()),
    )
    bench.add_argument("--quick", action="store_true", help="a short run")
    bench.add_argument("--out", default=None, help="output folder (default out/<which>)")
    _common(bench, 'print {"out": folder} on stdout')
    bench.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run ``args.which``. Benchmarks live in the repository's ``benchmarks/`` folder (next
    to the package in a source checkout), not in the installed package."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]  # autockpt/cli/bench.py -> the checkout
    if not (root / "benchmarks" / "__init__.py").exists():
        raise SpecError(
            "benchmarks/ not found next to the autockpt package: run `autockpt bench` from a "
            "source checkout installed with `pip install -e .`"
        )
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    module = importlib.import_module(BENCHMARKS[args.which][0])
    out = Path(args.out or f"out/{args.which}")
    # A benchmark reports as it goes on stdout; --json keeps stdout for the one JSON object
    # (the running report moves to stderr) and --quiet drops it.
    if args.quiet:
        with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
            module.run(args.quick, out)
    elif args.json:
        with contextlib.redirect_stdout(sys.stderr):
            module.run(args.quick, out)
    else:
        module.run(args.quick, out)
    if args.json:
        print(json.dumps({"benchmark": args.which, "out": str(out)}))
    else:
        _say(args)(f"wrote {out}/")
    return EXIT_OK
