"""Vectorised unit costs of the chain model, shared by the exact solvers.

This restates the event formulas of :mod:`solvers.chain` per *unit* so that solvers can
test feasibility as ``before(start) + local(unit) <= budget - static`` without replaying a
timeline. Tests check every quantity here against :func:`solvers.chain.simulate`.

Local peak of a unit (bytes above ``static + before(start)``):

* kept stage ``k``: its backward dominates its forward (it adds ``G(k) >= 0``), so
  ``local_kept(k) = a_k + s_k + t_k + a_{k+1} + G(k)``.
* segment ``[p, q)``: the first-forward event of stage ``m`` is dominated by its
  recompute event (recompute adds ``sum_{p<=n<m} s_n + a_q + G(q) >= 0``), so
  ``local(p, q) = max(rec(p, q), bwd(p, q))`` with

  ``rec(p, q) = a_p - cs_p + max(X0_p, max_{p<m<q} Xr_m) + a_q + G(q)``
  ``bwd(p, q) = a_p - cs_p + max_{p<=m<q} Y_m``

  where ``cs`` are prefix sums of ``s``, ``X0_p = cs_p + s_p + t_p + a_{p+1}``,
  ``Xr_m = cs_m + a_m + s_m + t_m + a_{m+1}`` and
  ``Y_m = cs_{m+1} + a_{m+1} + a_m + t_m + G(m)``. For fixed ``p`` the inner maxima are
  running maxima over ``q``, so a whole row ``local(p, p+1 .. qmax)`` costs one
  ``O(qmax - p)`` numpy pass. ``bwd(p, q)`` is non-decreasing in ``q`` and at least
  ``cs_q - cs_p``, which bounds how far a row needs to go.

Costs are quantised once to integers (:class:`CostScale`) so that the exact solvers
compare and add costs without floating-point rounding and ties are real ties.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .chain import ChainProblem

__all__ = ["ChainArrays", "CostScale", "INT_LIMIT"]

# Every byte quantity a kernel forms is bounded by the total below; keep it far from the
# int64 limit so that sums of two such values (and ``budget`` offsets) cannot overflow.
INT_LIMIT = 2**61


class ChainArrays:
    """Numpy view of a :class:`ChainProblem` with the per-unit local peaks."""

    def __init__(self, problem: ChainProblem) -> None:
        n = problem.num_stages
        total = (
            problem.static_bytes
            + problem.budget_bytes
            + sum(problem.saved_bytes)
            + 3 * sum(problem.input_bytes)
            + sum(problem.transient_bytes)
            + sum(problem.param_grad_bytes)
        )
        if total >= INT_LIMIT:
            raise ValueError(
                f"byte counts are too large for exact int64 arithmetic (total {total} >= 2**61)"
            )
        self.problem = problem
        self.n = n
        self.static = problem.static_bytes
        self.budget = problem.budget_bytes
        s = np.asarray(problem.saved_bytes, dtype=np.int64)
        a = np.zeros(n + 1, dtype=np.int64)
        a[:n] = problem.input_bytes
        t = np.asarray(problem.transient_bytes, dtype=np.int64)
        g = np.asarray(problem.param_grad_bytes, dtype=np.int64)
        big_g = np.zeros(n + 1, dtype=np.int64)
        big_g[:n] = np.cumsum(g[::-1])[::-1]
        cs = np.zeros(n + 1, dtype=np.int64)
        cs[1:] = np.cumsum(s)
        self.s, self.a, self.t, self.big_g, self.cs = s, a, t, big_g, cs
        self.local_kept = a[:n] + s + t + a[1:] + big_g[:n]
        self._x0 = cs[:n] + s + t + a[1:]
        self._xr = cs[:n] + a[:n] + s + t + a[1:]
        self._y = cs[1:] + a[1:] + a[:n] + t + big_g[:n]
        self._tail = a + big_g  # a_q + G(q), q = 0..n

    def segment_row(self, p: int, qmax: int) -> np.ndarray:
        """``local(p, q)`` for ``q = p+1 .. qmax`` (int64 array of length ``qmax - p``)."""
        rec = np.empty(qmax - p, dtype=np.int64)
        rec[0] = self._x0[p]
        if qmax - p > 1:
            np.maximum(self._x0[p], np.maximum.accumulate(self._xr[p + 1 : qmax]), out=rec[1:])
        rec += self._tail[p + 1 : qmax + 1]
        bwd = np.maximum.accumulate(self._y[p:qmax])
        out = np.maximum(rec, bwd)
        out += self.a[p] - self.cs[p]
        return out

    def segment_local(self, p: int, q: int) -> int:
        """``local(p, q)`` of a single segment."""
        return int(self.segment_row(p, q)[-1])

    def row_limit(self, p: int, headroom: int) -> int:
        """Largest ``q`` whose segment ``[p, q)`` can have ``local <= headroom``.

        Uses ``local(p, q) >= cs_q - cs_p``; the bound is safe, not tight.
        """
        return max(p + 1, int(np.searchsorted(self.cs, self.cs[p] + headroom, side="right")) - 1)

    def plan_peak(self, segments: Sequence[tuple[int, int]]) -> int:
        """Peak of a plan (same value as ``simulate(...).peak_bytes``), in ``O(L)`` numpy.

        ``segments`` must already be valid (sorted, disjoint, in range).
        """
        n = self.n
        stored = self.s.copy()
        local = self.local_kept.copy()
        is_start = np.ones(n, dtype=bool)
        for p, q in segments:
            is_start[p + 1 : q] = False
            stored[p] = self.a[p]
            stored[p + 1 : q] = 0
            local[p] = self.segment_local(p, q)
        before = np.cumsum(stored) - stored
        return int(self.static + np.max((before + local)[is_start]))


@dataclass(frozen=True)
class CostScale:
    """Integer recompute costs with the number of segments as a tie-breaker.

    ``key = cost_ticks * base + segments``: comparing keys compares recompute cost first
    (quantised to ``tick`` seconds) and then the number of segments. ``tick`` is chosen so
    that the most expensive plan costs at most ``2**50`` ticks (exact in float64; keys stay
    below ``2**62``); the rounding error per stage is at most ``tick / 2``, i.e. below
    ``5e-16`` of the total forward time, about float64 rounding level.
    """

    tick: float
    base: int
    f_ticks: np.ndarray  # prefix sums of per-stage ticks, length L + 1
    overhead_ticks: int
    quantum: int = 1  # every plan's cost in ticks is a multiple of this (gcd of the ticks)

    @classmethod
    def of(cls, problem: ChainProblem) -> CostScale:
        n = problem.num_stages
        base = 1 << max(1, (n + 1).bit_length())
        # <= 2**50 ticks keeps every cost (and bound) an exact float64 integer, and
        # ``ticks * base`` below 2**62.
        budget_ticks = min((1 << 61) // base, 1 << 50)
        seconds = np.asarray(problem.forward_seconds, dtype=np.float64)
        overhead_s = problem.segment_overhead_seconds
        total = math.fsum(problem.forward_seconds) + overhead_s * n
        tick = total / budget_ticks if total > 0 else 1.0
        f = np.rint(seconds / tick).astype(np.int64)
        prefix = np.zeros(n + 1, dtype=np.int64)
        prefix[1:] = np.cumsum(f)
        overhead = round(overhead_s / tick)
        quantum = int(np.gcd.reduce(np.append(f, overhead)))
        return cls(
            tick=tick, base=base, f_ticks=prefix, overhead_ticks=overhead, quantum=max(1, quantum)
        )

    def round_up(self, ticks: np.ndarray) -> np.ndarray:
        """Lower bounds on plan costs raised to the next multiple of :attr:`quantum`.

        Valid because every plan's cost is such a multiple; it matters for chains with
        repeated identical stages, where it turns "within one stage of the optimum" into
        "at the optimum" and prunes accordingly.
        """
        if self.quantum <= 1:
            return ticks
        # ``ticks / quantum`` is below 2**50 and off by at most 1/16 after rounding; the
        # 0.25 slack keeps the result <= the true next multiple.
        return np.ceil(ticks / self.quantum - 0.25) * self.quantum

    def segment_keys(self, p: int, q: np.ndarray | int) -> np.ndarray:
        """Keys of segments ``[p, q)`` for an array (or scalar) of ends ``q``."""
        return (self.f_ticks[q] - self.f_ticks[p] + self.overhead_ticks) * self.base + 1

    def plan_key(self, segments: Sequence[tuple[int, int]]) -> int:
        return sum(int(self.segment_keys(p, q)) for p, q in segments)
