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


class _KeepsScores(torch.nn.Module):
    """Falls back to torch.export (``len(x)`` in the root's own code) and, like
    x-transformers' ``Intermediates``, keeps every layer's scores alive until its forward
    returns, where the captured graph drops them (never used: dead code to export)."""

    def __init__(self, width: int = 64, depth: int = 3) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch = len(x)
        kept = []
        for layer in self.layers:
            scores = x @ x.transpose(-1, -2)
            kept.append(scores.clone())
            x = x + layer(self.drop(torch.softmax(scores, -1) @ x))
        return x.reshape(batch, -1)


class _LoopVariable(torch.nn.Module):
    """Traced by fx; its forward's loop variable holds the last layer's attention output
    (not saved for backward: the projection saves its reshaped copy) until it returns, at
    the end of the forward, where this step peaks."""

    def __init__(self, width: int = 64, depth: int = 2) -> None:
        super().__init__()
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(width, 3 * width) for _ in range(depth))
        self.out = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))
        self.up = torch.nn.ModuleList(torch.nn.Linear(width, 4 * width) for _ in range(depth))
        self.down = torch.nn.ModuleList(torch.nn.Linear(4 * width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for qkv, out, up, down in zip(self.qkv, self.out, self.up, self.down, strict=True):
            q, k, v = qkv(x).chunk(3, -1)
            q, k, v = (t.unflatten(-1, (4, 16)).transpose(1, 2) for t in (q, k, v))
            attended = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
            x = x + out(attended.transpose(1, 2).flatten(2))
            x = x + torch.nn.functional.dropout(down(torch.nn.functional.gelu(up(x))), 0.1)
        return x


def _eager_peak(model: torch.nn.Module, inputs: tuple) -> int:
    from autockpt.measure import measure

    return measure(model, inputs, repeat=0).peak_bytes


def test_the_baseline_is_the_model_as_written_where_its_export_graph_keeps_less():
    torch.manual_seed(0)
    model, x = _KeepsScores().train(), torch.randn(4, 96, 64)
    planner = quiet_planner(model, (x,), cache=False)
    assert planner.capture.method == "export"
    written, graph = planner.as_written_peak_bytes, planner.no_checkpoint_peak_bytes
    eager = _eager_peak(model, (x,))  # the test may run the unmodified step; planning never
    assert abs(written - eager) <= 0.01 * eager
    assert written - graph > 0.2 * written  # three layers' scores, 96x96 each, kept
    low = planner.minimum_peak_bytes
    plan = planner.optimize(budget_gb=(low + written) / 2 / 2**30).plan
    assert plan.as_written_peak_bytes == written == plan.baseline_peak_bytes
    assert plan.no_checkpoint_peak_bytes == graph
    (note,) = [n for n in plan.notes if n.startswith("the captured graph without checkpointing")]
    assert f"{written - graph} bytes ({100 * (written - graph) / written:.1f}%) below" in note
    assert Plan.from_json(plan.to_json()) == plan


def test_an_fx_graph_of_modules_peaks_like_the_model_as_written():
    model, inputs = ZOO["gpt"]()  # dropout in attention and MLP
    planner = quiet_planner(model, inputs, cache=False)
    assert planner.capture.method == "fx"
    assert planner.as_written_peak_bytes == planner.no_checkpoint_peak_bytes
    eager = _eager_peak(model, inputs if isinstance(inputs, tuple) else (inputs,))
    assert abs(planner.as_written_peak_bytes - eager) <= 0.01 * eager


def test_a_forward_variable_the_fx_graph_frees_counts_in_the_baseline():
    torch.manual_seed(0)
    model, x = _LoopVariable().train(), torch.randn(4, 128, 64)
    planner = quiet_planner(model, (x,), cache=False)
    assert planner.capture.method == "fx"
    written, graph = planner.as_written_peak_bytes, planner.no_checkpoint_peak_bytes
    eager = _eager_peak(model, (x,))
    assert eager - graph > 0.01 * eager  # the graph's own peak is no baseline here
    assert abs(written - eager) <= 0.01 * eager
