"""Per-module plans, for a root whose own forward cannot be captured.

Real models put code that neither fx nor torch.export can capture around their stack of
layers: an input check by value (Wav2Vec2ForCTC: ``if labels.max() >= vocab_size: raise``),
a LayerDrop loop that draws ``torch.rand([]) < p`` and branches on it (the Wav2Vec2/HuBERT
encoder), routing on a tensor's value.

NOTE [nested: units]. That code runs eagerly; the submodules it calls are planned as
*units*:

1. find the units (:func:`find_units`): one run of the root's forward that keeps nothing
   for a backward (``autockpt/rewrite/submodule.record_calls``) lists the submodules called
   from the root's own code; each that holds parameters and captures is a unit, each that
   does not capture, or whose outputs the capture would drop (an object the root reads),
   is descended into (its own code runs eagerly too), down to :data:`_MAX_DEPTH` levels.
   The run draws torch's scalars at their worst case, so every LayerDrop layer is called
   and planned (the worst case, as inside captured graphs); a module the run did not call
   that holds a unit's place in another child of a container above it (an expert not routed
   to, a layer a Python draw skipped) is a unit too, for the worst case that it runs. A
   module called more than once (a block reused, shared weights) is not a unit: it runs
   eagerly and the notes say so (planning it per call would double-count or miss a call);
2. plan each distinct unit once (same class, inputs, parameter and buffer shapes: the
   layers of a stack share one planner) with an ordinary planner, and summarise a few of its
   plans (leave it alone, checkpoint it whole, its leanest plan, least-recompute plans at
   budgets in between) by the replay's numbers: peak, bytes held after its forward, seconds
   (:class:`solvers.units.UnitOption`);
3. choose one option per unit under the one budget of the whole step
   (:func:`solvers.units.least_seconds`: units run in order, each while the earlier ones
   hold what they kept): checkpoint a unit whole, plan inside it, or leave it alone;
4. verify: measure the root's whole step. What the units' replays do not see (the root's
   own activations: a head, a loss, a feature extractor running eagerly) is learnt when
   planning begins from measured steps of three choices (the replays' leanest, each
   repeated block checkpointed whole, every unit checkpointed whole): the leanest measured
   is the stated minimum, achievable by construction and never above checkpointing each
   block by hand, and its measured minus predicted peak corrects every later prediction
   (never downwards when the root draws from Python's or NumPy's generator, which cannot be
   put at its worst case). The measure-and-tighten loop (``autockpt/planning/verify.py``)
   takes care of the rest.

The result is a new instance of the user's class sharing every parameter, buffer and module
with the original, except the units that are checkpointed, which are replaced by their
rewritten modules; the user's model is not changed. docs/design.md ("Planning a model that
cannot be captured whole") gives the reasons and limits.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

from autockpt.base.inputs import Inputs, given_input_names
from autockpt.capture.export import DROPPED_OUTPUTS
from autockpt.capture.front import capture
from autockpt.errors import AutockptError, InfeasibleBudgetError, TraceError
from autockpt.measure import Measurement, static_bytes
from autockpt.plan import MemoryBreakdown, Plan, Segment, UnitPlan, scoped_bytes
from autockpt.planning.make_plan import make_plan
from autockpt.planning.prepared import ProgressFn
from autockpt.planning.specs import segment_specs
from autockpt.planning.verify import Attempt, fit_by_measuring
from autockpt.rewrite.apply import apply_plan
from autockpt.rewrite.result import plain_module
from autockpt.rewrite.submodule import Call, record_calls, replace_submodules, sibling_path
from solvers import Solution, replay
from solvers.units import UnitOption, leanest, least_seconds, step_peak, step_seconds

_MAX_DEPTH = 3
"""Levels of uncapturable code descended through (the root, a body, an encoder)."""

_AS_WRITTEN, _WHOLE = 0, 1
"""Where every distinct unit's options list its plan "left as written" and "checkpointed
whole" (:func:`_options`)."""

_SHARES = (0.25, 0.5, 0.75)
"""Where between a unit's leanest plan and no checkpointing its middle options are planned."""


@dataclasses.dataclass(frozen=True)
class Unit:
    """A submodule call planned on its own (NOTE [nested: units])."""

    path: str
    inputs: Inputs
    """Its call's ``(args, kwargs)`` in the recorded run (a sibling's, see ``called``)."""
    called: bool = True
    """False: the recorded run never called it (an expert not routed to, a layer skipped by
    a Python draw); it is planned with the inputs of the unit in its place in another child
    of a container above it (``rewrite/submodule.sibling_path``), for the worst case that
    it runs."""


@dataclasses.dataclass(frozen=True)
class Units:
    """What :func:`find_units` found: the units in call order, and notes on what runs
    eagerly instead."""

    units: tuple[Unit, ...]
    notes: tuple[str, ...]
    python_draws: tuple[str, ...] = ()
    """Generators other than torch's the root's run drew from (``random``, ``numpy``):
    their draws cannot be put at their worst case, so measured steps may skip what a later
    step runs (NOTE [nested: units], step 4)."""


def find_units(
    model: nn.Module, inputs: Inputs, leaf_modules: tuple[str, ...], error: TraceError
) -> Units:
    """The units of ``model``'s step (NOTE [nested: units], step 1). When no submodule
    captures, raises ``error`` (the root's capture failure) with the first failure of each
    level tried (:attr:`TraceError.tried`)."""
    levels, notes = {""}, []
    found: dict[str, tuple[int, Inputs]] = {}
    failures: dict[tuple, str | None] = {}
    failed_levels: dict[str, str] = {}
    for _ in range(_MAX_DEPTH):
        current = frozenset(levels)
        recorded = record_calls(model, inputs, lambda path, caller, at=current: caller in at)
        calls = recorded.calls
        levels = set()
        for call in sorted(calls.values(), key=lambda c: c.order):
            if call.caller not in current or call.inputs is None:
                continue
            module = model.get_submodule(call.path)
            if call.path in leaf_modules or not any(True for _ in module.parameters()):
                continue  # no parameters: its activations are the root's own (measured)
            if call.count > 1:
                notes.append(
                    f"'{call.path}' is called {call.count} times per step (a reused block or "
                    "shared weights): it is not planned and runs as written; its memory is "
                    "measured with the root's"
                )
                continue
            key = unit_key(module, call.inputs)
            if key not in failures:
                failures[key] = _capture_error(model, call.path, call.inputs, leaf_modules)
            if failures[key] is None:
                found[call.path] = (call.order, call.inputs)
            else:
                levels.add(call.path)
                if call.caller not in failed_levels:  # the first failure of each level
                    failed_levels[call.caller] = failures[key]
        if not levels:
            break
    if levels:
        notes.append(
            "not planned, deeper than the levels searched: "
            + ", ".join(f"'{path}'" for path in sorted(levels))
        )
    if not found:
        raise TraceError(
            error.module,
            error.location,
            error.source_line,
            error.reason,
            error.in_root_code,
            tried=tuple(failed_levels.values()),
        )
    units = _with_siblings(model, found, calls)
    return Units(units, tuple(notes), recorded.python_draws)


def _with_siblings(
    model: nn.Module, found: dict[str, tuple[int, Inputs]], calls: dict[str, Call]
) -> tuple[Unit, ...]:
    """The units in call order, with each module the run never called that holds the same
    place as a unit in another child of a container above it (an expert the router did not
    pick, a layer a Python draw skipped): planned for the worst case that it runs, with
    that unit's inputs, and placed after it."""
    keyed: dict[str, tuple[tuple[int, int], Unit]] = {
        path: ((order, 0), Unit(path, unit_inputs)) for path, (order, unit_inputs) in found.items()
    }
    classes = {type(model.get_submodule(path)) for path in found}
    registered = {path: k for k, (path, _) in enumerate(model.named_modules())}
    for path, module in model.named_modules():
        if not path or path in calls or type(module) not in classes:
            continue
        if any(path.startswith(f"{unit}.") for unit in keyed):
            continue  # inside a unit: planned with it
        source = sibling_path(model, path, lambda p: p in found)
        if source is None:
            continue
        # where it would run: after the called unit registered last before it
        before = [p for p in found if registered[p] < registered[path]]
        anchor = max(before, key=registered.__getitem__) if before else source
        keyed[path] = (
            (found[anchor][0], registered[path] + 1),
            Unit(path, found[source][1], called=False),
        )
    return tuple(unit for _, unit in sorted(keyed.values(), key=lambda item: item[0]))


def unit_key(module: nn.Module, inputs: Inputs) -> tuple:
    """Units with equal keys share one planner and one plan: same class, call signature,
    parameter and buffer shapes, dtypes and ``requires_grad``."""
    return (
        type(plain_module(module)),
        inputs.signature(),
        tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in module.named_parameters()),
        tuple((n, tuple(b.shape), b.dtype) for n, b in module.named_buffers()),
    )


@dataclasses.dataclass(frozen=True)
class _Option:
    """One candidate plan of a distinct unit: the solver's summary and what makes it."""

    summary: UnitOption
    segments: tuple[tuple[int, int], ...]
    kept: tuple[tuple[int, ...], ...]
    label: str


class UnitsPlanner:
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
        per_unit = tuple(_WHOLE for _ in self.options)
        # The leanest choice by the units' replays, and the two a user writes by hand:
        # every unit checkpointed whole, and each repeated block whole with the rest as
        # written. The root's own activations lie between the units, unseen by their
        # replays, so which is leanest is measured: one step each, memory only.
        classes = [type(plain_module(model.get_submodule(u.path))) for u in self.units]
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
                measured[choice] = measure_step(self._module(choice)).peak_bytes
        self.phase_seconds["verify"] = time.perf_counter() - started
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

    # -- predictions ----------------------------------------------------------------------

    def _predicted_total(self, choice: tuple[int, ...]) -> int:
        """Total bytes of the whole step predicted for ``choice``, with the measured
        correction (:attr:`unseen_bytes`, 0 until it is known)."""
        return self.static_total + step_peak(self._summaries, choice) + self.unseen_bytes

    def _scoped(self, total_bytes: int) -> int:
        return scoped_bytes(total_bytes, self.scope, self.static_bytes)

    # -- plans ----------------------------------------------------------------------------

    def optimize(
        self,
        budget_bytes: int,
        *,
        solver: str,
        time_limit_s: float,
        verify: bool,
        selective: bool = True,
    ) -> nn.Module:
        """Choose each unit's plan so that the root's whole step fits ``budget_bytes`` (in
        the user's scope) at the least predicted seconds; measure the step to check
        (``verify``). The leanest choice, measured to fit the minimum, is the last round's.
        ``solver``, ``time_limit_s`` and ``selective`` were used when the units' options
        were made (their planners' defaults)."""
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
            return self._scoped(checked.peak_bytes), checked

        def out_of_reach(underestimate: int, used: int) -> InfeasibleBudgetError:
            return self._infeasible(budget_bytes, max(used, budget_bytes + 1))

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
        segments restated in the model's terms (docs/plan-schema.md, "units")."""
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
            f"the root's forward cannot be captured ({self.error.location}: "
            f"`{self.error.source_line}`) and runs eagerly; its submodule calls are planned "
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


def _capture_error(
    model: nn.Module, path: str, inputs: Inputs, leaf_modules: tuple[str, ...]
) -> str | None:
    """Why the submodule at ``path`` does not capture (one line), or None when it does."""
    prefix = f"{path}."
    leaves = [name.removeprefix(prefix) for name in leaf_modules if name.startswith(prefix)]
    try:  # a result of optimize is planned from the user's module it was made from
        captured = capture(plain_module(model.get_submodule(path)), inputs, leaf_modules=leaves)
    except TraceError as error:
        inside = f"{path}.{error.module}" if error.module else path
        return f"'{inside}' at {error.location}: `{error.source_line}` ({error.reason})"
    except (AutockptError, TypeError) as error:
        return f"'{path}': {str(error).splitlines()[0]}"
    dropped = [note for note in captured.warnings if note.startswith(DROPPED_OUTPUTS)]
    if dropped:  # the root's own code reads its outputs: they must come back whole
        return f"'{path}': its {dropped[0]}"
    return None


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
