"""Exact minimum-recompute plan by a Pareto-front dynamic program over suffixes.

Reference: the decomposition of :mod:`solvers.chain` (every event of a unit is
``static + before(start) + local(unit)``) turns plan search into a resource-constrained
shortest path on the DAG whose nodes are stage boundaries ``0 .. L`` and whose edges are
units; the Pareto-label ("multi-criteria labelling") method for such paths is classical,
e.g. Martins, "On a multicriteria shortest path problem", EJOR 16(2), 1984, and the
label-setting algorithms for the resource-constrained shortest path problem surveyed by
Irnich and Desaulniers, "Shortest path problems with resource constraints", 2005.
Checkmate (Jain et al., MLSys 2020) and Beaumont et al. (2019) solve related
checkpointing problems with ILP and DP respectively.

Why suffixes
------------
The textbook form is a left-to-right DP over (stored prefix bytes, cost). This module runs
the mirror image, right-to-left over (headroom, cost); both are exact and, without
bounds, their fronts are about equally large (measured on a 200-stage random chain at a
50% budget: largest front 3,930 labels / 336k labels in total left-to-right, 3,754 / 343k
right-to-left). Right-to-left was chosen because its label ``H`` is the suffix's peak
contribution, which gives

* a cheap, strong pruning rule: the slack ``budget - static - H`` left for the prefix is
  exactly what the Lagrangian prefix bound of :mod:`solvers.bounds` needs (this is what
  makes 1000+ stages tractable: with it and the beam upper bound below, the instance
  above peaks at 26 labels, 1,658 in total);
* a meaningful tie-break for free: among cheapest plans the one with the lowest peak;
* exact ties decided on the *first* unit, i.e. lexicographically (see below).

Algorithm
---------
Label ``(H, K)`` at boundary ``p``: a plan for ``p .. L-1`` needing headroom ``H`` (its
peak is ``static + before(p) + H``) and costing key ``K`` (:class:`CostScale`: integer
recompute ticks, then number of segments). ``front(L) = {(0, 0)}``. For
``p = L-1 .. 0`` the candidates are

* keep ``p``: from each label of ``front(p+1)``, ``(max(local_kept(p), s_p + H), K)``;
* segment ``[p, q)``: from each label of ``front(q)``,
  ``(max(local(p, q), a_p + H), K + key(p, q))``.

A candidate is discarded if ``H > budget - static - msp(p)`` (``msp``: least stored
bytes any feasible prefix can have) or if ``cost(K) + LB(p, H)`` exceeds the cost of the
best fitting plan known (``LB``: Lagrangian lower bound on the cost of any prefix that
leaves ``H`` of headroom, :class:`solvers.bounds.PrefixCostBound`). ``front(p)`` is the
Pareto minimum of the rest (no other label with ``H`` and ``K`` both ``<=``). All three
rules are exact: ``H'`` and ``K'`` are monotone in ``H`` and ``K``, and a discarded label
cannot complete to a plan cheaper than one already known. The answer is the label of
``front(0)`` with the least ``K`` (fronts are sorted by ``H`` up and ``K`` strictly down,
so it is unique); its plan is recovered from back-pointers. Costs are integers, so no
comparison rounds; bytes are exact int64 (no memory discretisation).

Engineering that keeps it fast (none of it changes the answer):

* the known-plan bound starts at the minimum-peak plan and is tightened by *beam* sweeps
  (the same recursion with fronts capped at 2, 8, then 32 labels, keeping the least
  headroom label so a fitting plan always survives): the exact sweep's work grows steeply
  with the distance between that bound and the optimum;
* fronts are stored contiguously and summarised in chunks of 8 labels (least headroom,
  least cost); a whole chunk is skipped when its corner already fails the bound, and a
  chunk whose labels all have ``a_p + H <= local(p, q)`` collapses to its cheapest label;
* every step for one ``p`` is a handful of numpy passes plus one sort.

Tie-break (deterministic): least recompute cost, then fewest segments, then lowest peak
(the least-``K`` label has the least ``H`` for that ``K``), then, among labels equal in
``(H, K)`` at a boundary, the one whose first unit comes first in the order segment
``[p, p+1)`` < ``[p, p+2)`` < ... < keep ``p``; for plans with as many segments this is
the lexicographic order of their segment lists. Partial plans dominated with a strictly
smaller ``H`` are gone by then, so this is the lexicographic minimum among the surviving
plans, not necessarily among all cheapest lowest-peak plans.

Complexity: ``O(sum_p sum_{q in window(p)} |front(q)|)`` time, where ``window(p)`` holds
the segment ends with ``cs_q - cs_p <= budget - static - msp(p)`` and segment cost within
the known bound: ``O(L * W * F)`` for longest feasible segment ``W`` and largest front
``F``, plus ``O(L * W * M)`` to build the bound (``M`` = 32 + 96 multipliers), and
``O(sum_p |front(p)|)`` memory. ``F`` is pseudo-polynomial in the worst case (the problem
contains knapsack); measured sizes and times are in ``docs/solvers.md``.
"""

from __future__ import annotations

import numpy as np

from ._kernels import ChainArrays, CostScale
from .bounds import (
    PrefixCostBound,
    SearchTimeout,
    check_deadline,
    plan_from_choice,
    prefix_min_stored,
    suffix_min_peaks,
)

__all__ = ["optimal_plan", "SearchTimeout"]

_NO_LIMIT = np.iinfo(np.int64).max
_BEAMS = (2, 8, 32)
CHUNK = 8


class _Store:
    """Growable column store of labels; fronts are appended for ``p = L, L-1, ..., 0``.

    Each front is also summarised in *chunks* of up to ``CHUNK`` consecutive labels (least
    headroom = first label, least cost = last label, largest headroom = last label), so
    that a sweep can discard or collapse whole chunks before touching their labels.
    """

    _LABEL_COLS = (
        ("h", np.int64),
        ("k", np.int64),
        ("pos", np.int64),
        ("end", np.int64),
        ("seg", bool),
        ("child", np.int64),
    )
    _CHUNK_COLS = (
        ("c_start", np.int64),
        ("c_len", np.int64),
        ("c_pos", np.int64),
        ("c_hmin", np.int64),
        ("c_hmax", np.int64),
        ("c_kmin", np.int64),
    )

    def __init__(self, capacity: int) -> None:
        for name, dtype in self._LABEL_COLS + self._CHUNK_COLS:
            setattr(self, name, np.empty(capacity, dtype=dtype))
        self.size = 0
        self.c_size = 0

    def _grow(self, cols: tuple[tuple[str, type], ...], used: int, need: int) -> None:
        if need <= len(getattr(self, cols[0][0])):
            return
        cap = max(need, 2 * len(getattr(self, cols[0][0])))
        for name, _ in cols:
            old = getattr(self, name)
            new = np.empty(cap, dtype=old.dtype)
            new[:used] = old[:used]
            setattr(self, name, new)

    def append(
        self,
        pos: int,
        h: np.ndarray,
        k: np.ndarray,
        end: np.ndarray,
        seg: np.ndarray,
        child: np.ndarray,
    ) -> None:
        m = len(h)
        need = self.size + m
        self._grow(self._LABEL_COLS, self.size, need)
        sl = slice(self.size, need)
        self.h[sl], self.k[sl], self.pos[sl] = h, k, pos
        self.end[sl], self.seg[sl], self.child[sl] = end, seg, child
        first = np.arange(0, m, CHUNK)
        last = np.minimum(first + CHUNK, m) - 1
        c_need = self.c_size + len(first)
        self._grow(self._CHUNK_COLS, self.c_size, c_need)
        cs = slice(self.c_size, c_need)
        self.c_start[cs] = first + self.size
        self.c_len[cs] = last - first + 1
        self.c_pos[cs] = pos
        self.c_hmin[cs] = h[first]
        self.c_hmax[cs] = h[last]
        self.c_kmin[cs] = k[last]
        self.size = need
        self.c_size = c_need


def _pareto(h: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Indices of the Pareto-minimal labels, sorted by ``h`` ascending.

    Among labels equal in ``(h, k)`` the earliest wins (the sort is stable), so callers
    list candidates in tie-break order.
    """
    order = np.lexsort((k, h))
    ks = k[order]
    keep = np.empty(len(ks), dtype=bool)
    if len(ks):
        keep[0] = True
        np.less(ks[1:], np.minimum.accumulate(ks)[:-1], out=keep[1:])
    return order[keep]


def optimal_plan(
    arrays: ChainArrays,
    cost: CostScale,
    *,
    upper_key: int | None = None,
    deadline: float | None = None,
) -> list[tuple[int, int]] | None:
    """Cheapest plan that fits ``arrays.budget``, or ``None`` if no plan fits.

    ``upper_key``: key (:meth:`CostScale.plan_key`) of a known feasible plan; it only
    prunes, the result stays exact. ``deadline``: a ``time.perf_counter()`` value; past it
    the search raises :class:`SearchTimeout` carrying the best fitting plan found so far
    (the minimum-peak plan at worst); an ``upper_key`` plan is not known here, so callers
    compare it themselves.

    Pipeline (each step only tightens what the next one may prune):

    1. minimum peak (infeasibility test) and ``msp``;
    2. the Lagrangian prefix bound (:meth:`PrefixCostBound.tuned`; measured: a fine grid
       of multipliers is what makes it prune, its range hardly matters);
    3. beam sweeps of width 2, 8 and 32, each bounded by the best plan so far, to get a
       near-optimal upper bound cheaply (the exact sweep's cost grows steeply with the
       gap between that bound and the optimum);
    4. the exact sweep.
    """
    headroom = arrays.budget - arrays.static
    if headroom < 0:
        return None
    min_peaks, choice = suffix_min_peaks(arrays)
    if int(min_peaks[0]) > headroom:
        return None
    msp = prefix_min_stored(arrays, headroom)
    # The minimum-peak plan fits, so its cost is always a valid first upper bound.
    incumbent = plan_from_choice(choice)
    limit = cost.plan_key(incumbent)
    if upper_key is not None:
        limit = min(limit, int(upper_key))
    try:
        bound = PrefixCostBound.tuned(
            arrays, cost.f_ticks, cost.overhead_ticks, headroom, msp, deadline
        )
        for beam in _BEAMS:
            found = _search(arrays, cost, headroom, msp, bound, limit, beam, deadline)
            if found is not None and cost.plan_key(found) <= limit:
                incumbent, limit = found, cost.plan_key(found)
        return _search(arrays, cost, headroom, msp, bound, limit, 0, deadline)
    except SearchTimeout as exc:
        exc.incumbent = incumbent
        raise


def _search(
    arrays: ChainArrays,
    cost: CostScale,
    headroom: int,
    msp: np.ndarray,
    bound: PrefixCostBound,
    limit: int,
    beam: int,
    deadline: float | None,
) -> list[tuple[int, int]] | None:
    """One right-to-left sweep; ``beam > 0`` caps every front (heuristic mode)."""
    n = arrays.n
    a, s = arrays.a, arrays.s
    limit_ticks = limit // cost.base
    cutoff_ticks = limit_ticks - cost.overhead_ticks

    def least_key(p: int, h: np.ndarray) -> np.ndarray:
        """Least key any prefix can add to a suffix needing headroom ``h`` (>= 0 segments)."""
        ticks = np.ceil(np.clip(bound(p, h), 0.0, float(limit_ticks + 1)))
        return cost.round_up(ticks).astype(np.int64) * cost.base

    store = _Store(max(1024, 8 * n))
    offset = np.zeros(n + 1, dtype=np.int64)  # first label of front(p)
    c_offset = np.zeros(n + 1, dtype=np.int64)  # first chunk of front(p)
    store.append(
        n,
        np.zeros(1, np.int64),
        np.zeros(1, np.int64),
        np.full(1, -1),
        np.zeros(1, bool),
        np.full(1, -1),
    )

    for p in range(n - 1, -1, -1):
        check_deadline(deadline)
        hi = store.size
        offset[p] = hi
        c_offset[p] = store.c_size
        cap = headroom - int(msp[p])
        if cap < 0:
            continue
        # Segments [p, q): fronts of q = p+1 .. qmax are one contiguous run of chunks.
        qmax = min(n, arrays.row_limit(p, cap))
        f_lim = int(np.searchsorted(cost.f_ticks, cost.f_ticks[p] + cutoff_ticks, side="right")) - 1
        qmax = max(p + 1, min(qmax, f_lim))
        row = arrays.segment_row(p, qmax)
        seg_ticks = cost.f_ticks[p + 1 : qmax + 1] - cost.f_ticks[p] + cost.overhead_ticks
        clo, chi = int(c_offset[qmax]), store.c_size
        c_col = store.c_pos[clo:chi] - (p + 1)
        c_loc = row[c_col]
        c_hmin = store.c_hmin[clo:chi] + a[p]
        h_lo = np.maximum(c_loc, c_hmin)
        # Discard chunks whose least cost and least headroom already exceed the limit.
        seg_keys = seg_ticks * cost.base + 1
        c_ok = (h_lo <= cap) & (
            store.c_kmin[clo:chi] + seg_keys[c_col] + least_key(p, h_lo) <= limit
        )
        # Reversed: fronts are stored for q descending; candidates must come in the
        # tie-break order (segments by q ascending, then keep) for the stable sort below.
        c_sel = (np.flatnonzero(c_ok) + clo)[::-1]
        # A chunk whose labels all satisfy a_p + H <= local(p, q) collapses onto
        # H' = local(p, q); only its last label (least cost) can survive.
        collapsed = store.c_hmax[c_sel] + a[p] <= row[store.c_pos[c_sel] - (p + 1)]
        lens = np.where(collapsed, 1, store.c_len[c_sel])
        starts = store.c_start[c_sel] + np.where(collapsed, store.c_len[c_sel] - 1, 0)
        total = int(lens.sum())
        idx = np.arange(total, dtype=np.int64) + np.repeat(starts - (np.cumsum(lens) - lens), lens)
        q_lab = store.pos[idx]
        seg_h = np.maximum(row[q_lab - (p + 1)], a[p] + store.h[idx])
        seg_k = store.k[idx] + cost.segment_keys(p, q_lab)
        seg_sel = np.flatnonzero((seg_h <= cap) & (seg_k <= limit))
        # Keep p: from front(p+1), the last block of the store.
        klo = int(offset[p + 1])
        keep_h = np.maximum(arrays.local_kept[p], s[p] + store.h[klo:hi])
        keep_k = store.k[klo:hi]
        keep_sel = np.flatnonzero((keep_h <= cap) & (keep_k <= limit))

        cand_h = np.concatenate((seg_h[seg_sel], keep_h[keep_sel]))
        cand_k = np.concatenate((seg_k[seg_sel], keep_k[keep_sel]))
        cand_end = np.concatenate((q_lab[seg_sel], np.full(len(keep_sel), p + 1)))
        cand_child = np.concatenate((idx[seg_sel], keep_sel + klo))
        cand_seg = np.zeros(len(cand_h), dtype=bool)
        cand_seg[: len(seg_sel)] = True
        # A label whose best completion is worse than the known plan in (cost, segments)
        # cannot lead to the answer; equal ones stay for the peak/lexicographic tie-break.
        est = cand_k + least_key(p, cand_h)
        alive = np.flatnonzero(est <= limit)
        if len(alive) == 0:
            continue
        if len(alive) < len(cand_h):
            cand_h, cand_k, cand_end = cand_h[alive], cand_k[alive], cand_end[alive]
            cand_child, cand_seg, est = cand_child[alive], cand_seg[alive], est[alive]
        sel = _pareto(cand_h, cand_k)
        if beam and len(sel) > beam:
            # Heuristic pass: keep the least-headroom label (it extends the minimum-peak
            # plan, so a feasible answer survives) and the best estimated totals.
            best = np.argsort(est[sel[1:]], kind="stable")[: beam - 1] + 1
            sel = sel[np.sort(np.concatenate(([0], best)))]
        store.append(p, cand_h[sel], cand_k[sel], cand_end[sel], cand_seg[sel], cand_child[sel])

    first, last = int(offset[0]), store.size
    if last <= first:
        return None  # every plan within ``limit`` was pruned (the limit was below optimum)
    label = last - 1  # least K in front(0)
    segments: list[tuple[int, int]] = []
    p = 0
    while p < n:
        end = int(store.end[label])
        if store.seg[label]:
            segments.append((p, end))
        p = end
        label = int(store.child[label])
    return segments
