"""``autockpt demo``: plan and measure the seed workload, a deep stack of MLP blocks.

It runs in phases, one helper each: profile and print the memory breakdown, plan and
measure the plan against no checkpointing, find the largest batch (autockpt's prediction
against trying sizes by hand), then print it all. Its options live here too; torch loads
inside :func:`run`, never when the parser is built.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
from collections.abc import Callable
from typing import Any

from autockpt.cli.exits import EXIT_OK, EXIT_VERIFY
from autockpt.cli.options import OPTIMIZERS, SOLVERS, _build_optimizer, _common, _positive_float
from autockpt.cli.output import _say
from autockpt.cli.progress import Progress

TIMING_ROUNDS = 7
"""Interleaved rounds the demo times (each round's ratio is shown, not one step's)."""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``demo`` and its options to the command line."""
    demo = sub.add_parser("demo", help="plan and measure the seed workload (a deep block stack)")
    demo.add_argument("--blocks", type=int, default=32)
    demo.add_argument("--width", type=int, default=128)
    demo.add_argument("--batch", type=int, default=512)
    demo.add_argument(
        "--budget-gb",
        type=_positive_float,
        default=None,
        help="budget in GiB (default: halfway between the leanest plan and none)",
    )
    demo.add_argument("--solver", choices=SOLVERS, default="auto")
    demo.add_argument(
        "--optimizer",
        choices=(*OPTIMIZERS, "none"),
        default="adamw",
        help="the optimizer the loop steps (default adamw; none: forward and backward only)",
    )
    demo.add_argument("--no-fit", action="store_true", help="skip the largest-batch comparison")
    demo.add_argument(
        "--meta",
        action="store_true",
        help="plan on the meta device (sizes too big for this machine): nothing is run",
    )
    _common(demo)
    demo.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run the demo's phases; exit code 1 when the measured peak exceeds the budget."""
    import torch

    from autockpt.demo import block_stack

    device = "meta" if args.meta else "cpu"
    model, x = block_stack(blocks=args.blocks, width=args.width, batch=args.batch, device=device)
    optimizer = _build_optimizer(args.optimizer, model)

    def rows(n: int) -> torch.Tensor:  # the workload's input at another batch size
        torch.manual_seed(n)
        return torch.randn(n, args.width, requires_grad=True, device=device)

    say = _say(args)
    loop = f"; the loop steps {type(optimizer).__name__}" if optimizer is not None else ""
    say(
        f"seed workload: {args.blocks} blocks of Linear({args.width}->{2 * args.width})->ReLU->"
        f"Linear({2 * args.width}->{args.width}), batch {args.batch}{loop}"
    )
    # Two progress phases, so that the breakdown prints between them (never under a live bar).
    planner, budget_gb = _profile(args, say, model, x, optimizer)
    report: dict[str, Any] = {}
    measured = fit = None
    with Progress.for_args(args) as progress:
        planner.progress = progress.stage
        fast = planner.optimize(budget_gb=budget_gb, solver=args.solver)
        plan = fast.plan
        if not args.meta:
            measured = _measure(progress, model, fast, x, optimizer)
        if not args.no_fit:
            fit, report["largest_batch"] = _largest_batches(
                args, progress, model, rows, budget_gb, optimizer, plan.budget_bytes
            )
    say("")
    say(plan.summary())
    fits = True
    if measured is not None:
        fits, times = _print_measured(say, plan, *measured)
        report |= times
    if "largest_batch" in report:
        _print_largest(args, say, plan, fit, report["largest_batch"])
    if args.json:
        print(json.dumps({"plan": json.loads(plan.to_json()), **report, "fits": fits}))
    return EXIT_OK if fits else EXIT_VERIFY


def _profile(
    args: argparse.Namespace, say: Callable[..., None], model: Any, x: Any, optimizer: Any
) -> tuple[Any, float]:
    """Profile the workload (its own progress phase) and print the memory breakdown; return
    the planner and the budget in GiB (``--budget-gb``, else halfway from the leanest plan
    to the model as written)."""
    from autockpt.api import Planner
    from autockpt.errors import GIB, format_bytes

    with Progress.for_args(args) as progress:
        planner = Planner(model, x, progress=progress.stage, optimizer=optimizer)
    prof = planner.profile
    what = "one training iteration" if optimizer is not None else "one forward and backward"
    say(f"memory breakdown of {what}:")
    for name, value in planner.breakdown.items():
        say(f"  {name:<36} {format_bytes(value):>12}")
    # "without checkpointing" is the model as written; the captured graph may keep less
    baseline = max(planner.as_written_peak_bytes, planner.minimum_peak_bytes)
    say(f"  {'predicted peak without checkpointing':<36} {format_bytes(baseline):>12}")
    if planner.no_checkpoint_peak_bytes != baseline:
        say(
            f"  {'the captured graph, no checkpoint':<36} "
            f"{format_bytes(planner.no_checkpoint_peak_bytes):>12}"
        )
    budget_gb = args.budget_gb
    if budget_gb is None:
        budget_gb = (planner.minimum_peak_bytes + baseline) / 2 / GIB
    static = baseline - prof.saved_bytes()
    activations = prof.saved_bytes()
    if activations < 0.05 * static:
        say(
            f"note: saved activations are {format_bytes(activations)} of a "
            f"{format_bytes(baseline)} peak: checkpointing can save at "
            f"most {100 * activations / max(1, baseline):.1f}% of it here."
        )
    return planner, budget_gb


def _measure(
    progress: Progress, model: Any, fast: Any, x: Any, optimizer: Any
) -> tuple[Any, Any, dict[str, float]]:
    """The measured peak of the model as written and of the plan, and their step times."""
    from autockpt.measure import interleaved_rounds, measure, process_seconds

    progress.stage("measuring")
    eager = measure(model, x, optimizer=optimizer, repeat=0)
    checked = measure(fast, x, optimizer=optimizer, repeat=0)
    # one step timed alone is no result: interleaved rounds, CPU time, each round's ratio
    none, plan = interleaved_rounds(
        [
            functools.partial(_iteration, model, x, optimizer),
            functools.partial(_iteration, fast, x, optimizer),
        ],
        TIMING_ROUNDS,
        process_seconds,
    )
    return eager, checked, {"none": none, "plan": plan}


def _largest_batches(
    args: argparse.Namespace,
    progress: Progress,
    model: Any,
    rows: Callable[[int], Any],
    budget_gb: float,
    optimizer: Any,
    budget_bytes: int,
) -> tuple[Any, dict[str, int]]:
    """autockpt's largest batch under the budget (predicted), and unless ``--meta`` the
    largest found by running sizes with every block checkpointed and with none."""
    import autockpt
    from autockpt.demo import checkpoint_every_block, largest_by_measuring
    from autockpt.measure import measure

    progress.stage("the largest batch that fits")
    fit = autockpt.fit_batch(
        model, rows, budget_gb=budget_gb, optimizer=optimizer, progress=progress.stage
    )
    largest = {"autockpt": fit.batch_size}
    if not args.meta:
        hand = checkpoint_every_block(model)
        hand_optimizer = _build_optimizer(args.optimizer, hand)
        for name, module, opt in (
            ("per_block", hand, hand_optimizer),
            ("none", model, optimizer),
        ):
            progress.stage(f"trying batch sizes by hand ({name})")
            size, runs = largest_by_measuring(
                lambda n, m=module, o=opt: measure(m, rows(n), optimizer=o, repeat=0).peak_bytes,
                budget_bytes,
                start=args.batch,
            )
            largest[name] = size
            largest[f"{name}_steps_run"] = runs
    return fit, largest


def _print_measured(
    say: Callable[..., None], plan: Any, eager: Any, checked: Any, seconds: dict[str, float]
) -> tuple[bool, dict[str, Any]]:
    """Print peak and step time without checkpointing and with the plan; return whether the
    plan's measured peak fits the budget, and the numbers for ``--json``."""
    from autockpt.errors import format_bytes

    median = {key: statistics.median(values) for key, values in seconds.items()}
    # a ratio is shown with its spread: each round's plan step over the same round's
    ratios = sorted(p / n for p, n in zip(seconds["plan"], seconds["none"], strict=True))
    say("")
    say(f"{'':<16}{'peak':>12}{'step':>12}")
    for label, key, m in (("no checkpoint", "none", eager), ("autockpt plan", "plan", checked)):
        say(f"{label:<16}{format_bytes(m.peak_bytes):>12}{median[key] * 1e3:>10.1f}ms")
    say(f"{'budget':<16}{format_bytes(plan.budget_bytes):>12}")
    fits = checked.peak_bytes <= plan.budget_bytes
    say(
        f"measured peak {'fits' if fits else 'EXCEEDS'} the budget "
        f"({100 * checked.peak_bytes / plan.budget_bytes:.1f}% of it)"
    )
    say(
        f"step time with the plan / without: median {statistics.median(ratios):.2f}x, range "
        f"{ratios[0]:.2f}x-{ratios[-1]:.2f}x over {len(ratios)} interleaved rounds (CPU "
        f"time); the plan predicts {100 * plan.recompute_fraction:.1f}% of its step recomputed"
    )
    return fits, {
        "eager": {"peak_bytes": eager.peak_bytes, "step_seconds": median["none"]},
        "optimized": {"peak_bytes": checked.peak_bytes, "step_seconds": median["plan"]},
        "step_ratio": {
            "median": statistics.median(ratios),
            "low": ratios[0],
            "high": ratios[-1],
            "rounds": len(ratios),
        },
    }


def _print_largest(
    args: argparse.Namespace,
    say: Callable[..., None],
    plan: Any,
    fit: Any,
    largest: dict[str, int],
) -> None:
    """Print the largest batch each way found."""
    from autockpt.errors import format_bytes

    say("")
    say(f"the largest batch {format_bytes(plan.budget_bytes)} holds:")
    say(
        f"  autockpt fit_batch                 {largest['autockpt']:>6}  (predicted, no "
        f"step tried; verified: {format_bytes(fit.plan.measured_peak_bytes or 0)})"
        if not args.meta
        else f"  autockpt fit_batch                 {largest['autockpt']:>6}  (predicted)"
    )
    if "per_block" in largest:
        say(
            f"  every block checkpointed by hand   {largest['per_block']:>6}  (found by "
            f"running {largest['per_block_steps_run']} sizes)"
        )
        say(
            f"  no checkpointing                   {largest['none']:>6}  (found by "
            f"running {largest['none_steps_run']} sizes)"
        )


def _iteration(model: Any, example: Any, optimizer: Any) -> None:
    """One training iteration as the loop runs it (the demo's timing)."""
    from autockpt.base.runtime import default_loss

    inputs = example if isinstance(example, tuple) else (example,)
    if optimizer is not None:
        optimizer.zero_grad()
    default_loss(model(*inputs)).backward()
    if optimizer is not None:
        optimizer.step()
    else:
        for p in model.parameters():
            p.grad = None
