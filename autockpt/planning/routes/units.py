"""The units route: a step that cannot be captured whole (NOTE [nested: units]): the root's
own forward, or an fx leaf that hides repeated blocks where torch.export fails too (NOTE
[routes: leaves that hide blocks]).

What this route decides: which plan each unit gets (its submodule calls, found by
autockpt/planning/nested.py) under the one budget of the whole step. Each distinct unit is
planned once by a planner of its own (the front door's, handed in: this route does not know
the front door), summarised by a few options, and one option per unit is chosen
(:func:`solvers.units.least_seconds`); the root's own code runs eagerly, so its share of the
peak is measured, not modelled. Why a route of its own: its minimum, its plans and its
verification are of the whole step made of many graphs, and it has no graph, profile or
search of the root to offer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

from autockpt.base.inputs import Inputs, given_input_names
from autockpt.base.runtime import loss_name
from autockpt.errors import AutockptError, InfeasibleBudgetError, TraceError
from autockpt.measure import Measurement, static_bytes
from autockpt.plan import MemoryBreakdown, Plan, Segment, UnitPlan, scoped_bytes
from autockpt.planning.make_plan import make_plan
from autockpt.planning.nested import Units, find_units, unit_key
from autockpt.planning.request import Phases, ProgressFn, Request
from autockpt.planning.routes.base import Finish, Replan, Solve, measure_step
from autockpt.planning.specs import segment_specs
from autockpt.planning.verify import Attempt, fit_by_measuring
from autockpt.rewrite.apply import apply_plan, same
from autockpt.rewrite.result import plain_module, watch_units_precision
from autockpt.rewrite.submodule import replace_submodules
from solvers import Solution, replay
from solvers.units import UnitOption, leanest, least_seconds, step_peak, step_seconds

PlanUnit = Callable[[nn.Module, Inputs, tuple[str, ...]], Any]
"""Builds the planner of one unit from its module, its recorded inputs and the leaf modules
inside it (the front door's ``Planner``, scope "total", the units' quiet loss)."""

_AS_WRITTEN, _WHOLE = 0, 1
"""Where every distinct unit's options list its plan "left as written" and "checkpointed
whole" (:func:`_options`)."""

_SHARES = (0.25, 0.5, 0.75)
"""Where between a unit's leanest plan and no checkpointing its middle options are planned."""


@dataclasses.dataclass(frozen=True)
class _Option:
    """One candidate plan of a distinct unit: the solver's summary and what makes it."""

    summary: UnitOption
    segments: tuple[tuple[int, int], ...]
    kept: tuple[tuple[int, ...], ...]
    label: str


class UnitsRoute:
    """Plan ``model``'s units (NOTE [nested: units]) for any budget of the whole step.

    ``error`` is the root's capture failure. ``planners`` gives each unit's planner (an
    :class:`autockpt.api.Planner` of the unit called with its recorded inputs, scope
    "total", default loss: the sum of its floating outputs), one per distinct unit; the
    caller builds them, so this module does not know the front door. ``measure_step``
    measures the root's whole step of a result, memory only.
    """

    def __init__(
        self,
        model: nn.Module,
        inputs: Inputs,
        error: TraceError,
        found: Units,
        planners: list[Any],
        *,
        scope: str,
        leaf_modules: tuple[str, ...],
        loss: str,
        precision_note: str,
        choose_seconds: float,
        progress: ProgressFn,
        measure_step: Callable[[nn.Module], Measurement],
    ) -> None:
        self.model, self.inputs, self.error = model, inputs, error
        self.eager = runs_eagerly(error)
        """What runs eagerly and why, for notes and messages."""
        self.hand_back: Callable[[nn.Module], nn.Module] = same
        """How a result is handed back (compiled again when the model came compiled)."""
        self.planning_peak_bytes: int | None = None
        self.units, self.found_notes = found.units, found.notes
        self.planners, self.scope, self.measure_step = planners, scope, measure_step
        self.leaf_modules, self.loss = leaf_modules, loss
        self.precision_note = precision_note
        """The precision the units were planned in, as a plan's note records it (a call in
        another precision plans again: NOTE [rewrite: precision change])."""
        self.phase_seconds = {"capture": choose_seconds}
        """Wall seconds of what this planner adds to the units' planners' phases."""
        self.path = ", ".join(f"'{u.path}'" for u in self.units)
        """The units, for messages."""
        self._distinct: dict[int, list[_Option]] = {}
        self.options: list[list[_Option]] = []
        for planner in planners:
            if id(planner) not in self._distinct:
                self._distinct[id(planner)] = _options(planner)
            self.options.append(self._distinct[id(planner)])
        self._summaries = [[o.summary for o in opts] for opts in self.options]
        self._modules: dict[tuple[str, int, int], nn.Module] = {}
        self._plans: dict[tuple[int, int], Plan] = {}
        # The whole step's static part: parameters, buffers and inputs, parameter gradients.
        self.static_total = static_bytes(model, inputs) + _gradient_bytes(model.parameters())
        self.static_bytes = 0 if scope == "total" else self.static_total
        """What scope="activations" leaves out."""
        self.unseen_bytes = 0  # learnt from the measured steps below
        none = tuple(_AS_WRITTEN for _ in self.options)
        measured, per_block = self._measure_hand_choices(progress, none)
        self.leanest_choice = min(measured, key=lambda choice: (measured[choice], choice))
        self.leanest_measured_bytes = measured[self.leanest_choice]
        # what the units' replays do not see (the root's own activations), learnt from the
        # leanest choice's measured step (negative where the replays over-count)
        unseen = self.leanest_measured_bytes - self._predicted_total(self.leanest_choice)
        self.python_draws = found.python_draws
        if self.python_draws:
            # The measured step drew from Python's or NumPy's generator, which cannot be put
            # at its worst case: it may have skipped a layer a later step runs. Only the
            # replays' worst case (every unit runs) is trusted below the measurement.
            unseen = max(0, unseen)
        self.unseen_bytes = unseen
        self.minimum_peak_bytes = self._scoped(
            max(self.leanest_measured_bytes, self._predicted_total(self.leanest_choice))
        )
        """The leanest measured choice's whole step: achievable by construction, and at most
        checkpointing each repeated block (or every unit) by hand (with Python or NumPy
        draws in the root, at least its worst-case prediction)."""
        self.no_checkpoint_peak_bytes = self._scoped(self._predicted_total(none))
        self.per_block_peak_bytes = (
            self._scoped(measured[per_block]) if per_block in measured else None
        )
        """Measured peak of checkpointing each repeated block whole, the rest as written
        (None without a repeated class: nothing to checkpoint by hand)."""
        self.breakdown = {
            "parameters, buffers, inputs and gradients": self.static_total,
            "the units' activations (leanest choice)": step_peak(
                self._summaries, self.leanest_choice
            ),
            "the root's own code (measured)": max(0, self.unseen_bytes),
        }

    def _measure_hand_choices(
        self, progress: ProgressFn, none: tuple[int, ...]
    ) -> tuple[dict[tuple[int, ...], int], tuple[int, ...]]:
        """The measured whole-step peaks of the leanest choice by the units' replays and of
        the two a user writes by hand (every unit checkpointed whole; each repeated block
        whole, the rest as written), and the per-block choice. The root's own activations
        lie between the units, unseen by their replays, so which is leanest is measured: one
        step each, memory only."""
        per_unit = tuple(_WHOLE for _ in self.options)
        classes = [type(plain_module(self.model.get_submodule(u.path))) for u in self.units]
        per_block = tuple(
            whole if classes.count(cls) > 1 else free
            for whole, free, cls in zip(per_unit, none, classes, strict=True)
        )
        progress("measuring the leanest choices' whole steps")
        started = time.perf_counter()
        measured: dict[tuple[int, ...], int] = {}
        lean = leanest(self._summaries)
        for choice in (lean, per_block, per_unit):
            # never the un-checkpointed step (no repeated class: per_block checkpoints
            # nothing), unless it is the leanest there is
            if choice not in measured and (choice != none or choice == lean):
                measured[choice] = self.measure_step(self._module(choice)).peak_bytes
        self.phase_seconds["verify"] = time.perf_counter() - started
        return measured, per_block

    # -- predictions ----------------------------------------------------------------------

    def _predicted_total(self, choice: tuple[int, ...]) -> int:
        """Total bytes of the whole step predicted for ``choice``, with the measured
        correction (:attr:`unseen_bytes`, 0 until it is known)."""
        return self.static_total + step_peak(self._summaries, choice) + self.unseen_bytes

    def _scoped(self, total_bytes: int) -> int:
        return scoped_bytes(total_bytes, self.scope, self.static_bytes)

    # -- plans ----------------------------------------------------------------------------

    # -- the route (NOTE [routes: protocol]) ---------------------------------------------

    meta = False
    """The units are found by running the root's forward: never on the meta device."""

    def as_written_or_none(self) -> int | None:
        return None  # the root's own code runs eagerly: its step is measured, not modelled

    def solve(self, budget_bytes: int, how: Solve) -> Solution:
        raise AttributeError(
            f"Planner.solve is not available: {self.eager}, so this planner plans "
            f"submodule calls as units ({self.path}); use "
            "optimize(), minimum_peak_bytes and no_checkpoint_peak_bytes, or "
            "planner.nested.planners for each unit's own planner"
        )

    def optimize(self, budget_bytes: int, how: Solve, finish: Finish, replan: Replan) -> nn.Module:
        """The units' choice for ``budget_bytes`` (:meth:`choose`), handed back as the model
        came; a result of units plans the whole step again from the user's model in another
        precision (``replan``). ``finish`` is the front door's to apply (it sets it after)."""
        units = self.choose(budget_bytes, verify=how.verify)
        watch_units_precision(
            units, lambda args, kwargs: replan(self.model, args, kwargs), "replan"
        )
        return self.hand_back(units)

    def choose(self, budget_bytes: int, *, verify: bool) -> nn.Module:
        """Choose each unit's plan so that the root's whole step fits ``budget_bytes`` (in
        the user's scope) at the least predicted seconds; measure the step to check
        (``verify``). The leanest choice, measured to fit the minimum, is the last round's.
        The solver, its time limit and selective recompute were used when the units'
        options were made (their planners' defaults)."""
        if budget_bytes < self.minimum_peak_bytes:
            raise self._infeasible(budget_bytes, self.minimum_peak_bytes)
        room_total = budget_bytes + self.static_bytes - self.static_total - self.unseen_bytes

        def attempt(underestimate: int, last_round: bool) -> Attempt[tuple[int, ...]]:
            choice = (
                None if last_round else least_seconds(self._summaries, room_total - underestimate)
            )
            if choice is None:
                choice = self.leanest_choice
            return Attempt(
                self._module(choice), choice, self._scoped(self._predicted_total(choice))
            )

        def measure(found: Attempt[tuple[int, ...]]) -> tuple[int, Measurement]:
            checked = self.measure_step(found.result)  # the root's whole step, memory only
            used = self._scoped(checked.peak_bytes)
            if found.found == self.leanest_choice and used > self.minimum_peak_bytes:
                # measured above the minimum stated when planning began (a step that drew
                # otherwise): the measured peak is the minimum from now on, so that it is
                # achievable (NOTE [routes: measured minimum])
                self.minimum_peak_bytes = used
            return used, checked

        def out_of_reach(underestimate: int, used: int) -> InfeasibleBudgetError:
            # the last round measured the leanest choice (``used``): what the step needs
            return self._infeasible(
                budget_bytes, max(used, self.minimum_peak_bytes, budget_bytes + 1)
            )

        fitted = fit_by_measuring(budget_bytes, attempt, measure if verify else None, out_of_reach)
        result = fitted.attempt.result
        result.plan = self._plan(fitted.attempt.found, budget_bytes, fitted.measurement)
        return result

    def _module(self, choice: tuple[int, ...]) -> nn.Module:
        """The root with each unit replaced by its chosen plan's module (or left as is)."""
        replacements = {}
        for unit, planner, opts, k in zip(
            self.units, self.planners, self.options, choice, strict=True
        ):
            if not opts[k].segments:
                continue
            key = (unit.path, id(planner), k)
            if key not in self._modules:
                child = self.model.get_submodule(unit.path)
                self._modules[key] = apply_plan(child, self._unit_plan(planner, k), unit.inputs)
            replacements[unit.path] = self._modules[key]
        return replace_submodules(self.model, replacements)

    def _unit_plan(self, planner: Any, k: int) -> Plan:
        """The plan of option ``k`` of a distinct unit, for its own graph."""
        key = (id(planner), k)
        if key not in self._plans:
            option = self._distinct[id(planner)][k]
            solution = Solution(
                segments=[tuple(seg) for seg in option.segments],
                recompute_seconds=option.summary.seconds,
                peak_bytes=planner.predict(option.segments, option.kept),
                status="feasible",
                method="units",
                solve_seconds=0.0,
                gap=None,
                kept=option.kept,
            )
            specs = segment_specs(
                planner.chain, planner.profile, planner.capture, solution, planner.trace
            )
            self._plans[key] = make_plan(
                planner.prepared,
                planner.predictor,
                solution,
                specs,
                max(1, solution.peak_bytes),
                minimum_peak_bytes=planner.minimum_peak_bytes,
                no_checkpoint_peak_bytes=planner.no_checkpoint_peak_bytes,
            )
        return self._plans[key]

    def _infeasible(self, budget_bytes: int, minimum: int) -> InfeasibleBudgetError:
        hint = (
            "The root's forward runs eagerly and its submodule calls are planned as units "
            f"({self.path}): the minimum is the whole step of the units' leanest plans, as "
            f"measured ({self.leanest_measured_bytes} bytes)."
        )
        return InfeasibleBudgetError(budget_bytes, minimum, self.breakdown, self.scope, hint)

    def _plan(
        self, choice: tuple[int, ...], budget_bytes: int, checked: Measurement | None
    ) -> Plan:
        """The whole step's plan: every checkpointed unit's own plan (``units``), and their
        segments restated in the model's terms (docs/plan-schema.md, "units").

        Why this is long: one :class:`Plan` record of some thirty fields, and the notes that
        explain a plan of units to its reader."""
        units, stages, segments, nodes = [], [], [], 0
        fingerprints = hashlib.sha256()
        described: list[str] = []
        for unit, planner, opts, k in zip(
            self.units, self.planners, self.options, choice, strict=True
        ):
            fingerprints.update(f"{unit.path}:{planner.capture.fingerprint()};".encode())
            described.append(f"'{unit.path}': {opts[k].label}")
            if not opts[k].segments:
                continue
            plan = self._unit_plan(planner, k)
            units.append(UnitPlan(path=unit.path, plan=plan))
            offset = len(stages)
            stages += [(f"{unit.path}:{a}", f"{unit.path}:{b}") for a, b in plan.stages]
            nodes += plan.num_nodes
            segments += [_in_the_model(seg, unit.path, offset) for seg in plan.segments]
        recompute = step_seconds(self._summaries, choice)
        unit_seconds = sum(planner.profile.step_seconds for planner in self.planners)
        first = self.planners[0]
        parameters = list(self.model.parameters())
        notes = (
            f"{self.eager}; the submodule calls it makes are planned "
            f"as {len(self.units)} units, checkpointed whole, planned inside or left as "
            "written under the one budget of the whole step",
            *(f"unit {text}" for text in described),
            *self.found_notes,
            *(
                f"'{u.path}' was not called in the recorded run; planned for the worst case "
                "that it runs"
                for u in self.units
                if not u.called
            ),
            f"predicted peaks are the whole step's: the units' replays plus the static part, "
            f"plus {self.unseen_bytes} bytes the root's own code adds (measured once on the "
            "leanest choice's step; negative: the replays over-count)",
            "predicted seconds are the units' (the root's own code is not timed)",
            self.precision_note,
            *(
                [
                    "the root's code draws from "
                    + " and ".join(self.python_draws)
                    + "'s generator, which cannot be put at its worst case: a unit it skips in "
                    "one step may run in another, so every unit is planned as running and no "
                    "measured step lowers a prediction"
                ]
                if self.python_draws
                else []
            ),
        )
        return Plan(
            model=type(self.model).__name__,
            graph_fingerprint="units-" + fingerprints.hexdigest()[:16],
            input_signature=self.inputs.signature(),
            input_names=given_input_names(self.model, self.inputs),
            capture_method=first.capture.method,
            leaf_modules=self.leaf_modules,
            num_nodes=nodes,
            stages=tuple(stages),
            budget_bytes=budget_bytes,
            scope=self.scope,
            solver="units",
            solver_status="feasible",
            solve_seconds=0.0,
            solver_gap=None,
            segments=tuple(segments),
            predicted_peak_bytes=self._scoped(self._predicted_total(choice)),
            no_checkpoint_peak_bytes=self.no_checkpoint_peak_bytes,
            minimum_peak_bytes=self.minimum_peak_bytes,
            predicted_recompute_seconds=recompute,
            predicted_step_seconds=unit_seconds + recompute,
            recompute_fraction=recompute / (unit_seconds + recompute) if unit_seconds else 0.0,
            memory=MemoryBreakdown(
                parameters=sum(p.nbytes for p in parameters),
                gradients=_gradient_bytes(parameters),
                buffers=sum(b.nbytes for b in self.model.buffers()),
                inputs=sum(t.nbytes for t in self.inputs.tensors()),
                kept_activations=sum(
                    opts[k].summary.held_bytes for opts, k in zip(self.options, choice, strict=True)
                ),
                no_checkpoint_activations=sum(
                    opts[_AS_WRITTEN].summary.held_bytes for opts in self.options
                ),
            ),
            measured_peak_bytes=checked.peak_bytes if checked is not None else None,
            device=first.profile.device,
            notes=notes,
            loss=self.loss,
            units=tuple(units),
        )


def _options(planner: Any) -> list[_Option]:
    """A distinct unit's candidate plans (NOTE [nested: units], step 2), by the replay."""
    trace, num_stages = planner.trace, planner.chain.num_stages
    output_bytes = planner.profile.output_bytes

    def option(segments: Iterable[tuple[int, int]], kept: Iterable[Iterable[int]], label: str):
        segments = tuple(tuple(seg) for seg in segments)
        kept = tuple(tuple(k) for k in kept)
        node_ranges, stash = planner.predictor.node_ranges(segments)
        saved = kept or None
        peak = replay.simulate(trace, node_ranges, stash, saved).peak_bytes - trace.static_bytes
        return _Option(
            UnitOption(
                # in the real step the output's gradient is dense (the planning loss's is an
                # expanded scalar)
                peak_bytes=peak + output_bytes,
                held_bytes=replay.held_after_forward(trace, node_ranges, stash, saved),
                seconds=planner.recompute_seconds(segments, kept) if segments else 0.0,
            ),
            segments,
            kept,
            label,
        )

    # at _AS_WRITTEN and _WHOLE: first, and distinct, so the de-duplication below keeps them
    options = [
        option((), (), "left as written"),
        option([(0, num_stages)], (), "checkpointed whole"),
    ]
    lean = planner.search.leanest()
    options.append(option(lean.segments, lean.kept, "planned inside (its leanest plan)"))
    low, high = planner.minimum_peak_bytes, planner.no_checkpoint_peak_bytes
    for share in _SHARES:
        budget = low + int(share * (high - low))
        try:
            found = planner.solve(budget)
        except AutockptError:
            continue
        options.append(
            option(found.segments, found.kept, f"planned inside (at {share:.0%} of its range)")
        )
    unique: dict[tuple, _Option] = {}
    for opt in options:
        unique.setdefault((opt.segments, opt.kept), opt)
    return list(unique.values())


def _in_the_model(seg: Segment, path: str, offset: int) -> Segment:
    """``seg`` of the unit at ``path`` restated in the whole plan: its stages moved by
    ``offset``, its nodes named ``path:node`` and its module paths the user's model's."""

    def qualified(module: str | None) -> str | None:
        return module if module is None else f"{path}.{module}" if module else path

    return dataclasses.replace(
        seg,
        start_stage=seg.start_stage + offset,
        end_stage=seg.end_stage + offset,
        first_node=f"{path}:{seg.first_node}",
        last_node=f"{path}:{seg.last_node}",
        first_module=qualified(seg.first_module),
        last_module=qualified(seg.last_module),
    )


def _gradient_bytes(parameters: Iterable[nn.Parameter]) -> int:
    return sum(p.nbytes for p in parameters if p.requires_grad)


def runs_eagerly(error: TraceError) -> str:
    """What runs eagerly in a step planned as units, and why, as a clause of a note: the
    root's forward (its own code could not be captured), or a submodule fx keeps whole
    that hides repeated blocks where torch.export refuses the model too (NOTE [routes:
    leaves that hide blocks])."""
    if error.in_root_code or not error.module:
        return (
            f"the root's forward cannot be captured ({error.location}: "
            f"`{error.source_line}`) and runs eagerly"
        )
    return (
        f"{error.reason}, hiding repeated blocks that neither fx nor torch.export reach, so "
        "the root's forward runs eagerly"
    )


def plan_units(
    model: nn.Module,
    inputs: Inputs,
    request: Request,
    error: TraceError,
    phases: Phases,
    progress: ProgressFn,
    plan_unit: PlanUnit,
    hand_back: Callable[[nn.Module], nn.Module],
) -> UnitsRoute:
    """The units route of a step that cannot be captured whole (``error``, before any
    profiling of the root: the root's own code, or an fx leaf that hides repeated blocks):
    find its units, plan each distinct one with ``plan_unit``, and measure the leanest
    choices (NOTE [nested: units]). A :class:`TraceError` when no submodule captures."""
    phases.stop()  # the failed capture; the units' planners time their own phases
    eager = runs_eagerly(error)
    if not request.probe:
        # finding units runs the root's forward: no plan from shapes alone (fit_batch)
        raise AutockptError(
            f"{eager}, so this model is planned as units found by running its forward, "
            "which a plan from shapes alone (probe=False, fit_batch's sizes) must not do: "
            "plan a given batch with autockpt.optimize instead"
        ) from error
    progress(f"finding the submodule calls to plan ({eager})")
    started = time.perf_counter()
    leaves = request.leaf_modules
    found = find_units(model, inputs, leaves, error)
    choose_seconds = time.perf_counter() - started
    planners: list[Any] = []
    by_key: dict[tuple, Any] = {}
    for unit in found.units:
        module = model.get_submodule(unit.path)
        key = unit_key(module, unit.inputs)
        if key not in by_key:
            prefix = f"{unit.path}."
            inside = tuple(n.removeprefix(prefix) for n in leaves if n.startswith(prefix))
            by_key[key] = plan_unit(module, unit.inputs, inside)
        planners.append(by_key[key])
    compiled = hand_back is not same
    assert request.precision is not None
    route = UnitsRoute(
        model,
        inputs,
        error,
        found,
        planners,
        scope=request.scope,
        leaf_modules=tuple(leaves),
        loss=loss_name(request.loss_fn),
        precision_note=request.precision.note(),
        choose_seconds=choose_seconds,
        progress=progress,
        measure_step=lambda result: measure_step(
            result, inputs, request, compiled=compiled, draws=True
        ),
    )
    route.hand_back = hand_back
    for seconds in (*(p.phase_seconds for p in by_key.values()), route.phase_seconds):
        for phase, spent in seconds.items():
            phases.add(phase, spent)
    route.planning_peak_bytes = max(p.planning_peak_bytes or 0 for p in by_key.values()) or None
    return route
