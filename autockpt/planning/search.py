"""The plan for a budget, searched under the replay (one memory model).

The peak every plan reports is the replay of the recorded step (:mod:`solvers.replay`),
so that is also what the search optimises: :func:`solvers.search.least_recompute` and
:func:`solvers.search.leanest` compare replayed peaks directly ("optimal" and "minimum" are
meant under the replay, at the user's budget). The stage-chain solvers (``dp``, ``ilp``,
``sqrt``, ``greedy``) optimise a proxy; they seed the search, and asked for by name they
are still available, judged by the replay (:func:`chain_solver`).

Every method judges plans by the predictor's exact prediction
(:meth:`autockpt.planning.predict.Predictor.predict`: stage ranges -> bytes in the budget's
scope, per rank when sharded) and returns only plans whose prediction fits.

NOTE [search: per-rank peaks] (solvers/search.py, ``RankShift``). Sharded, a rank's peak is
the replay's with each moment moved by what the engine shards or adds at that event of the
step (static, gradient and transient terms), often far below one process's (FSDP keeps 1/N
of the parameters, gradients and optimizer state). The torch-free search gets those terms
as data (the predictor's ``replay_chain.rank_shift``) and judges every plan by the result, which is
:meth:`Predictor.predict` itself: the leanest plan (the stated minimum), the plan for a
budget, the empty plan when ``predict([])`` fits, and every refusal are the per-rank
model's. Before, the search walked the single-process replay against the per-rank budget
and only tightened it where a rank's prediction came out over: budgets above a rank's
no-checkpoint peak still got segments, and budgets between the per-rank and the
single-process minimum were refused. Why the shift as data rather than a budget translated
by it and searched again to a fixed point: the shift depends on the plan, so a translated
budget is right only for the plan it came from; iterating it need not settle, and where it
settles it finds the best plan of the single-process replay at some budget, not the best per
rank. One process (``rank_shift`` None) searches exactly as before.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

from autockpt.costs.problem import Chain, StageRange
from autockpt.planning.predict import Predictor
from solvers import (
    METHODS,
    ChainProblem,
    InfeasibleError,
    Solution,
    minimum_peak_bytes,
    simulate,
    solve,
)
from solvers.search import leanest, least_recompute
from solvers.selective import keep_greedily

__all__ = ["METHODS", "SEARCH_METHODS", "BudgetSearch"]

SEARCH_METHODS = ("auto", "replay")
"""Solver names that mean the search under the replay (``auto`` is the default)."""


class BudgetSearch:
    """Plans for any budget over one chain and one recorded step.

    ``predictor`` is the one memory model (its replay chain, a sharded rank's shift
    included, is what the torch-free search walks; its ``predict`` is that chain's peak);
    ``seeds`` are plans the search must never do worse than (the per-block hand plan);
    ``leanest``, when given, is this search's own :meth:`leanest` from an earlier call on
    the same prepared data (the planning cache, autockpt/planning/cache.py).
    """

    def __init__(
        self,
        chain: Chain,
        predictor: Predictor,
        seeds: tuple[tuple[StageRange, ...], ...] = (),
        leanest: Solution | None = None,
    ) -> None:
        self.chain = chain
        self.predictor = predictor
        self.seeds = seeds
        self.replay_chain = predictor.replay_chain
        self._leanest: Solution | None = leanest
        self._chain_solutions: dict[tuple[int, str], Solution] = {}

    def predict(self, segments: Sequence[StageRange], kept: Sequence[Sequence[int]] = ()) -> int:
        return self.predictor.predict(segments, kept)

    # -- the search under the replay -----------------------------------------------------

    def leanest(self, time_limit_s: float | None = 30.0) -> Solution:
        """The plan with the least predicted peak (ties: least recompute): the stated
        minimum. Never above any seed's peak (the per-block hand plan among them)."""
        if self._leanest is None:
            found = leanest(self.replay_chain, seeds=self.seeds, time_limit_s=time_limit_s)
            self._leanest = _with_peak(found, self.predict(found.segments))
        return self._leanest

    def least_recompute(
        self, budget_bytes: int, *, time_limit_s: float | None = 30.0, selective: bool = True
    ) -> Solution:
        """The least-recompute plan whose predicted peak fits ``budget_bytes``. With
        ``selective``, segments may also keep chosen operator outputs instead of recomputing
        them (:mod:`solvers.selective`), when that is cheaper under the same replay."""
        segment_only = self._segment_plan(budget_bytes, time_limit_s)
        if not selective or not self.replay_chain.node_seconds:
            return segment_only
        return self._selective(budget_bytes, segment_only)

    def _selective(self, budget_bytes: int, segment_only: Solution) -> Solution:
        """``segment_only`` with operator outputs kept inside its segments where the budget
        leaves room and keeping saves more than it costs (:mod:`solvers.selective`);
        ``segment_only`` itself when nothing is worth keeping.

        Why only that plan's segments: trading segments for kept outputs (a leaner segment
        plan, then keeping matmuls in the room it frees) compares plans of different shape
        by the cost model, which on the CPU prices matrix multiplies at about twice their
        measured time and other nodes below theirs; such trades measured 3-15% slower than
        the segment-only plan (docs/design.md, "Selective recompute"). Keeping outputs in
        the room a plan leaves only removes recompute from it."""
        started = time.perf_counter()
        found = keep_greedily(self.replay_chain, segment_only.segments, budget_bytes)
        if not any(found.kept) or found.cost_seconds >= segment_only.recompute_seconds:
            return segment_only
        peak = self.predict(found.segments, found.kept)
        if peak > budget_bytes:  # never: the search's peak is the prediction (kept as a guard)
            return segment_only
        return Solution(
            segments=[tuple(seg) for seg in found.segments],
            recompute_seconds=found.cost_seconds,
            peak_bytes=peak,
            status="feasible",
            method="selective",
            solve_seconds=segment_only.solve_seconds + time.perf_counter() - started,
            gap=None,
            kept=found.kept,
        )

    def _segment_plan(self, budget_bytes: int, time_limit_s: float | None) -> Solution:
        none = self.predict([])
        if none <= budget_bytes:  # nothing to checkpoint (a rank's peak, when sharded)
            return _with_peak(_EMPTY, none)
        return self._fitting(
            budget_bytes,
            # the leanest plan is a seed too: a budget at or above the stated minimum
            # always finds a plan
            lambda budget: least_recompute(
                self.replay_chain,
                budget,
                seeds=(*self.seeds, tuple(self.leanest().segments)),
                time_limit_s=time_limit_s,
            ),
        )

    # -- the stage-chain solvers, judged by the replay -----------------------------------

    def chain_solver(self, budget_bytes: int, solver: str, *, time_limit_s: float) -> Solution:
        """``solver``'s answer (dp, ilp, sqrt, greedy: optimal for the stage-chain proxy)
        at the largest proxy budget whose plan the replay accepts (bisection). Reported as
        ``feasible``: it is not optimal under the replay."""
        problem = self.chain.problem
        floor = _proxy_floor(problem)
        ceiling = _proxy_ceiling(problem)

        def at(proxy_budget: int) -> Solution:
            key = (proxy_budget, solver)
            if key not in self._chain_solutions:
                self._chain_solutions[key] = solve(
                    problem.with_budget(proxy_budget), method=solver, time_limit_s=time_limit_s
                )
            return self._chain_solutions[key]

        def search(budget: int) -> Solution:
            best: Solution | None = None
            low, high = floor, ceiling
            if self.predict([]) <= budget:
                return at(ceiling)
            tolerance = max(1, (high - low) // 256)
            while high - low > tolerance:
                middle = (low + high) // 2
                candidate = at(middle)
                if candidate.status != "infeasible" and self.predict(candidate.segments) <= budget:
                    best, low = candidate, middle
                else:
                    high = middle
            if best is None:
                raise InfeasibleError(f"'{solver}' found no plan within {budget} bytes")
            return dataclasses.replace(best, status="feasible", gap=None)

        return self._fitting(budget_bytes, search)

    # -------------------------------------------------------------------------------------

    def _fitting(self, budget_bytes: int, search: Callable[[int], Solution]) -> Solution:
        """``search`` at ``budget_bytes``, its plan's peak the exact prediction. Every search
        here judges plans by that prediction (a rank's shift included: NOTE [search:
        per-rank peaks]), so its plan fits; should it not, the leanest plan answers where
        it fits. Raises :class:`solvers.InfeasibleError` when no plan fits."""
        try:
            found = search(budget_bytes)
        except InfeasibleError:
            found = None  # a search cut by its safety net: the leanest plan still answers
        if found is not None:
            peak = self.predict(found.segments)
            if peak <= budget_bytes:
                return _with_peak(found, peak)
        lean = self.leanest()
        if lean.peak_bytes <= budget_bytes:
            return lean
        raise InfeasibleError(f"no plan found within {budget_bytes} bytes")


_EMPTY = Solution([], 0.0, 0, "optimal", "replay-exact", 0.0, 0.0)
"""The plan that checkpoints nothing: the answer wherever the step without checkpoints fits."""


def _with_peak(solution: Solution, peak: int) -> Solution:
    return dataclasses.replace(solution, peak_bytes=peak)


def _proxy_floor(problem: ChainProblem) -> int:
    return minimum_peak_bytes(problem)[0]


def _proxy_ceiling(problem: ChainProblem) -> int:
    return simulate(problem, []).peak_bytes
