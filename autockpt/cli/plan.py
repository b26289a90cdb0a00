"""``autockpt plan SPEC --budget-gb N``: profile the model, solve for the budget, save the plan.

Its options and its handler live together so that the command reads in one file; torch and
the planner load inside :func:`run`, never when the parser is built.
"""

from __future__ import annotations

import argparse

from autockpt.cli.exits import EXIT_OK
from autockpt.cli.loading import load_spec
from autockpt.cli.options import (
    SOLVERS,
    SPEC_HELP,
    _build_optimizer,
    _common,
    _iteration_options,
    _positive_float,
    _target_options,
    planned_model,
    reshard_after_forward,
)
from autockpt.cli.output import _default_loss_note, _say, _write
from autockpt.cli.progress import Progress


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``plan`` and its options to the command line."""
    plan = sub.add_parser("plan", help="make a plan for SPEC under a budget")
    plan.add_argument("spec", help=SPEC_HELP)
    plan.add_argument(
        "--budget-gb",
        type=_positive_float,
        default=None,
        help="peak memory budget of one training step, GiB (2**30 bytes), per rank when "
        "sharded; needed unless --target gives the default",
    )
    plan.add_argument("--solver", choices=SOLVERS, default="auto")
    plan.add_argument("--scope", choices=("total", "activations"), default="total")
    plan.add_argument(
        "--no-selective",
        action="store_true",
        help="segments recompute everything inside them (no kept operator outputs)",
    )
    plan.add_argument(
        "--time-limit", type=_positive_float, default=30.0, help="solver time limit, seconds"
    )
    plan.add_argument("-o", "--output", default="plan.json")
    plan.add_argument(
        "--world-size",
        type=int,
        default=1,
        help="ranks; the budget and the example inputs are per rank",
    )
    plan.add_argument(
        "--sharding",
        choices=("ddp", "fsdp"),
        default=None,
        help="distributed engine whose per-rank memory the plan counts",
    )
    plan.add_argument(
        "--reshard-after-forward",
        choices=("true", "false"),
        default=None,
        help="FSDP2's reshard_after_forward for every unit (with --sharding fsdp; the root "
        "keeps FSDP2's default, False); default: FSDP2's defaults",
    )
    plan.add_argument(
        "--fsdp-units",
        default=None,
        help="comma-separated modules to fully_shard (default: repeated blocks)",
    )
    _iteration_options(plan)
    _target_options(plan)
    plan.add_argument(
        "--meta",
        action="store_true",
        help="build the model on the meta device: plan without allocating "
        "(FLOP-estimated times, no measurement)",
    )
    _common(plan, "print the plan JSON on stdout")
    plan.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Make the plan, write it to ``--output`` and print its summary (or its JSON)."""
    from autockpt.api import Planner
    from autockpt.planning.request import budget_or_default

    budget_gb = budget_or_default(args.budget_gb, args.target)  # refused before any work
    if args.meta or args.target:
        import torch

        with torch.device("meta"):  # parameters and inputs get shapes, never memory
            model, inputs, loss_fn = load_spec(args.spec, args.loss)
    else:
        model, inputs, loss_fn = load_spec(args.spec, args.loss)
    _default_loss_note(args, loss_fn)
    model = planned_model(model, args.precision)
    units = None if args.fsdp_units is None else [u for u in args.fsdp_units.split(",") if u]
    with Progress.for_args(args) as progress:
        planner = Planner(
            model,
            inputs,
            scope=args.scope,
            loss_fn=loss_fn,
            progress=progress.stage,
            world_size=args.world_size,
            sharding=args.sharding,
            fsdp_units=units,
            reshard_after_forward=reshard_after_forward(args),
            optimizer=_build_optimizer(args.optimizer, model),
            accumulation_steps=args.accumulation_steps,
            budget_gb=budget_gb,
            target=args.target,
            precision=args.precision,
        )
        fast = planner.optimize(
            budget_gb=budget_gb,
            solver=args.solver,
            time_limit_s=args.time_limit,
            selective=not args.no_selective,
        )
    _write(args.output, fast.plan.save, "plan")
    if args.json:
        print(fast.plan.to_json(indent=None))
    else:
        say = _say(args)
        say(fast.plan.summary())
        say(f"wrote {args.output}")
    return EXIT_OK
