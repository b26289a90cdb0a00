"""Checkpoint plans chosen by the replay itself, not by the stage-level proxy.

Why
---
:mod:`solvers.dp` is exact for the stage model of :mod:`solvers.chain`, which only
approximates what one recorded step does (:mod:`solvers.replay`, the plan simulator that
predicts every reported peak). A plan that is optimal for the proxy can be beaten under the
replay, and a budget the proxy calls infeasible can be met (for example by checkpointing
each block by hand). This module searches plans directly under the replay: every peak it
compares is :func:`replay_peak`, so "optimal" means optimal for the number the user sees.

Formulation
-----------
A :class:`ReplayChain` is a chain of ``L`` stages (contiguous node ranges) over one
recorded step. A plan is a set of disjoint checkpointed stage ranges; a stage outside them
is kept. Its peak is the replay's peak of the plan's node ranges (a range that holds a
random op stashes the RNG state) plus ``offset_bytes``, plus, for one rank of a sharded
run, the plan's :class:`RankShift` (NOTE [search: per-rank peaks]); its cost is the
recompute time ``fsum(stage_seconds of checkpointed stages) + segment_overhead_seconds *
segments``.
Plans are totally ordered, so every answer is unique:

* :func:`least_recompute`: least ``(cost, peak, number of segments, segments)`` among the
  plans whose peak fits the budget;
* :func:`leanest`: least ``(peak, cost, number of segments, segments)``.

How
---
1. **Seeds**: the plans the caller passes (e.g. one segment per block), no checkpoint, one
   segment over everything, one segment per stage, ``ceil(sqrt(L))`` equal segments, and,
   when the chain carries its stage-model ``problem``, :mod:`solvers.dp`'s plans at the
   rungs of a fixed ladder of proxy budgets that the search needs (NOTE [search: the rungs
   a search needs]: for :func:`leanest` from the lowest up while each is leaner; under a
   budget, those a bisection for the highest fitting rung visits, plus a fixed number of
   bisection steps between it and the next). All are replayed; the answer is never worse
   than the best of them.
2. **Local search** under the replay from the best seed: remove, add, extend, shrink,
   split and merge segments, and un-checkpoint one stage inside a segment. For
   :func:`least_recompute` the cost-reducing neighbours are tried cheapest first and the
   first one that fits is taken; when none does, pairs of moves (a cost-reducing one, then
   any one that keeps the total cheaper) are tried, cheapest first, up to a cap; then every
   re-planning of one window of :data:`_WINDOW` consecutive stages, cheapest first. For
   :func:`leanest`, a first-improvement descent on ``(peak, cost)``, scanning the
   neighbours circularly from the last improvement.
3. **Exact branch and bound** over units left to right (a unit: one kept stage or one
   segment). A prefix is pruned when the replay's lower bound for it
   (:meth:`solvers.replay.Replayer.lower_bound_bytes`: the prefix decided, the rest left
   open) is over the budget, or cannot beat the incumbent in the total order. The bound is
   valid for every completion (see that method), so when the search finishes within its
   node budget nothing was missed and the answer is ``optimal``. A chain of up to
   :data:`EXHAUSTIVE_STAGES` stages has at most as many prefixes as the node budget, so
   there it always finishes. Otherwise the answer is ``feasible``.

Determinism: the work is bounded by counts (``max_evaluations`` replays in the local
search, ``max_nodes`` in the branch and bound), ties are broken by the total order above
and every candidate set is sorted, so the same inputs give the same plan in every process.
``time_limit_s`` is a safety net only: if it cuts a search, the answer is still a fitting
plan no worse than the seeds, but it may then depend on the machine's speed.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from .chain import ChainProblem, normalize_segments
from .chain import simulate as proxy_simulate
from .rank import RankShift
from .replay import MemoryTrace, Replayer, replayer
from .solution import InfeasibleError, Solution

__all__ = [
    "DEFAULT_MAX_EVALUATIONS",
    "DEFAULT_MAX_NODES",
    "EXHAUSTIVE_STAGES",
    "RankShift",
    "ReplayChain",
    "count_plans",
    "leanest",
    "least_recompute",
    "recompute_seconds",
    "replay_peak",
]

Plan = tuple[tuple[int, int], ...]

DEFAULT_MAX_EVALUATIONS = 3000
"""Replays the local search may spend (seeds are always all replayed)."""
DEFAULT_MAX_NODES = 2000
"""Prefixes the branch and bound may bound before it gives up proving optimality (raised
to ``2 * count_plans(L) + L`` for chains of up to :data:`EXHAUSTIVE_STAGES` stages, where
that many always suffice)."""
EXHAUSTIVE_STAGES = 10
"""Up to this many stages the branch and bound is always complete under the default node
budget: a chain of ``L`` stages has ``count_plans(L)`` plans and fewer prefixes than
``2 * count_plans(L)`` (10 stages: 10946 plans)."""

_DP_RUNGS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16)  # proxy budgets, sixteenths of the range
_DP_BISECTIONS = 5  # bisection steps between the rungs that bracket the budget
_LEANEST_PATIENCE = 2  # rungs in a row no leaner before the leanest search stops climbing
_PAIR_FIRST_MOVES = 16  # cost-reducing first moves combined into pairs
_PAIR_CAP = 200  # pairs replayed per pair step
_WINDOW = 6  # stages re-planned together by the window move (count_plans(6) = 233 plans)


@dataclass(frozen=True)
class ReplayChain:
    """A chain of stages over one recorded step: everything the search needs.

    ``stages``: per stage its half-open node range, contiguous, covering all of the trace's
    compute nodes. ``stage_seconds``: recompute cost per stage. ``random``: per stage, does
    it hold a random op (a segment containing one stashes the RNG state).
    ``segment_overhead_seconds`` is charged once per segment. ``offset_bytes`` is added to
    every replayed peak (calibration, scope). ``problem``: the stage-level proxy of the
    same chain, used only to seed the search (:mod:`solvers.dp`). ``rank_shift``: for one
    rank of a sharded run, what its peak differs from the replay's, plan by plan (NOTE
    [search: per-rank peaks]); None: one process."""

    trace: MemoryTrace
    stages: tuple[tuple[int, int], ...]
    stage_seconds: tuple[float, ...]
    random: tuple[bool, ...]
    segment_overhead_seconds: float = 0.0
    offset_bytes: int = 0
    stash_bytes: tuple[int, ...] = ()
    """Per stage, bytes a segment holding it snapshots besides the RNG state (the buffers it
    restores), held like the RNG stash (:func:`solvers.replay.simulate`); empty: none."""
    problem: ChainProblem | None = None
    node_seconds: tuple[float, ...] = ()
    """Per compute node, the recompute seconds keeping it inside a segment saves, net of
    what keeping costs (:mod:`solvers.selective`); empty: plans keep nothing inside
    segments."""
    rank_shift: RankShift | None = None

    def __post_init__(self) -> None:
        stages = tuple((int(first), int(stop)) for first, stop in self.stages)
        if not stages:
            raise ValueError("a chain needs at least one stage")
        expected = 0
        for first, stop in stages:
            if first != expected or stop <= first:
                raise ValueError(
                    f"stages must be contiguous, non-empty node ranges from 0: got {stages}"
                )
            expected = stop
        if expected != self.trace.num_nodes:
            raise ValueError(f"stages cover {expected} nodes, the trace has {self.trace.num_nodes}")
        seconds = tuple(float(t) for t in self.stage_seconds)
        if len(seconds) != len(stages) or len(self.random) != len(stages):
            raise ValueError("stage_seconds and random need one entry per stage")
        if not all(math.isfinite(t) and t >= 0 for t in (*seconds, self.segment_overhead_seconds)):
            raise ValueError("seconds must be finite and >= 0")
        if self.problem is not None and self.problem.num_stages != len(stages):
            raise ValueError("problem has a different number of stages")
        if self.rank_shift is not None and self.rank_shift.rank.num_stages != len(stages):
            raise ValueError("rank_shift has a different number of stages")
        object.__setattr__(self, "stages", stages)
        object.__setattr__(self, "stage_seconds", seconds)
        object.__setattr__(self, "random", tuple(bool(r) for r in self.random))
        stash = tuple(int(b) for b in self.stash_bytes)
        if stash and len(stash) != len(stages):
            raise ValueError("stash_bytes needs one entry per stage (or none)")
        object.__setattr__(self, "stash_bytes", stash)
        object.__setattr__(self, "segment_overhead_seconds", float(self.segment_overhead_seconds))
        object.__setattr__(self, "offset_bytes", int(self.offset_bytes))
        node_seconds = tuple(float(t) for t in self.node_seconds)
        if node_seconds and len(node_seconds) != self.trace.num_nodes:
            raise ValueError("node_seconds needs one entry per compute node (or none)")
        if not all(math.isfinite(t) and t >= 0 for t in node_seconds):
            raise ValueError("seconds must be finite and >= 0")
        object.__setattr__(self, "node_seconds", node_seconds)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def peak(
        self,
        plan: Sequence[tuple[int, int]],
        saved: Sequence[Sequence[int]] | None = None,
        replay: Replayer | None = None,
    ) -> int:
        """The peak every solver compares for ``plan`` (normalised stage ranges; ``saved``:
        nodes kept inside each, selective recompute): the replayed peak plus
        ``offset_bytes``, for one rank the replay's slots each moved by its event's
        difference (NOTE [search: per-rank peaks])."""
        replay = replay or replayer(self.trace)
        ranges, rng = self.node_ranges(plan), self.preserve_rng(plan)
        if self.rank_shift is None:
            return replay.peak_bytes(ranges, rng, saved) + self.offset_bytes
        slots = replay.timeline(ranges, rng, saved)
        return self.rank_shift.peak(slots, plan, self.stages) + self.offset_bytes

    @property
    def least_offset(self) -> int:
        """A lower bound of :meth:`offset` over every plan."""
        shift = self.rank_shift
        return self.offset_bytes + (0 if shift is None else shift.least_bytes)

    def node_ranges(self, segments: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
        """Node ranges of stage ranges."""
        return [(self.stages[start][0], self.stages[end - 1][1]) for start, end in segments]

    def preserve_rng(self, segments: Iterable[tuple[int, int]]) -> list[bool] | list[int]:
        """Per stage range, does it hold a random op."""
        if not any(self.stash_bytes):
            return [any(self.random[start:end]) for start, end in segments]
        rng = self.trace.rng_state_bytes
        return [
            rng * any(self.random[start:end]) + sum(self.stash_bytes[start:end])
            for start, end in segments
        ]


def count_plans(num_stages: int) -> int:
    """Number of plans of a chain of ``num_stages`` stages: ``c(L) = 3 c(L-1) - c(L-2)``,
    ``c(0) = 1``, ``c(1) = 2`` (about ``2.618 ** L``; 10 stages: 10946, 20: 1.1e8)."""
    previous, current = 1, 1  # c(-1) := 1 makes the recursion give c(1) = 2
    for _ in range(num_stages):
        previous, current = current, 3 * current - previous
    return current


def replay_peak(chain: ReplayChain, segments: Sequence[tuple[int, int]]) -> int:
    """The replayed peak of checkpointing the given stage ranges (sorted, disjoint), plus
    ``offset_bytes``; for one rank, moved event by event (:meth:`ReplayChain.peak`)."""
    return chain.peak(normalize_segments(segments, chain.num_stages))


def recompute_seconds(chain: ReplayChain, segments: Sequence[tuple[int, int]]) -> float:
    """Recompute time of a plan: its stages' seconds plus the per-segment overhead, summed
    with ``math.fsum`` (correctly rounded, so independent of order and monotone)."""
    plan = normalize_segments(segments, chain.num_stages)
    return _cost(chain, tuple(plan))


def _cost(chain: ReplayChain, plan: Plan) -> float:
    seconds = chain.stage_seconds
    parts = [seconds[m] for start, end in plan for m in range(start, end)]
    parts += [chain.segment_overhead_seconds] * len(plan)
    return math.fsum(parts)


# ---------------------------------------------------------------------------------------------
# The search state: memoised replays and the work budget
# ---------------------------------------------------------------------------------------------


class _Budget(Exception):
    """The work budget (evaluations, nodes or time) is spent."""


class _Search:
    def __init__(
        self, chain: ReplayChain, max_evaluations: int, max_nodes: int, time_limit_s: float | None
    ) -> None:
        self.chain = chain
        self.replay: Replayer = replayer(chain.trace)
        self.num_stages = chain.num_stages
        self.started = time.perf_counter()
        self.deadline = None if time_limit_s is None else self.started + time_limit_s
        self.max_evaluations = max_evaluations
        if self.num_stages <= EXHAUSTIVE_STAGES:
            max_nodes = max(max_nodes, 2 * count_plans(self.num_stages) + self.num_stages)
        self.max_nodes = max_nodes
        self.evaluations = 0  # local-search replays (seeds are not counted)
        self.nodes = 0
        self.timed_out = False
        self.peaks: dict[Plan, int] = {}
        self.costs: dict[Plan, float] = {}

    def out_of_time(self) -> bool:
        if self.deadline is not None and time.perf_counter() > self.deadline:
            self.timed_out = True
        return self.timed_out

    def peak(self, plan: Plan, *, counted: bool = True) -> int:
        found = self.peaks.get(plan)
        if found is None:
            if counted:
                if self.evaluations >= self.max_evaluations or self.out_of_time():
                    raise _Budget
                self.evaluations += 1
            found = self.peaks[plan] = self.chain.peak(plan, replay=self.replay)
        return found

    def cost(self, plan: Plan) -> float:
        found = self.costs.get(plan)
        if found is None:
            found = self.costs[plan] = _cost(self.chain, plan)
        return found

    def bound(self, plan: Plan, decided_stages: int) -> int:
        """Lower bound on the peak of every plan with at least one segment that equals
        ``plan`` on the stages before ``decided_stages``."""
        if self.nodes >= self.max_nodes or self.out_of_time():
            raise _Budget
        self.nodes += 1
        chain = self.chain
        decided = chain.stages[decided_stages - 1][1] if decided_stages else 0
        if decided_stages == self.num_stages and plan:
            return self.peak(plan, counted=False)
        low = self.replay.lower_bound_bytes(
            chain.node_ranges(plan), decided, chain.preserve_rng(plan)
        )
        return low + chain.least_offset


Key = tuple[float, float, int, Plan]


def _cost_key(search: _Search, plan: Plan, peak: int) -> Key:
    return (search.cost(plan), peak, len(plan), plan)


def _peak_key(search: _Search, plan: Plan, peak: int) -> Key:
    return (peak, search.cost(plan), len(plan), plan)


# ---------------------------------------------------------------------------------------------
# Seeds
# ---------------------------------------------------------------------------------------------


def _sqrt_plan(num_stages: int) -> Plan:
    k = math.isqrt(num_stages - 1) + 1
    size, extra = divmod(num_stages, k)
    plan, start = [], 0
    for i in range(k):
        end = start + size + (1 if i < extra else 0)
        plan.append((start, end))
        start = end
    return tuple(plan)


def _normalized(seeds: Iterable[Sequence[tuple[int, int]]], num_stages: int) -> list[Plan]:
    return [tuple(normalize_segments(seed, num_stages)) for seed in seeds]


def _structural_seeds(num_stages: int) -> list[Plan]:
    return [
        (),
        ((0, num_stages),),
        tuple((m, m + 1) for m in range(num_stages)),
        _sqrt_plan(num_stages),
    ]


class _Ladder:
    """dp's plans of the proxy at proxy budgets (memoised): the proxy ranks plans by cost
    well even where its peaks are off, so its plans at many budgets are good starts."""

    def __init__(self, problem: ChainProblem) -> None:
        from .auto import minimum_peak_bytes

        self.problem = problem
        self.floor, floor_plan = minimum_peak_bytes(problem)
        self.ceiling = proxy_simulate(problem, []).peak_bytes
        self.plans: dict[int, Plan] = {self.floor: tuple(floor_plan)}

    def plan(self, budget: int) -> Plan:
        from .auto import solve

        budget = max(self.floor, min(self.ceiling, budget))
        if budget not in self.plans:
            answer = solve(self.problem.with_budget(budget), method="dp")
            self.plans[budget] = tuple(answer.segments)
        return self.plans[budget]

    def rungs(self) -> list[int]:
        span = self.ceiling - self.floor
        return sorted({self.floor + span * k // 16 for k in _DP_RUNGS})


@functools.lru_cache(maxsize=8)
def _ladder(problem: ChainProblem) -> _Ladder:
    """One ladder per proxy (a planner searches many budgets of the same chain; dp is
    deterministic, so sharing its plans changes no answer)."""
    return _Ladder(problem)


def _seed_plans(
    search: _Search, given: Iterable[Sequence[tuple[int, int]]], budget: int | None
) -> list[Plan]:
    """Every seed, replayed (not counted against the evaluation budget)."""
    n = search.num_stages
    plans = set(_normalized(given, n)) | set(_structural_seeds(n))
    problem = search.chain.problem
    if problem is not None:
        ladder = _ladder(problem)
        if budget is None:
            plans.update(_leanest_rungs(search, ladder))
        else:
            plans.update(_budget_rungs(search, ladder, budget))
    ordered = sorted(plans)
    for plan in ordered:
        search.peak(plan, counted=False)
    return ordered


def _leanest_rungs(search: _Search, ladder: _Ladder) -> list[Plan]:
    """NOTE [search: the rungs a search needs]. dp's plans from the lowest rung up, until
    :data:`_LEANEST_PATIENCE` rungs in a row replay no leaner than the leanest rung before
    them. Why not the whole ladder: each rung costs one dp solve (0.3 s on the zoo GPT's
    160-stage chain, 13 rungs: 4 s of a 9 s planner) and a rung is dp's plan at a higher
    proxy budget than the one below, so its peak mostly grows with the rung: a seed only
    matters to :func:`leanest` as the leanest start. Mostly, not always: the zoo U-Net's
    second rung replays leaner than its first (5.87 MB, 6.01 MB), and its leanest plan
    found from there is 2.6% leaner than from the first; the patience keeps such a dip."""
    found: list[Plan] = []
    best: int | None = None
    misses = 0
    for rung in ladder.rungs():
        plan = ladder.plan(rung)
        peak = search.peak(plan, counted=False)
        found.append(plan)
        if best is None or peak < best:
            best, misses = peak, 0
        else:
            misses += 1
            if misses >= _LEANEST_PATIENCE:
                break
    return found


def _budget_rungs(search: _Search, ladder: _Ladder, budget: int) -> list[Plan]:
    """dp's plans at the rungs a bisection over the ladder visits to find the highest rung
    whose plan fits ``budget`` under the replay (NOTE [search: the rungs a search needs]:
    peaks grow with the rung, so the rungs that fit are the lowest ones), then at a fixed
    number of proxy budgets bisected between that rung and the one above it. The highest
    fitting rung is the cheapest fitting seed the ladder holds (dp's cost falls as its
    budget grows), the start the local search improves."""
    rungs = ladder.rungs()
    found: list[Plan] = []

    def fits(proxy_budget: int) -> bool:
        plan = ladder.plan(proxy_budget)
        found.append(plan)
        return search.peak(plan, counted=False) <= budget

    # rungs[low] fits (or, at -1, none does), rungs[high] does not (or, past the end, none)
    low = _highest_fitting(-1, len(rungs), lambda index: fits(rungs[index]), len(rungs))
    if 0 <= low < len(rungs) - 1:
        # the cheapest dp plan the replay accepts, between that rung and the next
        _highest_fitting(rungs[low], rungs[low + 1], fits, _DP_BISECTIONS)
    return found


def _highest_fitting(low: int, high: int, fits: Callable[[int], bool], steps: int) -> int:
    """Bisection, at most ``steps`` halvings, for the highest integer in ``[low, high)``
    that ``fits``, given that ``low`` fits (or stands for none) and ``high`` does not."""
    for _ in range(steps):
        if high - low <= 1:
            break
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return low


# ---------------------------------------------------------------------------------------------
# Local search
# ---------------------------------------------------------------------------------------------


def _neighbours(plan: Plan, num_stages: int) -> list[Plan]:
    """Plans one move away: remove, shrink, extend, split, un-checkpoint an inner stage,
    merge with the next segment (absorbing the gap), add a one-stage segment. Sorted."""
    out: set[Plan] = set()
    segs = list(plan)
    for k, (start, end) in enumerate(segs):
        before, after = segs[:k], segs[k + 1 :]

        def with_(*middle: tuple[int, int], before=before, after=after) -> Plan:
            return tuple(before + list(middle) + after)

        out.add(with_())
        if end - start >= 2:
            out.add(with_((start + 1, end)))
            out.add(with_((start, end - 1)))
            for m in range(start + 1, end):
                out.add(with_((start, m), (m, end)))
                if m + 1 < end:
                    out.add(with_((start, m), (m + 1, end)))
        previous_end = segs[k - 1][1] if k else 0
        next_start = segs[k + 1][0] if k + 1 < len(segs) else num_stages
        if start > previous_end:
            out.add(with_((start - 1, end)))
        if end < next_start:
            out.add(with_((start, end + 1)))
        if after:
            out.add(tuple(before + [(start, after[0][1])] + after[1:]))
    covered = [False] * num_stages
    for start, end in segs:
        for m in range(start, end):
            covered[m] = True
    for m in range(num_stages):
        if not covered[m]:
            out.add(tuple(sorted([*segs, (m, m + 1)])))
    out.discard(plan)
    return sorted(out)


@functools.lru_cache(maxsize=32)
def _sub_plans(length: int) -> tuple[Plan, ...]:
    """Every plan of a chain of ``length`` stages."""
    if length == 0:
        return ((),)
    out = [tuple((s + 1, e + 1) for s, e in rest) for rest in _sub_plans(length - 1)]
    for end in range(1, length + 1):
        out += [
            ((0, end), *((s + end, e + end) for s, e in rest)) for rest in _sub_plans(length - end)
        ]
    return tuple(out)


def _windows(plan: Plan, num_stages: int) -> list[list[Plan]]:
    """Per window of :data:`_WINDOW` stages (half-overlapping; widened to whole segments),
    every plan equal to ``plan`` outside it."""
    out = []
    for low in range(0, max(1, num_stages - _WINDOW // 2), max(1, _WINDOW // 2)):
        high = min(num_stages, low + _WINDOW)
        for start, end in plan:  # a segment across an edge joins the window
            if start < low < end:
                low = start
            if start < high < end:
                high = end
        if high - low > _WINDOW + 2:
            continue  # widened too far by long segments: too many plans
        before = tuple(seg for seg in plan if seg[1] <= low)
        after = tuple(seg for seg in plan if seg[0] >= high)
        out.append(
            [
                (*before, *((s + low, e + low) for s, e in inner), *after)
                for inner in _sub_plans(high - low)
            ]
        )
    return out


def _improve_cost(search: _Search, plan: Plan, budget: int) -> Plan:
    """Cheaper plans that fit, from ``plan`` (which fits). In order, until one is found:
    single moves, cheapest first; pairs of moves, cheapest first; every re-planning of one
    window of stages, cheapest first. Repeats from the new plan; stops at a local optimum
    or when the budget is spent."""
    n = search.num_stages
    try:
        while True:
            current = search.cost(plan)

            def first_fit(plans: Iterable[Plan], current: float = current) -> Plan | None:
                ranked = sorted(
                    (search.cost(p), len(p), p) for p in set(plans) if search.cost(p) < current
                )
                return next((p for _, _, p in ranked if search.peak(p) <= budget), None)

            cheaper = sorted(
                (search.cost(nb), len(nb), nb)
                for nb in _neighbours(plan, n)
                if search.cost(nb) < current
            )
            found = next((nb for _, _, nb in cheaper if search.peak(nb) <= budget), None)
            if found is None:
                pairs: set[Plan] = set()
                for _, _, first in cheaper[:_PAIR_FIRST_MOVES]:
                    pairs.update(nb for nb in _neighbours(first, n) if search.cost(nb) < current)
                ranked = sorted((search.cost(p), len(p), p) for p in pairs)[:_PAIR_CAP]
                found = first_fit(p for _, _, p in ranked)
            for window in [] if found is not None else _windows(plan, n):
                found = first_fit(window)
                if found is not None:
                    break
            if found is None:
                return plan
            plan = found
    except _Budget:
        return plan


def _descend(search: _Search, plan: Plan, key: Callable[[Plan], Key]) -> Plan:
    """First-improvement descent on ``key``: the neighbours (sorted) are scanned circularly
    from where the last improvement was found, and the first better one is taken; it stops
    when a whole scan finds none. Improvements that repeat along the chain (one more stage
    of the same kind) then cost a few replays each instead of a full scan."""
    n = search.num_stages
    best = key(plan)
    at = 0
    try:
        while True:
            around = _neighbours(plan, n)
            at = min(at, len(around))
            for i in [*range(at, len(around)), *range(at)]:
                k = key(around[i])
                if k < best:
                    best, at = k, i
                    break
            else:
                return plan
            plan = best[3]
    except _Budget:
        return best[3]


# ---------------------------------------------------------------------------------------------
# Branch and bound
# ---------------------------------------------------------------------------------------------


def _branch_and_bound(
    search: _Search,
    incumbent: Key | None,
    key_of: Callable[[Plan, int], Key],
    prune: Callable[[float, float, Key | None], bool],
) -> tuple[Key | None, bool]:
    """Depth-first over units, left to right; returns the best key found (at least the
    incumbent) and whether the search was complete. ``prune(cost, bound, incumbent)``
    says a prefix of that cost and peak bound cannot lead to a better plan. Only plans with
    at least one segment are searched (the bound assumes one); the caller has replayed
    the plan without any."""
    n = search.num_stages
    best = incumbent
    seconds = search.chain.stage_seconds
    overhead = search.chain.segment_overhead_seconds

    def visit(start: int, plan: Plan, parts: list[float]) -> None:
        nonlocal best
        if start == n:
            if plan:
                k = key_of(plan, search.peak(plan, counted=False))
                if best is None or k < best:
                    best = k
            return
        # Keep stage ``start``, then segments [start, end) by length.
        options: list[tuple[Plan, int, list[float]]] = [(plan, start + 1, parts)]
        grown = [*parts, overhead]
        for end in range(start + 1, n + 1):
            grown = [*grown, seconds[end - 1]]
            options.append(((*plan, (start, end)), end, grown))
        for child, stop, child_parts in options:
            cost = math.fsum(child_parts)
            if prune(cost, -math.inf, best):  # the cost alone (no peak is below -inf)
                if child is not plan:
                    break  # longer segments only cost more
                continue
            if stop == n and not child:
                continue  # no segment at all: replayed by the caller
            if prune(cost, search.bound(child, stop), best):
                continue
            visit(stop, child, child_parts)

    try:
        visit(0, (), [])
    except _Budget:
        return best, False
    return best, True


# ---------------------------------------------------------------------------------------------
# Public entry points
# ---------------------------------------------------------------------------------------------


def _solution(search: _Search, plan: Plan, proved: bool) -> Solution:
    return Solution(
        segments=list(plan),
        recompute_seconds=search.cost(plan),
        peak_bytes=search.peak(plan, counted=False),
        status="optimal" if proved else "feasible",
        method="replay-exact" if proved else "replay-search",
        solve_seconds=time.perf_counter() - search.started,
        gap=0.0 if proved else None,
    )


def least_recompute(
    chain: ReplayChain,
    budget_bytes: int,
    *,
    seeds: Iterable[Sequence[tuple[int, int]]] = (),
    time_limit_s: float | None = 30.0,
    max_evaluations: int = DEFAULT_MAX_EVALUATIONS,
    max_nodes: int = DEFAULT_MAX_NODES,
) -> Solution:
    """The plan of least recompute time whose :func:`replay_peak` is at most
    ``budget_bytes`` (ties: lower peak, fewer segments, then the segment list).

    ``status`` is ``"optimal"`` when the branch and bound finished (always for chains of
    up to :data:`EXHAUSTIVE_STAGES` stages), else ``"feasible"``. Raises
    :class:`solvers.InfeasibleError` (with the least peak seen) when no plan found fits;
    that is a proof only if the branch and bound finished, so pass the :func:`leanest`
    plan as a seed when it is known to fit."""
    budget = int(budget_bytes)
    search = _Search(chain, max_evaluations, max_nodes, time_limit_s)
    seeds_ = _seed_plans(search, seeds, budget)

    def key_of(plan: Plan, peak: int) -> Key:
        return _cost_key(search, plan, peak)

    fitting = [key_of(p, search.peaks[p]) for p in seeds_ if search.peaks[p] <= budget]
    incumbent = min(fitting) if fitting else None
    if incumbent is None:
        # Nothing fits yet: the leanest plan the local search finds, if it fits.
        start = min(seeds_, key=lambda p: _peak_key(search, p, search.peaks[p]))
        lean = _descend(search, start, lambda p: _peak_key(search, p, search.peak(p)))
        if search.peaks[lean] <= budget:
            incumbent = key_of(lean, search.peaks[lean])
    if incumbent is not None:
        plan = _improve_cost(search, incumbent[3], budget)
        incumbent = min(incumbent, key_of(plan, search.peaks[plan]))

    def prune(cost: float, bound: float, best: Key | None) -> bool:
        if bound > budget:
            return True
        if best is None:
            return False
        return cost > best[0] or (cost == best[0] and bound > best[1])

    best, complete = _branch_and_bound(search, incumbent, key_of, prune)
    if best is None:
        raise InfeasibleError(min(search.peaks.values()), budget)
    return _solution(search, best[3], complete)


def leanest(
    chain: ReplayChain,
    *,
    seeds: Iterable[Sequence[tuple[int, int]]] = (),
    time_limit_s: float | None = 30.0,
    max_evaluations: int = DEFAULT_MAX_EVALUATIONS,
    max_nodes: int = DEFAULT_MAX_NODES,
) -> Solution:
    """The plan with the least :func:`replay_peak` (ties: least recompute, fewer segments,
    then the segment list). ``status`` is ``"optimal"`` when the branch and bound finished
    (always for chains of up to :data:`EXHAUSTIVE_STAGES` stages), else ``"feasible"``:
    then it is the best plan found, never worse than any seed."""
    search = _Search(chain, max_evaluations, max_nodes, time_limit_s)
    seeds_ = _seed_plans(search, seeds, None)

    def key_of(plan: Plan, peak: int) -> Key:
        return _peak_key(search, plan, peak)

    incumbent = min(key_of(p, search.peaks[p]) for p in seeds_)
    plan = _descend(search, incumbent[3], lambda p: key_of(p, search.peak(p)))
    incumbent = min(incumbent, key_of(plan, search.peaks[plan]))

    def prune(cost: float, bound: float, best: Key | None) -> bool:
        if best is None:
            return False
        return bound > best[0] or (bound == best[0] and cost > best[1])

    best, complete = _branch_and_bound(search, incumbent, key_of, prune)
    assert best is not None  # the seeds include plans
    return _solution(search, best[3], complete)
