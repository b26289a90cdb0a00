"""Budget-aware greedy segmentation (Chen et al. 2016, Algorithm 3) plus a local repair.

Reference: T. Chen, B. Xu, C. Zhang, C. Guestrin, "Training Deep Nets with Sublinear
Memory Cost", arXiv:1604.06174, 2016, Section 4.3, Algorithm 3 ("Memory Planning with
Budget") and the grid search over its threshold described with it.

How the paper maps onto the chain model
---------------------------------------
Algorithm 3 walks the graph in topological order, adding each node's size to a running
``temp``; when ``temp`` exceeds the threshold ``b`` the node's output is stored (a
checkpoint) and ``temp`` restarts at 0. Everything between two stored outputs is
recomputed from the first. Here:

* nodes are stages and a node's size is ``s_k`` (what it would keep for backward), so
  ``temp`` is the recompute memory of the segment being built;
* storing the output of stage ``k`` ends the segment ``[start, k+1)``; the next segment
  starts at ``k+1`` and stores ``a_{k+1}``, which is that output;
* the stages after the last checkpoint form a final run. The paper recomputes it like
  any other segment; we also try keeping it (it is the first to be back-propagated, so
  recomputing it only delays its own backward). Both variants are candidates.

In the paper every stage is recomputed, so the threshold only trades memory between
stored checkpoints and segment size; the paper picks ``b`` by a grid search around
``sqrt(x * y)``. We sweep ``b`` over a geometric grid from ``min s`` to ``sum s`` plus the
sqrt-derived ``sum(s) / sqrt(L)``, refine by bisection at the largest fitting ``b``
(larger ``b`` means fewer segments, hence less overhead), and keep the cheapest plan that
fits under the chain model.

Local repair (not in the paper)
-------------------------------
Under this model a kept stage costs nothing to recompute, whereas Algorithm 3 recomputes
everything. So the best fitting plans are then repaired greedily: release whole segments
(most expensive first) while the plan still fits, then shrink each remaining segment from
its end and from its start by the largest amount (binary search) that still fits. Every
accepted step keeps the plan within budget, so the repair never breaks feasibility.

Complexity: the sweep evaluates ``O(G)`` thresholds (``G`` about 180), each in
``O(S log L + L)`` for ``S`` segments; the repair does ``O(S log L)`` evaluations of
``O(L)`` each. Fits are checked with the vectorised peak of :mod:`solvers._kernels`
(equal to :func:`solvers.chain.simulate`'s peak).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import numpy as np

from ._kernels import ChainArrays

__all__ = ["chen_segments", "greedy_plan"]

Plan = list[tuple[int, int]]


def chen_segments(cs: np.ndarray, threshold: float, keep_tail: bool) -> Plan:
    """Algorithm 3 on prefix sums ``cs`` of saved bytes with threshold ``threshold``.

    A segment closes after the first stage that makes its running sum exceed
    ``threshold``. With ``keep_tail`` the final unfinished run is kept instead of
    checkpointed.
    """
    n = len(cs) - 1
    segments: Plan = []
    start = 0
    while start < n:
        # First end e with cs[e] - cs[start] > threshold: stage e-1 tips the sum over b.
        end = int(np.searchsorted(cs, cs[start] + threshold, side="right"))
        if end > n:
            if not keep_tail:
                segments.append((start, n))
            break
        segments.append((start, end))
        start = end
    return segments


def _cost(f: np.ndarray, overhead: float, plan: Plan) -> float:
    return float(sum(f[q] - f[p] for p, q in plan)) + overhead * len(plan)


def greedy_plan(arrays: ChainArrays, *, repair: bool = True, keep: int = 3) -> tuple[Plan, bool]:
    """``(plan, True)``: the cheapest fitting plan found by the sweep (then repaired);
    ``(plan, False)``: nothing swept fits, ``plan`` is the swept plan of lowest peak.

    ``keep``: how many of the cheapest fitting sweep plans are repaired.
    """
    problem = arrays.problem
    cs = arrays.cs
    total = float(cs[-1])
    f = np.zeros(arrays.n + 1)
    f[1:] = np.cumsum(problem.forward_seconds)
    overhead = problem.segment_overhead_seconds
    budget = arrays.budget

    positive = arrays.s[arrays.s > 0]
    lo = float(positive.min()) if len(positive) else 1.0
    grid = list(np.geomspace(lo, max(total, lo), 64)) if total > 0 else [0.0]
    grid.append(total / math.sqrt(arrays.n))  # Chen et al.'s sqrt-derived starting point
    grid = sorted(set(grid))

    peaks: dict[tuple[tuple[int, int], ...], int] = {}

    def peak(plan: Plan) -> int:
        key = tuple(plan)
        if key not in peaks:
            peaks[key] = arrays.plan_peak(plan)
        return peaks[key]

    def fits(plan: Plan) -> bool:
        return peak(plan) <= budget

    fitting: list[Plan] = []
    for keep_tail in (False, True):
        fit_flags = []
        for b in grid:
            plan = chen_segments(cs, b, keep_tail)
            fit_flags.append(fits(plan))
            if fit_flags[-1]:
                fitting.append(plan)
        # Bisect the last fit -> miss step: the largest fitting threshold has the fewest
        # segments there (feasibility need not be monotone in b, so only that step).
        steps = [i for i in range(len(grid) - 1) if fit_flags[i] and not fit_flags[i + 1]]
        if steps:
            lo_b, hi_b = grid[steps[-1]], grid[steps[-1] + 1]
            for _ in range(24):
                mid = 0.5 * (lo_b + hi_b)
                plan = chen_segments(cs, mid, keep_tail)
                if fits(plan):
                    fitting.append(plan)
                    lo_b = mid
                else:
                    hi_b = mid
    if not fitting:
        lowest = min(peaks.items(), key=lambda item: (item[1], len(item[0]), item[0]))[0]
        return list(lowest), False
    fitting.sort(key=lambda plan: (_cost(f, overhead, plan), len(plan), plan))
    if not repair:
        return fitting[0], True
    best: Plan | None = None
    best_cost = math.inf
    for plan in _unique(fitting)[:keep]:
        repaired = _repair(plan, f, overhead, fits)
        cost = _cost(f, overhead, repaired)
        if cost < best_cost:
            best, best_cost = repaired, cost
    assert best is not None
    return best, True


def _unique(plans: list[Plan]) -> list[Plan]:
    out: list[Plan] = []
    seen: set[tuple[tuple[int, int], ...]] = set()
    for plan in plans:
        key = tuple(plan)
        if key not in seen:
            seen.add(key)
            out.append(plan)
    return out


def _repair(plan: Plan, f: np.ndarray, overhead: float, fits: Callable[[Plan], bool]) -> Plan:
    """Release and shrink segments while the plan still fits (see module docstring)."""
    plan = list(plan)
    for seg in sorted(plan, key=lambda pq: -(f[pq[1]] - f[pq[0]])):
        trial = [x for x in plan if x != seg]
        if fits(trial):
            plan = trial
    for i in range(len(plan) - 1, -1, -1):
        p, q = plan[i]
        plan[i] = (p, q - _largest(q - p - 1, partial(_tail_fits, fits, plan, i)))
        p, q = plan[i]
        plan[i] = (p + _largest(q - p - 1, partial(_head_fits, fits, plan, i)), q)
    return plan


def _tail_fits(fits: Callable[[Plan], bool], plan: Plan, i: int, t: int) -> bool:
    """Does the plan fit when segment ``i`` keeps its last ``t`` stages instead?"""
    p, q = plan[i]
    return fits([*plan[:i], (p, q - t), *plan[i + 1 :]])


def _head_fits(fits: Callable[[Plan], bool], plan: Plan, i: int, t: int) -> bool:
    """Does the plan fit when segment ``i`` keeps its first ``t`` stages instead?"""
    p, q = plan[i]
    return fits([*plan[:i], (p + t, q), *plan[i + 1 :]])


def _largest(upper: int, ok: Callable[[int], bool]) -> int:
    """Largest ``t`` in ``0 .. upper`` with ``ok(t)`` found by bisection (``ok(0)`` holds).

    Fitting is not monotone in ``t`` in general, so this finds *a* large fitting ``t``,
    never an unfitting one.
    """
    lo, hi = 0, upper
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo
