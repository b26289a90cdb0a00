"""The ``autockpt`` command line: ``demo``, ``plan``, ``show``, ``verify``, ``bench``.

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
====  =====================================================
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

EXIT_OK, EXIT_VERIFY, EXIT_USAGE, EXIT_BUDGET, EXIT_PLAN, EXIT_SPEC, EXIT_TRACE = range(7)


class SpecError(Exception):
    """The model SPEC could not be imported or called."""


def main(argv: Sequence[str] | None = None) -> int:
    # Before torch loads: quiet profiler logging, and OpenMP workers that sleep rather than
    # spin (spinning threads starve each other on small shared machines).
    os.environ.setdefault("KINETO_LOG_LEVEL", "5")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    parser = _parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "run"):
        parser.print_help()
        return EXIT_USAGE
    from autockpt.errors import (
        InfeasibleBudgetError,
        PlanFormatError,
        PlanMismatchError,
        TraceError,
    )

    try:
        return int(args.run(args) or 0)
    except InfeasibleBudgetError as error:
        return _fail(args, EXIT_BUDGET, error)
    except (PlanFormatError, PlanMismatchError) as error:
        return _fail(args, EXIT_PLAN, error)
    except SpecError as error:
        return _fail(args, EXIT_SPEC, error)
    except TraceError as error:
        return _fail(args, EXIT_TRACE, error)
    except FileNotFoundError as error:
        return _fail(args, EXIT_PLAN, error)


def _fail(args: argparse.Namespace, code: int, error: BaseException) -> int:
    if getattr(args, "json", False):
        print(json.dumps({"error": type(error).__name__, "message": str(error), "exit_code": code}))
    else:
        print(f"autockpt: error: {error}", file=sys.stderr)
    return code


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autockpt",
        description="Place activation checkpoints so that training fits a memory budget.",
    )
    sub = parser.add_subparsers(metavar="COMMAND")

    demo = sub.add_parser("demo", help="plan and measure the seed workload (a deep block stack)")
    demo.add_argument("--blocks", type=int, default=32)
    demo.add_argument("--width", type=int, default=128)
    demo.add_argument("--batch", type=int, default=512)
    demo.add_argument("--budget-gb", type=float, default=None,
                      help="budget in GiB (default: halfway between the leanest plan and none)")
    demo.add_argument("--solver", default="auto")
    demo.add_argument("--json", action="store_true", help="print one JSON object")
    demo.set_defaults(run=_demo)

    plan = sub.add_parser("plan", help="make a plan for SPEC under a budget")
    plan.add_argument("spec", help="package.module:factory returning (model, example_inputs)")
    plan.add_argument("--budget-gb", type=float, required=True)
    plan.add_argument("--solver", default="auto")
    plan.add_argument("--scope", choices=("total", "activations"), default="total")
    plan.add_argument("--time-limit", type=float, default=30.0)
    plan.add_argument("-o", "--output", default="plan.json")
    plan.add_argument("--json", action="store_true")
    plan.add_argument("--quiet", action="store_true")
    plan.set_defaults(run=_plan)

    show = sub.add_parser("show", help="print a saved plan")
    show.add_argument("plan")
    show.add_argument("--json", action="store_true")
    show.set_defaults(run=_show)

    bench = sub.add_parser("bench", help="run a benchmark: solvers | budgets | e2e")
    bench.add_argument("which", choices=("solvers", "budgets", "e2e"),
                       help="solvers: solve time and quality on synthetic and zoo chains; "
                            "budgets: measured peak and step time across budgets on the zoo; "
                            "e2e: autockpt against per-block checkpointing, checkpoint_sequential, "
                            "torch.compile memory budgets and other planners")
    bench.add_argument("--quick", action="store_true", help="a short run")
    bench.add_argument("--out", default=None, help="output folder (default out/<which>)")
    bench.set_defaults(run=_bench)

    verify = sub.add_parser("verify", help="apply a plan to SPEC and check it against eager")
    verify.add_argument("spec")
    verify.add_argument("plan")
    verify.add_argument("--json", action="store_true")
    verify.set_defaults(run=_verify)
    return parser


# ---------------------------------------------------------------------------------------------


def load_spec(spec: str) -> tuple[Any, Any]:
    """Import ``package.module:factory`` and call it; return ``(model, example_inputs)``."""
    if ":" not in spec:
        raise SpecError(f"model SPEC must look like package.module:factory, got {spec!r}")
    module_name, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # noqa: BLE001 - any import failure is the user's SPEC
        raise SpecError(f"cannot import {module_name!r}: {type(error).__name__}: {error}") from error
    factory: Callable[[], Any] | None = getattr(module, attr, None)
    if not callable(factory):
        raise SpecError(f"{module_name!r} has no callable {attr!r}")
    try:
        result = factory()
    except Exception as error:  # noqa: BLE001
        raise SpecError(f"{spec} raised {type(error).__name__}: {error}") from error
    if not (isinstance(result, tuple) and len(result) == 2):
        raise SpecError(f"{spec} must return (model, example_inputs), got {type(result).__name__}")
    return result


def _demo(args: argparse.Namespace) -> int:
    from autockpt.api import Planner
    from autockpt.errors import GIB, format_bytes
    from autockpt.measure import measure
    from autockpt.zoo import block_stack

    model, x = block_stack(blocks=args.blocks, width=args.width, batch=args.batch)
    say = (lambda *a: None) if args.json else print
    say(f"seed workload: {args.blocks} blocks of Linear({args.width}->{2 * args.width})->ReLU->"
        f"Linear({2 * args.width}->{args.width}), batch {args.batch}")
    planner = Planner(model, x)
    prof = planner.profile
    say("memory breakdown:")
    for name, value in planner.breakdown.items():
        say(f"  {name:<36} {format_bytes(value):>12}")
    say(f"  {'predicted peak without checkpointing':<36} {format_bytes(planner.no_checkpoint_peak_bytes):>12}")
    budget_gb = args.budget_gb
    if budget_gb is None:
        budget_gb = (planner.minimum_peak_bytes + planner.no_checkpoint_peak_bytes) / 2 / GIB
    static = prof.param_bytes + prof.param_grad_bytes
    activations = prof.saved_bytes()
    if activations < 0.05 * static:
        say(f"note: parameters + gradients are {format_bytes(static)} and saved activations only "
            f"{format_bytes(activations)}: checkpointing can save at most "
            f"{100 * activations / max(1, planner.no_checkpoint_peak_bytes):.1f}% of the peak here.")
    fast = planner.optimize(budget_gb=budget_gb, solver=args.solver)
    plan = fast.plan
    say("")
    say(plan.summary())
    eager = planner.eager or measure(model, x)
    checked = measure(fast, x)
    say("")
    say(f"{'':<16}{'peak':>12}{'step':>12}")
    say(f"{'no checkpoint':<16}{format_bytes(eager.peak_bytes):>12}{eager.step_seconds * 1e3:>10.1f}ms")
    say(f"{'autockpt plan':<16}{format_bytes(checked.peak_bytes):>12}{checked.step_seconds * 1e3:>10.1f}ms")
    say(f"{'budget':<16}{format_bytes(plan.budget_bytes):>12}")
    fits = checked.peak_bytes <= plan.budget_bytes
    say(f"measured peak {'fits' if fits else 'EXCEEDS'} the budget "
        f"({100 * checked.peak_bytes / plan.budget_bytes:.1f}% of it); step time "
        f"{checked.step_seconds / eager.step_seconds:.2f}x of no checkpointing")
    if args.json:
        print(json.dumps({
            "plan": json.loads(plan.to_json()),
            "eager": {"peak_bytes": eager.peak_bytes, "step_seconds": eager.step_seconds},
            "optimized": {"peak_bytes": checked.peak_bytes, "step_seconds": checked.step_seconds},
            "fits": fits,
        }))
    return EXIT_OK if fits else EXIT_VERIFY


def _plan(args: argparse.Namespace) -> int:
    import autockpt

    model, inputs = load_spec(args.spec)
    fast = autockpt.optimize(model, inputs, budget_gb=args.budget_gb, solver=args.solver,
                             scope=args.scope, time_limit_s=args.time_limit)
    fast.plan.save(args.output)
    if args.json:
        print(fast.plan.to_json(indent=None))
    elif not args.quiet:
        print(fast.plan.summary())
        print(f"wrote {args.output}")
    return EXIT_OK


def _show(args: argparse.Namespace) -> int:
    from autockpt.plan import Plan

    plan = Plan.load(args.plan)
    print(plan.to_json() if args.json else plan.summary())
    return EXIT_OK


def _bench(args: argparse.Namespace) -> int:
    """Benchmarks live in the repository's ``benchmarks/`` folder (next to the package in a
    source checkout), not in the installed package."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    if not (root / "benchmarks" / "__init__.py").exists():
        raise SpecError(
            "benchmarks/ not found next to the autockpt package: run `autockpt bench` from a "
            "source checkout installed with `pip install -e .`"
        )
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    modules = {"solvers": "benchmarks.solvers_bench", "budgets": "benchmarks.budgets",
               "e2e": "benchmarks.e2e"}
    module = importlib.import_module(modules[args.which])
    out = Path(args.out or f"out/{args.which}")
    module.run(args.quick, out)
    print(f"wrote {out}/")
    return EXIT_OK


def _verify(args: argparse.Namespace) -> int:
    import torch

    import autockpt
    from autockpt.plan import Plan
    from autockpt.runtime import default_loss, preserved_training_state
    from autockpt.trace import Inputs

    plan = Plan.load(args.plan)
    model, example = load_spec(args.spec)
    inputs = Inputs.of(example)
    fast = autockpt.apply(model, plan, example)
    checks: dict[str, bool] = {}
    grads = {}
    with preserved_training_state(model):
        torch.manual_seed(0)
        expected = default_loss(model(*inputs.args, **inputs.kwargs))
        expected.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    with preserved_training_state(model):
        torch.manual_seed(0)
        got = default_loss(fast(*inputs.args, **inputs.kwargs))
        got.backward()
        checks["loss equal"] = bool(torch.allclose(expected, got, rtol=1e-5, atol=1e-6))
        checks["gradients equal"] = all(
            p.grad is not None and torch.allclose(grads[n], p.grad, rtol=1e-4, atol=1e-6)
            for n, p in model.named_parameters() if n in grads
        )
    measured = autockpt.measure(fast, example)
    checks["peak within budget"] = measured.peak_bytes <= plan.budget_bytes
    ok = all(checks.values())
    if args.json:
        print(json.dumps({"ok": ok, "checks": checks, "peak_bytes": measured.peak_bytes,
                          "budget_bytes": plan.budget_bytes, "step_seconds": measured.step_seconds}))
    else:
        for name, value in checks.items():
            print(f"{'ok  ' if value else 'FAIL'} {name}")
        print(f"measured peak {measured.peak_bytes} bytes vs budget {plan.budget_bytes}; "
              f"step {measured.step_seconds * 1e3:.1f} ms")
    return EXIT_OK if ok else EXIT_VERIFY


if __name__ == "__main__":
    raise SystemExit(main())
