"""The answer type shared by every method, and the one place plans become answers.

Every method hands its plan to :func:`make_solution`, which replays it with
:func:`solvers.chain.simulate` and reports simulate's numbers, so a method can never
claim a peak or a cost that the reference model disagrees with, and can never report
``optimal``/``feasible`` for a plan over budget.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from .chain import ChainProblem, simulate

__all__ = ["Solution", "InfeasibleError", "STATUSES", "make_solution"]

STATUSES = ("optimal", "feasible", "infeasible")


class InfeasibleError(ValueError):
    """No plan fits the budget (raised by :meth:`Solution.raise_if_infeasible`).

    ``peak_bytes`` is the peak of the returned plan: for ``auto``/``dp``/``ilp`` answers,
    the least achievable peak of the chain.
    """

    def __init__(self, peak_bytes: int, budget_bytes: int | None = None) -> None:
        self.peak_bytes = peak_bytes
        self.budget_bytes = budget_bytes
        budget = "the budget" if budget_bytes is None else f"the budget of {budget_bytes} bytes"
        super().__init__(
            f"no checkpoint plan fits {budget}; the returned plan peaks at {peak_bytes} bytes"
        )


@dataclass(frozen=True)
class Solution:
    """A checkpoint plan and what it costs under the chain model.

    ``segments``: sorted, disjoint, non-empty half-open ``(start, end)`` stage ranges that
    are checkpointed; every other stage is kept. ``peak_bytes`` and ``recompute_seconds``
    come from :func:`solvers.chain.simulate`. ``status``: ``"optimal"`` (proved cheapest
    among plans that fit), ``"feasible"`` (fits, optimality not proved) or
    ``"infeasible"`` (``peak_bytes > budget_bytes``; see :func:`solvers.solve` for which
    plan is returned then). ``method``: the method whose plan this is (``"dp"``,
    ``"ilp"``, ``"greedy"``, ``"sqrt"``, never ``"auto"``). ``solve_seconds``: wall time
    of the whole call. ``gap``: relative optimality gap ``(cost - lower_bound) / cost``;
    ``0.0`` when optimal, ``None`` when unknown or infeasible.
    """

    segments: list[tuple[int, int]]
    recompute_seconds: float
    peak_bytes: int
    status: str
    method: str
    solve_seconds: float
    gap: float | None
    kept: tuple[tuple[int, ...], ...] = ()
    """Per segment, the compute nodes whose operator output the checkpoint keeps instead
    of recomputing (selective recompute, :mod:`solvers.selective`); empty: none."""

    @property
    def feasible(self) -> bool:
        """True when the plan fits the budget (status ``optimal`` or ``feasible``)."""
        return self.status != "infeasible"

    def raise_if_infeasible(self, budget_bytes: int | None = None) -> Solution:
        """Return ``self``, or raise :class:`InfeasibleError` if the plan does not fit."""
        if not self.feasible:
            raise InfeasibleError(self.peak_bytes, budget_bytes)
        return self


def make_solution(
    problem: ChainProblem,
    segments: Sequence[tuple[int, int]],
    *,
    method: str,
    started: float,
    proved_optimal: bool = False,
    gap: float | None = None,
) -> Solution:
    """Simulate ``segments`` and wrap them as a :class:`Solution`.

    The status is decided here from the simulated peak: a plan over budget is always
    ``"infeasible"`` whatever the method believed. ``started`` is the
    ``time.perf_counter()`` value at the start of the call.
    """
    sim = simulate(problem, segments)  # validates: sorted, disjoint, in range
    plan = [(int(p), int(q)) for p, q in segments]
    if sim.peak_bytes > problem.budget_bytes:
        status, gap = "infeasible", None
    elif proved_optimal:
        status, gap = "optimal", 0.0
    else:
        status = "feasible"
    return Solution(
        segments=plan,
        recompute_seconds=sim.recompute_seconds,
        peak_bytes=sim.peak_bytes,
        status=status,
        method=method,
        solve_seconds=time.perf_counter() - started,
        gap=gap,
    )
