"""``autockpt fit SPEC --budget-gb N``: the largest (or fastest) batch that fits a budget.

Sizes are chosen from predictions alone: the factory is called with a batch size, one model
serves every size, and each size is planned with the inputs and the loss (its third item,
when it returns one) of its own call. Its options and its handler live together; torch and the planner
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
    _target_options,
    planned_model,
    reshard_after_forward,
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
        "of size n (each size planned with its own call's inputs and loss)",
    )
    fit.add_argument(
        "--budget-gb",
        type=_positive_float,
        default=None,
        help="peak memory budget of one training iteration, GiB (2**30 bytes), per rank when "
        "sharded; needed unless --target gives the default",
    )
    _iteration_options(fit)
    _target_options(fit)
    fit.add_argument(
        "--world-size", type=_positive_int, default=1, help="ranks; sizes are per rank"
    )
    fit.add_argument(
        "--sharding",
        choices=("ddp", "fsdp"),
        default=None,
        help="distributed engine whose per-rank memory the sizes are judged by",
    )
    fit.add_argument(
        "--reshard-after-forward",
        choices=("true", "false"),
        default=None,
        help="FSDP2's reshard_after_forward for every unit (with --sharding fsdp; the root "
        "keeps FSDP2's default, False); default: FSDP2's defaults",
    )
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
    from autockpt.planning.request import budget_or_default

    budget_gb = budget_or_default(args.budget_gb, args.target)  # refused before any work
    loaded = load_factory(args.spec)
    if args.target:  # every size's model and inputs get shapes, never memory

        def factory(n: int) -> Any:
            import torch

            with torch.device("meta"):
                return loaded(n)
    else:
        factory = loaded
    # one model for every size (the first call's); each size's inputs, and its loss when the
    # factory returns one, from the same call factory(n): a loss that holds targets has the
    # size in it (--loss: one loss for every size)
    called = {args.multiple_of: _call_factory(args.spec, factory, args.multiple_of, loss=args.loss)}
    model, _, loss_fn = called[args.multiple_of]
    model = planned_model(model, args.precision)

    _default_loss_note(args, loss_fn)

    def size(n: int) -> tuple[Any, Any, Any]:
        if n not in called:
            called.clear()  # keep one size's tensors, not every size's
            called[n] = _call_factory(args.spec, factory, n, loss=args.loss)
        return called[n]

    per_size = loss_fn is not None and args.loss is None
    with Progress.for_args(args) as progress:
        result = autockpt.fit_batch(
            model,
            lambda n: size(n)[1],
            budget_gb=budget_gb,
            target=args.target,
            precision=args.precision,
            world_size=args.world_size,
            sharding=args.sharding,
            reshard_after_forward=reshard_after_forward(args),
            optimizer=_build_optimizer(args.optimizer, model),
            accumulation_steps=args.accumulation_steps,
            loss_fn=None if per_size else loss_fn,
            make_loss=(lambda n: size(n)[2]) if per_size else None,
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
