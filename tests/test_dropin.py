"""Drop-in use: the front doors take what a training script has at hand.

A bad budget is refused before any work; a model in eval mode is planned for training; an
optimized model is planned again from the original; ``torch.compile`` composes both ways
(after ``optimize``, and around the model given to it). Every case checks real behaviour:
gradients equal to eager, allocator-measured peaks under the budget, segments that run.
"""

from __future__ import annotations

import copy
import fractions
import math
import warnings

import pytest
import torch
from torch import nn

import autockpt
from autockpt import cli
from autockpt.api import Planner
from autockpt.errors import (
    GIB,
    AutockptError,
    BudgetError,
    BudgetTypeError,
    CompileError,
    CompileWarning,
)
from autockpt.rewrite import CheckpointSegment, is_checkpointed, segments_of
from autockpt.rewrite.apply import compiled_backend
from autockpt_zoo.toy import gpt
from tests.conftest import assert_same_step, budget_gb_between, quiet_planner, train_step


class Net(nn.Module):
    """Linear -> BatchNorm -> ReLU -> Dropout blocks: every op whose behaviour depends on the
    mode (batch statistics and running buffers, dropout), with activations well above the
    parameters so that checkpointing matters."""

    def __init__(self, width: int = 32, depth: int = 6, p: float = 0.1) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Dropout(p))
            for _ in range(depth)
        )
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def net(p: float = 0.1) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return Net(p=p).train(), torch.randn(256, 32)


@pytest.fixture(scope="module")
def planned_net():
    model, x = net()
    return model, x, quiet_planner(model, x)


@pytest.fixture(scope="module")
def planned_gpt():
    model, inputs = gpt(layers=2, dropout=0.0)
    return model, inputs, quiet_planner(model, inputs)


def _count_segment_calls(result: nn.Module) -> list[int]:
    calls = [0]
    for segment in segments_of(result).values():
        assert isinstance(segment, CheckpointSegment)
        segment.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


# -- 1. budgets: refused before capture, with a typed error -------------------------------------


BAD_TYPES = ["8", True, None, torch.tensor(1.0)]
BAD_VALUES = [0, 0.0, -1, -0.5, math.inf, -math.inf, math.nan, 1e300]


@pytest.mark.parametrize(
    ("budget", "expected"),
    [(b, BudgetTypeError) for b in BAD_TYPES] + [(b, BudgetError) for b in BAD_VALUES],
    ids=repr,
)
def test_bad_budget_is_refused_before_capture(budget, expected, monkeypatch):
    def no_capture(*args, **kwargs):
        raise AssertionError("capture ran before the budget was checked")

    monkeypatch.setattr("autockpt.planning.routes.capture", no_capture)
    model, x = net()
    with pytest.raises(expected, match="budget_gb") as error:
        autockpt.optimize(model, x, budget_gb=budget)
    assert isinstance(error.value, AutockptError) and isinstance(error.value, ValueError)
    if expected is BudgetTypeError:
        assert isinstance(error.value, TypeError)
    else:
        assert "positive, finite" in str(error.value) and "frontier" in str(error.value)


def test_string_budget_says_how_to_fix_it():
    model, x = net()
    with pytest.raises(BudgetTypeError, match=r"pass float\('8'\)"):
        autockpt.optimize(model, x, budget_gb="8")


@pytest.mark.parametrize("budget", ["8", True, 0, -1, math.nan, math.inf])
def test_planner_refuses_bad_budget_before_solving(planned_net, budget, monkeypatch):
    _, _, planner = planned_net

    def no_search(*args, **kwargs):
        raise AssertionError("solved before the budget was checked")

    monkeypatch.setattr(planner.route, "solve", no_search)
    with pytest.raises(BudgetError):
        planner.optimize(budget_gb=budget)


def test_good_budgets_of_other_number_types_are_accepted(planned_net):
    _, x, planner = planned_net
    high = planner.no_checkpoint_peak_bytes
    fast = planner.optimize(budget_gb=fractions.Fraction(2 * high, GIB), verify=False)
    assert fast.plan.budget_bytes == 2 * high and not fast.plan.segments


@pytest.mark.parametrize("value", ["inf", "nan", "0", "-1", "eight"])
def test_cli_refuses_bad_budget_as_a_usage_error(value, capsys, monkeypatch):
    monkeypatch.setattr("autockpt.planning.routes.capture", lambda *a, **k: pytest.fail("captured"))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["plan", "autockpt.zoo:gpt", "--budget-gb", value])
    assert exit_info.value.code == cli.EXIT_USAGE
    assert "--budget-gb" in capsys.readouterr().err


# -- 2. a model in eval mode ---------------------------------------------------------------------


def test_model_in_eval_mode_is_planned_for_training(planned_net):
    model, x, planner = planned_net
    budget_gb = budget_gb_between(planner, 0.1)
    user = copy.deepcopy(model).eval()
    user.blocks[0][2].train()  # a mixed tree (a ReLU): every module's mode comes back as found
    modes = [m.training for m in user.modules()]
    with pytest.warns(UserWarning, match=r"eval mode.*\.train\(\) on the result"):
        fast = autockpt.optimize(user, x, budget_gb=budget_gb)
    assert [m.training for m in user.modules()] == modes
    assert not fast.training and fast.plan.segments
    # In eval mode the result is the eval model (its original forward).
    with torch.no_grad():
        torch.testing.assert_close(fast(x), user(x))
    # Training mode runs the plan: segments run, eager's step, within the budget.
    fast.train()
    calls = _count_segment_calls(fast)
    assert_same_step(train_step(copy.deepcopy(model), x), train_step(fast, x))
    assert calls[0] == len(fast.plan.segments)
    measured = autockpt.measure(fast, x, repeat=0)
    assert measured.peak_bytes <= fast.plan.budget_bytes


def test_apply_to_a_model_in_eval_mode_plans_training(planned_net, tmp_path):
    model, x, planner = planned_net
    plan = planner.optimize(budget_gb=budget_gb_between(planner, 0.1)).plan
    user = copy.deepcopy(model).eval()
    with pytest.warns(UserWarning, match="eval mode"):
        again = autockpt.apply(user, plan, x)
    assert not user.training and not again.training
    again.train()
    calls = _count_segment_calls(again)
    assert_same_step(train_step(copy.deepcopy(model), x), train_step(again, x))
    assert calls[0] == len(plan.segments)


def test_model_in_training_mode_with_frozen_submodule_is_planned_as_it_is(planned_net):
    # Root in training mode: nothing is switched (a frozen batch norm stays frozen).
    model, x, _ = planned_net
    user = copy.deepcopy(model)
    user.blocks[2][1].eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        planner = Planner(user, x)
    assert not [w for w in caught if "eval mode" in str(w.message)]
    fast = planner.optimize(budget_gb=budget_gb_between(planner, 0.1))
    assert not user.blocks[2][1].training
    assert_same_step(train_step(copy.deepcopy(user), x), train_step(fast, x))


# -- 3. optimize(optimize(m)) --------------------------------------------------------------------


def test_optimizing_a_result_plans_the_original_again(planned_gpt):
    model, inputs, planner = planned_gpt
    first = planner.optimize(budget_gb=budget_gb_between(planner, 0.2))
    budget_gb = budget_gb_between(planner, 0.6)
    second = autockpt.optimize(first, inputs, budget_gb=budget_gb)
    assert second.plan.budget_bytes == int(budget_gb * GIB)
    assert second.plan.graph_fingerprint == first.plan.graph_fingerprint  # the original's graph
    assert type(second) is type(first) and is_checkpointed(second)
    assert [id(p) for p in second.parameters()] == [id(p) for p in model.parameters()]
    assert list(second.state_dict()) == list(model.state_dict())
    assert_same_step(train_step(copy.deepcopy(model), inputs), train_step(second, inputs))
    assert autockpt.measure(second, inputs, repeat=0).peak_bytes <= second.plan.budget_bytes
    # apply takes a result too: the plan goes onto the original.
    again = autockpt.apply(second, first.plan, inputs)
    assert again.plan == first.plan
    assert_same_step(train_step(copy.deepcopy(model), inputs), train_step(again, inputs))


# -- 4. torch.compile ----------------------------------------------------------------------------


def _strip_compiled(step: dict) -> dict:
    """A step through a ``torch.compile`` wrapper, with the wrapper's name prefix dropped."""
    for key in ("grads", "buffers"):
        step[key] = {name.removeprefix("_orig_mod."): v for name, v in step[key].items()}
    return step


@pytest.fixture
def fresh_dynamo():
    # Every rewrite generates new code, and dynamo recompiles a class's forward for each
    # (up to its recompile limit per process): start each compile test from a clean cache.
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_compiled_result_trains_like_eager(planned_net, fresh_dynamo):
    # Batch norm's running statistics are the buffers a segment restores in eager mode;
    # under compile no context_fn is passed (compile accepts none but dispatch modes) and
    # the functionalized graph updates them once per step. Dropout is recomputed with the
    # forward's mask.
    model, x, planner = planned_net
    fast = planner.optimize(budget_gb=budget_gb_between(planner, 0.1))
    assert any(seg.restore_buffers for seg in fast.plan.segments)
    assert any(seg.preserve_rng for seg in fast.plan.segments)
    compiled = torch.compile(fast, backend="aot_eager")
    expected = train_step(copy.deepcopy(model), x)
    assert_same_step(expected, _strip_compiled(train_step(compiled, x)))
    # Checkpointing takes effect under compile: the compiled step keeps less than the
    # compiled model without a plan.
    plain = autockpt.measure(torch.compile(copy.deepcopy(model), backend="aot_eager"), x, repeat=0)
    checkpointed = autockpt.measure(compiled, x, repeat=0)
    eager_saving = planner.no_checkpoint_peak_bytes - fast.plan.predicted_peak_bytes
    assert plain.peak_bytes - checkpointed.peak_bytes >= 0.5 * eager_saving


def test_segments_without_buffers_pass_no_context_fn(planned_gpt, monkeypatch):
    _, inputs, planner = planned_gpt
    fast = planner.optimize(budget_gb=budget_gb_between(planner, 0.2), verify=False)
    seen = []
    real = torch.utils.checkpoint.checkpoint

    def spy(fn, *args, **kwargs):
        seen.append("context_fn" in kwargs)
        return real(fn, *args, **kwargs)

    monkeypatch.setattr("autockpt.rewrite.segment.checkpoint", spy)
    fast(*inputs)[1].backward()
    assert seen == [False] * len(fast.plan.segments)


def test_optimize_keeps_the_models_torch_compile(planned_net, fresh_dynamo):
    model, x, planner = planned_net
    budget_gb = budget_gb_between(planner, 0.5)
    given = torch.compile(copy.deepcopy(model), backend="aot_eager")
    # autockpt's plan alone (compile's own partitions as candidates: tests/test_compiled.py)
    fast = autockpt.optimize(given, x, budget_gb=budget_gb, compile_budgets=())
    # compiled with the user's backend (and its mode and options), in a context of its own
    assert type(fast) is type(given) and compiled_backend(fast) is compiled_backend(given)
    assert is_checkpointed(fast._orig_mod) and fast.plan.segments
    # Verified as handed back: compiled.
    assert fast.plan.measured_peak_bytes <= fast.plan.budget_bytes
    assert autockpt.measure(fast, x, repeat=0).peak_bytes <= fast.plan.budget_bytes
    expected = train_step(copy.deepcopy(model), x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert_same_step(expected, _strip_compiled(train_step(fast, x)))
    # Its plan is verified compiled: a trace of it (here after torch._dynamo.reset) is
    # expected and says nothing.
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught_again:
        warnings.simplefilter("always")
        train_step(fast, x)
    assert not [w for w in caught + caught_again if issubclass(w.category, CompileWarning)]


def _compile_warnings(step) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step()
    return [str(w.message) for w in caught if issubclass(w.category, CompileWarning)]


def test_compiling_a_plan_verified_eagerly_warns_once(planned_gpt, fresh_dynamo):
    # The budget is a promise about the eager step (a compiled one was measured up to 25%
    # over it): compiling the result says so, once per plan, and names the order that
    # verifies the compiled step.
    model, inputs, planner = planned_gpt
    fast = planner.optimize(budget_gb=budget_gb_between(planner, 0.2), verify=False)
    assert not _compile_warnings(lambda: train_step(fast, inputs))  # eager: nothing to say
    compiled = torch.compile(fast, backend="aot_eager")
    said = _compile_warnings(lambda: train_step(compiled, inputs))
    assert len(said) == 1
    assert f"budget ({fast.plan.budget_bytes} bytes) was verified for eager steps" in said[0]
    assert "autockpt.optimize(torch.compile(model), ...)" in said[0]
    assert not _compile_warnings(lambda: train_step(compiled, inputs))
    torch._dynamo.reset()  # traced again: said already
    assert not _compile_warnings(lambda: train_step(compiled, inputs))
    again = planner.optimize(budget_gb=budget_gb_between(planner, 0.2), verify=False)  # same plan
    again = torch.compile(again, backend="aot_eager")
    assert not _compile_warnings(lambda: train_step(again, inputs))
    other = planner.optimize(budget_gb=budget_gb_between(planner, 0.6), verify=False)
    other = torch.compile(other, backend="aot_eager")
    assert len(_compile_warnings(lambda: train_step(other, inputs))) == 1


def test_results_of_one_plan_share_their_generated_code(planned_gpt):
    # dynamo guards on the functions a forward runs: one function per distinct code lets
    # results of the same plan share a compiled graph instead of recompiling the class.
    model, inputs, planner = planned_gpt
    first = planner.optimize(budget_gb=budget_gb_between(planner, 0.2), verify=False)
    second = planner.optimize(budget_gb=budget_gb_between(planner, 0.2), verify=False)
    other = planner.optimize(budget_gb=budget_gb_between(planner, 0.6), verify=False)

    def ranges(result):
        return [(seg.start_stage, seg.end_stage) for seg in result.plan.segments]

    assert first is not second and ranges(first) == ranges(second) != ranges(other)
    assert vars(first)["_autockpt"].code is vars(second)["_autockpt"].code
    assert vars(first)["_autockpt"].code is not vars(other)["_autockpt"].code
    ones = [segment._fn for segment in segments_of(first).values()]
    assert ones and ones == [segment._fn for segment in segments_of(second).values()]
    # Shared code runs on each result's own tree: gradients equal eager's for both.
    expected = train_step(copy.deepcopy(model), inputs)
    for result in (first, second):
        assert_same_step(expected, train_step(result, inputs))


def test_model_compiled_in_place_is_refused_before_capture(monkeypatch):
    monkeypatch.setattr("autockpt.planning.routes.capture", lambda *a, **k: pytest.fail("captured"))
    model, x = net()
    model.compile(backend="aot_eager")
    with pytest.raises(CompileError, match=r"torch.compile\(model\) before optimize"):
        autockpt.optimize(model, x, budget_gb=1.0)


@pytest.mark.slow
def test_compiled_result_with_inductor(fresh_dynamo):
    # Inductor generates C++ on the CPU (a compiler is needed) and takes tens of seconds.
    # Its kernels reassociate sums, so it is compared with the same model compiled without
    # a plan (equal: the checkpointed regions compute the same kernels), and with eager to
    # float tolerance.
    model, x = net(p=0.0)
    planner = quiet_planner(model, x)
    fast = planner.optimize(budget_gb=budget_gb_between(planner, 0.1))
    compiled = torch.compile(fast, backend="inductor")
    plain = torch.compile(copy.deepcopy(model), backend="inductor")
    got = _strip_compiled(train_step(compiled, x))
    assert_same_step(_strip_compiled(train_step(plain, x)), got)
    expected = train_step(copy.deepcopy(model), x)
    for name, grad in expected["grads"].items():
        scale = grad.abs().max().item()
        torch.testing.assert_close(got["grads"][name], grad, rtol=0, atol=1e-4 * max(scale, 1.0))
    assert (
        autockpt.measure(compiled, x, repeat=0).peak_bytes
        < autockpt.measure(plain, x, repeat=0).peak_bytes
    )
