"""Measure the plan's own step and tighten until it fits: the one measure-and-tighten loop.

Why a loop: the prediction is exact for what the recorded step and the probe see, and a
plan is returned only when its measured step fits too ("never over budget"). When a
measured peak exceeds the budget, what the prediction missed (measured minus predicted) is
taken off the budget the search may use, and the search runs again, at most
:data:`VERIFY_ROUNDS` times. The plan's own step fits where the plan fits, so measuring it
is the only real step planning runs.

Two planners use it: :class:`autockpt.api.Planner` (the search under the replay), and
:class:`autockpt.planning.nested.UnitsPlanner`, whose last round falls back to the
leanest choice of its units (it is told which round is the last).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from torch import nn

from autockpt.measure import Measurement

VERIFY_ROUNDS = 4
"""Rounds of solve, rewrite and measure before a budget is declared out of reach."""

Found = TypeVar("Found")


@dataclass(frozen=True)
class Attempt(Generic[Found]):
    """One round's answer: the module to measure, what made it (a solution, a plan) and
    its predicted peak in the budget's scope."""

    result: nn.Module
    found: Found
    predicted_bytes: int


@dataclass(frozen=True)
class Fitted(Generic[Found]):
    """The attempt that fitted, and its measurement (``None`` when not verified)."""

    attempt: Attempt[Found]
    measurement: Measurement | None


def fit_by_measuring(
    budget_bytes: int,
    attempt: Callable[[int, bool], Attempt[Found]],
    measure: Callable[[Attempt[Found]], tuple[int, Measurement]] | None,
    out_of_reach: Callable[[int, int], Exception],
    *,
    rounds: int = VERIFY_ROUNDS,
) -> Fitted[Found]:
    """The first attempt whose measured step fits ``budget_bytes``.

    ``attempt(underestimate, last_round)`` answers the budget less ``underestimate`` (the
    largest measured-minus-predicted peak seen so far, 0 in the first round); it may raise
    (no plan fits). ``measure(attempt)`` returns the measured peak in the budget's scope and
    the measurement; ``None``: not verified, the first attempt is returned. After
    ``rounds`` rounds over budget, ``out_of_reach(underestimate, last measured)`` is raised.
    """
    underestimate = 0
    used = 0
    for round_ in range(rounds):
        found = attempt(underestimate, round_ == rounds - 1)
        if measure is None:
            return Fitted(found, None)
        used, measurement = measure(found)
        if used <= budget_bytes:
            return Fitted(found, measurement)
        underestimate = max(underestimate + 1, used - found.predicted_bytes)
    raise out_of_reach(underestimate, used)
