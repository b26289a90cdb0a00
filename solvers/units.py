"""Plans for a step made of units run one after another, each with plans of its own.

When a model's own code cannot be captured, its submodule calls are planned as units
(``autockpt/planning/nested.py``): the root's code runs eagerly and calls unit 0, 1, ...
in order; each unit has a few candidate plans (leave it alone, plan inside it, checkpoint
it whole). A unit's plan is summarised by what the replay of that unit's recorded step says:

- ``peak_bytes``: the most it holds above everything static while its own forward or
  backward runs (its own kept activations and temporaries, its output's gradient);
- ``held_bytes``: what it still holds when its forward has returned (its kept activations,
  its output), held until its backward runs;
- ``seconds``: what the plan adds to the step (recompute).

Unit ``i`` runs (forward, and later backward) while every earlier unit holds what it kept,
so the step's peak above the static part is ``max_i(held_0 + ... + held_{i-1} + peak_i)``.
Later units have finished their backward, and freed what they held, before unit ``i``'s
backward starts. This module chooses one option per unit under a byte budget for that
peak: least total seconds (:func:`least_seconds`, exact over the Pareto front of held bytes
and seconds) and the leanest choice (:func:`leanest`). Torch-free, like every solver.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MAX_STATES = 4096
"""Pareto states kept per unit; beyond it the front is thinned evenly in held bytes (never
reached by the models planned so far; it bounds time, at the cost of exactness)."""


@dataclass(frozen=True)
class UnitOption:
    """One candidate plan of one unit (module docstring: what the numbers mean)."""

    peak_bytes: int
    held_bytes: int
    seconds: float


def step_peak(options: Sequence[Sequence[UnitOption]], choice: Sequence[int]) -> int:
    """The step's peak above the static part when unit ``i`` uses ``options[i][choice[i]]``."""
    held, peak = 0, 0
    for unit, k in zip(options, choice, strict=True):
        peak = max(peak, held + unit[k].peak_bytes)
        held += unit[k].held_bytes
    return peak


def step_seconds(options: Sequence[Sequence[UnitOption]], choice: Sequence[int]) -> float:
    return sum(unit[k].seconds for unit, k in zip(options, choice, strict=True))


def least_seconds(
    options: Sequence[Sequence[UnitOption]], budget_bytes: int
) -> tuple[int, ...] | None:
    """The choice of least total seconds whose :func:`step_peak` fits ``budget_bytes``
    (ties: less held, then the earlier options), or ``None`` when none fits.

    A dynamic programme over units in order whose state is the bytes held so far: only
    states on the Pareto front of (held bytes, seconds) can lead to the best answer, since
    holding less never makes a later unit's constraint harder."""
    states: list[tuple[int, float, tuple[int, ...]]] = [(0, 0.0, ())]
    for unit in options:
        grown = [
            (held + opt.held_bytes, seconds + opt.seconds, choice + (k,))
            for held, seconds, choice in states
            for k, opt in enumerate(unit)
            if held + opt.peak_bytes <= budget_bytes
        ]
        if not grown:
            return None
        states = _front(grown)
    return min(states, key=lambda s: (s[1], s[0], s[2]))[2]


def leanest(options: Sequence[Sequence[UnitOption]]) -> tuple[int, ...]:
    """The choice of least :func:`step_peak` (ties: least seconds).

    Feasibility at a budget is greedy and exact (at each unit, among the options that fit,
    the one holding least leaves every later unit the most room), so the least peak is
    found by bisection over the budget; the least-seconds choice at that peak is returned."""
    lo = max(min(opt.peak_bytes for opt in unit) for unit in options) if options else 0
    hi = step_peak(options, [min(range(len(u)), key=lambda k: u[k].peak_bytes) for u in options])
    hi = max(hi, lo)
    while lo < hi:
        mid = (lo + hi) // 2
        if _fits_greedily(options, mid):
            hi = mid
        else:
            lo = mid + 1
    choice = least_seconds(options, lo)
    assert choice is not None  # the greedy choice fits at lo
    return choice


def _fits_greedily(options: Sequence[Sequence[UnitOption]], budget_bytes: int) -> bool:
    held = 0
    for unit in options:
        fitting = [opt.held_bytes for opt in unit if held + opt.peak_bytes <= budget_bytes]
        if not fitting:
            return False
        held += min(fitting)
    return True


def _front(
    states: list[tuple[int, float, tuple[int, ...]]],
) -> list[tuple[int, float, tuple[int, ...]]]:
    """States not dominated in (held bytes, seconds), in increasing held bytes."""
    states.sort(key=lambda s: (s[0], s[1], s[2]))
    front: list[tuple[int, float, tuple[int, ...]]] = []
    for state in states:
        if not front or state[1] < front[-1][1]:
            front.append(state)
    if len(front) > MAX_STATES:
        step = len(front) / MAX_STATES
        front = [front[int(k * step)] for k in range(MAX_STATES - 1)] + [front[-1]]
    return front


__all__ = ["UnitOption", "least_seconds", "leanest", "step_peak", "step_seconds"]
