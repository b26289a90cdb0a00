"""Stage 4 — solve: the chain's bounds from the torch-free ``solvers`` package.

The search itself (which solver budget yields the cheapest plan the plan simulator accepts)
lives in :class:`autockpt.api.Planner`, which owns both the chain and the recorded step.
"""

from __future__ import annotations

from autockpt.problem import Chain
from solvers import METHODS, ChainProblem, minimum_peak_bytes, simulate

__all__ = ["METHODS", "no_checkpoint_peak", "minimum_peak"]


def no_checkpoint_peak(chain: Chain) -> int:
    """Predicted peak of the unmodified model (no segment)."""
    return simulate(chain.problem, []).peak_bytes


def minimum_peak(problem: ChainProblem) -> int:
    """Least predicted peak over all plans."""
    return minimum_peak_bytes(problem)[0]
