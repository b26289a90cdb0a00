"""Reports for people: plan tables, the memory timeline of one step, and the frontier of
recompute overhead against peak memory across budgets.

Reporting stays outside the pipeline: no stage (``autockpt/capture`` ... ``autockpt/planning``)
imports this module, tables need only ``rich`` (a dependency already) and matplotlib is imported
inside the functions that draw, so everything else works where matplotlib is not installed.
Figures are built on a bare :class:`matplotlib.figure.Figure` (no ``pyplot`` global state),
returned to the caller so that tests can inspect axes, labels and legend before saving.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autockpt.api import Planner
from autockpt.costs.blocks import NO_BLOCKS
from autockpt.errors import AutockptError, InfeasibleBudgetError, format_bytes
from autockpt.fit import BatchFit
from autockpt.measure import measure
from autockpt.plan import Plan
from solvers.sqrt import sqrt_plan

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from rich.console import RenderableType

MIB = 2**20


class ReportError(AutockptError):
    """A report cannot be made from what was given (e.g. a plan without a timeline)."""


class MissingDependencyError(AutockptError):
    """An optional dependency that a report needs (matplotlib) is not installed."""


# -- tables --------------------------------------------------------------------------------


def plan_tables(plan: Plan) -> list[RenderableType]:
    """The plan as rich tables: overview, memory breakdown, predicted vs measured, segments."""
    return [_overview_table(plan), _memory_table(plan), _peaks_table(plan), _segments_table(plan)]


def _overview_table(plan: Plan) -> RenderableType:
    """What the plan is for and who made it: the first thing a reader checks it against."""
    from rich.table import Table

    overview = Table(title=f"plan for {plan.model}", show_header=False, title_justify="left")
    overview.add_column("field", style="bold")
    overview.add_column("value")
    gap = "unknown" if plan.solver_gap is None else f"{100 * plan.solver_gap:.2f}%"
    rows = [
        (
            "graph",
            f"{plan.num_nodes} nodes in {len(plan.stages)} stages, captured with "
            f"{plan.capture_method}; fingerprint {plan.graph_fingerprint}",
        ),
        ("inputs", plan.input_signature),
        ("budget", f"{format_bytes(plan.budget_bytes)} (scope={plan.scope})"),
        ("covers", _what_the_budget_covers(plan)),
        ("solver", f"{plan.solver}: {plan.solver_status}, gap {gap}, {plan.solve_seconds:.3f} s"),
        (
            "written by",
            f"autockpt {plan.autockpt_version}, torch {plan.torch_version}, "
            f"schema {plan.schema_version}, device {plan.device}",
        ),
    ]
    rows += [("note", note) for note in plan.notes]
    for row in rows:
        overview.add_row(*row)
    return overview


def _memory_table(plan: Plan) -> RenderableType:
    """Where the predicted bytes go, so that a reader sees which part the budget squeezes."""
    from rich.table import Table

    memory = Table(title="memory breakdown (predicted)", title_justify="left")
    memory.add_column("part")
    memory.add_column("bytes", justify="right")
    parts = dataclasses.asdict(plan.memory)
    labels = {
        "kept_activations": "activations kept with the plan",
        "no_checkpoint_activations": "activations without checkpointing",
    }
    for name, value in parts.items():
        memory.add_row(labels.get(name, name), format_bytes(value))
    if plan.optimizer is not None:
        memory.add_row(f"{plan.optimizer.name} state", format_bytes(plan.optimizer.state_bytes))
        memory.add_row(
            f"{plan.optimizer.name} step (its own temporaries)",
            format_bytes(plan.optimizer.step_bytes),
        )
    if plan.accumulation_steps > 1:
        memory.add_row(
            f"gradients resident ({plan.accumulation_steps} micro-batches per step)",
            format_bytes(plan.memory.gradients),
        )
    if plan.calibration_bytes:
        memory.add_row(
            "calibration (measured, unseen by the graph)", format_bytes(plan.calibration_bytes)
        )
    return memory


def _peaks_table(plan: Plan) -> RenderableType:
    """Predicted against measured peak and step time: how far the prediction can be trusted."""
    from rich.table import Table

    peaks = Table(title="peak memory and step time", title_justify="left")
    peaks.add_column("")
    peaks.add_column("predicted", justify="right")
    peaks.add_column("measured", justify="right")

    def measured(value: Any, fmt: Callable[[Any], str]) -> str:
        return "not measured" if value is None else fmt(value)

    peaks.add_row(
        "peak with the plan",
        format_bytes(plan.predicted_peak_bytes),
        measured(plan.measured_peak_bytes, lambda value: _scoped(plan, value)),
    )
    peaks.add_row("budget", format_bytes(plan.budget_bytes), "")
    peaks.add_row("peak without checkpointing", format_bytes(plan.baseline_peak_bytes), "")
    if plan.baseline_peak_bytes != plan.no_checkpoint_peak_bytes:  # the model as written keeps more
        peaks.add_row(
            "the captured graph, no checkpoint", format_bytes(plan.no_checkpoint_peak_bytes), ""
        )
    peaks.add_row("leanest plan's peak", format_bytes(plan.minimum_peak_bytes), "")
    # Verification runs one step for its peak without timing it: say so rather than "not
    # measured" beside a measured peak.
    untimed = "not timed" if plan.measured_peak_bytes is not None else "not measured"
    peaks.add_row(
        "step time with the plan",
        f"{plan.predicted_step_seconds * 1e3:.2f} ms",
        untimed
        if plan.measured_step_seconds is None
        else f"{plan.measured_step_seconds * 1e3:.2f} ms",
    )
    peaks.add_row(
        "recompute",
        f"{plan.predicted_recompute_seconds * 1e3:.2f} ms "
        f"({100 * plan.recompute_fraction:.1f}% of the step)",
        "",
    )
    return peaks


def _segments_table(plan: Plan) -> RenderableType:
    """Each checkpointed segment, located in the model and the graph, with what it costs."""
    from rich.table import Table

    segments = Table(title=f"{len(plan.segments)} checkpointed segment(s)", title_justify="left")
    for name, justify in (
        ("#", "right"),
        ("stages", "left"),
        ("first module (node)", "left"),
        ("last module (node)", "left"),
        ("recompute", "right"),
        ("frees", "right"),
        ("rng", "left"),
        ("restores buffers", "left"),
        ("keeps", "left"),
    ):
        # Module paths are what a reader finds in the model, node names what they grep the
        # graph for: wrap them, never elide them.
        segments.add_column(name, justify=justify, overflow="fold")  # type: ignore[arg-type]
    for k, seg in enumerate(plan.segments):
        segments.add_row(
            str(k),
            f"[{seg.start_stage}, {seg.end_stage})",
            seg.first_label,
            seg.last_label,
            f"{seg.recompute_seconds * 1e3:.2f} ms",
            format_bytes(seg.bytes_freed),
            "yes" if seg.preserve_rng else "no",
            ", ".join(seg.restore_buffers) or "-",
            ", ".join(f"{kept.node} ({kept.op.split('.')[1]})" for kept in seg.kept_ops) or "-",
        )
    return segments


def _what_the_budget_covers(plan: Plan) -> str:
    if plan.optimizer is None and plan.accumulation_steps == 1:
        return "one forward and backward (the optimizer outside)"
    what = "one training iteration from steady state"
    if plan.optimizer is not None:
        what += f": forward, backward and the {plan.optimizer.name} step, its state resident"
    if plan.accumulation_steps > 1:
        what += f"; {plan.accumulation_steps} micro-batches per step"
    return what


def _scoped(plan: Plan, measured_total: int) -> str:
    """A measured peak as the plan's budget counts it. ``measured_peak_bytes`` is the whole
    step's peak; under scope ``activations`` the budget covers only what lies above
    parameters, buffers, inputs and gradients, so that part is shown (with the total)."""
    if plan.scope != "activations":
        return format_bytes(measured_total)
    above = plan.budgeted_bytes(measured_total)
    return f"{format_bytes(above)} ({format_bytes(measured_total)} in all)"


def render_plan(plan: Plan, width: int = 110) -> str:
    """The tables of :func:`plan_tables` as plain text (what ``autockpt show`` prints when
    its output is not a terminal)."""
    from rich.console import Console

    buffer = io.StringIO()
    console = Console(file=buffer, width=width, color_system=None, force_terminal=False)
    print_plan(plan, console)
    return buffer.getvalue()


def print_plan(plan: Plan, console: Any = None) -> None:
    """Print the tables of :func:`plan_tables` to ``console`` (a rich Console; default:
    stdout, 120 columns wide when stdout is not a terminal so node names stay whole)."""
    import sys

    from rich.console import Console

    if console is None:
        console = Console() if sys.stdout.isatty() else Console(width=120)
    for table in plan_tables(plan):
        console.print(table)


# -- figures -------------------------------------------------------------------------------


def require_matplotlib() -> None:
    """Raise :class:`MissingDependencyError` now, before expensive work, if plots cannot be
    drawn."""
    try:
        import matplotlib.figure  # noqa: F401
    except ImportError as error:
        raise MissingDependencyError(
            "plots need matplotlib: pip install matplotlib (or autockpt[bench])"
        ) from error


def _figure(width: float, height: float) -> Figure:
    require_matplotlib()
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def _scale(max_bytes: int) -> tuple[float, str]:
    return (2.0**30, "GiB") if max_bytes >= 2**30 else (float(MIB), "MiB")


def _steps(
    events: Sequence[tuple[str, int, int, float]],
) -> tuple[list[float], list[float], list[tuple[float, float]]]:
    """Cumulative times (ms) and bytes for a step plot, plus the recompute intervals."""
    times, values, recompute = [0.0], [], []
    for phase, _, nbytes, seconds in events:
        start = times[-1]
        times.append(start + 1e3 * max(seconds, 0.0))
        values.append(nbytes)
        if phase == "r":
            recompute.append((start, times[-1]))
    values.append(values[-1] if values else 0)
    return times, values, recompute


def timeline_figure(plan: Plan) -> Figure:
    """Predicted live memory over one training step: no checkpointing vs the plan, against
    time (a recompute costs its stage's forward again), with the budget as a line."""
    timeline = plan.timeline
    if timeline is None:
        raise ReportError(
            "this plan has no memory timeline (it was written by an older autockpt); "
            "re-create it with `autockpt plan` to plot it"
        )
    plan_times, plan_bytes, recompute = _steps(timeline.plan_events())
    base_times, base_bytes, _ = _steps(timeline.no_checkpoint_events())
    unit, unit_name = _scale(max([plan.budget_bytes, *plan_bytes, *base_bytes]))
    fig = _figure(9, 4.8)
    ax = fig.add_subplot()
    ax.step(
        base_times,
        [b / unit for b in base_bytes],
        where="post",
        color="tab:gray",
        label=f"no checkpointing (peak {format_bytes(max(base_bytes))})",
    )
    ax.step(
        plan_times,
        [b / unit for b in plan_bytes],
        where="post",
        color="tab:blue",
        label=f"plan, {len(plan.segments)} segment(s) (peak {format_bytes(max(plan_bytes))})",
    )
    ax.axhline(
        plan.budget_bytes / unit,
        color="tab:red",
        linestyle="--",
        label=f"budget {format_bytes(plan.budget_bytes)}",
    )
    for k, (start, end) in enumerate(recompute):
        ax.axvspan(
            start,
            end,
            color="tab:orange",
            alpha=0.2,
            linewidth=0,
            label="recompute" if k == 0 else None,
        )
    forward_end = 1e3 * sum(timeline.stage_forward_seconds)
    ax.axvline(forward_end, color="black", linestyle=":", linewidth=1, label="end of forward")
    ax.set_xlabel("time in one training step (predicted from the probe's per-node times, ms)")
    ax.set_ylabel(f"live memory ({unit_name}, scope={plan.scope})")
    ax.set_title(f"{plan.model}: predicted memory over one step")
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper right", fontsize="small")
    return fig


def save_figure(fig: Figure, path: str) -> None:
    """Write ``fig`` as an image; the format follows the file name (``.png``, ``.svg``...)."""
    fig.savefig(path, dpi=120)


# -- the batch that fits ------------------------------------------------------------------


def print_fit(result: BatchFit, console: Any = None) -> None:
    """The sizes ``fit_batch`` planned, as a table, and its answer."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    plan = result.plan
    table = Table(
        title=f"batch sizes planned under {format_bytes(plan.budget_bytes)}",
        title_justify="left",
    )
    for name in ("size", "leanest plan's peak", "fits", "predicted step", "samples/s"):
        table.add_column(name, justify="right")
    for c in result.candidates:
        table.add_row(
            str(c.size) + (" *" if c.size == result.batch_size else ""),
            format_bytes(c.minimum_peak_bytes),
            "yes" if c.fits else "no",
            "-" if c.predicted_step_seconds is None else f"{c.predicted_step_seconds * 1e3:.1f} ms",
            "-" if c.samples_per_second is None else f"{c.samples_per_second:.1f}",
        )
    console.print(table)
    measured = (
        "not measured"
        if plan.measured_peak_bytes is None
        else f"measured {format_bytes(plan.measured_peak_bytes)}"
    )
    console.print(
        f"{result.objective}: batch {result.batch_size} (* above); predicted peak "
        f"{format_bytes(plan.predicted_peak_bytes)}, {measured}; "
        f"{len(plan.segments)} checkpointed segment(s); {result.samples_per_second:.1f} "
        "samples/s predicted"
    )
    for note in result.notes:
        console.print(f"note: {note}")


def fit_figure(result: BatchFit) -> Figure:
    """Leanest plan's peak and predicted samples per second against the size, with the
    budget as a line and the answer marked."""
    fig = _figure(7, 6)
    peak_ax, speed_ax = fig.subplots(2, 1, sharex=True)
    sizes = [c.size for c in result.candidates]
    peak_ax.plot(
        sizes,
        [c.minimum_peak_bytes / MIB for c in result.candidates],
        "o-",
        label="leanest plan's peak",
    )
    peak_ax.axhline(result.plan.budget_bytes / MIB, color="red", linestyle="--", label="budget")
    peak_ax.axvline(result.batch_size, color="green", linestyle=":", label="answer")
    peak_ax.set_ylabel("MiB")
    peak_ax.legend()
    fitting = [c for c in result.candidates if c.samples_per_second]
    speed_ax.plot(
        [c.size for c in fitting],
        [c.samples_per_second for c in fitting],
        "o-",
        label="predicted samples/s at the budget",
    )
    speed_ax.axvline(result.batch_size, color="green", linestyle=":")
    speed_ax.set_xlabel("batch size")
    speed_ax.set_ylabel("samples / s")
    speed_ax.legend()
    return fig


# -- frontier ------------------------------------------------------------------------------


@dataclass(frozen=True)
class FrontierPoint:
    """One plan on the peak-memory / recompute plane. ``overhead`` is predicted recompute
    time as a fraction of the unmodified step; measured fields are ``None`` unless the
    frontier was measured."""

    label: str
    segments: tuple[tuple[int, int], ...]
    predicted_peak_bytes: int
    predicted_recompute_seconds: float
    overhead: float
    budget_bytes: int | None = None
    measured_peak_bytes: int | None = None
    measured_step_seconds: float | None = None
    measured_overhead: float | None = None


@dataclass(frozen=True)
class Frontier:
    """Pareto-optimal plans across budgets (``points``, by increasing peak) plus the
    sqrt(n) baseline and, when the model has repeated blocks, the plan that checkpoints each
    block (``per_block``; ``block_container``: the names of the containers holding the
    blocks, joined by ", ")."""

    model: str
    scope: str
    solver: str
    step_seconds: float
    minimum_peak_bytes: int
    no_checkpoint_peak_bytes: int
    points: tuple[FrontierPoint, ...]
    sqrt_point: FrontierPoint
    per_block: FrontierPoint | None
    block_container: str | None
    per_block_note: str | None = None
    """Why there is no per-block point (``per_block`` None), for every report to say."""
    as_written_peak_bytes: int | None = None
    """The model as written without checkpointing (``Planner.as_written_peak_bytes``): the
    baseline "no checkpointing" at the frontier's right end. ``no_checkpoint_peak_bytes``
    is the captured graph's, where the budgets end (every plan runs the graph)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def frontier(
    planner: Planner,
    *,
    budgets: int = 12,
    solver: str = "auto",
    measure: bool = False,
    on_step: Callable[[str, int, int], None] | None = None,
) -> Frontier:
    """Solve ``budgets`` budgets evenly spaced from the leanest plan's peak to the captured
    graph's no-checkpoint peak (above it every budget gets the empty plan) with one profile;
    keep the Pareto-optimal plans; add the sqrt(n) and per-block plans. The right end's
    reference, "no checkpointing", is the model as written (``as_written_peak_bytes``).
    ``measure`` rewrites and measures every point (slow: one real step each).
    ``on_step(what, done, total)`` reports progress."""
    if budgets < 2:
        raise ValueError(f"a frontier needs at least 2 budgets, got {budgets}")
    nested = planner.nested
    if nested is not None:
        raise ReportError(
            "no frontier for this model: its forward cannot be captured, so its submodule "
            f"calls are planned as units ({nested.path}), each of its own graph, and one "
            "step's stages do not exist; plan at the budgets you want (`autockpt plan "
            "--budget-gb`, or Planner.optimize), each measured against its budget"
        )
    report = on_step or (lambda what, done, total: None)
    low, high = planner.minimum_peak_bytes, planner.no_checkpoint_peak_bytes
    step = planner.step_seconds
    points = _pareto(_points_across_budgets(planner, budgets, solver, low, high, step, report))
    sqrt_point = _point(planner, "sqrt(n)", tuple(_sqrt_segments(planner)), step)
    container, block_segments = repeated_block_segments(planner)
    per_block = _point(planner, "per block", block_segments, step) if block_segments else None
    if measure:
        todo = [*points, sqrt_point, *([per_block] if per_block else [])]
        measured = _measured_points(planner, todo, report)
        points = tuple(measured[: len(points)])
        sqrt_point = measured[len(points)]
        per_block = measured[len(points) + 1] if per_block else None
    return Frontier(
        model=type(planner.model).__name__,
        scope=planner.scope,
        solver=solver,
        step_seconds=step,
        minimum_peak_bytes=low,
        no_checkpoint_peak_bytes=high,
        points=tuple(points),
        sqrt_point=sqrt_point,
        per_block=per_block,
        block_container=container if block_segments else None,
        per_block_note=None if block_segments else NO_BLOCKS,
        as_written_peak_bytes=planner.as_written_peak_bytes,
    )


def _points_across_budgets(
    planner: Planner,
    budgets: int,
    solver: str,
    low: int,
    high: int,
    step: float,
    report: Callable[[str, int, int], None],
) -> list[FrontierPoint]:
    """One point per distinct plan across evenly spaced budgets: the frontier's candidates."""
    found: dict[tuple[tuple[int, int], ...], FrontierPoint] = {}
    for k in range(budgets):
        report("solving budgets", k, budgets)
        budget = low + (high - low) * k // (budgets - 1)
        try:
            solution = planner.solve(max(budget, low), solver=solver)
        except InfeasibleBudgetError:  # a heuristic (sqrt, greedy) may miss a low budget
            continue
        segments = tuple(tuple(seg) for seg in solution.segments)
        if segments not in found:
            # labelled with the solver's own status, as plan and show label it
            found[segments] = _point(planner, solution.status, segments, step, budget)
    report("solving budgets", budgets, budgets)
    return list(found.values())


def _measured_points(
    planner: Planner, todo: list[FrontierPoint], report: Callable[[str, int, int], None]
) -> list[FrontierPoint]:
    """``todo`` with each plan's measured peak and step time: the frontier checked by real steps."""
    # Step times drift on a busy machine: time the unmodified model right before and
    # right after the plans and compare against the mean of the two.
    report("measuring plans", 0, len(todo) + 2)
    before = _measure(planner, planner.model).step_seconds
    results = []
    for k, point in enumerate(todo):
        report("measuring plans", k + 1, len(todo) + 2)
        results.append(_measure(planner, planner.rewrite(point.segments)))
    after = _measure(planner, planner.model).step_seconds
    report("measuring plans", len(todo) + 2, len(todo) + 2)
    base = (before + after) / 2
    return [
        dataclasses.replace(
            point,
            measured_peak_bytes=planner.budgeted_bytes(result),
            measured_step_seconds=result.step_seconds,
            measured_overhead=result.step_seconds / base - 1 if base > 0 else None,
        )
        for point, result in zip(todo, results, strict=True)
    ]


def _point(
    planner: Planner,
    label: str,
    segments: tuple[tuple[int, int], ...],
    step: float,
    budget: int | None = None,
) -> FrontierPoint:
    simulation = planner.simulate(segments)
    return FrontierPoint(
        label=label,
        segments=segments,
        predicted_peak_bytes=simulation.peak_bytes,
        predicted_recompute_seconds=simulation.recompute_seconds,
        overhead=simulation.recompute_seconds / step if step > 0 else 0.0,
        budget_bytes=budget,
    )


def _pareto(points: list[FrontierPoint]) -> list[FrontierPoint]:
    """Points that no other point beats on both peak and recompute, by increasing peak."""
    kept: list[FrontierPoint] = []
    for point in sorted(
        points, key=lambda p: (p.predicted_peak_bytes, p.predicted_recompute_seconds)
    ):
        if not kept or point.predicted_recompute_seconds < kept[-1].predicted_recompute_seconds:
            kept.append(point)
    return kept


def _sqrt_segments(planner: Planner) -> list[tuple[int, int]]:
    return sqrt_plan(planner.chain.problem)


def _measure(planner: Planner, module: Any) -> Any:
    return measure(
        module,
        planner.inputs,
        loss_fn=planner.loss_fn,
        repeat=5,
        optimizer=planner.optimizer,
        accumulation_steps=planner.accumulation_steps,
    )


def repeated_block_segments(planner: Planner) -> tuple[str | None, tuple[tuple[int, int], ...]]:
    """Checkpoint each of the model's repeated blocks (the hand-written baseline most code
    uses, "checkpoint every layer"), as stage ranges of the planner's chain, with the names
    of the containers holding them (:attr:`autockpt.costs.blocks.RepeatedBlocks.label`).

    The planner's own per-block plan (:func:`autockpt.costs.blocks.per_block_plan`, the one
    derivation: the same blocks seed its search, cut its chain and make the FSDP units).
    Returns ``(None, ())`` for a model without repeated blocks.
    """
    per = planner.prepared.per_block
    if per is None:
        return None, ()
    return per.label, tuple((start, end) for start, end in per.segments)


def frontier_figure(result: Frontier) -> Figure:
    """Recompute overhead (share of a step) against peak memory: the optimal plans across
    budgets, the sqrt(n) and per-block baselines, and the measured points if any."""
    everything = [
        *result.points,
        result.sqrt_point,
        *([result.per_block] if result.per_block else []),
    ]
    unit, unit_name = _scale(max(p.predicted_peak_bytes for p in everything))
    fig = _figure(8, 4.8)
    ax = fig.add_subplot()
    ax.plot(
        [p.predicted_peak_bytes / unit for p in result.points],
        [100 * p.overhead for p in result.points],
        marker="o",
        color="tab:blue",
        label=f"plans across budgets ({result.solver}), predicted",
    )
    ax.plot(
        [result.sqrt_point.predicted_peak_bytes / unit],
        [100 * result.sqrt_point.overhead],
        marker="*",
        markersize=14,
        linestyle="none",
        color="tab:orange",
        label=f"sqrt(n): {len(result.sqrt_point.segments)} equal segments",
    )
    if result.per_block is not None:
        ax.plot(
            [result.per_block.predicted_peak_bytes / unit],
            [100 * result.per_block.overhead],
            marker="D",
            markersize=9,
            linestyle="none",
            color="tab:green",
            label=f"per block: each child of '{result.block_container}'",
        )
    measured = [p for p in everything if p.measured_peak_bytes is not None]
    if measured:
        ax.plot(
            [p.measured_peak_bytes / unit for p in measured],
            [100 * (p.measured_overhead or 0.0) for p in measured],
            marker="x",
            linestyle="none",
            color="black",
            label="measured (peak, step-time increase)",
        )
    ax.axvline(
        result.minimum_peak_bytes / unit,
        color="tab:red",
        linestyle="--",
        linewidth=1,
        label=f"leanest plan {format_bytes(result.minimum_peak_bytes)}",
    )
    baseline = result.as_written_peak_bytes or result.no_checkpoint_peak_bytes
    ax.axvline(
        baseline / unit,
        color="tab:gray",
        linestyle=":",
        linewidth=1,
        label=f"no checkpointing {format_bytes(baseline)}",
    )
    if baseline != result.no_checkpoint_peak_bytes:  # the model as written keeps more
        ax.axvline(
            result.no_checkpoint_peak_bytes / unit,
            color="tab:olive",
            linestyle=":",
            linewidth=1,
            label=f"the captured graph, no checkpoint "
            f"{format_bytes(result.no_checkpoint_peak_bytes)}",
        )
    ax.set_xlabel(f"peak memory ({unit_name}, scope={result.scope})")
    ax.set_ylabel("recompute overhead (% of a step)")
    ax.set_title(f"{result.model}: recompute vs peak memory across budgets")
    ax.legend(loc="upper right", fontsize="small")
    return fig
