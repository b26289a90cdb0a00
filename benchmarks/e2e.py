"""End-to-end benchmark: autockpt against the checkpointing users apply today.

    autockpt bench e2e [--quick] [--out out/e2e]
    python -m benchmarks.e2e [--quick] [--out out/e2e] [--models gpt2,llama] [--compile all]

For every workload in :mod:`benchmarks.e2e_models` and in one process:

* fixed methods, one point each: no checkpointing; per-block checkpointing (non-reentrant
  ``checkpoint`` around every block, what Hugging Face's ``gradient_checkpointing_enable``
  does); per-block selective checkpointing with torchtitan's op policy (``titan_sac``: keep
  matmul and attention outputs except every second projection matmul) and with every matmul
  and attention output kept (``matmul_sac``); ``checkpoint_sequential`` with sqrt(n)
  segments; Chen's sqrt(L) segments on autockpt's chain; ``torch.compile`` with
  ``activation_memory_budget`` 0.1, 0.3 and 0.5;
* budgeted methods at every budget: Chen's budget-aware greedy, autockpt (``auto``, which may
  keep chosen operator outputs inside its segments, and ``auto_segments``, segments only),
  autockpt ``dp`` and ``ilp``, PyTorch's selective-checkpoint ILP
  (``torch.distributed._tools.sac_ilp``) and Rockmate where they run. A method that cannot
  run gets a row with the error it raised;
* ``compile_auto``: autockpt's compiled route, ``autockpt.optimize(torch.compile(model),
  ...)``, at the measured peak of each compile point (is it within that peak, and no slower
  than the point? Its candidates include compile's own partitions: NOTE [compiled:
  partitioner budgets]).

Budgets per model run from the leanest plan autockpt predicts to the no-checkpoint peak and
include each fixed method's own measured peak (so "at the memory per-block uses" is a real
budget) and the point halfway between per-block's peak and no checkpointing.

Per cell: allocator-level peak (``autockpt.measure``: the CPU profiler's allocator events,
or ``max_memory_allocated`` on CUDA), median step time over interleaved rounds (every round
times one step of every cell, starting at a rotating position; on CUDA with events, on a
CPU as the process's CPU time, which other load on a shared machine inflates far less than
wall time), the
median per-round ratio to no checkpointing, profile and solve time, and whether the measured
peak exceeded the budget. Writes ``e2e.json``, ``e2e.csv``, ``summary.md``, ``headline.md`` (the
README table), ``e2e_frontier.png`` (step time vs peak per method) and ``e2e_budget.png``
(measured peak vs budget, with the diagonal).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import json
import os
import platform
import statistics
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("KINETO_LOG_LEVEL", "5")

import torch  # noqa: E402
from torch import nn  # noqa: E402

import autockpt  # noqa: E402
from autockpt.api import Planner  # noqa: E402
from autockpt.base.runtime import default_loss  # noqa: E402
from autockpt.capture import Inputs  # noqa: E402
from autockpt.errors import GIB, InfeasibleBudgetError  # noqa: E402
from autockpt.measure import interleaved_rounds, measure  # noqa: E402
from benchmarks.e2e_models import Case, cases, op_policy, per_block, sequential  # noqa: E402

FIXED = (
    "none",
    "per_block",
    "titan_sac",
    "matmul_sac",
    "sequential",
    "sqrt",
    "compile_0.1",
    "compile_0.3",
    "compile_0.5",
)
BUDGETED = ("greedy", "auto", "auto_segments", "dp", "sac_ilp", "rockmate")
COMPILED_PLAN = "compile_auto"
"""autockpt's compiled route, ``optimize(torch.compile(model), budget)``, at the measured peak
of each of :data:`COMPILE_POINTS` (one cell per point; NOTE [compiled: partitioner budgets]:
its candidates are autockpt's plan compiled and compile's own partitions, measured)."""
COMPILE_POINTS = ("compile_0.1", "compile_0.3", "compile_0.5")
AUTOCKPT = ("auto", "auto_segments")
"""autockpt's own rows, held to "never over budget": the search under the replay, with and
without operator outputs kept inside segments (``dp`` is the stage-chain proxy solver, judged
by the replay, kept as a peer). :data:`COMPILED_PLAN` has a budget target of its own: what
inductor does to a planned model's memory is outside the plan's guarantee."""
SEGMENT_ONLY = ("sqrt", "greedy", "auto_segments")
"""Methods that checkpoint whole segments by definition (Chen's two and autockpt's own
segment-only row): planned with ``selective=False``."""
BEST_OF = ("titan_sac", "per_block", "auto_segments")
"""At every budget, ``auto`` must be at least as fast as the fastest of these that fits."""
QUICK_MODELS = ("gpt2", "llama", "block_stack")
QUICK_METHODS = ("none", "per_block", "titan_sac", "sequential", "greedy", "auto", "auto_segments")
COMPILE_DEFAULT_MODELS = ("gpt2", "llama")
"""On a CPU, inductor takes minutes per model to compile (C++ codegen with gcc); the default
run compiles the two decoders only (``--compile all`` for every model)."""
PREDICTION_TOLERANCE = 0.15
"""How close a plan's predicted step must come to its measured one (a ratio off 1)."""


@dataclass
class Cell:
    """One method on one model at one budget (``budget_bytes`` None: a fixed method)."""

    model: str
    method: str
    budget_label: str = ""
    budget_bytes: int | None = None
    measured_peak_bytes: int | None = None
    predicted_peak_bytes: int | None = None
    over_budget: bool | None = None
    step_seconds: float | None = None
    ratio_to_none: float | None = None
    ratio_to_per_block: float | None = None
    profile_seconds: float = 0.0
    solve_seconds: float = 0.0
    segments: int | None = None
    plan: list[list[int]] | None = None
    """autockpt's segments as chain stage ranges (identical plans time the same)."""
    kept_ops: list[list[str]] | None = None
    """Per segment, the fx nodes whose outputs autockpt's plan keeps inside it instead of
    recomputing them (selective plans; empty lists: segment-only)."""
    same_as: str | None = None
    """The cell whose identical plan was measured and timed (this one shares its numbers)."""
    error: str | None = None
    predicted_step_seconds: float | None = None
    """The step time autockpt predicts for this plan (its one time model: the probe's
    measured node seconds plus the recompute; autockpt's rows, none and per-block)."""
    wall_step_seconds: float | None = None
    """Median wall time of a step over the rounds (what the prediction is compared with)."""
    planning_step_seconds: float | None = None
    """The plan's own step as planning timed it (median wall seconds of its timed steps;
    None: planning did not time it). The first verified plan of a model is timed and sets
    the step factors its prediction is made by (NOTE [timing: step factors]), so for that
    plan predicted / measured is the clock's own repeatability: the same step timed minutes
    apart, in planning's loop and in the rounds."""
    wall_spread: float | None = None
    """(slowest - fastest) / median of the wall times over the rounds: how much one step of
    this cell moved within this run."""
    compile_memory_budget: float | None = None
    """``compile_auto`` cells: the partitioner budget of compile's own partition autockpt
    handed back as the fastest within the budget (None: its own plan, compiled)."""
    line: float | None = None
    """At this budget, the straight line between per-block checkpointing and none, as a
    ratio to per-block: what checkpointing a share of the blocks gives (budgets between
    per-block's measured peak and none's)."""
    times: list[float] = field(default_factory=list)
    wall_times: list[float] = field(default_factory=list)

    def row(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("times")
        out.pop("wall_times")
        return out


@dataclass
class _Runner:
    """What the timing loop needs for one successful cell."""

    cell: Cell
    step: Callable[[], None]


# ---------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------


def _clear(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


def _stepper(model: nn.Module, inputs: Inputs) -> Callable[[], None]:
    def step() -> None:
        default_loss(model(*inputs.args, **inputs.kwargs)).backward()
        _clear(model)

    return step


def _timed(step: Callable[[], None], device: torch.device) -> tuple[float, float]:
    """(the time ratios compare, wall seconds) of one step."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize(device)
        seconds = start.elapsed_time(end) / 1e3
        return seconds, seconds
    # On a CPU, the process's CPU time (all its threads): on a machine shared with other
    # work, wall time mostly measures who else is running; CPU time measures the step's work.
    # Wall time too: predictions are of wall seconds.
    begin, wall = time.process_time(), time.perf_counter()
    step()
    return time.process_time() - begin, time.perf_counter() - wall


def _interleave(runners: list[_Runner], rounds: int, device: torch.device) -> None:
    """Every cell's step timed in interleaved rounds (NOTE [timing: interleaved rounds] in
    autockpt/measure.py: a timed step follows its own step, as in a training loop, and
    rounds rotate the cells so that a slow spell falls on every cell alike)."""
    samples = interleaved_rounds(
        [runner.step for runner in runners], rounds, lambda step: _timed(step, device)
    )
    for runner, readings in zip(runners, samples, strict=True):
        runner.cell.times += [cpu for cpu, _ in readings]
        runner.cell.wall_times += [wall for _, wall in readings]


def paired_ratio(a: Cell, b: Cell) -> float | None:
    """Median over rounds of ``a``'s step time over ``b``'s in the same round."""
    if not a.times or not b.times:
        return None
    return statistics.median(x / y for x, y in zip(a.times, b.times, strict=True))


# ---------------------------------------------------------------------------------------------
# peers that may not run here
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


class _UnderMemoryBudget(nn.Module):
    """Calls a compiled module with ``activation_memory_budget`` patched in, every time: a
    recompile (a guard failing) must see the same budget as the first compile."""

    def __init__(self, compiled: nn.Module, fraction: float) -> None:
        super().__init__()
        self.compiled = compiled
        self.fraction = fraction

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        import torch._functorch.config as functorch_config

        with functorch_config.patch(activation_memory_budget=self.fraction):
            return self.compiled(*args, **kwargs)


def _budget_backend(fraction: float) -> Callable[..., Any]:
    """Inductor, compiling with ``activation_memory_budget=fraction`` patched in.

    A backend of its own per budget matters: dynamo reuses a compiled graph for another
    instance of the same model class unless the backend differs, and with compile caches on,
    a second budget was measured here to silently get the first budget's graph."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    def backend(graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        with (
            functorch_config.patch(activation_memory_budget=fraction),
            inductor_config.patch(force_disable_caches=True),
        ):
            return compile_fx(graph, example_inputs)

    return backend


def _compiled(case: Case, fraction: float, inputs: Inputs, device: torch.device) -> nn.Module:
    """``torch.compile`` (inductor) with ``activation_memory_budget=fraction``; compiles on the
    first step (compilation is lazy), so that step is part of the solve time."""
    model, _ = case.build()
    compiled = torch.compile(model.to(device), backend=_budget_backend(fraction))
    wrapped = _UnderMemoryBudget(compiled, fraction)
    default_loss(wrapped(*inputs.args, **inputs.kwargs)).backward()
    _clear(wrapped)
    return wrapped


def optimize_row(
    planner: Planner, budget_bytes: int, method: str, *, verify: bool = True
) -> nn.Module:
    """``planner.optimize`` for a budgeted row: ``auto`` and ``auto_segments`` both use the
    ``auto`` solver; the :data:`SEGMENT_ONLY` rows pass ``selective=False``."""
    solver = "auto" if method in ("auto", "auto_segments") else method
    return planner.optimize(
        budget_gb=budget_bytes / GIB,
        solver=solver,
        verify=verify,
        selective=method not in SEGMENT_ONLY,
    )


def _sac_ilp(case: Case, inputs: Inputs, budget_bytes: int, device: torch.device) -> nn.Module:
    """PyTorch's selective-checkpoint ILP: estimate memory (MemTracker), op runtimes
    (RuntimeEstimator) and per-module trade-offs (SACEstimator), solve ``sac_milp`` for the
    budget, then checkpoint each chosen module with the per-op save/recompute policy that
    ``get_optimal_checkpointing_policy_per_module`` picks for its discard ratio."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.ilp_utils import aggregate_stats, parse_module_info
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed._tools.runtime_estimator import RuntimeEstimator
    from torch.distributed._tools.sac_estimator import SACEstimator
    from torch.distributed._tools.sac_ilp import (
        get_optimal_checkpointing_policy_per_module,
        sac_milp,
    )
    from torch.utils.checkpoint import (
        CheckpointPolicy,
        checkpoint,
        create_selective_checkpoint_contexts,
    )

    # The estimators run on fake tensors (they insist on FakeTensorMode); the decisions are
    # then applied to a real copy of the model.
    with FakeTensorMode(), torch.device(device):
        fake_model, fake_example = case.build()
        fake = Inputs.of(fake_example)

        def step() -> None:
            default_loss(fake_model(*fake.args, **fake.kwargs)).backward()

        tracker = MemTracker()
        tracker.track_external(fake_model)
        with tracker:
            step()
        _clear(fake_model)
        runtime = RuntimeEstimator()
        try:
            with runtime("operator-level-benchmark"):
                step()
        except RuntimeError as error:
            if device.type == "cuda":
                raise
            raise RuntimeError(
                "torch.distributed._tools.RuntimeEstimator times every op with CUDA events "
                f"(its other mode is a CUDA roofline model) and there is no CUDA here: {error}"
            ) from error
        _clear(fake_model)
        sac = SACEstimator()
        with sac(estimate_mode_type="operator-level-benchmark"):
            default_loss(fake_model(*fake.args, **fake.kwargs))
        info = aggregate_stats(fake_model, tracker, runtime, sac, device)
    graph = parse_module_info(info)
    decisions, _, _ = sac_milp(graph, memory_budget=budget_bytes / GIB, world_size=1)
    model, _ = case.build()
    model.to(device)
    root = type(model).__name__
    for fqn, discard in decisions.items():
        stats = sac.sac_mod_stats[fqn]
        keep = get_optimal_checkpointing_policy_per_module(stats, memory_budget=1.0 - discard)
        path = fqn[len(root) + 1 :] if fqn.startswith(root + ".") else fqn
        target = model.get_submodule(path)
        saved = {i for i, bit in enumerate(keep) if bit}
        names = list(stats.func_names)

        def contexts(_saved: set = saved, _names: list = names) -> Any:
            # Ops are matched to the estimator's list by name, in order of appearance within
            # one call of the module. The count lives here, one per checkpointed call: torch
            # hands the policy a new context object for every op, so state kept on it is lost.
            seen: dict[str, int] = {}

            def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
                name = str(func)
                index = [i for i, n in enumerate(_names) if n == name]
                k = seen.get(name, 0)
                seen[name] = k + 1
                if k < len(index) and index[k] in _saved:
                    return CheckpointPolicy.MUST_SAVE
                return CheckpointPolicy.PREFER_RECOMPUTE

            return create_selective_checkpoint_contexts(policy)

        original = target.forward

        def forward(*args: Any, _f: Any = original, _c: Any = contexts, **kwargs: Any) -> Any:
            return checkpoint(_f, *args, use_reentrant=False, context_fn=_c, **kwargs)

        target.forward = forward
    return model


def _rockmate(case: Case, inputs: Inputs, budget_bytes: int) -> nn.Module:
    """Rockmate (PyPI ``rockmate``): a module that must be stepped with ``rk.backward()``."""
    try:
        from rockmate import Rockmate
    except ImportError as error:  # not a dependency of autockpt
        raise ImportError(
            f"{error}. Rockmate 2.0.0 installs from PyPI but its rkgb 2.0.0 sdist lacks the "
            "rkgb.core package, so `import rockmate` fails; 1.0.1 imports but measures memory "
            "with CUDA only (docs/benchmarks.md)"
        ) from error

    model, _ = case.build()
    return Rockmate(model, inputs.args, budget=budget_bytes)


def _least_bytes(error: InfeasibleBudgetError) -> int:
    """The refusal's achievable minimum, or its floor where it was refused before profiling
    (``minimum_bytes`` None)."""
    return error.minimum_bytes if error.minimum_bytes is not None else error.floor_bytes


def _error_text(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip()
    text = " ".join(text.split())
    return text[:600]


# ---------------------------------------------------------------------------------------------
# one model
# ---------------------------------------------------------------------------------------------


def _budgets(planner: Planner, peaks: dict[str, int]) -> list[tuple[str, int]]:
    """Leanest feasible .. no checkpointing, with each fixed method's own measured peak (also
    below autockpt's predicted leanest: then its row says it cannot plan there) and the
    halfway point between per-block's peak and no checkpointing; equal byte counts merge
    labels."""
    leanest = planner.minimum_peak_bytes
    none = peaks["none"]
    points: dict[str, int] = {"leanest": leanest, "none_peak": none}
    if "per_block" in peaks:
        points["per_block_peak"] = peaks["per_block"]
        points["halfway"] = (peaks["per_block"] + none) // 2
        points["lean_mid"] = (leanest + peaks["per_block"]) // 2
    for name, peak in peaks.items():
        if name not in ("none", "per_block") and peak <= none:
            points[f"{name}_peak"] = peak
    merged: dict[int, list[str]] = {}
    for label, value in points.items():
        merged.setdefault(value, []).append(label)
    return [("/".join(labels), value) for value, labels in sorted(merged.items())]


def run_case(
    case: Case,
    *,
    methods: tuple[str, ...],
    rounds: int,
    device: torch.device,
    compile_models: tuple[str, ...],
    budget_labels: tuple[str, ...] | None = None,
    log: Callable[[str], None] = print,
) -> list[Cell]:
    """Measure every method on ``case``; return its cells (errors included).

    ``budget_labels`` keeps only the budgets carrying one of those labels (``halfway``,
    ``per_block_peak``, ...; None: every budget of :func:`_budgets`)."""
    model, example = case.build()
    model.to(device)
    inputs = Inputs.of(example)
    inputs = Inputs(
        tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in inputs.args),
        {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.kwargs.items()},
    )
    started = time.perf_counter()
    with _quiet():
        planner = Planner(model, inputs)
    profile_seconds = time.perf_counter() - started
    eager_peak = measure(model, inputs, repeat=1).peak_bytes
    log(
        f"{case.name}: profiled in {profile_seconds:.1f}s; leanest "
        f"{planner.minimum_peak_bytes / 2**20:.1f} MiB, no checkpointing "
        f"{eager_peak / 2**20:.1f} MiB"
    )
    cells: list[Cell] = []
    runners: list[_Runner] = []

    def add(
        cell: Cell,
        module: nn.Module | None,
        step: Callable[[], None] | None = None,
        peak: int | None = None,
    ) -> None:
        """Record ``cell``; measure the peak of ``module`` (unless ``peak`` was measured
        already) and time it in the interleaved rounds."""
        cells.append(cell)
        if module is not None and cell.error is None:
            if peak is None:
                with _quiet():
                    peak = measure(module, inputs, repeat=1, warmup=0).peak_bytes
            cell.measured_peak_bytes = peak
            if cell.budget_bytes is not None:
                cell.over_budget = peak > cell.budget_bytes
            runners.append(_Runner(cell, step or _stepper(module, inputs)))
        log(_line(cell))

    # A plan that autockpt already measured (same segments) is not measured or timed again:
    # the copy shares its reference's measurements and says so in ``same_as``.
    measured_plans: dict[tuple[tuple[int, int], ...], Cell] = {}

    def reuse(cell: Cell, reference: Cell) -> None:
        cell.same_as = f"{reference.method} {reference.budget_label}".strip()
        cell.measured_peak_bytes = reference.measured_peak_bytes
        if cell.budget_bytes is not None and cell.measured_peak_bytes is not None:
            cell.over_budget = cell.measured_peak_bytes > cell.budget_bytes
        copies.append((cell, reference))
        cells.append(cell)
        log(_line(cell) + f"  (same plan as {cell.same_as})")

    copies: list[tuple[Cell, Cell]] = []

    add(Cell(case.name, "none", profile_seconds=profile_seconds, segments=0, plan=[]), model)
    measured_plans[()] = cells[0]
    for method in FIXED[1:]:
        if method not in methods:
            continue
        cell = Cell(case.name, method)
        module: nn.Module | None = None
        started = time.perf_counter()
        try:
            with _quiet():
                if method == "per_block":
                    built, _ = case.build()
                    module = per_block(case, built.to(device))
                elif method in ("titan_sac", "matmul_sac"):
                    built, _ = case.build()
                    module = op_policy(case, built.to(device), every_other=method == "titan_sac")
                elif method == "sequential":
                    built, _ = case.build()
                    module = sequential(case, built.to(device))
                elif method == "sqrt":
                    module = optimize_row(planner, 4 * eager_peak, "sqrt")
                    _record_plan(cell, module)
                    cell.profile_seconds = profile_seconds
                else:
                    if case.name not in compile_models:
                        raise RuntimeError(
                            "skipped: inductor compiles take minutes per model on a CPU; "
                            "run with --compile all to include this model"
                        )
                    module = _compiled(case, float(method.split("_")[1]), inputs, device)
        except Exception as error:  # noqa: BLE001 - a peer that cannot run gets its error
            cell.error = _error_text(error)
            module = None
        cell.solve_seconds = time.perf_counter() - started
        add(cell, module)
        if method == "sqrt" and cell.plan is not None and cell.error is None:
            measured_plans.setdefault(_key(cell), cell)
    peaks = {c.method: c.measured_peak_bytes for c in cells if c.measured_peak_bytes is not None}
    broken: dict[str, str] = {}  # a peer that failed for a reason unrelated to the budget
    for label, budget in _budgets(planner, peaks):
        if budget_labels is not None and not set(label.split("/")) & set(budget_labels):
            continue
        for method in BUDGETED:
            if method not in methods:
                continue
            cell = Cell(case.name, method, label, budget)
            module = None
            step = None
            peak = None
            started = time.perf_counter()
            if method in broken:
                cell.error = broken[method]
                add(cell, None)
                continue
            try:
                with _quiet():
                    if method in ("greedy", "auto", "auto_segments", "dp", "ilp"):
                        cell.profile_seconds = profile_seconds
                        # Solve without measuring first: a plan measured before is reused.
                        draft = optimize_row(planner, budget, method, verify=False)
                        _record_plan(cell, draft)
                        if _key(cell) not in measured_plans:
                            module = optimize_row(planner, budget, method)
                            _record_plan(cell, module)
                            peak = module.plan.measured_peak_bytes
                    elif method == "sac_ilp":
                        module = _sac_ilp(case, inputs, budget, device)
                    else:
                        module = _rockmate(case, inputs, budget)
                        step = _rockmate_step(module, inputs)
            except InfeasibleBudgetError as error:
                least = _least_bytes(error)
                cell.error = (
                    f"InfeasibleBudgetError: budget {error.budget_bytes / 2**20:.2f} MiB is "
                    f"below the leanest plan's predicted {least / 2**20:.2f} MiB"
                    if least > error.budget_bytes
                    else f"InfeasibleBudgetError: {method} found no plan within "
                    f"{error.budget_bytes / 2**20:.2f} MiB"
                    + (" (dp/ilp do)" if method == "greedy" else "")
                )
            except Exception as error:  # noqa: BLE001
                cell.error = _error_text(error)
                if method in ("sac_ilp", "rockmate"):
                    broken[method] = f"(as at {label}) {cell.error}"
                if os.environ.get("AUTOCKPT_BENCH_TRACEBACK"):
                    traceback.print_exc()
            cell.solve_seconds = time.perf_counter() - started
            if cell.error is None and cell.plan is not None and _key(cell) in measured_plans:
                reuse(cell, measured_plans[_key(cell)])
                continue
            add(cell, module if cell.error is None else None, step, peak)
            if cell.error is None and cell.plan is not None:
                measured_plans[_key(cell)] = cell
    if COMPILED_PLAN in methods:
        for cell, module in _compiled_plans(case, cells, inputs, compile_models, device):
            add(cell, module)
    _interleave(runners, rounds, device)
    for cell, reference in copies:
        cell.times = list(reference.times)
        cell.wall_times = list(reference.wall_times)
    none = cells[0]
    none.predicted_step_seconds = planner.step_seconds
    blocks = next((c for c in cells if c.method == "per_block" and c.times), None)
    if blocks is not None and planner.per_block_segments:
        blocks.predicted_step_seconds = planner.step_seconds + planner.recompute_seconds(
            planner.per_block_segments
        )
    for cell in cells:
        if cell.times:
            cell.step_seconds = statistics.median(cell.times)
            cell.wall_step_seconds = statistics.median(cell.wall_times)
            cell.wall_spread = (
                max(cell.wall_times) - min(cell.wall_times)
            ) / cell.wall_step_seconds
            cell.ratio_to_none = paired_ratio(cell, none)
            cell.ratio_to_per_block = paired_ratio(cell, blocks) if blocks else None
    if blocks is not None:
        for cell in cells:
            cell.line = line_at(cell, blocks, none)
    return cells


def line_at(cell: Cell, blocks: Cell, none: Cell) -> float | None:
    """The straight line from per-block (ratio 1 at its measured peak) to no checkpointing
    (its ratio to per-block at its peak), at ``cell``'s budget; None outside that range."""
    low, high = blocks.measured_peak_bytes, none.measured_peak_bytes
    if cell.budget_bytes is None or low is None or high is None or high <= low:
        return None
    ratio = paired_ratio(none, blocks)
    if ratio is None or not low <= cell.budget_bytes <= high:
        return None
    return 1 + (ratio - 1) * (cell.budget_bytes - low) / (high - low)


def _compiled_plans(
    case: Case,
    cells: list[Cell],
    inputs: Inputs,
    compile_models: tuple[str, ...],
    device: torch.device,
) -> list[tuple[Cell, nn.Module | None]]:
    """The :data:`COMPILED_PLAN` cells: ``autockpt.optimize(torch.compile(model), ...)`` at
    the measured peak of each of :data:`COMPILE_POINTS` (one model compiled once, planned
    per point: later points reuse the profile and the candidates' stored measurements)."""
    out: list[tuple[Cell, nn.Module | None]] = []
    compiled: nn.Module | None = None
    example: Any = None
    for point in COMPILE_POINTS:
        reference = next((c for c in cells if c.method == point), None)
        cell = Cell(case.name, COMPILED_PLAN, f"{point}_peak")
        out.append((cell, None))
        if reference is None or reference.measured_peak_bytes is None:
            cell.error = f"needs {point}'s measured peak: " + (
                reference.error or "no peak" if reference else f"{point} not run"
            )
            continue
        cell.budget_bytes = reference.measured_peak_bytes
        started = time.perf_counter()
        try:
            if case.name not in compile_models:
                raise RuntimeError("skipped: not in the models to compile")
            if compiled is None:
                built, example = case.build()
                compiled = torch.compile(built.to(device))
            with _quiet():
                module = autockpt.optimize(compiled, example, budget_gb=cell.budget_bytes / GIB)
            _record_plan(cell, module)
            cell.compile_memory_budget = module.plan.compile_memory_budget
            cell.predicted_peak_bytes = module.plan.measured_peak_bytes
            cell.predicted_step_seconds = None  # measured while planning, not predicted
            out[-1] = (cell, module)
        except InfeasibleBudgetError as error:
            cell.error = (
                f"InfeasibleBudgetError: {point}'s peak {error.budget_bytes / 2**20:.2f} MiB "
                f"is below every compiled candidate (at least {_least_bytes(error) / 2**20:.2f} MiB)"
            )
        except Exception as error:  # noqa: BLE001
            cell.error = _error_text(error)
            if os.environ.get("AUTOCKPT_BENCH_TRACEBACK"):
                traceback.print_exc()
        cell.solve_seconds = time.perf_counter() - started
    return out


def _record_plan(cell: Cell, module: nn.Module) -> None:
    cell.segments = len(module.plan.segments)
    cell.plan = [[s.start_stage, s.end_stage] for s in module.plan.segments]
    cell.kept_ops = [_kept(s) for s in module.plan.segments]
    cell.predicted_peak_bytes = module.plan.predicted_peak_bytes
    cell.predicted_step_seconds = module.plan.predicted_step_seconds
    cell.planning_step_seconds = module.plan.measured_step_seconds


def _kept(segment: Any) -> list[str]:
    """What a plan segment keeps inside (``kept_ops``): the fx node of each kept output."""
    return [kept.node for kept in segment.kept_ops]


def _key(cell: Cell) -> tuple[tuple[int, int, tuple[str, ...]], ...]:
    """Identifies a plan: its segments and what each keeps inside."""
    kept = cell.kept_ops or [[] for _ in cell.plan or ()]
    return tuple((a, b, tuple(k)) for (a, b), k in zip(cell.plan or (), kept, strict=True))


def _rockmate_step(module: Any, inputs: Inputs) -> Callable[[], None]:
    def step() -> None:
        default_loss(module(*inputs.args)).backward()
        module.backward()
        _clear(module)

    return step


def _line(cell: Cell) -> str:
    where = (
        f"{cell.budget_label:<22} {cell.budget_bytes / 2**20:8.2f} MiB"
        if cell.budget_bytes
        else " " * 35
    )
    if cell.error:
        return f"  {cell.method:<13} {where}  error: {cell.error[:110]}"
    over = "  OVER BUDGET" if cell.over_budget else ""
    return f"  {cell.method:<13} {where}  peak {cell.measured_peak_bytes / 2**20:8.2f} MiB{over}"


# ---------------------------------------------------------------------------------------------
# targets
# ---------------------------------------------------------------------------------------------


@dataclass
class Target:
    """One of the issue's targets on one model, as measured."""

    model: str
    method: str
    target: str
    budget_label: str
    value: float | None
    limit: float
    met: bool | None
    note: str = ""


PER_BLOCK_LIMITS = (
    ("per_block_peak", 0.90, "step <= 0.90x per-block at per-block's peak"),
    ("halfway", 0.80, "step <= 0.80x per-block halfway to no checkpointing"),
)
"""``auto``'s step over per-block checkpointing's, at per-block's measured peak and halfway
from there to no checkpointing."""
PEERS_AT_PEAK = tuple(method for method in FIXED if method != "none")


def evaluate_targets(cells: list[Cell]) -> list[Target]:
    """The targets, per model: autockpt's rows (:data:`AUTOCKPT`) never over budget; the
    speed targets for ``auto``; ``compile_auto`` within and against ``compile_0.5``."""
    out: list[Target] = []
    for model in sorted({c.model for c in cells}):
        mine = [c for c in cells if c.model == model]
        for method in AUTOCKPT:
            planned = [c for c in mine if c.method == method]
            if not planned:
                continue
            over = [c for c in planned if c.over_budget]
            out.append(
                Target(
                    model,
                    method,
                    "never over budget",
                    "all",
                    float(len(over)),
                    0.0,
                    not over,
                    f"{len(over)} of {len(planned)} plans over budget",
                )
            )
        out += _speed_targets(model, mine)
        out += _compile_targets(model, mine)
    return out


def _at(cells: list[Cell], label: str) -> Cell | None:
    """The cell whose (merged) budget label includes ``label``."""
    return next((c for c in cells if label in c.budget_label.split("/")), None)


def _speed_targets(model: str, mine: list[Cell], method: str = "auto") -> list[Target]:
    planned = [c for c in mine if c.method == method]
    if not planned:
        return []
    out: list[Target] = []
    fixed = {c.method: c for c in mine if c.budget_bytes is None}
    blocks = fixed.get("per_block")
    for label, limit, name in PER_BLOCK_LIMITS:
        mine_cell = _at(planned, label)
        ratio = paired_ratio(mine_cell, blocks) if mine_cell and blocks else None
        note = "" if ratio is not None else _why_missing(mine_cell, blocks)
        met = None if ratio is None else ratio <= limit
        out.append(Target(model, method, name, label, ratio, limit, met, note))
    for peer in PEERS_AT_PEAK:
        other = fixed.get(peer)
        if other is None or not other.times:
            continue
        mine_cell = _at(planned, f"{peer}_peak")
        if mine_cell is None:
            note = "no autockpt cell at the peer's peak (above no checkpointing's, or not run)"
            out.append(
                Target(
                    model,
                    method,
                    f"step <= {peer} at its peak",
                    f"{peer}_peak",
                    None,
                    1.0,
                    None,
                    note,
                )
            )
            continue
        out.append(
            _peer_target(
                model,
                method,
                f"step <= {peer} at its peak",
                mine_cell.budget_label,
                mine_cell,
                other,
            )
        )
    for peer in ("greedy", "sac_ilp", "rockmate"):
        for other in (c for c in mine if c.method == peer and c.times and not c.over_budget):
            out.append(
                _peer_target(
                    model,
                    method,
                    f"step <= {peer} where it fits",
                    other.budget_label,
                    _at(planned, other.budget_label.split("/")[0]),
                    other,
                )
            )
    name = f"step <= fastest of {'/'.join(BEST_OF)} that fits"
    for cell in planned:
        if cell.budget_bytes is None or cell.error or not cell.times:
            continue
        best = _fastest_fitting(mine, cell)
        if best is None:
            continue
        target = _peer_target(model, method, name, cell.budget_label, cell, best)
        target.note = (
            f"fastest: {best.method} ({1e3 * (best.step_seconds or 0.0):.1f} ms, "
            f"peak {_mib(best.measured_peak_bytes)} MiB)"
            + (f"; {target.note}" if target.note else "")
        )
        out.append(target)
    for cell in planned:
        if cell.line is not None and cell.ratio_to_per_block is not None and not cell.error:
            out.append(
                Target(
                    model,
                    method,
                    "step <= the line per-block -> none",
                    cell.budget_label,
                    cell.ratio_to_per_block,
                    round(cell.line, 3),
                    cell.ratio_to_per_block <= cell.line,
                )
            )
        if cell.predicted_step_seconds is not None and cell.wall_step_seconds and not cell.error:
            off = cell.predicted_step_seconds / cell.wall_step_seconds
            out.append(
                Target(
                    model,
                    method,
                    f"predicted step within {100 * PREDICTION_TOLERANCE:.0f}% of measured (wall)",
                    cell.budget_label,
                    off,
                    PREDICTION_TOLERANCE,
                    abs(off - 1) <= PREDICTION_TOLERANCE,
                    _repeatability(cell),
                )
            )
    return out


def _fastest_fitting(mine: list[Cell], cell: Cell) -> Cell | None:
    """The fastest timed :data:`BEST_OF` cell whose measured peak fits ``cell``'s budget (a
    budgeted one at the same budget, a fixed one wherever its peak fits)."""
    assert cell.budget_bytes is not None
    fits = [
        c
        for c in mine
        if c.method in BEST_OF
        and c.times
        and c.step_seconds is not None
        and c.measured_peak_bytes is not None
        and c.measured_peak_bytes <= cell.budget_bytes
        and (c.budget_bytes is None or c.budget_label == cell.budget_label)
    ]
    return min(fits, key=lambda c: c.step_seconds or 0.0, default=None)


def _compile_targets(model: str, mine: list[Cell]) -> list[Target]:
    """Each ``compile_auto`` cell (autockpt's compiled route at a compile point's measured
    peak): within that peak, and no slower than the point."""
    out: list[Target] = []
    for cell in (c for c in mine if c.method == COMPILED_PLAN):
        point = cell.budget_label.removesuffix("_peak")
        reference = next((c for c in mine if c.method == point), None)
        label = cell.budget_label
        within_name, faster_name = f"within {point}'s peak", f"step <= {point}"
        if cell.error or cell.measured_peak_bytes is None or not cell.budget_bytes:
            note = _why_missing(cell, reference)
            out += [
                Target(model, COMPILED_PLAN, within_name, label, None, 1.0, None, note),
                Target(model, COMPILED_PLAN, faster_name, label, None, 1.0, None, note),
            ]
            continue
        fraction = cell.measured_peak_bytes / cell.budget_bytes
        out.append(
            Target(
                model,
                COMPILED_PLAN,
                within_name,
                label,
                fraction,
                1.0,
                fraction <= 1.0,
                f"peak {_mib(cell.measured_peak_bytes)} MiB of {_mib(cell.budget_bytes)} MiB",
            )
        )
        assert reference is not None  # the cell has a budget only when the point measured one
        faster = _peer_target(model, COMPILED_PLAN, faster_name, label, cell, reference)
        if cell.compile_memory_budget is not None:
            chosen = f"handed back compile's own partition at {cell.compile_memory_budget:g}"
            faster = dataclasses.replace(
                faster, note="; ".join(n for n in (chosen, faster.note) if n)
            )
        out.append(faster)
    return out


def _peer_target(
    model: str, method: str, name: str, label: str, mine: Cell | None, other: Cell
) -> Target:
    """autockpt's step over a peer's at the same budget must be at most 1.0; the same plan
    on both sides counts as met (any ratio is then timing noise)."""
    ratio = paired_ratio(mine, other) if mine else None
    met = None if ratio is None else ratio <= 1.0
    note = "" if ratio is not None else _why_missing(mine, other)
    if ratio is not None and mine.plan is not None and other.plan is not None:
        if _key(mine) == _key(other):
            met, note = True, "same plan: the ratio is timing noise"
    return Target(model, method, name, label, ratio, 1.0, met, note)


def _why_missing(mine: Cell | None, other: Cell | None) -> str:
    if mine is None or other is None:
        return "cell not run"
    return mine.error or other.error or "no timing"


# ---------------------------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    return info


def _mib(value: int | None) -> str:
    return "" if value is None else f"{value / 2**20:.2f}"


def _percent(value: float | None) -> str:
    return "" if value is None else f"{100 * value:.0f}%"


def _x(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}x"


def _segments(cell: Cell) -> str:
    if cell.segments is None:
        return ""
    kept = sum(len(ops) for ops in cell.kept_ops or ())
    text = f"{cell.segments} (+{kept} kept ops)" if kept else str(cell.segments)
    return f"{text} (= {cell.same_as})" if cell.same_as else text


def summary_markdown(cells: list[Cell], targets: list[Target]) -> str:
    """Per-model tables of every cell, then the targets."""
    lines: list[str] = []
    for model in sorted({c.model for c in cells}, key=[c.model for c in cells].index):
        lines += [
            f"### {model}",
            "",
            "| method | budget | budget (MiB) | peak (MiB) | over budget | step (ms) | vs none "
            "| vs per-block | line | predicted / measured step | spread | profile + solve (s) "
            "| segments |",
            "|---|---|---:|---:|:-:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for c in (c for c in cells if c.model == model):
            if c.error:
                lines.append(
                    f"| {c.method} | {c.budget_label} | {_mib(c.budget_bytes)} | "
                    f"error: {c.error[:160].replace('|', '/')} | | | | | | | | | |"
                )
                continue
            over = "" if c.over_budget is None else ("**YES**" if c.over_budget else "no")
            step = "" if c.step_seconds is None else f"{1e3 * c.step_seconds:.1f}"
            lines.append(
                f"| {c.method} | {c.budget_label} | {_mib(c.budget_bytes)} | {_mib(c.measured_peak_bytes)} "
                f"| {over} | {step} | {_x(c.ratio_to_none)} | {_x(c.ratio_to_per_block)} "
                f"| {_x(c.line)} | {_predicted_over_measured(c)} | {_percent(c.wall_spread)} "
                f"| {c.profile_seconds + c.solve_seconds:.1f} | {_segments(c)} |"
            )
        lines.append("")
    lines += [
        "### The clock's own repeatability",
        "",
        "The plan planning timed (its step set the time model's factors), timed again in the "
        "rounds: no prediction can come closer to the rounds than the clock comes to itself, "
        "but by luck. The last column divides each predicted/measured ratio by that move.",
        "",
        repeatability_markdown(cells),
        "### Targets",
        "",
        "| model | autockpt | target | budget | measured | limit | met | note |",
        "|---|---|---|---|---:|---:|:-:|---|",
    ]
    for t in targets:
        met = "n/a" if t.met is None else ("yes" if t.met else "**NO**")
        value = "" if t.value is None else f"{t.value:.3f}"
        lines.append(
            f"| {t.model} | {t.method} | {t.target} | {t.budget_label} | {value} "
            f"| {t.limit:g} | {met} | {t.note} |"
        )
    return "\n".join(lines) + "\n"


def _repeatability(cell: Cell) -> str:
    """For the plan planning timed (it set the step factors): its step there against here."""
    if cell.planning_step_seconds is None or not cell.wall_step_seconds:
        return ""
    return (
        f"planning timed this plan (it set the step factors): "
        f"{1e3 * cell.planning_step_seconds:.1f} ms there, "
        f"{1e3 * cell.wall_step_seconds:.1f} ms in the rounds "
        f"({cell.planning_step_seconds / cell.wall_step_seconds:.2f}x)"
    )


def repeatability_markdown(cells: list[Cell], method: str = "auto") -> str:
    """Per model, how far the clock alone moves: the plan planning timed, there against in
    the rounds (no prediction can be closer to the rounds than that, but by luck), and the
    spread of one cell's steps within the rounds. The last two columns set ``method``'s
    predicted/measured ratios beside the same ratios divided by planning/rounds: what is left
    once the clock's own move between planning and the rounds is taken out. The target stays
    on the first; the second says how much of a miss is the time model's."""
    lines = [
        "| model | plan timed by planning | planning (ms) | rounds (ms) | planning / rounds "
        "| spread within the rounds (median of cells) "
        f"| {method} predicted / measured | the same / (planning / rounds) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for model in sorted({c.model for c in cells}, key=[c.model for c in cells].index):
        mine = [c for c in cells if c.model == model]
        timed = next((c for c in mine if c.planning_step_seconds and c.wall_step_seconds), None)
        spreads = [c.wall_spread for c in mine if c.wall_spread is not None and not c.same_as]
        spread = f"{100 * statistics.median(spreads):.0f}%" if spreads else ""
        ratios = [
            c.predicted_step_seconds / c.wall_step_seconds
            for c in mine
            if c.method == method and c.predicted_step_seconds and c.wall_step_seconds
        ]
        if timed is None or timed.planning_step_seconds is None or not timed.wall_step_seconds:
            lines.append(f"| {model} | none | | | | {spread} | {_ratio_range(ratios)} | |")
            continue
        moved = timed.planning_step_seconds / timed.wall_step_seconds
        lines.append(
            f"| {model} | {f'{timed.method} {timed.budget_label}'.strip()} "
            f"| {1e3 * timed.planning_step_seconds:.1f} | {1e3 * timed.wall_step_seconds:.1f} "
            f"| {moved:.2f} | {spread} | {_ratio_range(ratios)} "
            f"| {_ratio_range([r / moved for r in ratios])} |"
        )
    return "\n".join(lines) + "\n"


def _ratio_range(ratios: list[float]) -> str:
    """``lo-hi (k of n within the tolerance)``, or empty without ratios."""
    if not ratios:
        return ""
    within = sum(1 for r in ratios if abs(r - 1) <= PREDICTION_TOLERANCE)
    return (
        f"{min(ratios):.2f}-{max(ratios):.2f} "
        f"({within} of {len(ratios)} within {100 * PREDICTION_TOLERANCE:.0f}%)"
    )


def _predicted_over_measured(cell: Cell) -> str:
    if cell.predicted_step_seconds is None or not cell.wall_step_seconds:
        return ""
    return f"{cell.predicted_step_seconds / cell.wall_step_seconds:.2f}"


def headline_markdown(cells: list[Cell], method: str = "auto") -> str:
    """One row per model: per-block checkpointing against autockpt (``method``) at per-block's
    own peak and halfway to no checkpointing; peaks in MiB, step times as ratios."""
    lines = [
        "| model | no checkpoint | per-block | autockpt at per-block's peak "
        "| autockpt halfway | never over budget |",
        "|---|---:|---:|---:|---:|:-:|",
    ]
    for model in sorted({c.model for c in cells}, key=[c.model for c in cells].index):
        mine = [c for c in cells if c.model == model]
        none = next(c for c in mine if c.method == "none")
        blocks = next((c for c in mine if c.method == "per_block" and c.times), None)
        planned = [c for c in mine if c.method == method]

        def at(label: str, planned: list[Cell] = planned, blocks: Cell | None = blocks) -> str:
            cell = next((c for c in planned if label in c.budget_label.split("/")), None)
            if cell is None or blocks is None:
                return "not run"
            if cell.error:
                return "no plan: " + cell.error.split(": ", 1)[-1]
            return (
                f"{_mib(cell.measured_peak_bytes)} MiB, {paired_ratio(cell, blocks):.2f}x per-block"
            )

        over = sum(1 for c in planned if c.over_budget)
        block_text = (
            f"{_mib(blocks.measured_peak_bytes)} MiB, {blocks.ratio_to_none:.2f}x none"
            if blocks
            else "not run"
        )
        lines.append(
            f"| {model} | {_mib(none.measured_peak_bytes)} MiB | {block_text} "
            f"| {at('per_block_peak')} | {at('halfway')} "
            f"| {'yes' if not over else f'NO ({over})'} ({len([c for c in planned if not c.error])} plans) |"
        )
    return "\n".join(lines) + "\n"


def write(
    cells: list[Cell],
    targets: list[Target],
    out_dir: Path,
    meta: dict[str, Any],
    *,
    plots: bool = True,
) -> None:
    """``e2e.json``, ``e2e.csv``, ``summary.md``, ``headline.md`` and (``plots``) the two
    PNGs."""
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {
        **meta,
        "cells": [{**c.row(), "times": c.times, "wall_times": c.wall_times} for c in cells],
        "targets": [asdict(t) for t in targets],
    }
    (out_dir / "e2e.json").write_text(json.dumps(payload, indent=2) + "\n")
    (out_dir / "summary.md").write_text(summary_markdown(cells, targets))
    (out_dir / "headline.md").write_text(headline_markdown(cells))
    rows = [c.row() for c in cells]
    with open(out_dir / "e2e.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]) if rows else ["model"])
        writer.writeheader()
        writer.writerows(rows)
    if plots:
        _plots(cells, out_dir)


_STYLE = {
    "none": ("black", "s"),
    "per_block": ("tab:red", "D"),
    "titan_sac": ("darkred", ">"),
    "matmul_sac": ("salmon", "<"),
    "sequential": ("tab:orange", "v"),
    "sqrt": ("tab:brown", "^"),
    "compile_0.1": ("tab:purple", "P"),
    "compile_0.3": ("orchid", "v"),
    "compile_0.5": ("tab:pink", "X"),
    "greedy": ("tab:olive", "x"),
    "auto": ("tab:blue", "o"),
    "auto_segments": ("navy", "d"),
    "compile_auto": ("magenta", "p"),
    "dp": ("tab:cyan", "."),
    "ilp": ("tab:cyan", "."),
    "sac_ilp": ("tab:gray", "*"),
    "rockmate": ("tab:green", "h"),
}


def _plots(cells: list[Cell], out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({c.model for c in cells}, key=[c.model for c in cells].index)
    cols = min(3, len(models)) or 1
    rows = (len(models) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 4 * rows), squeeze=False)
    for ax, model in zip(axes.flat, models, strict=False):
        for method, (color, marker) in _STYLE.items():
            got = sorted(
                (
                    c
                    for c in cells
                    if c.model == model and c.method == method and c.ratio_to_none is not None
                ),
                key=lambda c: c.measured_peak_bytes,
            )
            if not got:
                continue
            ax.plot(
                [c.measured_peak_bytes / 2**20 for c in got],
                [c.ratio_to_none for c in got],
                marker=marker,
                color=color,
                label=method,
                linestyle=("--" if method == "auto_segments" else "-")
                if method in BUDGETED
                else "none",
                markersize=7,
            )
        ends = [
            next((c for c in cells if c.model == model and c.method == m and c.times), None)
            for m in ("per_block", "none")
        ]
        if all(ends) and ends[0].ratio_to_none is not None:
            ax.plot(  # the line a share of the blocks gives (per-block -> none)
                [c.measured_peak_bytes / 2**20 for c in ends],
                [ends[0].ratio_to_none, 1.0],
                color="black",
                linestyle=":",
                linewidth=1,
                label="line per-block -> none",
            )
        ax.set_title(model)
        ax.set_xlabel("measured peak (MiB)")
        ax.set_ylabel("step time / no checkpointing")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(models) :]:
        ax.axis("off")
    handles, labels = [], []
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    # As many legend columns as the figure's width holds; room below the axes for its rows.
    ncol = max(1, min(len(labels), 3 * cols))
    legend_rows = -(-len(labels) // ncol)
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=8)
    fig.tight_layout(rect=(0, (0.15 + 0.2 * legend_rows) / (4 * rows), 1, 1))
    fig.savefig(out_dir / "e2e_frontier.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 5))
    top = 1.0
    for method in (*BUDGETED, COMPILED_PLAN):
        got = [
            c
            for c in cells
            if c.method == method
            and c.measured_peak_bytes is not None
            and c.budget_bytes is not None
        ]
        if not got:
            continue
        color, marker = _STYLE[method]
        xs = [c.budget_bytes / 2**20 for c in got]
        ys = [c.measured_peak_bytes / 2**20 for c in got]
        top = max(top, *xs, *ys)
        ax.scatter(xs, ys, color=color, marker=marker, label=method, s=22)
    ax.plot([0, top], [0, top], color="grey", linestyle="--", label="budget")
    ax.set_xlabel("budget (MiB)")
    ax.set_ylabel("measured peak (MiB)")
    ax.set_title("measured peak vs budget (all models)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "e2e_budget.png", dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# entry points
# ---------------------------------------------------------------------------------------------


def run(
    quick: bool,
    out_dir: Path,
    *,
    models: tuple[str, ...] | None = None,
    methods: tuple[str, ...] | None = None,
    rounds: int | None = None,
    compile_models: tuple[str, ...] | None = None,
    device: str | None = None,
    log: Callable[[str], None] = print,
) -> list[Cell]:
    """Run the benchmark and write its files into ``out_dir``; return the cells.

    ``quick`` runs three models (GPT-2, Llama, block stack) at half batch with the
    :data:`QUICK_METHODS` and three timing rounds; the full run has every model and method
    and seven rounds.
    """
    chosen = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if chosen.type == "cpu":
        torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    all_cases = cases(chosen.type, quick=quick)
    names = models or (QUICK_MODELS if quick else tuple(c.name for c in all_cases))
    unknown = set(names) - {c.name for c in all_cases}
    if unknown:
        raise ValueError(
            f"unknown model(s) {sorted(unknown)}; choose from {[c.name for c in all_cases]}"
        )
    methods = methods or (QUICK_METHODS if quick else (*FIXED, *BUDGETED, COMPILED_PLAN))
    if "none" not in methods:
        methods = ("none", *methods)
    rounds = rounds or (3 if quick else 7)
    if compile_models is None:
        compile_models = () if quick else COMPILE_DEFAULT_MODELS
    started = time.perf_counter()
    cells: list[Cell] = []
    for case in (c for c in all_cases if c.name in names):
        cells += run_case(
            case,
            methods=methods,
            rounds=rounds,
            device=chosen,
            compile_models=compile_models,
            log=log,
        )
    targets = evaluate_targets(cells)
    meta = {
        "command": "autockpt bench e2e" + (" --quick" if quick else ""),
        "machine": machine(),
        "device": str(chosen),
        "rounds": rounds,
        "methods": list(methods),
        "models": {c.name: c.description for c in all_cases if c.name in names},
        "wall_seconds": time.perf_counter() - started,
    }
    write(cells, targets, out_dir, meta)
    log(f"wrote {out_dir}/ in {meta['wall_seconds']:.0f}s")
    return cells


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 models, 7 methods, 3 rounds")
    parser.add_argument("--out", type=Path, default=Path("out/e2e"))
    parser.add_argument("--models", default=None, help="comma-separated subset")
    parser.add_argument("--methods", default=None, help="comma-separated subset")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument(
        "--compile",
        default=None,
        help="models to torch.compile: 'all', 'none' or a comma-separated list",
    )
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    args = parser.parse_args(argv)

    def split(text: str) -> tuple[str, ...]:
        return tuple(x for x in text.split(",") if x)

    compile_models = None
    if args.compile == "all":
        compile_models = tuple(c.name for c in cases())
    elif args.compile == "none":
        compile_models = ()
    elif args.compile:
        compile_models = split(args.compile)
    run(
        args.quick,
        args.out,
        models=split(args.models) if args.models else None,
        methods=split(args.methods) if args.methods else None,
        rounds=args.rounds,
        compile_models=compile_models,
        device=args.device,
    )


if __name__ == "__main__":
    main()
