"""Method dispatch: ``solve`` for every method, ``auto``'s portfolio, ``minimum_peak_bytes``.

Every path ends in :func:`solvers.solution.make_solution`, so every answer is replayed by
:func:`solvers.chain.simulate` and never claims ``optimal``/``feasible`` over budget.

``auto`` (portfolio, in order):

1. exact infeasibility test (minimum peak, :mod:`solvers.bounds`); if no plan fits,
   return the cheapest minimum-peak plan as ``infeasible``;
2. ``greedy`` and ``sqrt`` (fast); the cheaper fitting one is the incumbent;
3. ``dp`` with the incumbent as upper bound, until 70% of the time limit; if it finishes
   its answer is optimal;
4. otherwise ``ilp`` for the remaining time, seeded with the best plan so far (dp's own
   incumbent or the heuristics'; see :mod:`solvers.ilp` for how it is used), up to
   400 stages (beyond, building the model would eat the time limit);
5. the cheapest fitting plan seen, ``feasible`` with the ILP's gap when it has a bound.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import replace

from ._kernels import ChainArrays, CostScale
from .bounds import plan_from_choice, suffix_min_peaks
from .chain import ChainProblem, simulate
from .dp import SearchTimeout, optimal_plan
from .greedy import greedy_plan
from .ilp import DEFAULT_TIME_LIMIT_S, ilp_plan
from .solution import Solution, make_solution
from .sqrt import sqrt_plan

__all__ = ["METHODS", "solve", "minimum_peak_bytes"]

METHODS = ("auto", "dp", "ilp", "sqrt", "greedy")

Plan = list[tuple[int, int]]

# ``auto`` only falls back to the ILP up to this many stages: beyond it the candidate set
# (up to L * W units) makes building the PuLP model alone a large share of the time limit,
# while dp's own incumbent is already near-optimal there.
_AUTO_ILP_MAX_STAGES = 400
_DP_SHARE = 0.7


def minimum_peak_bytes(problem: ChainProblem) -> tuple[int, Plan]:
    """Least achievable peak over all plans, and the cheapest plan achieving it.

    Exact: the peak comes from the min-max recursion of :mod:`solvers.bounds`; the plan
    from the exact DP at ``budget = that peak`` (so among minimum-peak plans it has the
    least recompute time), and ``simulate(problem, plan).peak_bytes`` equals the returned
    peak. This is the "minimum feasible budget" callers should report.
    """
    peak, fallback = _min_peak(ChainArrays(problem))
    plan = optimal_plan(
        ChainArrays(problem.with_budget(peak)), CostScale.of(problem.with_budget(peak))
    )
    if plan is None or simulate(problem, plan).peak_bytes != peak:  # defensive, not expected
        plan = fallback
    return peak, plan


def _min_peak(arrays: ChainArrays) -> tuple[int, Plan]:
    best, choice = suffix_min_peaks(arrays)
    return arrays.static + int(best[0]), plan_from_choice(choice)


def solve(
    problem: ChainProblem, method: str = "auto", time_limit_s: float | None = None
) -> Solution:
    """Choose segments to checkpoint so that ``problem`` fits its budget at least cost.

    ``method`` is one of :data:`METHODS`. ``time_limit_s`` bounds ``auto`` (default 30 s),
    ``ilp`` (default 30 s) and ``dp`` (default: none); ``sqrt`` and ``greedy`` ignore it.

    Infeasible answers (``status == "infeasible"``, always ``peak_bytes > budget``): when
    no plan fits, every method returns the cheapest minimum-peak plan, so ``peak_bytes``
    is the least achievable peak. ``auto``, ``dp`` and ``ilp`` only answer infeasible in
    that case; ``sqrt``/``greedy`` also do when their own plan does not fit although
    another would, and then return their own (lowest-peak) plan.
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; valid methods: {', '.join(METHODS)}")
    if time_limit_s is not None and not (time_limit_s > 0 and math.isfinite(time_limit_s)):
        raise ValueError(f"time_limit_s must be a positive number of seconds, got {time_limit_s!r}")
    started = time.perf_counter()
    runner: Callable[[ChainProblem, float | None, float], Solution] = _RUNNERS[method]
    return runner(problem, time_limit_s, started)


def _infeasible(problem: ChainProblem, method: str, started: float) -> Solution:
    """The cheapest minimum-peak plan, reported infeasible (caller checked it is)."""
    _, plan = minimum_peak_bytes(problem)
    return make_solution(problem, plan, method=method, started=started)


def _truly_infeasible(arrays: ChainArrays) -> bool:
    return _min_peak(arrays)[0] > arrays.budget


def _cost(problem: ChainProblem, plan: Plan) -> float:
    return simulate(problem, plan).recompute_seconds


def _run_sqrt(problem: ChainProblem, _limit: float | None, started: float) -> Solution:
    plan = sqrt_plan(problem)
    answer = make_solution(problem, plan, method="sqrt", started=started)
    if answer.feasible or not _truly_infeasible(ChainArrays(problem)):
        return answer
    return _infeasible(problem, "sqrt", started)


def _run_greedy(problem: ChainProblem, _limit: float | None, started: float) -> Solution:
    arrays = ChainArrays(problem)
    plan, fits = greedy_plan(arrays)
    if fits or not _truly_infeasible(arrays):
        # Not fitting although another plan would: the sweep's lowest-peak plan.
        return make_solution(problem, plan, method="greedy", started=started)
    return _infeasible(problem, "greedy", started)


def _best_heuristic(problem: ChainProblem, arrays: ChainArrays) -> tuple[Plan | None, str]:
    """Cheaper fitting plan of greedy and sqrt (``None`` if neither fits)."""
    options: list[tuple[float, int, str, Plan]] = []
    greedy, greedy_fits = greedy_plan(arrays)
    for name, plan in (("greedy", greedy if greedy_fits else None), ("sqrt", sqrt_plan(problem))):
        if plan is not None and arrays.plan_peak(plan) <= arrays.budget:
            options.append((_cost(problem, plan), len(options), name, plan))
    if not options:
        return None, ""
    _, _, name, plan = min(options)
    return plan, name


def _run_dp(problem: ChainProblem, limit: float | None, started: float) -> Solution:
    arrays = ChainArrays(problem)
    deadline = None if limit is None else started + limit
    try:
        plan = optimal_plan(arrays, CostScale.of(problem), deadline=deadline)
    except SearchTimeout as exc:
        # Out of time: the best fitting plan the search had (never worse than the
        # minimum-peak plan), without an optimality claim.
        return make_solution(problem, exc.incumbent or [], method="dp", started=started)
    if plan is None:
        return _infeasible(problem, "dp", started)
    return make_solution(problem, plan, method="dp", started=started, proved_optimal=True)


def _run_ilp(problem: ChainProblem, limit: float | None, started: float) -> Solution:
    arrays = ChainArrays(problem)
    if _truly_infeasible(arrays):
        return _infeasible(problem, "ilp", started)
    incumbent, _ = _best_heuristic(problem, arrays)
    if incumbent is None:
        incumbent = _min_peak(arrays)[1]
    budget_s = DEFAULT_TIME_LIMIT_S if limit is None else limit
    remaining = max(0.5, budget_s - (time.perf_counter() - started))
    return _finish_ilp(problem, arrays, incumbent, remaining, started)


def _finish_ilp(
    problem: ChainProblem, arrays: ChainArrays, incumbent: Plan, remaining: float, started: float
) -> Solution:
    """Run the ILP from a fitting ``incumbent``; report the better of the two plans."""
    result = ilp_plan(arrays, time_limit_s=remaining, warm_start=incumbent)
    best, proved = incumbent, False
    if result.plan is not None and arrays.plan_peak(result.plan) <= arrays.budget:
        if _cost(problem, result.plan) <= _cost(problem, incumbent):
            best, proved = result.plan, result.proved_optimal
    answer = make_solution(problem, best, method="ilp", started=started, proved_optimal=proved)
    if answer.status == "feasible" and result.lower_bound_seconds is not None:
        cost = answer.recompute_seconds
        gap = 0.0 if cost <= 0 else max(0.0, (cost - result.lower_bound_seconds) / cost)
        answer = replace(answer, gap=gap)
    return answer


def _run_auto(problem: ChainProblem, limit: float | None, started: float) -> Solution:
    budget_s = DEFAULT_TIME_LIMIT_S if limit is None else limit
    arrays = ChainArrays(problem)
    if _truly_infeasible(arrays):
        return _infeasible(problem, "dp", started)
    incumbent, source = _best_heuristic(problem, arrays)
    cost = CostScale.of(problem)
    upper = None if incumbent is None else cost.plan_key(incumbent)
    try:
        plan = optimal_plan(arrays, cost, upper_key=upper, deadline=started + _DP_SHARE * budget_s)
    except SearchTimeout as exc:
        if exc.incumbent is not None and (
            incumbent is None or _cost(problem, exc.incumbent) < _cost(problem, incumbent)
        ):
            incumbent, source = exc.incumbent, "dp"
    else:
        if plan is not None:
            return make_solution(problem, plan, method="dp", started=started, proved_optimal=True)
    if incumbent is None:  # cannot happen: the minimum-peak plan fits (checked above)
        incumbent, source = _min_peak(arrays)[1], "dp"
    remaining = budget_s - (time.perf_counter() - started)
    if problem.num_stages <= _AUTO_ILP_MAX_STAGES and remaining >= 1.0:
        answer = _finish_ilp(problem, arrays, incumbent, remaining, started)
        if answer.segments == incumbent and answer.status != "optimal":
            answer = replace(answer, method=source)  # the ILP kept the incumbent
        return answer
    return make_solution(problem, incumbent, method=source, started=started)


_RUNNERS = {
    "auto": _run_auto,
    "dp": _run_dp,
    "ilp": _run_ilp,
    "sqrt": _run_sqrt,
    "greedy": _run_greedy,
}
