"""``autockpt fit SPEC --budget-gb N``: the largest (or fastest) batch that fits a budget.

Sizes are chosen from predictions alone: the factory is called with a batch size and one
model serves every size. Its options and its handler live together; torch and the planner
load inside :func:`run`, never when the parser is built.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from autockpt.cli.exits import EXIT_OK
from autockpt.cli.loading import _call_factory, load_factory
from autockpt.cli.options import (
    _build_optimizer,
    _common,
    _iteration_options,
    _positive_float,
    _positive_int,
)
from autockpt.cli.output import _default_loss_note, _write
from autockpt.cli.progress import Progress


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``fit`` and its options to the command line."""
    fit = sub.add_parser(
        "fit",
        help="the largest (or fastest) batch that fits a budget, from predictions alone",
    )
    fit.add_argument(
        "spec",
        help="package.module:factory; factory(n) returns (model, example_inputs[, loss_fn]) "
        "of size n",
    )
    fit.add_argument(
        "--budget-gb",
        type=_positive_float,
        required=True,
        help="peak memory budget of one training iteration, GiB (2**30 bytes)",
    )
    _iteration_options(fit)
    fit.add_argument("--objective", choices=("largest", "throughput"), default="largest")
    fit.add_argument("--multiple-of", type=_positive_int, default=1)
    fit.add_argument("--max-batch-size", type=_positive_int, default=None)
    fit.add_argument("-o", "--output", default="fit.png", help="plot file (default fit.png)")
    fit.add_argument("--no-plot", action="store_true", help="do not draw the plot")
    _common(fit)
    fit.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Search the batch sizes, then draw, write and print what the options ask for."""
    import autockpt
    from autockpt.report import fit_figure, print_fit, require_matplotlib, save_figure

    if not args.no_plot:  # fail before the expensive part when matplotlib is missing
        require_matplotlib()
    factory = load_factory(args.spec)
    # one model for every size (the first call's); each size's inputs from factory(n)
    model, first_inputs, loss_fn = _call_factory(
        args.spec, factory, args.multiple_of, loss=args.loss
    )

    _default_loss_note(args, loss_fn)

    def make_inputs(n: int) -> Any:
        if n == args.multiple_of:
            return first_inputs
        return _call_factory(args.spec, factory, n)[1]

    with Progress.for_args(args) as progress:
        result = autockpt.fit_batch(
            model,
            make_inputs,
            budget_gb=args.budget_gb,
            optimizer=_build_optimizer(args.optimizer, model),
            accumulation_steps=args.accumulation_steps,
            loss_fn=loss_fn,
            objective=args.objective,
            multiple_of=args.multiple_of,
            max_batch_size=args.max_batch_size,
            progress=progress.stage,
        )
    if not args.no_plot:
        figure = fit_figure(result)
        _write(args.output, lambda path: save_figure(figure, path), "plot")
    if args.json:
        print(json.dumps(result.to_dict()))
    elif not args.quiet:
        print_fit(result)
        if not args.no_plot:
            print(f"wrote {args.output}")
    return EXIT_OK
