"""Mixed-integer formulation solved by CBC through PuLP (HiGHS when PuLP offers it).

Reference: the interval-selection (shortest path) formulation of the chain, in the
spirit of Checkmate (P. Jain et al., "Checkmate: Breaking the Memory Wall with Optimal
Tensor Rematerialization", MLSys 2020), which also solves rematerialisation as a MILP;
here the chain structure lets the model choose whole units instead of per-tensor
schedules.

Model
-----
Candidate units: keep stage ``k`` (``[k, k+1)``, stores ``s_k``) and segment ``[i, j)``
(stores ``a_i``). Variables:

* ``x_u`` binary: unit ``u`` is in the plan;
* ``P_b`` continuous, ``b = 1 .. L-1``: ``before(b)``, bytes stored by units ending at or
  before boundary ``b`` (``P_0 = 0``).

Constraints:

* flow on boundaries ``0 .. L``: one unit leaves ``0``, one enters ``L``, and at every
  interior boundary as many enter as leave. The flow matrix is totally unimodular, and
  it makes the chosen units an exact partition of the stages;
* ``P_b = P_{b-1} + sum_{u ends at b} stored(u) x_u``;
* memory, for every stage ``i``: ``P_i + sum_{u covers i} local(u) x_u <= budget - static``.
  This is the per-unit big-M constraint of the chain model ``P_start(u) + local(u) <= budget -
  static + M (1 - x_u)`` with ``M = local(u)``, aggregated over the units covering ``i``:
  exactly one of them is chosen, and ``P_i = P_start(u)`` for that unit because no unit
  ends strictly inside it. Aggregating is valid for every stage (not only starts) and
  gives a tighter LP relaxation than separate big-M rows. When that would need more than
  ``max_cover_nonzeros`` coefficients (``O(L * W^2)``), row ``i`` only aggregates the
  units *starting* at ``i`` (same integer points, weaker LP, ``O(L * W)`` coefficients);
  on 100-stage chains both variants proved optimality in similar times (measured).

Objective: recompute seconds ``sum_u cost(u) x_u`` (kept stages cost 0).

Candidates are pruned only where provably safe (:func:`_candidates`): a unit needing
more memory than any feasible plan can give it, or one whose cost plus the Lagrangian
lower bound on the prefix before it exceeds the cost of the incumbent plan (a fitting
plan from the heuristics, passed as ``warm_start``). If more than ``max_units``
candidates remain, the longest segments are dropped; that restriction is *not* safe, so
the answer is then reported ``feasible`` with unknown gap, never ``optimal``.

MIP start
---------
A warm start (``warmStart=True``) was the design's first choice. With the CBC that ships with PuLP (2.10.3, 2019)
a MIP start makes CBC occasionally report a *worse* plan as proven optimal: on 36
random 100-stage chains (budgets 30/50/70%) started from the greedy plan, 1 run in 36
claimed optimality 0.56% above the true optimum, with default, ``preprocess on`` and
``preprocess off`` settings alike; without the MIP start 0 of 36, at the same median
time (0.69 s). CBC's tracker has related MIP-start bugs fixed after 2.10.3
(coin-or/Cbc#449). So the incumbent is used only where it is provably safe: to prune
candidates (above) and as the answer whenever CBC does not beat it (the caller compares);
``mip_start=True`` restores the MIP start for a CBC known to be fixed.

Bytes are scaled by the headroom (right-hand sides become 1) and seconds by the total
forward time, to keep CBC's tolerances meaningful; the decoded plan is re-checked with
:func:`solvers.chain.simulate` by the caller, so a tolerance slip can never report a plan
over budget.

Complexity: ``O(L * W)`` binaries for windows of ``W`` stages and ``O(L * W^2)``
non-zeros in the memory rows; solving is NP-hard in general (the problem contains
knapsack) and is always time-limited.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
import time
import warnings
from dataclasses import dataclass

import numpy as np
import pulp

from ._kernels import ChainArrays, CostScale
from .bounds import UNREACHABLE, PrefixCostBound, prefix_min_stored, suffix_min_peaks
from .chain import plan_units

__all__ = ["IlpResult", "ilp_plan", "DEFAULT_TIME_LIMIT_S"]

DEFAULT_TIME_LIMIT_S = 30.0


@dataclass(frozen=True)
class IlpResult:
    """Decoded solver answer.

    ``plan``: the solver's best plan, ``None`` when it returned nothing usable.
    ``proved_optimal``: the solver proved optimality over the full candidate set.
    ``lower_bound_seconds``: the solver's final bound on the optimum (``None`` if unknown
    or if the candidate set was restricted, when it bounds nothing useful).
    ``restricted``: candidates were capped (see module docstring).
    """

    plan: list[tuple[int, int]] | None
    proved_optimal: bool
    lower_bound_seconds: float | None
    restricted: bool
    num_units: int
    aggregated_rows: bool = True


def _solver(time_limit_s: float, log_path: str, mip_start: bool) -> pulp.LpSolver:
    """HiGHS when PuLP can run it, else PuLP's bundled CBC (single thread, logged)."""
    if "HiGHS" in pulp.listSolvers(onlyAvailable=True):
        return pulp.HiGHS(msg=False, timeLimit=time_limit_s)
    with warnings.catch_warnings():
        # PuLP 3.x flags the bundled-CBC wrapper for removal in 4.0; it is still the only
        # CBC that ships with the wheel, so keep using it quietly.
        warnings.simplefilter("ignore", DeprecationWarning)
        return pulp.PULP_CBC_CMD(
            msg=False, timeLimit=time_limit_s, warmStart=mip_start, logPath=log_path, threads=1
        )


def _variable(model: pulp.LpProblem, name: str, **kwargs: object) -> pulp.LpVariable:
    """``model.add_variable`` on PuLP >= 3.3 (no deprecation warning), else ``LpVariable``."""
    if hasattr(model, "add_variable"):
        return model.add_variable(name, **kwargs)
    return pulp.LpVariable(name, **kwargs)


def _candidates(
    arrays: ChainArrays, headroom: int, incumbent: list[tuple[int, int]] | None, max_units: int
):
    """Units that some feasible plan at most as expensive as ``incumbent`` may use.

    A unit ``u`` starting at ``i`` and ending at ``j`` is dropped when no feasible plan can
    contain it: (1) ``msp(i) + max(local(u), stored(u) + P*(j)) > headroom``, or (2) its
    cost plus the Lagrangian lower bound on any prefix before it (given that the suffix
    from ``i`` needs at least ``max(local(u), stored(u) + P*(j))`` headroom) exceeds the
    incumbent's cost; suffix costs are bounded below by 0.
    """
    n = arrays.n
    msp = prefix_min_stored(arrays, headroom)
    peaks, _ = suffix_min_peaks(arrays)
    cost = CostScale.of(arrays.problem)
    bound = None
    allow = np.inf
    if incumbent is not None:
        bound = PrefixCostBound.tuned(arrays, cost.f_ticks, cost.overhead_ticks, headroom, msp)
        ticks = cost.plan_key(incumbent) // cost.base
        allow = ticks + 1e-9 * ticks + 1.0
    f = np.zeros(n + 1)
    f[1:] = np.cumsum(arrays.problem.forward_seconds)
    overhead = arrays.problem.segment_overhead_seconds
    units: list[tuple[int, int, bool, int, int, float]] = []  # start, end, seg, stored, local, cost
    for i in range(n):
        base = int(msp[i])
        if base >= UNREACHABLE or base > headroom:
            continue
        room = headroom - base
        need = max(int(arrays.local_kept[i]), int(arrays.s[i]) + int(peaks[i + 1]))
        if need <= room and (bound is None or bound(i, np.array([need]))[0] <= allow):
            units.append((i, i + 1, False, int(arrays.s[i]), int(arrays.local_kept[i]), 0.0))
        qmax = min(n, arrays.row_limit(i, room))
        row = arrays.segment_row(i, qmax)
        ends = np.arange(i + 1, qmax + 1)
        need = np.maximum(row, arrays.a[i] + peaks[i + 1 : qmax + 1])
        ok = need <= room
        if bound is not None:
            seg_ticks = cost.f_ticks[ends] - cost.f_ticks[i] + cost.overhead_ticks
            ok &= seg_ticks + bound(i, need) <= allow
        for j in ends[ok].tolist():
            units.append(
                (i, j, True, int(arrays.a[i]), int(row[j - i - 1]), float(f[j] - f[i]) + overhead)
            )
    restricted = False
    if len(units) > max_units:
        # Not provably safe: drop the longest segments first (documented above).
        restricted = True
        kept = [u for u in units if not u[2]]
        segs = sorted((u for u in units if u[2]), key=lambda u: (u[1] - u[0], u[0]))
        units = sorted(kept + segs[: max(0, max_units - len(kept))], key=lambda u: (u[0], u[1]))
    return units, restricted


def ilp_plan(
    arrays: ChainArrays,
    *,
    time_limit_s: float | None = None,
    warm_start: list[tuple[int, int]] | None = None,
    max_units: int = 60_000,
    max_cover_nonzeros: int = 400_000,
    mip_start: bool = False,
) -> IlpResult:
    """Solve the MILP above within ``time_limit_s`` (model building included).

    ``warm_start`` must be a plan that fits (or ``None``); it bounds the candidate pruning
    and, with ``mip_start=True``, is handed to CBC as a MIP start (off by default: see
    "MIP start" in the module docstring). Memory rows are aggregated over covering units unless that needs
    more than ``max_cover_nonzeros`` coefficients; then each row only aggregates the units
    *starting* at that stage (the same constraint on integer points, a weaker LP bound,
    but linear in the number of units).
    """
    started = time.perf_counter()
    problem = arrays.problem
    n = arrays.n
    headroom = arrays.budget - arrays.static
    limit = DEFAULT_TIME_LIMIT_S if time_limit_s is None else float(time_limit_s)
    if headroom < 0:
        return IlpResult(None, False, None, False, 0)
    units, restricted = _candidates(arrays, headroom, warm_start, max_units)
    if not units:
        return IlpResult(None, False, None, restricted, 0)
    aggregated = sum(j - i for i, j, *_r in units) <= max_cover_nonzeros

    byte_scale = float(max(1, headroom))
    time_scale = max(math.fsum(problem.forward_seconds), 1e-12) / 1000.0
    model = pulp.LpProblem("autockpt_chain", pulp.LpMinimize)
    x = [_variable(model, f"x{u}", cat=pulp.LpBinary) for u in range(len(units))]
    prefix: list[pulp.LpVariable | None] = [None]
    prefix += [_variable(model, f"P{b}", lowBound=0) for b in range(1, n)]
    model += pulp.lpSum(units[u][5] / time_scale * x[u] for u in range(len(units)) if units[u][2])

    starting: list[list[int]] = [[] for _ in range(n + 1)]
    ending: list[list[int]] = [[] for _ in range(n + 1)]
    for u, (i, j, *_rest) in enumerate(units):
        starting[i].append(u)
        ending[j].append(u)
    model += pulp.lpSum(x[u] for u in starting[0]) == 1, "leave_0"
    model += pulp.lpSum(x[u] for u in ending[n]) == 1, f"enter_{n}"
    for b in range(1, n):
        model += (
            pulp.lpSum(x[u] for u in ending[b]) == pulp.lpSum(x[u] for u in starting[b]),
            f"flow_{b}",
        )
        stored = pulp.lpSum(units[u][3] / byte_scale * x[u] for u in ending[b])
        model += prefix[b] == (prefix[b - 1] if b > 1 else 0) + stored, f"prefix_{b}"
    rows: list[list[int]] = starting[:n]
    if aggregated:
        rows = [[] for _ in range(n)]
        for u, (i, j, *_rest) in enumerate(units):
            for m in range(i, j):
                rows[m].append(u)
    for m in range(n):
        load = pulp.lpSum(units[u][4] / byte_scale * x[u] for u in rows[m])
        model += (load + (prefix[m] if m > 0 else 0)) <= 1.0, f"memory_{m}"

    warm = (
        mip_start
        and warm_start is not None
        and _set_warm_start(units, x, prefix, ending, warm_start, n, byte_scale)
    )
    remaining = max(1.0, limit - (time.perf_counter() - started))
    fd, log_path = tempfile.mkstemp(prefix="autockpt_cbc_", suffix=".log")
    os.close(fd)
    try:
        model.solve(_solver(remaining, log_path, warm))
        log = _read(log_path)
    except pulp.PulpSolverError:
        return IlpResult(None, False, None, restricted, len(units), aggregated)
    finally:
        try:
            os.remove(log_path)
        except OSError:
            pass

    lower = None if restricted else _lower_bound(log)
    if lower is not None:
        lower *= time_scale
    values = [var.value() for var in x]
    usable = model.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)
    if not usable or any(v is None for v in values):
        return IlpResult(None, False, lower, restricted, len(units), aggregated)
    plan = _decode([units[u] for u, v in enumerate(values) if v > 0.5], n)
    proved = (
        plan is not None
        and not restricted
        and not _stopped_early(log)
        and model.status == pulp.LpStatusOptimal
        and model.sol_status == pulp.LpSolutionOptimal
    )
    return IlpResult(plan, proved, lower, restricted, len(units), aggregated)


def _set_warm_start(units, x, prefix, ending, plan, n: int, byte_scale: float) -> bool:
    """Give CBC ``plan`` as MIP start; ``False`` if a unit of it was pruned."""
    index = {(i, j, seg): u for u, (i, j, seg, *_r) in enumerate(units)}
    chosen = plan_units(plan, n)
    if not all(key in index for key in chosen):
        return False
    picked = {index[key] for key in chosen}
    for u, var in enumerate(x):
        var.setInitialValue(1 if u in picked else 0)
    running = 0
    for b in range(1, n):
        running += sum(units[u][3] for u in ending[b] if u in picked)
        prefix[b].setInitialValue(running / byte_scale)
    return True


def _decode(picked, n: int) -> list[tuple[int, int]] | None:
    """Chosen units as segments, or ``None`` unless they partition ``0 .. n-1``."""
    picked = sorted(picked, key=lambda u: u[0])
    k = 0
    segments: list[tuple[int, int]] = []
    for i, j, seg, *_rest in picked:
        if i != k:
            return None
        if seg:
            segments.append((i, j))
        k = j
    return segments if k == n else None


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError:
        return ""


_FLOAT = r"([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)"


def _stopped_early(log: str) -> bool:
    return bool(re.search(r"Result - Stopped|Stopped on time|stopped on time", log))


def _lower_bound(log: str) -> float | None:
    """CBC's final ``Lower bound:`` (scaled objective units), or ``None``."""
    found = re.findall(r"Lower bound:\s*" + _FLOAT, log)
    return float(found[-1]) if found else None
