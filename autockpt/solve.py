"""Stage 4 — solve: hand the chain to the torch-free ``solvers`` package under the budget.

This module is the only bridge between autockpt's types and the solvers' plain numbers:
it sets the budget, runs the chosen method and turns "no plan fits" into a typed error that
states the least budget that does fit and where the memory goes.
"""

from __future__ import annotations

from autockpt.errors import InfeasibleBudgetError
from autockpt.problem import Chain
from solvers import METHODS, ChainProblem, Solution, minimum_peak_bytes, simulate, solve

__all__ = ["METHODS", "solve_chain", "no_checkpoint_peak", "minimum_peak"]


def solve_chain(
    problem: ChainProblem,
    *,
    method: str,
    time_limit_s: float | None,
    breakdown: dict[str, int],
    scope: str,
) -> Solution:
    """Solve ``problem`` (budget already set); raise :class:`InfeasibleBudgetError` when no
    plan fits, with the exact minimum the leanest plan reaches."""
    if method not in METHODS:
        raise ValueError(f"unknown solver {method!r}; choose one of {', '.join(METHODS)}")
    solution = solve(problem, method=method, time_limit_s=time_limit_s)
    if solution.status == "infeasible":
        least, _ = minimum_peak_bytes(problem)
        if method not in ("auto", "dp", "ilp") and least <= problem.budget_bytes:
            hint = (
                f"The '{method}' heuristic found no plan that fits, but one exists: use "
                f"solver='auto' (or 'dp'/'ilp')."
            )
            raise InfeasibleBudgetError(problem.budget_bytes, least, breakdown, scope, hint)
        raise InfeasibleBudgetError(problem.budget_bytes, least, breakdown, scope)
    return solution


def no_checkpoint_peak(chain: Chain) -> int:
    """Predicted peak of the unmodified model (no segment)."""
    return simulate(chain.problem, []).peak_bytes


def minimum_peak(problem: ChainProblem) -> int:
    """Least predicted peak over all plans."""
    return minimum_peak_bytes(problem)[0]
