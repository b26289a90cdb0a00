"""The planner's parts (autockpt/planning/): one road from a plan to a module, the one
measure-and-tighten loop and the one scope rule."""

from __future__ import annotations

import pytest
import torch

from autockpt.measure import Measurement
from autockpt.plan import Plan, scoped_bytes
from autockpt.planning.make_plan import make_plan
from autockpt.planning.specs import segment_specs
from autockpt.planning.verify import VERIFY_ROUNDS, Attempt, fit_by_measuring
from autockpt.rewrite.apply import segment_specs_from_plan
from autockpt_zoo.toy import ZOO
from solvers import Solution
from solvers.selective import keep_greedily
from tests.conftest import budget_between, quiet_planner


def _plans(planner, kept_too: bool):
    """Solutions at three budgets, and one keeping operator outputs when asked."""
    found = [planner.solve(budget_between(planner, f)) for f in (0.0, 0.4, 0.8)]
    if kept_too:
        segments = planner.per_block_segments
        peak = planner.predict(segments)
        budget = peak + (planner.no_checkpoint_peak_bytes - peak) // 5
        kept = keep_greedily(planner.search.replay_chain, segments, budget)
        assert any(kept.kept)
        found.append(
            Solution(
                segments=list(segments),
                recompute_seconds=0.0,
                peak_bytes=0,
                status="feasible",
                method="given",
                solve_seconds=0.0,
                gap=None,
                kept=kept.kept,
            )
        )
    return found


@pytest.mark.parametrize(
    ("name", "kept_too"),
    [("gpt", True), ("resnet", False), ("unet", False)],  # dropout, BatchNorm, many stages
)
def test_specs_read_back_from_the_plan_equal_the_solutions(name, kept_too):
    """Field by field: node range, RNG, restored buffers, kept operator calls."""
    model, inputs = ZOO[name]()
    planner = quiet_planner(model, inputs)
    for solution in _plans(planner, kept_too):
        direct = segment_specs(
            planner.chain, planner.profile, planner.capture, solution, planner.trace
        )
        plan = make_plan(
            planner.prepared,
            planner.predictor,
            solution,
            direct,
            2**40,
            minimum_peak_bytes=planner.minimum_peak_bytes,
            no_checkpoint_peak_bytes=planner.no_checkpoint_peak_bytes,
        )
        read_back = segment_specs_from_plan(planner.capture, Plan.from_json(plan.to_json()))
        assert read_back == direct and direct, (solution.segments, solution.kept)
    rng = any(spec.preserve_rng for spec in direct)
    buffers = any(spec.restore_buffers for spec in direct)
    assert (rng, buffers) == {"gpt": (True, False), "resnet": (False, True), "unet": (False, True)}[
        name
    ]


def _attempts(predicted: int):
    calls = []

    def attempt(underestimate: int, last_round: bool) -> Attempt[int]:
        calls.append((underestimate, last_round))
        return Attempt(torch.nn.Identity(), len(calls), predicted - underestimate)

    return attempt, calls


def _measure_each(*peaks: int):
    measured = iter(peaks)

    def measure(found: Attempt[int]) -> tuple[int, Measurement]:
        peak = next(measured)
        return peak, Measurement(peak, 0, 0.0, "cpu", 0)

    return measure


def _never(underestimate: int, used: int) -> Exception:
    return AssertionError(f"gave up at {underestimate}, {used}")


def test_the_loop_tightens_by_what_the_measurement_exceeded():
    attempt, calls = _attempts(predicted=100)
    fitted = fit_by_measuring(100, attempt, _measure_each(130, 101, 99), _never)
    # 130 measured vs 100 predicted: 30 off; then 101 vs 70: at least one more byte
    assert calls == [(0, False), (30, False), (31, False)]
    assert fitted.attempt.found == 3 and fitted.measurement.peak_bytes == 99


def test_the_loop_gives_up_after_its_rounds_with_what_it_learnt():
    attempt, calls = _attempts(predicted=100)
    with pytest.raises(ValueError, match="^85 120$"):  # 5, 25, 65, then 85 learnt
        fit_by_measuring(
            100,
            attempt,
            _measure_each(105, 120, 140, 120),
            lambda u, used: ValueError(f"{u} {used}"),
        )
    assert len(calls) == VERIFY_ROUNDS and calls[-1][1] and not any(last for _, last in calls[:-1])


def test_without_measuring_the_first_answer_is_returned():
    attempt, calls = _attempts(predicted=500)
    fitted = fit_by_measuring(100, attempt, None, _never)
    assert calls == [(0, False)] and fitted.measurement is None


def test_one_scope_rule_for_the_planner_and_the_plan():
    model, inputs = ZOO["gpt"]()
    planner = quiet_planner(model, inputs, scope="activations")
    fast = planner.optimize(budget_gb=budget_between(planner, 0.5) / 2**30)
    measured = fast.plan.measured_peak_bytes
    static = planner.profile.static_bytes + planner.profile.param_grad_bytes
    measurement = Measurement(measured, 0, 0.0, "cpu", 0)
    assert planner.budgeted_bytes(measurement) == fast.plan.budgeted_bytes(measured)
    assert fast.plan.budgeted_bytes(measured) == scoped_bytes(measured, "activations", static)
    assert fast.plan.budgeted_bytes(measured) <= fast.plan.budget_bytes < measured
