"""The compiled route: a model that came under ``torch.compile``. Its fastest step within the
budget: autockpt's plan, or torch.compile's own recompute told what peak to hit.

What this route decides (:class:`CompiledRoute`): which of the captured graph's verified plan
(compiled as the user compiled it) and compile's own partitions is handed back. Its range and
its plans are the captured graph's route (held as a value, :class:`GraphAnswers`); what it
adds is measuring the candidates compiled, below.

NOTE [compiled: partitioner budgets]. ``torch.compile`` has its own recompute knob,
``torch._functorch.config.activation_memory_budget``: a fraction of the bytes its min-cut
partitioner would save, not a peak. Its measured peak is not even monotone in it (a GPT on
a CPU: 0.1 -> 91.5 MiB, 0.3 -> 107.2, 0.5 -> 79.1), and inductor's fused kernels make its
recompute cheaper than the same recompute in eager segments: at compile's own 0.5 point,
autockpt's plan compiled took 1.06-1.10x compile's step. So when the model came compiled
(``optimize(torch.compile(model), ...)``) the candidates are autockpt's verified plan,
compiled as the user compiled it, and the model compiled at each partitioner budget of
``compile_budgets`` (0.1, 0.3, 0.5 by default); each is *measured* compiled (peak by the
allocator, step time side by side with the others), and the fastest whose measured peak
fits the budget is handed back. That turns compile's fraction into a real peak, and at
each of compile's own points its own partition is a candidate, so the answer is at least
as fast as the knob there (up to the clock's noise), and never over the budget.

Why measured, not predicted: the partitioner's choice and inductor's buffer reuse are not
in the replay (which models eager steps); measuring is what "verified compiled" already
meant. Budget 1.0 (the partition that saves everything) is never a candidate: that is the
un-checkpointed step, which planning never runs; autockpt's plan with no segments is.

Determinism: like node seconds (NOTE [timing: stored]), each candidate's measured peak and
seconds are published once per machine beside the model's node times, keyed by the
candidate (the backend and its options, the fraction, or the plan's segments); a later
process reads them instead of compiling and timing again, so the same request picks the
same candidate. Without a store each process measures its own (the plan notes say so).

NOTE [compiled: one clock]. Stored seconds were timed at another moment, on a machine whose
load moves a step's wall time by tens of percent: a plan timed now against a partition's
seconds stored an hour ago compares two moments, not two steps (Llama at compile's 0.3
point: the partition stored earlier was handed back at 1.078x the knob's step). So a
candidate timed in this call is timed side by side with the fastest stored candidate that
fits (compiled again: one more compile), and its seconds are published on that one's clock,
``stored x (own now / reference now)``: every stored time of a model is on the clock of the
call that timed its first candidates, and a choice between them is a ratio measured side by
side. Without a stored fitting candidate there is nothing to rescale to.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from autockpt.costs.timing import STORE_VERSION, Timing, publish, read_stored, stored_beside
from autockpt.errors import InfeasibleBudgetError
from autockpt.measure import Measurement, time_steps
from autockpt.plan import Plan
from autockpt.planning.request import Phases, Request
from autockpt.planning.routes.base import Finish, Replan, Solve
from autockpt.rewrite.apply import CompiledHandBack, rewrite_for_training
from autockpt.rewrite.result import mark_verified_compiled
from solvers import Solution

COMPILE_BUDGETS: tuple[float, ...] = (0.1, 0.3, 0.5)
"""The partitioner budgets tried by default: the points users set and issue reports name."""


@dataclass(frozen=True)
class Candidate:
    """One way to run the compiled step: ``fraction`` None is autockpt's plan compiled as
    the user compiled it; otherwise no segments and the partitioner at ``fraction``."""

    module: nn.Module
    fraction: float | None
    key: str
    """What the store knows this candidate by (backend, options, fraction or segments)."""

    @property
    def label(self) -> str:
        if self.fraction is None:
            return "autockpt's plan, compiled"
        return f"torch.compile at activation_memory_budget={self.fraction:g}"


@dataclass(frozen=True)
class Run:
    """A candidate's measured compiled step: its peak in the budget's scope (None: it ran
    out of device memory) and its median seconds (None: not timed, over the budget)."""

    budgeted_bytes: int | None
    peak_bytes: int | None
    seconds: float | None
    stored: bool = False
    """Read from the store (measured by an earlier process on this machine)."""
    beside: int | None = None
    """Timed in this call side by side with this candidate, and put on its stored clock
    (NOTE [compiled: one clock]); None: not rescaled."""


def candidate_key(backend: str, fraction: float | None, segments: object) -> str:
    """The store key of a candidate: the backend (name and options), and the fraction or,
    for autockpt's plan, its segments and kept operators."""
    described = json.dumps(
        {"backend": backend, "fraction": fraction, "plan": repr(segments)}, sort_keys=True
    )
    return hashlib.sha256(described.encode()).hexdigest()[:16]


def fastest_within(
    candidates: Sequence[Candidate],
    budget_bytes: int,
    timing: Timing | None,
    measure_peak: Callable[[nn.Module], tuple[int, int]],
    time_side_by_side: Callable[[list[nn.Module]], list[float]],
) -> tuple[int | None, list[Run]]:
    """The index of the fastest candidate whose measured peak fits ``budget_bytes`` (None:
    none fits), and every candidate's run. ``measure_peak(module)`` gives (budgeted bytes,
    peak bytes) of one compiled step; ``time_side_by_side`` the median seconds of each.

    Peaks and seconds stored beside ``timing`` are read; new ones are published (first
    writer wins), peaks and seconds apart: a candidate over this budget is not timed, and
    may be at a larger one. A candidate that is timed here or handed back has its own peak
    measured here first, whatever is stored: a compiled module can run eagerly (dynamo
    gives up on a frame after its recompile limit), and then it keeps everything; such a
    step is over the budget and neither timed nor chosen.

    Why this is long: peaks, then side-by-side times, then the choice, all over one list of
    runs that each step updates in place; the store's rules (NOTE [compiled: one clock])
    read in one order here."""
    runs: list[Run] = []
    now: set[int] = set()  # candidates whose own step was measured in this call

    def measure(k: int) -> Run:
        found = _peak(candidates[k], measure_peak)
        now.add(k)
        if found["budgeted_bytes"] is not None:  # one out of memory may fit another time
            _settled(timing, candidates[k], "peak", lambda: found)
        return Run(found["budgeted_bytes"], found["peak_bytes"], None)

    for k, candidate in enumerate(candidates):
        stored = _read(timing, candidate, "peak")
        if stored is None:
            runs.append(measure(k))
        else:
            runs.append(Run(stored.get("budgeted_bytes"), stored.get("peak_bytes"), None, True))

    def fits(k: int) -> bool:
        budgeted = runs[k].budgeted_bytes
        return budgeted is not None and budgeted <= budget_bytes

    to_time = []
    for k in range(len(candidates)):
        if fits(k) and _read(timing, candidates[k], "time") is None:
            if k not in now:
                runs[k] = measure(k)  # this module's own compiled step, before timing it
            if fits(k):
                to_time.append(k)
    reference, reference_seconds = _reference(candidates, timing, fits, to_time)
    if reference is not None and reference not in now:
        runs[reference] = measure(reference)  # it runs again: its own step first
        if not fits(reference):
            reference = None
    if to_time:
        timed = [candidates[k].module for k in to_time]
        if reference is not None:
            timed.append(candidates[reference].module)
        measured = time_side_by_side(timed)
        if reference is not None:  # onto the stored clock (NOTE [compiled: one clock])
            scale = reference_seconds / max(measured.pop(), 1e-12)
            measured = [seconds * scale for seconds in measured]
        for k, seconds in zip(to_time, measured, strict=True):
            _settled(timing, candidates[k], "time", lambda s=seconds: {"seconds": s})
    while True:
        ranked = []
        for k in range(len(candidates)):
            found = _read(timing, candidates[k], "time") if fits(k) else None
            beside = None
            if k in to_time:
                own = measured[to_time.index(k)]
                if found is None or found["seconds"] == own:  # this call's own seconds
                    found = {"seconds": own, "stored": False}
                    beside = reference
            if found is not None:
                run = runs[k]
                runs[k] = Run(
                    run.budgeted_bytes,
                    run.peak_bytes,
                    float(found["seconds"]),
                    run.stored or found["stored"],
                    beside,
                )
                ranked.append((runs[k].seconds, k))
        if not ranked:
            return None, runs
        best = min(ranked)[1]
        if best in now:
            return best, runs
        runs[best] = measure(best)  # handed back: its own step within the budget, measured
        if fits(best):
            runs[best] = dataclasses.replace(runs[best], seconds=min(ranked)[0], stored=True)
            return best, runs


def _reference(
    candidates: Sequence[Candidate],
    timing: Timing | None,
    fits: Callable[[int], bool],
    to_time: Sequence[int],
) -> tuple[int | None, float]:
    """The candidate whose stored seconds put this call's timings on the stored clock, and
    those seconds: the fastest stored one that fits ((None, 0.0): nothing to time, or none
    is stored)."""
    stored = []
    for k, candidate in enumerate(candidates):
        found = (
            _read(timing, candidate, "time") if to_time and k not in to_time and fits(k) else None
        )
        if found is not None:
            stored.append((float(found["seconds"]), k))
    if not stored:
        return None, 0.0
    seconds, k = min(stored)
    return k, seconds


def _peak(candidate: Candidate, measure_peak: Callable[[nn.Module], tuple[int, int]]) -> dict:
    try:
        budgeted, peak = measure_peak(candidate.module)
    except torch.OutOfMemoryError:
        # a partition over a tight budget can exceed the device: not a candidate
        return {"budgeted_bytes": None, "peak_bytes": None}
    return {"budgeted_bytes": budgeted, "peak_bytes": peak}


def _path(timing: Timing | None, candidate: Candidate, what: str) -> Path | None:
    return stored_beside(timing, f"compiled-{candidate.key}-{what}")


def _read(timing: Timing | None, candidate: Candidate, what: str) -> dict | None:
    path = _path(timing, candidate, what)
    found = read_stored(path) if path is not None else None
    return None if found is None else {**found, "stored": True}


def _settled(
    timing: Timing | None, candidate: Candidate, what: str, measure: Callable[[], dict]
) -> dict:
    """The stored record of ``candidate`` (``what``: its peak or its seconds), else
    ``measure()``'s, published now; ``stored`` says whether another process measured it."""
    found = _read(timing, candidate, what)
    if found is not None:
        return found
    own = measure()
    path = _path(timing, candidate, what)
    if path is None:
        return {**own, "stored": False}
    publish(path, {"version": STORE_VERSION, **own})
    again = read_stored(path)
    if again is None or {k: again.get(k) for k in own} == own:
        return {**own, "stored": False}
    return {**again, "stored": True}  # another process published first: every one uses it


def check_compile_budgets(given: object) -> tuple[float, ...]:
    """``compile_budgets`` as a tuple of fractions in [0, 1), or a typed error saying what
    is expected (before any planning work)."""
    if isinstance(given, (str, bytes)) or not isinstance(given, Sequence):
        raise TypeError(
            "compile_budgets must be a sequence of activation_memory_budget fractions in "
            f"[0, 1), such as (0.1, 0.3, 0.5), or () to measure autockpt's plan alone; got {given!r}"
        )
    fractions = []
    for value in given:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"compile_budgets holds {value!r}: each must be a number in [0, 1)")
        if not 0.0 <= float(value) < 1.0:
            raise ValueError(
                f"compile_budgets holds {value!r}: each must be in [0, 1) (1.0 saves "
                "everything, the un-checkpointed step, which planning never runs)"
            )
        fractions.append(float(value))
    return tuple(sorted(set(fractions)))


def compiled_notes(
    candidates: Sequence[Candidate], runs: Sequence[Run], best: int, budget_bytes: int
) -> tuple[str, ...]:
    """What the plan says of the compiled candidates: each one's measured peak and step,
    and which was handed back."""
    lines = [
        "compiled candidates, measured compiled (NOTE [compiled: partitioner budgets]); "
        f"handed back: {candidates[best].label}"
    ]
    for candidate, run in zip(candidates, runs, strict=True):
        if run.budgeted_bytes is None:
            said = "ran out of device memory"
        else:
            fits = "within" if run.budgeted_bytes <= budget_bytes else "over"
            said = f"peak {run.budgeted_bytes} B in the budget's scope ({fits} {budget_bytes} B)"
            if run.seconds is not None:
                said += f", step {run.seconds * 1e3:.2f} ms"
            if run.stored:
                said += " (stored: measured earlier on this machine)"
            elif run.beside is not None:
                said += (
                    f" (timed beside {candidates[run.beside].label}, on its stored clock: "
                    "NOTE [compiled: one clock])"
                )
        lines.append(f"{candidate.label}: {said}")
    return tuple(lines)


class GraphAnswers(Protocol):
    """What the compiled route asks of the captured graph's route it is composed over
    (NOTE [routes: protocol]; autockpt/planning/routes/captured.py)."""

    model: nn.Module
    inputs: Any
    request: Request
    phases: Phases
    hand_back: Any
    capture: Any
    profile: Any
    meta: bool
    minimum_peak_bytes: int
    no_checkpoint_peak_bytes: int
    breakdown: dict[str, int]
    planning_peak_bytes: int | None

    def solve(self, budget_bytes: int, how: Solve) -> Solution: ...
    def optimize(
        self, budget_bytes: int, how: Solve, finish: Finish, replan: Replan
    ) -> nn.Module: ...
    def fit(self, budget_bytes: int, how: Solve) -> nn.Module: ...
    def plan_of(self, solution: Solution, budget_bytes: int) -> Plan: ...
    def measure(self, result: nn.Module, timed: bool = False) -> Measurement: ...
    def budgeted_bytes(self, measurement: Measurement) -> int: ...
    def measured_infeasible(
        self, budget_bytes: int, underestimate: int
    ) -> InfeasibleBudgetError: ...
    def as_written_or_none(self) -> int | None: ...


class CompiledRoute:
    """NOTE [compiled: partitioner budgets], as a route over the captured graph's: the same
    range and plans; :meth:`optimize` measures compile's own partitions beside the plan."""

    def __init__(self, graph: GraphAnswers) -> None:
        assert isinstance(graph.hand_back, CompiledHandBack)
        self.graph = graph
        self.hand_back: CompiledHandBack = graph.hand_back

    @property
    def minimum_peak_bytes(self) -> int:
        return self.graph.minimum_peak_bytes

    @property
    def no_checkpoint_peak_bytes(self) -> int:
        return self.graph.no_checkpoint_peak_bytes

    @property
    def breakdown(self) -> dict[str, int]:
        return self.graph.breakdown

    @property
    def planning_peak_bytes(self) -> int | None:
        return self.graph.planning_peak_bytes

    @property
    def meta(self) -> bool:
        return self.graph.meta

    def solve(self, budget_bytes: int, how: Solve) -> Solution:
        return self.graph.solve(budget_bytes, how)

    def as_written_or_none(self) -> int | None:
        return self.graph.as_written_or_none()

    def optimize(self, budget_bytes: int, how: Solve, finish: Finish, replan: Replan) -> nn.Module:
        """The fastest of the graph's verified plan and compile's partitions at
        ``how.compile_budgets`` (measured only when verifying on a real device; else the
        graph's plan alone), ``finish``-ed."""
        graph = self.graph
        if not how.verify or graph.meta:
            fractions: tuple[float, ...] = ()
        elif how.compile_budgets is None:
            fractions = COMPILE_BUDGETS
        else:
            fractions = check_compile_budgets(how.compile_budgets)
        if not fractions:
            return graph.optimize(budget_bytes, how, finish, replan)
        try:
            try:
                planned = graph.fit(budget_bytes, how)
            except InfeasibleBudgetError as error:
                # compile's own partitions may still fit (NOTE [compiled: partitioner budgets])
                result = self._fastest(None, budget_bytes, fractions, error, finish)
            else:
                result = self._fastest(planned, budget_bytes, fractions, None, finish)
        finally:
            graph.phases.stop()
        finish(result)
        return result

    def _fastest(
        self,
        planned: nn.Module | None,
        budget_bytes: int,
        fractions: tuple[float, ...],
        infeasible: InfeasibleBudgetError | None,
        finish: Finish,
    ) -> nn.Module:
        """The fastest of the verified plan (``planned``; None: no plan fits) and the model
        compiled at each partitioner budget, by measured peak and time (NOTE [compiled:
        partitioner budgets]). ``finish`` sets the result's precision-change rule before its
        last measured step: dynamo guards on it, and set afterwards it made the user's first
        step compile again, which kept 16-64 bytes more than the step planning measured (over
        the budget at compile's own 0.5 point on GPT-2)."""
        graph, hand_back = self.graph, self.hand_back
        graph.phases.start("verify", "measuring torch.compile's own partitions")
        backend = hand_back.backend_name + repr(getattr(hand_back.context, "_dynamic", None))
        plain = rewrite_for_training(graph.model, graph.capture, [], graph.inputs)
        candidates = [
            Candidate(
                hand_back.at_budget(plain, fraction),
                fraction,
                candidate_key(backend, fraction, None),
            )
            for fraction in fractions
        ]
        if planned is not None:
            plan = planned.plan
            segments = [(s.first_node, s.last_node, s.kept_ops) for s in plan.segments]
            key = candidate_key(backend, None, segments)
            candidates.insert(0, Candidate(planned, None, key))

        def measure_peak(module: nn.Module) -> tuple[int, int]:
            checked = graph.measure(module)
            return graph.budgeted_bytes(checked), checked.peak_bytes

        def side_by_side(modules: list[nn.Module]) -> list[float]:
            with graph.request.precision.entered(graph.request.device):
                return time_steps(modules, graph.inputs, loss_fn=graph.request.loss_fn)

        while True:
            best, runs = fastest_within(
                candidates, budget_bytes, graph.profile.timing, measure_peak, side_by_side
            )
            if best is None:
                if infeasible is not None:
                    raise infeasible
                raise graph.measured_infeasible(budget_bytes, 0)
            result = self._handed_back(candidates, runs, best, budget_bytes)
            finish(result)
            # The module as handed back, its final plan and re-plan in place (dynamo guards
            # on both, so this step compiles it once more): its own step is the promise, and
            # the user's first step compiles nothing.
            final = graph.measure(result)
            if graph.budgeted_bytes(final) <= budget_bytes:
                # recorded in place: a new plan object would fail dynamo's guard on it and
                # compile the module once more, which is not the step just measured
                object.__setattr__(result.plan, "measured_peak_bytes", final.peak_bytes)
                return result
            candidates = [c for k, c in enumerate(candidates) if k != best]

    def _handed_back(
        self, candidates: list[Candidate], runs: list[Run], best: int, budget_bytes: int
    ) -> nn.Module:
        """The chosen compiled candidate with its plan (NOTE [compiled: partitioner
        budgets])."""
        notes = compiled_notes(candidates, runs, best, budget_bytes)
        chosen, run = candidates[best], runs[best]
        result = chosen.module
        if chosen.fraction is None:
            result.plan = dataclasses.replace(
                result.plan,
                measured_step_seconds=run.seconds,
                notes=(*result.plan.notes, *notes),
            )
            return result
        # no segments: the partitioner recomputes; peak and step measured compiled
        empty = Solution([], 0.0, 0, "feasible", "compile", 0.0, None)
        plan = self.graph.plan_of(empty, budget_bytes)
        mark_verified_compiled(result._orig_mod)
        result.plan = dataclasses.replace(
            plan,
            compile_memory_budget=chosen.fraction,
            predicted_peak_bytes=run.peak_bytes,
            predicted_recompute_seconds=0.0,
            predicted_step_seconds=run.seconds,
            recompute_fraction=0.0,
            measured_peak_bytes=run.peak_bytes,
            measured_step_seconds=run.seconds,
            notes=(*plan.notes, *notes),
        )
        return result
