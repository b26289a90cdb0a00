"""``autockpt frontier SPEC``: recompute overhead against peak memory across budgets.

One profile, a plan per budget, a table (and plot, and JSON) of the trade-off. Its options,
its handler and its table live together; torch, the planner and rich load inside
:func:`run`, never when the parser is built.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from autockpt.cli.exits import EXIT_OK
from autockpt.cli.loading import load_spec
from autockpt.cli.options import (
    SOLVERS,
    SPEC_HELP,
    _at_least_two,
    _build_optimizer,
    _iteration_options,
)
from autockpt.cli.output import _default_loss_note, _write, _write_text
from autockpt.cli.progress import Progress


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``frontier`` and its options to the command line (its ``--json`` takes a file)."""
    frontier = sub.add_parser(
        "frontier", help="recompute overhead vs peak memory across budgets (one profile)"
    )
    frontier.add_argument("spec", help=SPEC_HELP)
    frontier.add_argument(
        "-o", "--output", default="frontier.png", help="plot file (default frontier.png)"
    )
    frontier.add_argument("--no-plot", action="store_true", help="do not draw the plot")
    frontier.add_argument(
        "--json",
        nargs="?",
        const="-",
        default=None,
        metavar="OUT.json",
        help="write the frontier as JSON to OUT.json (stdout when no file is named)",
    )
    frontier.add_argument(
        "--quiet", action="store_true", help="print nothing but errors; no progress"
    )
    frontier.add_argument(
        "--budgets",
        type=_at_least_two,
        default=12,
        help="budgets to solve, evenly spaced from the leanest plan to none (default 12)",
    )
    frontier.add_argument("--solver", choices=SOLVERS, default="auto")
    frontier.add_argument("--scope", choices=("total", "activations"), default="total")
    frontier.add_argument(
        "--measure",
        action="store_true",
        help="also rewrite and measure every point (one real step each; slower)",
    )
    _iteration_options(frontier)
    frontier.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Solve every budget, then draw, write and print what the options ask for."""
    from autockpt.api import Planner
    from autockpt.report import frontier, frontier_figure, require_matplotlib, save_figure

    if not args.no_plot:  # fail before the expensive part when matplotlib is missing
        require_matplotlib()
    model, inputs, loss_fn = load_spec(args.spec, args.loss)
    to_stdout = args.json == "-"
    if not to_stdout:
        _default_loss_note(args, loss_fn)
    progress_wanted = not args.quiet and not to_stdout and sys.stderr.isatty()
    with Progress(progress_wanted) as progress:
        planner = Planner(
            model,
            inputs,
            scope=args.scope,
            loss_fn=loss_fn,
            progress=progress.stage,
            optimizer=_build_optimizer(args.optimizer, model),
            accumulation_steps=args.accumulation_steps,
        )

        def on_step(what: str, done: int, total: int) -> None:
            if done == 0:
                progress.stage(what, total)
            progress.advance(done)

        result = frontier(
            planner, budgets=args.budgets, solver=args.solver, measure=args.measure, on_step=on_step
        )
    if not args.no_plot:
        figure = frontier_figure(result)
        _write(args.output, lambda path: save_figure(figure, path), "plot")
    data = json.dumps(result.to_dict(), indent=None if to_stdout else 2)
    if to_stdout:
        print(data)
    elif args.json:
        _write(args.json, lambda path: _write_text(path, data + "\n"), "frontier JSON")
    if not to_stdout and not args.quiet:
        _print_frontier(result)
        for path in filter(None, [None if args.no_plot else args.output, args.json]):
            print(f"wrote {path}")
    return EXIT_OK


def _print_frontier(result: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    from autockpt.errors import format_bytes

    measured = any(p.measured_peak_bytes is not None for p in (*result.points, result.sqrt_point))
    table = Table(
        title=f"{result.model}: recompute vs peak (predicted; step "
        f"{result.step_seconds * 1e3:.1f} ms without checkpointing)",
        title_justify="left",
    )
    for name in ("plan", "budget", "peak", "recompute", "overhead", "segments"):
        table.add_column(name, justify="left" if name == "plan" else "right")
    if measured:
        table.add_column("measured peak", justify="right")
        table.add_column("measured overhead", justify="right")
    rows = [*result.points, result.sqrt_point, *([result.per_block] if result.per_block else [])]
    for point in rows:
        cells = [
            point.label if point.label != "per block" else f"per block ({result.block_container})",
            "-" if point.budget_bytes is None else format_bytes(point.budget_bytes),
            format_bytes(point.predicted_peak_bytes),
            f"{point.predicted_recompute_seconds * 1e3:.2f} ms",
            f"{100 * point.overhead:.1f}%",
            str(len(point.segments)),
        ]
        if measured:
            cells.append(
                "-"
                if point.measured_peak_bytes is None
                else format_bytes(point.measured_peak_bytes)
            )
            cells.append(
                "-" if point.measured_overhead is None else f"{100 * point.measured_overhead:.1f}%"
            )
        table.add_row(*cells)
    console = Console(width=None if sys.stdout.isatty() else 120)
    console.print(table)
    if result.per_block_note:
        console.print(f"note: no per-block row: {result.per_block_note}")
    written = result.as_written_peak_bytes
    if written is not None and written != result.no_checkpoint_peak_bytes:
        console.print(
            f"note: without checkpointing the model as written peaks at {format_bytes(written)} "
            f"(predicted); the captured graph every plan runs, at "
            f"{format_bytes(result.no_checkpoint_peak_bytes)}"
        )
