"""``autockpt verify SPEC PLAN``: apply a saved plan and check it against eager execution.

The checks are one step's loss and gradients equal to eager's, and the measured peak within
the plan's budget; exit code 1 says one does not hold. Its options and its handler live
together; torch loads inside :func:`run`, never when the parser is built.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from autockpt.cli.exits import EXIT_OK, EXIT_VERIFY
from autockpt.cli.loading import _load_plan, load_spec
from autockpt.cli.options import SPEC_HELP, _build_optimizer, _common, _loss_option
from autockpt.cli.output import _say
from autockpt.cli.progress import Progress


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``verify`` and its options to the command line."""
    verify = sub.add_parser("verify", help="apply a plan to SPEC and check it against eager")
    verify.add_argument("spec", help=SPEC_HELP)
    verify.add_argument("plan")
    _loss_option(verify)
    _common(verify)
    verify.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Apply the plan, compare one step with eager, measure; report every check."""
    import autockpt
    from autockpt.base.inputs import Inputs
    from autockpt.base.runtime import default_loss

    plan = _load_plan(args.plan)
    model, example, loss_fn = load_spec(args.spec, args.loss)
    inputs = Inputs.of(example)
    loss_fn = loss_fn or default_loss
    with Progress.for_args(args) as progress:
        progress.stage("applying the plan")
        optimizer = _build_optimizer(plan.optimizer.name if plan.optimizer else None, model)
        fast = autockpt.apply(model, plan, example, optimizer=optimizer)
        progress.stage("comparing one step with eager")
        checks = _compare_with_eager(model, fast, inputs, loss_fn)
        progress.stage("measuring peak memory and step time")
        measured = autockpt.measure(
            fast,
            example,
            loss_fn=loss_fn,
            optimizer=optimizer,
            accumulation_steps=plan.accumulation_steps,
        )
    used = plan.budgeted_bytes(measured.peak_bytes)  # what the budget covers
    if plan.sharding is None:
        checks["peak within budget"] = used <= plan.budget_bytes
    elif not args.json and not args.quiet:
        # One unsharded process is not a rank: see docs/distributed.md for per-rank checks.
        print(
            f"note: the budget is per rank of {plan.world_size} under {plan.sharding}; this "
            "process runs unsharded, so its peak is not checked against it"
        )
    ok = all(checks.values())
    _report(args, plan, loss_fn, checks, used, measured.step_seconds, ok)
    return EXIT_OK if ok else EXIT_VERIFY


def _compare_with_eager(model: Any, fast: Any, inputs: Any, loss_fn: Any) -> dict[str, bool]:
    """One seeded step of the model as written, then of the planned one: loss and gradients
    equal (the planned model shares the parameters, so each step's gradients are kept)."""
    import torch

    from autockpt.base.runtime import preserved_training_state

    checks: dict[str, bool] = {}
    with preserved_training_state(model):
        torch.manual_seed(0)
        expected = loss_fn(model(*inputs.args, **inputs.kwargs))
        expected.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    with preserved_training_state(model):
        torch.manual_seed(0)
        got = loss_fn(fast(*inputs.args, **inputs.kwargs))
        got.backward()
        checks["loss equal"] = bool(torch.allclose(expected, got, rtol=1e-5, atol=1e-6))
        checks["gradients equal"] = all(
            p.grad is not None and torch.allclose(grads[n], p.grad, rtol=1e-4, atol=1e-6)
            for n, p in model.named_parameters()
            if n in grads
        )
    return checks


def _report(
    args: argparse.Namespace,
    plan: Any,
    loss_fn: Any,
    checks: dict[str, bool],
    used: int,
    step_seconds: float,
    ok: bool,
) -> None:
    """The verdict: one JSON object, or a line per check and the measured peak.

    The verdict is the peak measured with the loss given here; a plan made with another
    loss was predicted for another step, which the output says (never "ok" unmeasured).
    """
    from autockpt.base.runtime import loss_name

    if args.json:
        print(
            json.dumps(
                {
                    "ok": ok,
                    "checks": checks,
                    "peak_bytes": used,
                    "budget_bytes": plan.budget_bytes,
                    "scope": plan.scope,
                    "predicted_peak_bytes": plan.predicted_peak_bytes,
                    "step_seconds": step_seconds,
                    "loss": loss_name(loss_fn),
                    "plan_loss": plan.loss,
                }
            )
        )
        return
    say = _say(args)
    if plan.loss is not None and plan.loss != loss_name(loss_fn):
        say(
            f"note: the plan was made with loss {plan.loss}; checked with "
            f"{loss_name(loss_fn)}, whose step's peak is measured here (the plan's "
            "prediction is for the other loss)"
        )
    for name, value in checks.items():
        say(f"{'ok  ' if value else 'FAIL'} {name}")
    say(
        f"measured peak {used} bytes vs budget {plan.budget_bytes} (scope={plan.scope}); "
        f"step {step_seconds * 1e3:.1f} ms"
    )
