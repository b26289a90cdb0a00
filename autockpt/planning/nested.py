"""Planning inside a submodule, for a root whose own forward cannot be captured.

Some models check their inputs by value at the top of ``forward`` (Wav2Vec2ForCTC and
HubertForCTC: ``if labels.max() >= vocab_size: raise``). Neither fx nor torch.export can
capture such code, yet one call below it the model's body is a plain stack of layers. Here
the root's own code runs eagerly and the plan lives inside that body:

1. choose: descend from the root by parameter count to the largest submodule that the
   forward calls and that captures (fx or export): the body holds the activations;
2. its example inputs: run the root's forward on the user's inputs until it calls that
   submodule (a forward pre-hook records the call and stops the run there), so only the
   root's prefix runs, never the un-checkpointed step;
3. plan it with an ordinary planner (:class:`autockpt.api.Planner`, which builds it and
   hands it in: this module does not know the front door) at the user's budget minus what
   lies outside it (parameters, gradients, buffers and inputs outside it, and the gradient
   of its output that the root's backward hands in);
4. verify: measure the root's whole step with the submodule replaced by its plan, and while
   the measured peak exceeds the budget tighten the submodule's budget by the overshoot and
   solve again (the root's own activations, a head and its loss, are learnt this way;
   ``autockpt/planning/verify.py``, the one measure-and-tighten loop). The
   stated minimum is the leanest plan's whole step as measured once when planning begins,
   and the leanest plan is always tried before giving up, so that minimum fits.

The result is a new instance of the user's class sharing every parameter, buffer and module
with the original, except the planned submodule, which is replaced by its rewritten module;
the user's model is not changed. docs/design.md ("Planning inside a submodule") gives the
reasons and limits.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import time
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

from autockpt.base.allocations import StorageSet
from autockpt.base.inputs import Inputs, given_input_names
from autockpt.capture.front import capture
from autockpt.errors import GIB, AutockptError, InfeasibleBudgetError, TraceError
from autockpt.measure import Measurement, static_bytes
from autockpt.plan import Plan, Segment, scoped_bytes
from autockpt.planning.make_plan import as_written_notes
from autockpt.planning.prepared import ProgressFn
from autockpt.planning.verify import Attempt, fit_by_measuring
from autockpt.rewrite.result import plain_module
from autockpt.rewrite.submodule import replace_submodule, submodule_inputs

_MAX_CANDIDATES = 8
"""Submodules tried (each a prefix run and a capture) before giving up."""


class SubmodulePlanner:
    """Plan ``model`` inside the submodule at ``path`` (:func:`choose_submodule` chose it)
    for any budget of the whole step.

    ``error`` is the root's capture failure. ``inner`` is the submodule's own planner (an
    :class:`autockpt.api.Planner` of ``model.get_submodule(path)`` called with
    ``child_inputs``, scope "total", default loss: the sum of the submodule's floating
    outputs, whose gradient has the shape the real step gives it); the caller builds it,
    so this module does not know the front door. ``measure_step`` measures the root's whole
    step of a result, memory only.
    """

    def __init__(
        self,
        model: nn.Module,
        inputs: Inputs,
        error: TraceError,
        path: str,
        child_inputs: Inputs,
        inner: Any,
        *,
        scope: str,
        choose_seconds: float,
        progress: ProgressFn,
        measure_step: Callable[[nn.Module], Measurement],
    ) -> None:
        self.model, self.inputs, self.error = model, inputs, error
        self.path, self.child_inputs, self.inner = path, child_inputs, inner
        self.scope, self.measure_step = scope, measure_step
        self.phase_seconds = {"capture": choose_seconds}
        """Wall seconds of what this planner adds to the submodule's planner's phases."""
        # What the submodule's planner does not count, as far as it is known before a
        # measurement: the static part outside it, and its output's gradient (a dense
        # tensor in the real step; the planning loss's is an expanded scalar).
        self.outside_bytes = _outside_bytes(model, inputs, self.path, self.child_inputs)
        self.outside_bytes += self.inner.profile.output_bytes
        # what scope="activations" leaves out: the whole model's static part
        self.static_bytes = (
            0
            if scope == "total"
            else (static_bytes(model, inputs) + _gradient_bytes(model.parameters()))
        )
        self.no_checkpoint_peak_bytes = self._scoped(self.inner.no_checkpoint_peak_bytes)
        self.breakdown = {
            f"outside '{self.path}' (static, and its output's gradient)": self.outside_bytes,
            **{f"{name} of '{self.path}'": nbytes for name, nbytes in self.inner.breakdown.items()},
        }
        # The root's own activations (a head, its loss) are not predicted, so the whole
        # step's minimum is the leanest plan's measured step (its own step: it fits where
        # the plan fits), or its prediction where that is higher.
        progress("measuring the leanest plan's whole step")
        started = time.perf_counter()
        leanest, _ = self._solve(self.inner.minimum_peak_bytes, "auto", 30.0)
        self.leanest_measured_bytes = self._used(measure_step(leanest))
        self.phase_seconds["verify"] = time.perf_counter() - started
        self.minimum_peak_bytes = max(
            self._scoped(self.inner.minimum_peak_bytes), self.leanest_measured_bytes
        )

    def _scoped(self, child_bytes: int) -> int:
        """A whole-step prediction in the user's scope from the submodule's prediction."""
        return scoped_bytes(child_bytes + self.outside_bytes, self.scope, self.static_bytes)

    def _used(self, measurement: Measurement) -> int:
        """A measured whole step in the user's scope."""
        return scoped_bytes(measurement.peak_bytes, self.scope, self.static_bytes)

    def _solve(
        self, child_budget: int, solver: str, time_limit_s: float, selective: bool = True
    ) -> tuple[nn.Module, Plan]:
        """The root with the submodule planned for ``child_budget`` bytes, and that plan."""
        budget_gb = child_budget / GIB
        while int(budget_gb * GIB) < child_budget:  # float GiB must not round bytes down
            budget_gb = math.nextafter(budget_gb, math.inf)
        child = self.inner.optimize(
            budget_gb=budget_gb,
            solver=solver,
            time_limit_s=time_limit_s,
            verify=False,
            selective=selective,
        )
        return replace_submodule(self.model, self.path, child), child.plan

    def optimize(
        self,
        budget_bytes: int,
        *,
        solver: str,
        time_limit_s: float,
        verify: bool,
        selective: bool = True,
    ) -> nn.Module:
        """Plan the submodule so that the root's whole step fits ``budget_bytes`` (in the
        user's scope); measure the step to check (``verify``), like Planner.optimize. The
        leanest plan, measured to fit the minimum, is always tried in the last round."""
        if budget_bytes < self.minimum_peak_bytes:
            raise self._infeasible(budget_bytes, self.minimum_peak_bytes)
        leanest = self.inner.minimum_peak_bytes

        def attempt(underestimate: int, last_round: bool) -> Attempt[Plan]:
            child_budget = budget_bytes + self.static_bytes - self.outside_bytes - underestimate
            if last_round:
                child_budget = leanest
            result, plan = self._solve(max(child_budget, leanest), solver, time_limit_s, selective)
            return Attempt(result, plan, self._scoped(plan.predicted_peak_bytes))

        def measure(found: Attempt[Plan]) -> tuple[int, Measurement]:
            checked = self.measure_step(found.result)  # the root's whole step, memory only
            return self._used(checked), checked

        def out_of_reach(underestimate: int, used: int) -> InfeasibleBudgetError:
            # the leanest plan measured more than when planning began
            return self._infeasible(budget_bytes, max(used, budget_bytes + 1))

        fitted = fit_by_measuring(budget_bytes, attempt, measure if verify else None, out_of_reach)
        result = fitted.attempt.result
        result.plan = self._plan(fitted.attempt.found, budget_bytes, fitted.measurement)
        return result

    def _infeasible(self, budget_bytes: int, minimum: int) -> InfeasibleBudgetError:
        hint = (
            f"The root's forward runs eagerly and the plan is inside '{self.path}': the "
            "minimum is the whole step of that submodule's leanest plan, as measured "
            f"({self.leanest_measured_bytes} bytes) or predicted, whichever is higher."
        )
        return InfeasibleBudgetError(budget_bytes, minimum, self.breakdown, self.scope, hint)

    def _plan(self, inner: Plan, budget_bytes: int, checked: Measurement | None) -> Plan:
        """The submodule's plan restated for the whole step (docs/plan-schema.md)."""
        shift = self._scoped(0)
        parameters = list(self.model.parameters())
        notes = (
            *inner.notes,
            f"the root's forward has data-dependent control flow ({self.error.location}: "
            f"`{self.error.source_line}`) and runs eagerly; segments are inside "
            f"'{self.path}'",
            f"predicted peaks are the whole step's: the prediction for '{self.path}' plus "
            f"{self.outside_bytes} bytes outside it (parameters, gradients, buffers and inputs "
            f"outside '{self.path}', and the gradient of its output that the root's backward "
            "hands in); the root's own activations are not predicted but measured",
        )
        timeline = inner.timeline
        if timeline is not None:
            timeline = dataclasses.replace(
                timeline,
                plan_bytes=tuple(max(0, b + shift) for b in timeline.plan_bytes),
                no_checkpoint_bytes=tuple(max(0, b + shift) for b in timeline.no_checkpoint_bytes),
            )
        as_written = inner.as_written_peak_bytes
        restated = dataclasses.replace(
            inner,
            model=type(self.model).__name__,
            input_signature=self.inputs.signature(),
            input_names=given_input_names(self.model, self.inputs),
            budget_bytes=budget_bytes,
            scope=self.scope,
            predicted_peak_bytes=inner.predicted_peak_bytes + shift,
            no_checkpoint_peak_bytes=inner.no_checkpoint_peak_bytes + shift,
            as_written_peak_bytes=None if as_written is None else as_written + shift,
            minimum_peak_bytes=self.minimum_peak_bytes,
            memory=dataclasses.replace(
                inner.memory,
                parameters=sum(p.nbytes for p in parameters),
                gradients=_gradient_bytes(parameters),
                buffers=sum(b.nbytes for b in self.model.buffers()),
                inputs=sum(t.nbytes for t in self.inputs.tensors()),
            ),
            # the whole step's total, as in every plan (the scope's part is the report's)
            measured_peak_bytes=checked.peak_bytes if checked is not None else None,
            measured_step_seconds=None,
            notes=notes,
            timeline=timeline,
            submodule=self.path,
            segments=tuple(_in_the_model(seg, self.path) for seg in inner.segments),
        )
        # the note on the model as written, in the whole step's bytes
        stale = set(as_written_notes(inner))
        kept = tuple(note for note in restated.notes if note not in stale)
        return dataclasses.replace(restated, notes=(*kept, *as_written_notes(restated)))


def choose_submodule(
    model: nn.Module, inputs: Inputs, leaf_modules: tuple[str, ...], error: TraceError
) -> tuple[str, Inputs]:
    """The submodule holding the most parameters among those the forward calls and that
    capture, with the inputs the root calls it with; raises ``error`` when there is none.

    Candidates are visited largest first (ties in registration order); a submodule that is
    not called or does not capture gives way to its own children. A user's leaf module is
    run as one opaque call, so it is neither planned inside nor descended into.
    """
    order = {name: k for k, (name, _) in enumerate(model.named_modules())}
    frontier: list[tuple[int, int, str]] = []

    def push_children(path: str) -> None:
        for name, child in model.get_submodule(path).named_children():
            qualified = f"{path}.{name}" if path else name
            if qualified in order and qualified not in leaf_modules:
                count = sum(p.numel() for p in child.parameters())
                heapq.heappush(frontier, (-count, order[qualified], qualified))

    push_children("")
    for _ in range(_MAX_CANDIDATES):
        if not frontier or frontier[0][0] == 0:
            break
        _, _, path = heapq.heappop(frontier)
        found = submodule_inputs(model, path, inputs)
        if found is not None and _captures(model, path, found, leaf_modules):
            return path, found
        push_children(path)
    raise error


def _captures(model: nn.Module, path: str, inputs: Inputs, leaf_modules: tuple[str, ...]) -> bool:
    prefix = f"{path}."
    leaves = [name.removeprefix(prefix) for name in leaf_modules if name.startswith(prefix)]
    try:  # a result of optimize is planned from the user's module it was made from
        capture(plain_module(model.get_submodule(path)), inputs, leaf_modules=leaves)
    except (AutockptError, TypeError):
        return False
    return True


def _outside_bytes(model: nn.Module, inputs: Inputs, path: str, child_inputs: Inputs) -> int:
    """Bytes of the whole step's static part (distinct storages of parameters, buffers and
    inputs, plus parameter gradients) that the submodule's own step does not hold."""
    child = model.get_submodule(path)
    storages = StorageSet(skip_meta=True)  # a measured step's: meta tensors hold nothing
    storages.add([*child.parameters(), *child.buffers(), *child_inputs.tensors()])
    outside = storages.add([*model.parameters(), *model.buffers(), *inputs.tensors()])
    inside = {id(p) for p in child.parameters()}
    outside_parameters = [p for p in model.parameters() if id(p) not in inside]
    return outside + _gradient_bytes(outside_parameters)


def _in_the_model(seg: Segment, path: str) -> Segment:
    """``seg`` of the submodule at ``path`` with its module paths in the user's model (its
    node names stay the submodule graph's)."""

    def qualified(module: str | None) -> str | None:
        return module if module is None else f"{path}.{module}" if module else path

    return dataclasses.replace(
        seg, first_module=qualified(seg.first_module), last_module=qualified(seg.last_module)
    )


def _gradient_bytes(parameters: Iterable[nn.Parameter]) -> int:
    return sum(p.nbytes for p in parameters if p.requires_grad)
