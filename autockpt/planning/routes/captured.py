"""The captured-graph route: a model whose forward is captured whole (fx or torch.export).

NOTE [routes: captured graph]. What this route decides: where to put checkpoints in one
captured graph of the whole step. It prepares once (profile -> chain -> recorded step ->
per-rank terms: autockpt/planning/prepared.py), finds the leanest plan (the stated minimum,
achievable by construction: the search's own answer under the replay), and for each budget
searches the least-recompute plan under the replay (autockpt/planning/search.py), rewrites
the model with it, and measures one real step, tightening by what the measurement exceeded
the prediction (autockpt/planning/verify.py). Why the leanest plan is searched when the
route is built: every budget's answer, error and breakdown states it, and a refusal must
say what would fit.

The first verified plan of a model on a machine also times its step, and its step factors
calibrate every later reported time (NOTE [timing: step factors]).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import Any

from torch import nn

from autockpt.base.inputs import Inputs
from autockpt.base.runtime import as_found, training_mode
from autockpt.capture.captured import Capture
from autockpt.costs.as_written import as_written_shift
from autockpt.costs.problem import StageRange
from autockpt.costs.timing import settle_factors, step_factors
from autockpt.errors import InfeasibleBudgetError
from autockpt.measure import Measurement
from autockpt.plan import MemoryTimeline, Plan
from autockpt.planning.cache import (
    Reused,
    cache_key,
    cached,
    keep,
    remember_as_written,
    remember_leanest_measured,
    remember_profile,
)
from autockpt.planning.make_plan import breakdown, make_plan, rank_breakdown, with_measurement
from autockpt.planning.predict import Predictor
from autockpt.planning.prepared import Phases, PlanningPeak, Prepared, prepare, resident_floor
from autockpt.planning.request import Request
from autockpt.planning.routes.base import Finish, Replan, Solve, measure_step
from autockpt.planning.search import SEARCH_METHODS, BudgetSearch
from autockpt.planning.sharding import kept_ratio
from autockpt.planning.specs import segment_specs
from autockpt.planning.verify import VERIFY_ROUNDS, Attempt, Fitted, fit_by_measuring
from autockpt.rewrite.apply import rewrite_for_training, same
from autockpt.rewrite.apply import segment_specs_from_plan as specs_from_plan
from solvers import METHODS, InfeasibleError, Simulation, Solution
from solvers.selective import keepable_nodes

HandBack = Any
"""How a rewritten module is handed back: as it came (``same``) or compiled again
(autockpt.rewrite.apply.CompiledHandBack)."""


def refuse_below_floor(
    model: nn.Module,
    inputs: Inputs,
    captured: Capture | None,
    request: Request,
    budget_bytes: int,
) -> None:
    """:class:`InfeasibleBudgetError` stating a floor (``floor_bytes``, ``lower_bound``; no
    minimum), before profiling, for a budget below what the step keeps whatever is
    checkpointed (:func:`resident_floor`); before capture (``captured`` None) below the
    parameters, buffers and inputs, so that a model far too large for its budget (an 8B
    model for one GPU) is refused before seconds or minutes of capture. Scope "total" on one
    process only: "activations" leaves that part out, and a rank keeps a share of it."""
    if request.scope != "total" or request.sharding.active:
        return
    parts = resident_floor(model, inputs, captured, request.optimizer)
    floor = sum(parts.values())
    if floor > budget_bytes:
        raise InfeasibleBudgetError(budget_bytes, None, parts, request.scope, floor_bytes=floor)


class CapturedRoute:
    """NOTE [routes: captured graph]: plan one captured graph for any number of budgets.

    Built inside the caller's ``as_found`` and ``training_mode`` blocks, right after
    capture; ``budget_bytes`` (when the budget to be asked for is known) is refused below
    the resident floor before anything is profiled."""

    def __init__(
        self,
        model: nn.Module,
        inputs: Inputs,
        request: Request,
        captured: Capture,
        phases: Phases,
        planning_peak: PlanningPeak,
        hand_back: HandBack,
        budget_bytes: int | None = None,
    ) -> None:
        self.model, self.inputs, self.request = model, inputs, request
        self.phases, self.hand_back = phases, hand_back
        self.compiled = hand_back is not same
        if budget_bytes is not None:
            refuse_below_floor(model, inputs, captured, request, budget_bytes)
        # probe=False (shapes alone: fit_batch's many sizes) is cheap: neither read nor kept
        key = (
            cache_key(model, inputs, captured, request, request.precision)
            if request.cache and request.probe
            else None
        )
        reused = cached(model, key)
        self.cache_key: Hashable | None = key
        """This preparation's entry in the cache, when cached."""
        self._as_written_shift: int | None = None
        self._as_written_known = False
        if reused is not None and reused.as_written_known:
            self._as_written_shift, self._as_written_known = reused.as_written_shift, True
        prepared = prepare(
            model,
            inputs,
            captured,
            request,
            request.precision,
            planning_peak,
            phases,
            reused=(reused.profile, reused.trace) if reused is not None else None,
        )
        self.adopt(prepared, leanest=reused.leanest if reused is not None else None)
        phases.start("search", "searching the leanest plan")
        self.no_checkpoint_peak_bytes = self.predict([])
        """Predicted peak of the captured graph run without checkpoints (the replay of the
        recorded step under no plan): the solver's upper end and what plans are compared
        with inside autockpt. The user's model as written may peak higher (its own code
        keeps tensors the graph frees): :meth:`as_written_or_none`."""
        leanest = self.search.leanest()
        self.minimum_peak_bytes = leanest.peak_bytes
        """The stated minimum (NOTE [routes: measured minimum]): the leanest plan's predicted
        peak, raised to its measured step's once a verifying step measured it higher."""
        self.leanest_measured_bytes: int | None = None
        """The leanest plan's measured peak in the budget's scope, once a verifying step
        has run it (NOTE [routes: measured minimum])."""
        if reused is None:
            keep(model, key, Reused(self.profile, self.trace, leanest))
        scope = request.scope
        self.breakdown = breakdown(
            self.profile, self.chain, scope, self.minimum_peak_bytes, self.trace
        )
        if self.rank_memory is not None and scope == "total":
            sharding = request.sharding
            kept = kept_ratio(model, sharding.units, prepared.precision.kept)
            self.breakdown = rank_breakdown(self.breakdown, self.rank_memory, sharding, kept)
        measured = reused.leanest_measured_bytes if reused is not None else None
        if measured is not None and not self.compiled:
            self._learn_leanest(
                measured
            )  # an earlier planner's step (NOTE [routes: measured minimum])
        phases.stop()

    def adopt(self, prepared: Prepared, leanest: Solution | None = None) -> None:
        """Make the prepared values this route's, and build the predictor and the search over
        them (``leanest``: the search's answer from the cache)."""
        self.prepared = prepared
        self.capture = prepared.capture
        self.profile = prepared.profile
        self.meta = prepared.meta
        self.blocks = prepared.blocks
        self.chain = prepared.chain
        self.trace = prepared.trace
        self.single_problem = prepared.single_problem
        self.rank_memory = prepared.rank_memory
        self.per_block_segments: tuple[StageRange, ...] | None = prepared.per_block_segments
        """The per-block hand plan as stage ranges (None without repeated blocks)."""
        self.planning_peak_bytes = prepared.planning_peak_bytes
        self.predictor = Predictor(prepared)
        self.search = BudgetSearch(
            self.chain, self.predictor, seeds=prepared.seeds, leanest=leanest
        )

    # -- predictions (the Predictor's) ----------------------------------------------------

    def predict(self, segments: Sequence[StageRange], kept: Sequence[Sequence[int]] = ()) -> int:
        """Predicted peak (in the budget's scope, per rank when sharded) of a plan given as
        stage ranges (and, per range, the compute nodes kept inside it: selective
        recompute): the plan simulator's replay of the recorded step."""
        return self.predictor.predict(segments, kept)

    def timeline(
        self, segments: Sequence[StageRange], kept: Sequence[Sequence[int]] = ()
    ) -> MemoryTimeline:
        """The predicted memory curve of one step with and without the plan
        (:meth:`autockpt.planning.predict.Predictor.timeline`)."""
        return self.predictor.timeline(segments, kept)

    def recompute_seconds(
        self, segments: Sequence[StageRange], kept: Sequence[Sequence[int]] = ()
    ) -> float:
        """Seconds a plan adds to a step, from the probe's measured node times
        (:meth:`autockpt.planning.predict.Predictor.recompute_seconds`)."""
        return self.predictor.recompute_seconds(segments, kept)

    def simulate(self, segments: Sequence[StageRange]) -> Simulation:
        """The prediction for checkpointing the given stage ranges: peak from the plan
        simulator (:meth:`predict`), recompute seconds from :meth:`recompute_seconds`."""
        return self.predictor.simulate(segments)

    def budgeted_bytes(self, measurement: Measurement) -> int:
        """The part of a measured peak that the budget covers (the Predictor's scope rule)."""
        return self.predictor.in_scope(measurement.peak_bytes)

    def as_written_or_none(self) -> int | None:
        """The model as written's predicted peak, or None where it does not run on fake
        tensors (autockpt/costs/as_written.py); computed on first use, never run for real."""
        if not self._as_written_known:
            with (
                as_found(self.model, self.inputs),
                training_mode(self.model),
                self.request.precision.entered(self.request.device),
            ):
                self._as_written_shift = as_written_shift(
                    self.model, self.capture, self.inputs, self.request.loss_fn
                )
            self._as_written_known = True
            # kept with the cached preparation: a later call does not run the two steps again
            remember_as_written(self.model, self.cache_key, self._as_written_shift)
        shift = self._as_written_shift
        return None if shift is None else self.no_checkpoint_peak_bytes + shift

    # -- plans ----------------------------------------------------------------------------

    def solve(self, budget_bytes: int, how: Solve) -> Solution:
        """The least-recompute plan whose predicted peak fits ``budget_bytes``: the search
        under the replay (``auto``), or a stage-chain solver judged by it
        (autockpt/planning/search.py). Raises :class:`InfeasibleBudgetError` below the
        minimum."""
        solver, scope = how.solver, self.request.scope
        if solver not in METHODS and solver not in SEARCH_METHODS:
            raise ValueError(
                f"unknown solver {solver!r}; choose one of {', '.join((*SEARCH_METHODS, *METHODS[1:]))}"
            )
        if self.search.leanest().peak_bytes > budget_bytes:  # the prediction's minimum
            raise InfeasibleBudgetError(
                budget_bytes, self.minimum_peak_bytes, self.breakdown, scope
            )
        try:
            if solver in SEARCH_METHODS:
                return self.search.least_recompute(
                    budget_bytes, time_limit_s=how.time_limit_s, selective=how.selective
                )
            return self.search.chain_solver(budget_bytes, solver, time_limit_s=how.time_limit_s)
        except InfeasibleError as error:
            hint = (
                f"The '{solver}' solver optimises the stage-chain proxy and found no plan that "
                "fits, but one exists: use solver='auto'."
                if solver not in SEARCH_METHODS
                else None
            )
            raise InfeasibleBudgetError(
                budget_bytes, self.minimum_peak_bytes, self.breakdown, scope, hint
            ) from error

    def optimize(self, budget_bytes: int, how: Solve, finish: Finish, replan: Replan) -> nn.Module:
        """Solve, rewrite and (``how.verify``) check one measured step; ``finish`` the
        result."""
        try:
            result = self.fit(budget_bytes, how)
        finally:
            self.phases.stop()
        finish(result)
        return result

    def fit(self, budget_bytes: int, how: Solve) -> nn.Module:
        """The verified plan's module for ``budget_bytes``, its plan with the measurement
        (:meth:`optimize` without finishing; the compiled route measures more beside it).

        NOTE [routes: measured minimum]: where the search under ``budget_bytes`` less what
        measurements exceeded their predictions finds nothing, and in one round after the
        usual ones, the leanest plan itself is measured; its step's peak is what a refusal
        states, and the stated minimum from then on (:attr:`minimum_peak_bytes`). Asking for
        it succeeds: the leanest plan fits it, and the loop always comes to the leanest plan
        before it gives up. Plans that fitted before fit the same way (the rounds before
        are unchanged)."""
        verifying = how.verify and not self.meta
        measured = self.leanest_measured_bytes
        if verifying and measured is not None and measured > budget_bytes:
            raise self.measured_infeasible(budget_bytes, 0)  # measured before: not again
        leanest = self.search.leanest()

        def attempt(underestimate: int, last_round: bool) -> Attempt[tuple[Solution, Plan]]:
            self.phases.start("search", "solving")
            solution = None
            if not last_round:
                try:
                    solution = self.solve(budget_bytes - underestimate, how)
                except InfeasibleBudgetError:
                    if not underestimate:
                        raise
            if solution is None:  # the leanest plan, unless its step is known not to fit
                known = self.leanest_measured_bytes
                if known is not None and known > budget_bytes:
                    raise self.measured_infeasible(budget_bytes, underestimate)
                solution = leanest
            plan = self.plan_of(solution, budget_bytes)
            # One road from a plan to a module, for optimize and apply alike.
            result = self.rewrite_specs(specs_from_plan(self.capture, plan))
            return Attempt(result, (solution, plan), solution.peak_bytes)

        def measure_attempt(found: Attempt[tuple[Solution, Plan]]) -> tuple[int, Measurement]:
            # The plan's own step fits by construction: measuring it is the only real step
            # planning runs (the probe already warmed every kernel up). Memory only: one
            # step's time is no result (benchmarks interleave rounds).
            self.phases.start("verify", "measuring the plan")
            checked = self.measure(found.result, timed=self._times_step)
            solution = found.found[0]
            used = self.budgeted_bytes(checked) + self.predictor.rank_shift(
                solution.segments, solution.kept
            )
            if _same_plan(solution, leanest):
                self._learn_leanest(used)
            return used, checked

        fitted: Fitted[tuple[Solution, Plan]] = fit_by_measuring(
            budget_bytes,
            attempt,
            measure_attempt if verifying else None,
            lambda underestimate, used: self.measured_infeasible(budget_bytes, underestimate),
            # one more round, the leanest plan's (NOTE [routes: measured minimum])
            rounds=VERIFY_ROUNDS + 1,
        )
        result = fitted.attempt.result
        solution, plan = fitted.attempt.found
        if fitted.measurement is not None and fitted.measurement.repeat > 0:
            self._adopt_step_factors(solution, fitted.measurement)
            plan = self.plan_of(solution, budget_bytes)  # its seconds at the factors
        result.plan = with_measurement(
            plan, self.prepared, self.predictor, solution, fitted.measurement
        )
        return result

    def _learn_leanest(self, measured: int) -> None:
        """The leanest plan's step measured ``measured`` bytes (in the budget's scope): above
        the stated minimum, it is the stated minimum from now on (NOTE [routes: measured
        minimum]); at or below, the prediction stays the minimum (plans stay as they were)."""
        self.leanest_measured_bytes = measured
        if measured > self.minimum_peak_bytes:
            self.minimum_peak_bytes = measured
            self.breakdown = {**self.breakdown, "leanest plan's peak": measured}
        if not self.compiled:  # kept for later planners of this model (an eager step's)
            remember_leanest_measured(self.model, self.cache_key, measured)

    def rewrite(
        self, segments: Sequence[StageRange], kept: Sequence[Sequence[int]] = ()
    ) -> nn.Module:
        """The model rewritten to checkpoint the given stage ranges, keeping the outputs of
        the compute nodes ``kept[k]`` inside segment ``k`` (no solving, no check)."""
        keepable = keepable_nodes(self.trace) if any(kept) else frozenset()
        for nodes in kept:
            for i in nodes:
                if i not in keepable:
                    raise ValueError(
                        f"node {i} ({self.chain.node_names[i]}) cannot be kept: it does not "
                        "call exactly one allocating, deterministic, non-mutating operator"
                    )
        given = Solution(
            segments=[tuple(seg) for seg in segments],
            recompute_seconds=0.0,
            peak_bytes=0,
            status="feasible",
            method="given",
            solve_seconds=0.0,
            gap=None,
            kept=tuple(tuple(nodes) for nodes in kept),
        )
        return self.rewrite_specs(
            segment_specs(self.chain, self.profile, self.capture, given, self.trace)
        )

    def rewrite_specs(self, specs: list[Any]) -> nn.Module:
        """The model rewritten with ``specs``, handed back as it came (compiled or not)."""
        return self.hand_back(rewrite_for_training(self.model, self.capture, specs, self.inputs))

    def plan_of(self, solution: Solution, budget_bytes: int) -> Plan:
        """The plan of ``solution``, with this route's predictions."""
        specs = segment_specs(self.chain, self.profile, self.capture, solution, self.trace)
        return make_plan(
            self.prepared,
            self.predictor,
            solution,
            specs,
            budget_bytes,
            minimum_peak_bytes=self.minimum_peak_bytes,
            no_checkpoint_peak_bytes=self.no_checkpoint_peak_bytes,
            as_written_peak_bytes=self.as_written_or_none(),
        )

    def measure(self, result: nn.Module, timed: bool = False) -> Measurement:
        """One real step of ``result`` (:func:`~autockpt.planning.routes.base.measure_step`),
        scalar draws at their worst case where the profile found any."""
        draws = self.profile.worst_case_draws > 0
        return measure_step(
            result, self.inputs, self.request, compiled=self.compiled, draws=draws, timed=timed
        )

    def measured_infeasible(self, budget_bytes: int, underestimate: int) -> InfeasibleBudgetError:
        """The refusal of ``budget_bytes`` after measured steps exceeded it. It states the
        leanest plan's measured peak where that step ran (NOTE [routes: measured minimum]):
        a budget the loop then meets. Otherwise (a compiled candidate measured on its own)
        the prediction's minimum raised by what the measurements exceeded."""
        measured = self.leanest_measured_bytes
        compiled = (
            " (Measured under the model's torch.compile, which keeps other tensors than "
            "the eager step the prediction models.)"
            if self.compiled
            else ""
        )
        if measured is not None and measured > budget_bytes:
            over = measured - self.search.leanest().peak_bytes
            return InfeasibleBudgetError(
                budget_bytes,
                max(measured, self.minimum_peak_bytes),
                self.breakdown,
                self.request.scope,
                f"The leanest plan's step measured {measured} bytes"
                + (f", {over} above its prediction" if over > 0 else "")
                + ", so the minimum stated is that measured peak; asking for it succeeds."
                + compiled,
            )
        return InfeasibleBudgetError(
            budget_bytes,
            max(self.minimum_peak_bytes + underestimate, budget_bytes + 1),
            self.breakdown,
            self.request.scope,
            f"Measured peaks ran up to {underestimate} bytes above the model's prediction, so "
            "the leanest plan needs the minimum stated." + compiled,
        )

    @property
    def _times_step(self) -> bool:
        """Whether the verifying measurement also times the plan's step, for the step
        factors no plan of this model has stored yet (NOTE [timing: step factors]): an
        eager, unsharded forward and backward with measured node seconds that rank."""
        timing, request = self.profile.timing, self.request
        return (
            timing is not None
            and timing.ranks
            and timing.factors is None
            and not self.compiled
            and request.optimizer is None
            and request.accumulation_steps == 1
            and not request.sharding.active
        )

    def _adopt_step_factors(self, solution: Solution, timed: Measurement) -> None:
        """Store the step factors from the verified plan's timed steps (or take those another
        process stored first) and predict by them from now on (NOTE [timing: step
        factors])."""
        timing = self.profile.timing
        assert timing is not None
        ranked = self.predictor.recompute_seconds(solution.segments, solution.kept)
        factors = step_factors(timing, ranked, timed.forward_seconds, timed.step_seconds)
        profile = self.profile.with_timing(settle_factors(timing, factors))
        leanest = self.search.leanest()
        self.adopt(dataclasses.replace(self.prepared, profile=profile), leanest=leanest)
        remember_profile(self.model, self.cache_key, profile)


def _same_plan(solution: Solution, other: Solution) -> bool:
    """Whether two solutions checkpoint the same stage ranges keeping the same nodes."""
    return [tuple(seg) for seg in solution.segments] == [
        tuple(seg) for seg in other.segments
    ] and tuple(map(tuple, solution.kept)) == tuple(map(tuple, other.kept))
