"""The ``autockpt`` command line: ``demo``, ``plan``, ``show``, ``verify``, ``frontier``, ``bench``.

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
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import os
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

EXIT_OK, EXIT_VERIFY, EXIT_USAGE, EXIT_BUDGET, EXIT_PLAN, EXIT_SPEC, EXIT_TRACE = range(7)
EXIT_OUTPUT, EXIT_DEPENDENCY = 7, 8
EXIT_INTERRUPTED = 130
PROGRESS_DELAY_S = 2.0
"""Progress appears only for work that takes longer than this: short commands stay quiet.
The environment variable ``AUTOCKPT_PROGRESS_DELAY_S`` overrides it (0: at once)."""

SOLVERS = ("auto", "dp", "ilp", "sqrt", "greedy")  # solvers.METHODS, without importing it here

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
    "survey": (
        "benchmarks.survey",
        "every Hugging Face architecture built from a config: "
        "capture path, train = eager, measured peak within budget, prediction error",
    ),
}


class SpecError(Exception):
    """The model SPEC could not be imported or called."""


class OutputError(Exception):
    """An output file (plan, plot, report) could not be written."""


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
        AutockptError,
        DefaultLossWarning,
        InfeasibleBudgetError,
        PlanFormatError,
        PlanMismatchError,
        ShardingError,
        TraceError,
    )
    from autockpt.report import MissingDependencyError, ReportError

    # The command line says which loss it plans for in one line of its own output
    # (_default_loss_note), not as a Python warning.
    warnings.filterwarnings("ignore", category=DefaultLossWarning)
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        print("autockpt: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except InfeasibleBudgetError as error:
        return _fail(args, EXIT_BUDGET, error)
    except (PlanFormatError, PlanMismatchError, ReportError) as error:
        return _fail(args, EXIT_PLAN, error)
    except OutputError as error:
        return _fail(args, EXIT_OUTPUT, error)
    except MissingDependencyError as error:
        return _fail(args, EXIT_DEPENDENCY, error)
    except SpecError as error:
        return _fail(args, EXIT_SPEC, error)
    except TraceError as error:
        return _fail(args, EXIT_TRACE, error)
    except FileNotFoundError as error:
        return _fail(args, EXIT_PLAN, error)
    except ShardingError as error:
        return _fail(args, EXIT_USAGE, error)
    except AutockptError as error:  # any other refusal concerns the model SPEC gave
        return _fail(args, EXIT_SPEC, error)


def _fail(args: argparse.Namespace, code: int, error: BaseException) -> int:
    message = " ".join(str(error).split())  # one line, whatever the error text holds
    if getattr(args, "json", False):
        print(json.dumps({"error": type(error).__name__, "message": message, "exit_code": code}))
    else:
        print(f"autockpt: error: {message}", file=sys.stderr)
    return code


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: a whole number of at least ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected at least {minimum}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1)
_at_least_two = _int_at_least(2)


def _common(
    command: argparse.ArgumentParser, json_help: str = "print one JSON object on stdout"
) -> None:
    command.add_argument("--json", action="store_true", help=json_help)
    command.add_argument(
        "--quiet", action="store_true", help="print nothing but errors; no progress"
    )


OPTIMIZERS = {
    # name -> (torch.optim class, keyword arguments): what `--optimizer NAME` builds over the
    # model's parameters (docs/cli.md). SGD is the common momentum form.
    "adamw": ("AdamW", {}),
    "adam": ("Adam", {}),
    "sgd": ("SGD", {"lr": 0.01, "momentum": 0.9}),
}


def _loss_option(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--loss",
        metavar="MODULE:FUNCTION",
        default=None,
        help="the loss the step differentiates, a function of the model's output (replaces "
        "the one the factory returns; default: the output's loss, else the sum of its "
        "floating tensors)",
    )


def _iteration_options(command: argparse.ArgumentParser) -> None:
    _loss_option(command)
    command.add_argument(
        "--optimizer",
        choices=tuple(OPTIMIZERS),
        default=None,
        help="the training loop's optimizer (torch.optim defaults; sgd: lr 0.01, momentum "
        "0.9): the budget then covers the whole iteration, its state and step included",
    )
    command.add_argument(
        "--accumulation-steps",
        type=_positive_int,
        default=1,
        help="micro-batches per optimizer step (gradient accumulation)",
    )


def _build_optimizer(name: str | None, model: Any) -> Any:
    """The optimizer ``--optimizer NAME`` (or a plan's ``optimizer.name``) stands for."""
    if name is None or name == "none":
        return None
    import torch

    by_class = {cls: (cls, kwargs) for cls, kwargs in OPTIMIZERS.values()}
    cls, kwargs = OPTIMIZERS.get(name) or by_class.get(name) or (None, None)
    if cls is None:
        from autockpt.errors import OptimizerError

        raise OptimizerError(
            f"the plan's budget covers a {name}, which the command line cannot build (it builds "
            f"{', '.join(c for c, _ in OPTIMIZERS.values())}): check it from Python with "
            "autockpt.measure(model, inputs, optimizer=your_optimizer)"
        )
    return getattr(torch.optim, cls)(model.parameters(), **kwargs)


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
    demo.set_defaults(run=_demo)

    plan = sub.add_parser("plan", help="make a plan for SPEC under a budget")
    plan.add_argument(
        "spec", help="package.module:factory returning (model, example_inputs[, loss_fn])"
    )
    plan.add_argument(
        "--budget-gb",
        type=_positive_float,
        required=True,
        help="peak memory budget of one training step, GiB (2**30 bytes)",
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
        "--fsdp-units",
        default=None,
        help="comma-separated modules to fully_shard (default: repeated blocks)",
    )
    _iteration_options(plan)
    plan.add_argument(
        "--meta",
        action="store_true",
        help="build the model on the meta device: plan without allocating "
        "(FLOP-estimated times, no measurement)",
    )
    _common(plan, "print the plan JSON on stdout")
    plan.set_defaults(run=_plan)

    show = sub.add_parser(
        "show", help="print a saved plan as tables; --plot draws its memory timeline"
    )
    show.add_argument("plan")
    show.add_argument(
        "--plot",
        metavar="PNG",
        default=None,
        help="write the predicted memory over one step (no checkpoint vs the plan, "
        "with the budget) to this image file",
    )
    _common(show, "print the plan JSON on stdout")
    show.set_defaults(run=_show)

    verify = sub.add_parser("verify", help="apply a plan to SPEC and check it against eager")
    verify.add_argument(
        "spec", help="package.module:factory returning (model, example_inputs[, loss_fn])"
    )
    verify.add_argument("plan")
    _loss_option(verify)
    _common(verify)
    verify.set_defaults(run=_verify)

    frontier = sub.add_parser(
        "frontier", help="recompute overhead vs peak memory across budgets (one profile)"
    )
    frontier.add_argument(
        "spec", help="package.module:factory returning (model, example_inputs[, loss_fn])"
    )
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
    frontier.set_defaults(run=_frontier)

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
    fit.set_defaults(run=_fit)

    bench = sub.add_parser("bench", help="run a benchmark: " + " | ".join(BENCHMARKS))
    bench.add_argument(
        "which",
        choices=tuple(BENCHMARKS),
        help="; ".join(f"{name}: {text}" for name, (_, text) in BENCHMARKS.items()),
    )
    bench.add_argument("--quick", action="store_true", help="a short run")
    bench.add_argument("--out", default=None, help="output folder (default out/<which>)")
    _common(bench, 'print {"out": folder} on stdout')
    bench.set_defaults(run=_bench)
    return parser


class Progress:
    """A transient progress line on stderr that appears only once the work has run for
    :data:`PROGRESS_DELAY_S` seconds, so quick commands never flash one.

    ``stage(text)`` names what runs now (an open-ended spinner); ``stage(text, total)``
    with ``advance(done)`` shows a bar. Disabled (every call a no-op) under ``--quiet``,
    ``--json`` or when stderr is not a terminal.
    """

    def __init__(self, enabled: bool, delay_s: float | None = None) -> None:
        self.enabled = enabled
        if delay_s is None:
            delay_s = float(os.environ.get("AUTOCKPT_PROGRESS_DELAY_S", PROGRESS_DELAY_S))
        self.delay_s = delay_s
        self._lock = threading.Lock()
        self._started = False
        self._closed = False
        self._bar: Any = None
        self._task: Any = None
        self._timer: threading.Timer | None = None

    @classmethod
    def for_args(cls, args: argparse.Namespace) -> Progress:
        wanted = not getattr(args, "quiet", False) and getattr(args, "json", None) in (None, False)
        return cls(wanted and sys.stderr.isatty())

    def __enter__(self) -> Progress:
        if not self.enabled:
            return self
        from rich.console import Console
        from rich.progress import BarColumn, SpinnerColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as Bar

        self._bar = Bar(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            # "3/12" for counted work (a frontier's budgets); nothing for open-ended stages
            TextColumn("{task.fields[count]}"),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            transient=True,
            # stdout stays stdout: results may be piped while the bar shows on the terminal
            redirect_stdout=False,
            redirect_stderr=False,
        )
        self._task = self._bar.add_task("starting", total=None, count="")
        self._timer = threading.Timer(self.delay_s, self._start)
        self._timer.daemon = True
        self._timer.start()
        return self

    def _start(self) -> None:
        with self._lock:
            if not self._closed:
                self._bar.start()
                self._started = True

    def stage(self, description: str, total: int | None = None) -> None:
        if self._bar is not None:
            count = "" if total is None else f"0/{total}"
            self._bar.update(
                self._task, description=description, total=total, completed=0, count=count
            )

    def advance(self, done: int) -> None:
        if self._bar is not None:
            total = self._bar.tasks[0].total
            count = "" if total is None else f"{done}/{int(total)}"
            self._bar.update(self._task, completed=done, count=count)

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        if self._timer is not None:
            self._timer.cancel()
        with self._lock:
            self._closed = True
            if self._started:
                self._bar.stop()


def _say(args: argparse.Namespace) -> Callable[..., None]:
    """``print`` for human output, or nothing under ``--json``/``--quiet``."""
    if getattr(args, "quiet", False) or getattr(args, "json", None) not in (None, False):
        return lambda *parts, **kw: None
    return print


def _default_loss_note(args: argparse.Namespace, loss_fn: Any) -> None:
    """One line saying which loss a command plans for when the user named none."""
    if loss_fn is None:
        _say(args)(
            "note: no loss given: the step differentiates the output's `loss` when it has one, "
            "else the sum of its floating tensors; for the loss you train with, give --loss "
            "package.module:function or return (model, example_inputs, loss_fn) from the factory"
        )


def _write(path: str, write: Callable[[str], None], what: str) -> None:
    try:
        write(path)
    except OSError as error:
        raise OutputError(
            f"cannot write the {what} to {path}: {error.strerror or error}"
        ) from error


def _load_plan(path: str) -> Any:
    from autockpt.plan import Plan

    try:
        return Plan.load(path)
    except FileNotFoundError as error:
        raise FileNotFoundError(f"plan file {path} not found") from error
    except OSError as error:
        from autockpt.errors import PlanFormatError

        raise PlanFormatError(f"cannot read plan file {path}: {error.strerror or error}") from error


# ---------------------------------------------------------------------------------------------


def load_spec(spec: str, loss: str | None = None) -> tuple[Any, Any, Any]:
    """Import ``package.module:factory`` and call it; return ``(model, example_inputs,
    loss_fn)``: the factory's third item when it returns one, else ``--loss``'s function
    (which wins when both are given), else None (the default loss)."""
    return _call_factory(spec, load_factory(spec), loss=loss)


def load_factory(spec: str, what: str = "model SPEC") -> Callable[..., Any]:
    """Import ``package.module:factory`` and return the factory (not called)."""
    if ":" not in spec:
        shape = "package.module:factory" if what == "model SPEC" else "package.module:function"
        raise SpecError(f"{what} must look like {shape}, got {spec!r}")
    module_name, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # noqa: BLE001 - any import failure is the user's SPEC
        raise SpecError(
            f"cannot import {module_name!r}: {type(error).__name__}: {error}"
        ) from error
    factory: Callable[[], Any] | None = getattr(module, attr, None)
    if not callable(factory):
        raise SpecError(f"{module_name!r} has no callable {attr!r}")
    return factory


def _call_factory(
    spec: str, factory: Callable[..., Any], *args: Any, loss: str | None = None
) -> tuple[Any, Any, Any]:
    """``factory(*args)``, checked to return ``(model, example_inputs)`` or ``(model,
    example_inputs, loss_fn)``; ``loss`` (``--loss``) names a loss function that replaces
    the factory's. Returns the three, the loss None when neither gives one."""
    try:
        result = factory(*args)
    except Exception as error:  # noqa: BLE001
        call = f"{spec}({', '.join(map(repr, args))})" if args else spec
        raise SpecError(f"{call} raised {type(error).__name__}: {error}") from error
    shape = "(model, example_inputs) or (model, example_inputs, loss_fn)"
    if not (isinstance(result, tuple) and len(result) in (2, 3)):
        raise SpecError(f"{spec} must return {shape}, got {type(result).__name__}")
    from torch import nn

    if not isinstance(result[0], nn.Module):
        raise SpecError(
            f"{spec} must return {shape} with a torch.nn.Module first, got "
            f"{type(result[0]).__name__}"
        )
    loss_fn = result[2] if len(result) == 3 else None
    if loss_fn is not None and not callable(loss_fn):
        raise SpecError(
            f"{spec} returned a loss_fn that is not callable ({type(loss_fn).__name__}): "
            "return a function of the model's output that gives the scalar loss"
        )
    if loss is not None:
        loss_fn = load_factory(loss, "--loss")
    return result[0], result[1], loss_fn


def _demo(args: argparse.Namespace) -> int:
    import torch

    import autockpt
    from autockpt.api import Planner
    from autockpt.demo import (
        block_stack,
        checkpoint_every_block,
        interleaved_seconds,
        largest_by_measuring,
    )
    from autockpt.errors import GIB, format_bytes
    from autockpt.measure import measure

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
    report: dict[str, Any] = {}
    with Progress.for_args(args) as progress:
        planner.progress = progress.stage
        fast = planner.optimize(budget_gb=budget_gb, solver=args.solver)
        plan = fast.plan
        if not args.meta:
            progress.stage("measuring")
            eager = measure(model, x, optimizer=optimizer, repeat=0)
            checked = measure(fast, x, optimizer=optimizer, repeat=0)
            # one step timed alone is no result: interleaved rounds, CPU time
            seconds = interleaved_seconds(
                {
                    "none": functools.partial(_iteration, model, x, optimizer),
                    "plan": functools.partial(_iteration, fast, x, optimizer),
                }
            )
        if not args.no_fit:
            progress.stage("the largest batch that fits")
            fit = autockpt.fit_batch(
                model, rows, budget_gb=budget_gb, optimizer=optimizer, progress=progress.stage
            )
            report["largest_batch"] = {"autockpt": fit.batch_size}
            if not args.meta:
                hand = checkpoint_every_block(model)
                hand_optimizer = _build_optimizer(args.optimizer, hand)
                for name, module, opt in (
                    ("per_block", hand, hand_optimizer),
                    ("none", model, optimizer),
                ):
                    progress.stage(f"trying batch sizes by hand ({name})")
                    size, runs = largest_by_measuring(
                        lambda n, m=module, o=opt: (
                            measure(m, rows(n), optimizer=o, repeat=0).peak_bytes
                        ),
                        plan.budget_bytes,
                        start=args.batch,
                    )
                    report["largest_batch"][name] = size
                    report["largest_batch"][f"{name}_steps_run"] = runs
    say("")
    say(plan.summary())
    fits = True
    if not args.meta:
        say("")
        say(f"{'':<16}{'peak':>12}{'step':>12}")
        for label, key, m in (("no checkpoint", "none", eager), ("autockpt plan", "plan", checked)):
            say(f"{label:<16}{format_bytes(m.peak_bytes):>12}{seconds[key] * 1e3:>10.1f}ms")
        say(f"{'budget':<16}{format_bytes(plan.budget_bytes):>12}")
        fits = checked.peak_bytes <= plan.budget_bytes
        say(
            f"measured peak {'fits' if fits else 'EXCEEDS'} the budget "
            f"({100 * checked.peak_bytes / plan.budget_bytes:.1f}% of it); step time "
            f"{seconds['plan'] / seconds['none']:.2f}x of no checkpointing (median of 5 "
            "interleaved rounds, CPU time)"
        )
        report |= {
            "eager": {"peak_bytes": eager.peak_bytes, "step_seconds": seconds["none"]},
            "optimized": {"peak_bytes": checked.peak_bytes, "step_seconds": seconds["plan"]},
        }
    if "largest_batch" in report:
        largest = report["largest_batch"]
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
    if args.json:
        print(json.dumps({"plan": json.loads(plan.to_json()), **report, "fits": fits}))
    return EXIT_OK if fits else EXIT_VERIFY


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


def _plan(args: argparse.Namespace) -> int:
    from autockpt.api import Planner

    if args.meta:
        import torch

        with torch.device("meta"):  # parameters and inputs get shapes, never memory
            model, inputs, loss_fn = load_spec(args.spec, args.loss)
    else:
        model, inputs, loss_fn = load_spec(args.spec, args.loss)
    _default_loss_note(args, loss_fn)
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
            optimizer=_build_optimizer(args.optimizer, model),
            accumulation_steps=args.accumulation_steps,
        )
        fast = planner.optimize(
            budget_gb=args.budget_gb,
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


def _show(args: argparse.Namespace) -> int:
    plan = _load_plan(args.plan)
    if args.plot:
        from autockpt.report import save_figure, timeline_figure

        figure = timeline_figure(plan)
        _write(args.plot, lambda path: save_figure(figure, path), "plot")
    if args.json:
        print(plan.to_json())
    elif not args.quiet:
        from autockpt.report import print_plan

        print_plan(plan)
        if args.plot:
            print(f"wrote {args.plot}")
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


def _verify(args: argparse.Namespace) -> int:
    import torch

    import autockpt
    from autockpt.base.inputs import Inputs
    from autockpt.base.runtime import default_loss, loss_name, preserved_training_state

    plan = _load_plan(args.plan)
    model, example, loss_fn = load_spec(args.spec, args.loss)
    inputs = Inputs.of(example)
    loss_fn = loss_fn or default_loss
    # The verdict is the peak measured with the loss given here; a plan made with another
    # loss was predicted for another step, which the output says (never "ok" unmeasured).
    other_loss = plan.loss is not None and plan.loss != loss_name(loss_fn)
    with Progress.for_args(args) as progress:
        progress.stage("applying the plan")
        optimizer = _build_optimizer(plan.optimizer.name if plan.optimizer else None, model)
        fast = autockpt.apply(model, plan, example, optimizer=optimizer)
        checks: dict[str, bool] = {}
        grads = {}
        progress.stage("comparing one step with eager")
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
                    "step_seconds": measured.step_seconds,
                    "loss": loss_name(loss_fn),
                    "plan_loss": plan.loss,
                }
            )
        )
    else:
        say = _say(args)
        if other_loss:
            say(
                f"note: the plan was made with loss {plan.loss}; checked with "
                f"{loss_name(loss_fn)}, whose step's peak is measured here (the plan's "
                "prediction is for the other loss)"
            )
        for name, value in checks.items():
            say(f"{'ok  ' if value else 'FAIL'} {name}")
        say(
            f"measured peak {used} bytes vs budget {plan.budget_bytes} (scope={plan.scope}); "
            f"step {measured.step_seconds * 1e3:.1f} ms"
        )
    return EXIT_OK if ok else EXIT_VERIFY


def _fit(args: argparse.Namespace) -> int:
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


def _frontier(args: argparse.Namespace) -> int:
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


def _write_text(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)


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


if __name__ == "__main__":
    raise SystemExit(main())
