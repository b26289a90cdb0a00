"""What every route of planning answers, and the one real step all of them measure.

NOTE [routes: protocol]. A route is one way of planning a model (autockpt/planning/routes/
lists them). The front door (``autockpt.api.Planner``) chooses one route per model, once,
and afterwards only asks it the questions of :class:`Route`: the range (the least peak any
plan reaches, the peak without checkpoints, what the least is made of), the plan of a
budget without measuring (:meth:`Route.solve`), and the model back for a budget, verified
by measurement (:meth:`Route.optimize`). Why a protocol and not a base class: routes share
no state, and a route composed over another (the compiled route over the captured graph's)
holds it as a value, so none reaches into another's attributes.

Every route measures a result the same way (:func:`measure_step`): one real step of the
plan, in the training mode and precision it was planned in, with scalar draws at their
worst case as the profile planned for them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from torch import nn

from autockpt.base.inputs import Inputs
from autockpt.base.rng import worst_case_draws
from autockpt.base.runtime import release_freed_heap, training_mode
from autockpt.costs.timing import STEP_ROUNDS, STEP_TIMING_SECONDS
from autockpt.measure import Measurement, measure
from autockpt.planning.request import Request
from autockpt.rewrite.result import mark_verified_compiled
from solvers import Solution

Finish = Callable[[nn.Module], None]
"""Sets on a result what the caller sets (its precision-change rule), before a compiled
result's last measured step (dynamo guards on it)."""

Replan = Callable[[nn.Module, tuple, dict], nn.Module]
"""Plans the user's model again from a call's arguments (NOTE [rewrite: precision change])."""


@dataclass(frozen=True)
class Solve:
    """How one budget is solved and checked: the options of ``Planner.optimize``."""

    solver: str = "auto"
    time_limit_s: float = 30.0
    verify: bool = True
    selective: bool = True
    compile_budgets: Sequence[float] | None = None


class Route(Protocol):
    """NOTE [routes: protocol]: what the front door asks of a way of planning."""

    minimum_peak_bytes: int
    """The leanest plan's peak in the budget's scope: a budget at it is planned."""
    no_checkpoint_peak_bytes: int
    """The peak with no checkpoints: a budget at or above it checkpoints nothing."""
    breakdown: dict[str, int]
    """What the minimum is made of, named for an error message."""
    planning_peak_bytes: int | None
    meta: bool

    def solve(self, budget_bytes: int, how: Solve) -> Solution:
        """The least-recompute plan under ``budget_bytes``, not measured."""
        ...

    def optimize(self, budget_bytes: int, how: Solve, finish: Finish, replan: Replan) -> nn.Module:
        """The model back, planned for ``budget_bytes`` and (``how.verify``) measured to fit."""
        ...

    def as_written_or_none(self) -> int | None:
        """The model as written's predicted peak, or None where it is not modelled."""
        ...


def measure_step(
    result: nn.Module,
    inputs: Inputs,
    request: Request,
    *,
    compiled: bool,
    draws: bool,
    timed: bool = False,
) -> Measurement:
    """One real step of the plan, in the training mode it was planned in (``timed``: then up
    to :data:`autockpt.costs.timing.STEP_ROUNDS` timed steps, fewer once they took
    :data:`~autockpt.costs.timing.STEP_TIMING_SECONDS`). A result under ``torch.compile``
    (``compiled``: the model came compiled) is measured compiled, after one warm-up step that
    compiles it: the budget holds for the module handed back. ``draws``: scalar draws at
    their worst case (every LayerDrop layer runs), as the profile and the recorded step
    planned for (autockpt/base/rng.py), so predicted and measured agree."""
    inner = getattr(result, "_orig_mod", None)
    if compiled and inner is not None:  # measured as handed back, under its torch.compile
        mark_verified_compiled(inner)  # so tracing it raises no CompileWarning
    worst_case = worst_case_draws() if draws and not compiled else contextlib.nullcontext()
    assert request.precision is not None
    with request.precision.entered(request.device), training_mode(result), worst_case:
        measured = measure(
            result,
            inputs,
            loss_fn=request.loss_fn,
            repeat=STEP_ROUNDS if timed else 0,
            max_seconds=STEP_TIMING_SECONDS,
            warmup=1 if compiled else 0,
            optimizer=request.optimizer,
            accumulation_steps=request.accumulation_steps,
        )
    release_freed_heap()  # the measured step is gone: so are its pages
    return measured
