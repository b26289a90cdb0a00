"""End to end on the model zoo: optimize -> train like eager, fit the measured budget,
save/load/apply the plan, and fail with typed errors where a user can go wrong."""

from __future__ import annotations

import copy
import functools
import json
import logging
import time
import warnings

import pytest
import torch

import autockpt
from autockpt.api import Planner
from autockpt.errors import GIB, gib_up
from autockpt.plan import Plan
from autockpt.rewrite import segments_of
from autockpt_zoo.toy import ZOO
from solvers.search import recompute_seconds
from tests.conftest import assert_same_step, budget_between, quiet_planner, train_step

MODELS = sorted(ZOO)
FRACTIONS = (0.0, 0.5, 0.9)


def _planner(name: str):
    model, inputs = ZOO[name]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        planner = Planner(model, inputs)
    return model, inputs, planner


@pytest.fixture(scope="module", params=MODELS)
def zoo_case(request):
    return (request.param, *_planner(request.param))


def test_optimize_trains_like_eager_and_fits_budget(zoo_case):
    name, model, inputs, planner = zoo_case
    low, high = planner.minimum_peak_bytes, planner.no_checkpoint_peak_bytes
    assert low <= high
    for fraction in FRACTIONS:
        budget = low + fraction * (high - low)
        fast = planner.optimize(budget_gb=budget / GIB)
        plan = fast.plan
        # same tensors, same names, same order: optimizers and state dicts keep working
        assert list(fast.state_dict().keys()) == list(model.state_dict().keys())
        assert [id(p) for p in fast.parameters()] == [id(p) for p in model.parameters()]
        # a training step moves batch-norm statistics: compare from the same state
        expected = train_step(copy.deepcopy(model), inputs)
        got = train_step(fast, inputs)
        assert_same_step(expected, got)
        # the budget is a promise about measured memory, not about the prediction
        measured = autockpt.measure(fast, inputs, repeat=1)
        assert measured.peak_bytes <= plan.budget_bytes, (
            name,
            fraction,
            measured.peak_bytes,
            plan.budget_bytes,
        )
        assert plan.predicted_peak_bytes <= plan.budget_bytes
        assert (
            plan.measured_peak_bytes is not None and plan.measured_peak_bytes <= plan.budget_bytes
        )
        assert autockpt.Plan.from_json(plan.to_json()) == plan


def test_checkpointing_frees_memory_when_the_budget_needs_it(zoo_case):
    name, model, inputs, planner = zoo_case
    if planner.minimum_peak_bytes >= planner.no_checkpoint_peak_bytes:
        pytest.skip(f"{name}: the leanest plan is no better than none at this size")
    fast = planner.optimize(budget_gb=planner.minimum_peak_bytes / GIB)
    assert fast.plan.segments, "a budget at the minimum must checkpoint something"
    lean = autockpt.measure(fast, inputs, repeat=1)
    plain = planner.optimize(budget_gb=planner.no_checkpoint_peak_bytes / GIB)
    assert not plain.plan.segments
    assert lean.peak_bytes < autockpt.measure(plain, inputs, repeat=1).peak_bytes


def test_saved_plan_reapplies_without_profiling(zoo_case, tmp_path):
    name, model, inputs, planner = zoo_case
    budget = (planner.minimum_peak_bytes + planner.no_checkpoint_peak_bytes) / 2
    fast = planner.optimize(budget_gb=budget / GIB)
    path = tmp_path / "plan.json"
    fast.plan.save(path)
    loaded = autockpt.Plan.load(path)
    assert loaded == fast.plan
    fresh, fresh_inputs = ZOO[name]()
    fresh.load_state_dict(model.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again = autockpt.apply(fresh, loaded, fresh_inputs)
    assert [(m.first_node, m.last_node) for m in segments_of(again).values()] == [
        (m.first_node, m.last_node) for m in segments_of(fast).values()
    ]
    assert_same_step(train_step(fast, inputs), train_step(again, fresh_inputs))


def test_plan_from_another_model_is_refused():
    gpt, gpt_inputs, gpt_planner = _planner("gpt")
    fast = gpt_planner.optimize(budget_gb=gpt_planner.no_checkpoint_peak_bytes / GIB)
    other, _ = ZOO["unet"]()
    with pytest.raises(autockpt.PlanMismatchError, match="plan was made for"):
        autockpt.apply(other, fast.plan)
    bigger, bigger_inputs = ZOO["gpt"](batch=8)
    with pytest.raises(autockpt.PlanMismatchError, match="inputs"):
        autockpt.apply(bigger, fast.plan, bigger_inputs)


def test_budget_below_minimum_states_an_achievable_minimum():
    model, inputs, planner = _planner("resnet")
    too_small = planner.minimum_peak_bytes * 0.8 / GIB
    with pytest.raises(autockpt.InfeasibleBudgetError) as info:
        planner.optimize(budget_gb=too_small)
    error = info.value
    assert error.minimum_gb > too_small
    shown = f"{gib_up(error.minimum_bytes)} GiB ({error.minimum_bytes} bytes)"
    assert "parameters" in str(error) and shown in str(error)
    assert not error.lower_bound and error.floor_bytes is None and error.floor_gb is None
    fast = planner.optimize(budget_gb=error.minimum_gb)
    assert autockpt.measure(fast, inputs, repeat=1).peak_bytes <= fast.plan.budget_bytes


def test_static_part_alone_exceeds_budget():
    model, inputs = ZOO["block_stack"]()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    with pytest.raises(autockpt.InfeasibleBudgetError, match="gradients"):
        autockpt.optimize(model, inputs, budget_gb=params / 2 / GIB)


def test_activation_scope_budgets_only_what_lies_above_static():
    model, inputs = ZOO["mlp_mixer"]()
    planner = Planner(model, inputs, scope="activations")
    budget = (planner.minimum_peak_bytes + planner.no_checkpoint_peak_bytes) / 2
    fast = planner.optimize(budget_gb=budget / GIB)
    measured = autockpt.measure(fast, inputs, repeat=1)
    static = planner.profile.static_bytes + planner.profile.param_grad_bytes
    assert measured.peak_bytes - static <= fast.plan.budget_bytes
    assert fast.plan.scope == "activations"


def test_model_that_already_checkpoints_warns():
    model, inputs = ZOO["gpt_checkpointed"]()
    with pytest.warns(UserWarning, match="already calls torch.utils.checkpoint"):
        fast = autockpt.optimize(model, inputs, budget_gb=1.0)
    assert any("already calls" in note for note in fast.plan.notes)


def test_bad_arguments_raise_clear_errors():
    model, inputs = ZOO["block_stack"]()
    with pytest.raises(ValueError, match="budget_gb"):
        autockpt.optimize(model, inputs, budget_gb=0)
    with pytest.raises(ValueError, match="scope"):
        autockpt.optimize(model, inputs, budget_gb=1, scope="everything")
    with pytest.raises(ValueError, match="solver"):
        autockpt.optimize(model, inputs, budget_gb=1, solver="magic")
    with pytest.raises(TypeError, match="nn.Module"):
        autockpt.optimize(lambda x: x, inputs, budget_gb=1)
    ddp_like = torch.nn.parallel.DistributedDataParallel.__new__(
        torch.nn.parallel.DistributedDataParallel
    )
    torch.nn.Module.__init__(ddp_like)
    with pytest.raises(autockpt.AutockptError, match="optimize on the plain module first"):
        autockpt.optimize(ddp_like, inputs, budget_gb=1)


def test_no_grad_inference_runs_segments_plainly():
    model, inputs, planner = _planner("gpt")
    fast = planner.optimize(budget_gb=planner.minimum_peak_bytes / GIB)
    fast.eval()
    model.eval()
    with torch.no_grad():
        expected = model(*inputs)
        got = fast(*inputs)
    torch.testing.assert_close(got, expected)


def _all_plans(num_stages: int, start: int = 0) -> list[list[tuple[int, int]]]:
    """Every set of disjoint stage ranges on stages ``start..num_stages``."""
    if start >= num_stages:
        return [[]]
    plans = list(_all_plans(num_stages, start + 1))  # stage kept
    for end in range(start + 1, num_stages + 1):
        plans += [[(start, end), *rest] for rest in _all_plans(num_stages, end)]
    return plans


@pytest.mark.parametrize("name", ["gpt", "resnet"])
def test_stated_minimum_is_the_exact_minimum_over_every_expressible_plan(name):
    """On a chain small enough to enumerate, the stated minimum is the least predicted peak
    of every plan the rewriter can express, and a budget at it is met (measured)."""
    model, example = ZOO[name]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        planner = Planner(model, example, max_stages=7)
    plans = _all_plans(planner.chain.num_stages)
    assert len(plans) > 100
    least = min(planner.predict(plan) for plan in plans)
    assert planner.minimum_peak_bytes == least
    # segment plans are enumerable here: the search proves its answer
    segments_only = planner.optimize(budget_gb=least / GIB, selective=False)
    assert segments_only.plan.solver_status == "optimal"
    assert autockpt.measure(segments_only, example, repeat=1).peak_bytes <= least
    # keeping operator outputs inside segments (a heuristic on top) is never dearer
    fast = planner.optimize(budget_gb=least / GIB)
    assert (
        planner.solve(least).recompute_seconds
        <= planner.solve(least, selective=False).recompute_seconds
    )
    assert autockpt.measure(fast, example, repeat=1).peak_bytes <= least


@pytest.mark.parametrize("name", ["gpt", "resnet"])
def test_the_per_block_hand_plan_is_never_called_infeasible(name):
    """Checkpointing each repeated block by hand is in the plan space; at its predicted
    peak optimize finds a plan at least as cheap under the cost model and meets it."""
    model, example = ZOO[name]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        planner = Planner(model, example)
    per_block = planner.per_block_segments
    assert per_block, "the zoo model has repeated blocks"
    peak = planner.predict(per_block)
    assert planner.minimum_peak_bytes <= peak
    fast = planner.optimize(budget_gb=peak / GIB)
    assert autockpt.measure(fast, example, repeat=1).peak_bytes <= peak
    chosen = [(s.start_stage, s.end_stage) for s in fast.plan.segments]
    cost = planner.search.replay_chain
    assert recompute_seconds(cost, chosen) <= recompute_seconds(cost, list(per_block))


def test_an_export_plan_applies_from_the_plan_alone():
    """README's ``autockpt.apply(model, autockpt.Plan.load("plan.json"))`` on a model captured
    with torch.export: the plan's recorded input shapes re-capture it."""
    model, inputs = ZOO["root_shape_branch"]()
    planner = quiet_planner(model, inputs)
    assert planner.capture.method == "export"
    fast = planner.optimize(budget_gb=budget_between(planner, 0.3) / GIB)
    again = autockpt.apply(model, Plan.from_json(fast.plan.to_json()))
    assert again.plan == fast.plan
    assert_same_step(train_step(fast, inputs), train_step(again, inputs))


def test_a_plan_naming_modules_the_model_lacks_is_a_plan_mismatch():
    model, inputs = ZOO["untraceable_submodule"]()
    planner = quiet_planner(model, inputs)
    assert planner.capture.leaf_modules  # the plan names a leaf module
    plan = planner.optimize(budget_gb=planner.no_checkpoint_peak_bytes / GIB).plan
    other, _ = ZOO["gpt"]()
    with pytest.raises(autockpt.PlanMismatchError, match="names modules this GPT lacks"):
        autockpt.apply(other, plan)


@pytest.mark.parametrize("name", ["gpt", "resnet"])
def test_the_stated_minimum_as_a_budget_succeeds_and_one_byte_less_says_both(name):
    model, inputs = ZOO[name]()
    planner = quiet_planner(model, inputs)
    least = planner.minimum_peak_bytes
    fast = planner.optimize(budget_gb=least / GIB)
    assert fast.plan.budget_bytes == least and fast.plan.measured_peak_bytes <= least
    with pytest.raises(autockpt.InfeasibleBudgetError) as refused:
        planner.optimize(budget_gb=(least - 1) / GIB)
    assert refused.value.minimum_bytes == least
    assert f"({least - 1} bytes" in str(refused.value) and f"({least} bytes)" in str(refused.value)


# -- repeated planning: the cache, the early refusal, progress ---------------------------


def _spy_on_profiling(monkeypatch) -> list[str]:
    """Count the expensive phases (the profile's probe and the recorded step) as they run."""
    from autockpt.planning import prepared

    calls: list[str] = []
    profile, record = prepared.profile, prepared.record_trace

    def spied_profile(*args, **kwargs):
        calls.append("profile")
        return profile(*args, **kwargs)

    def spied_record(*args, **kwargs):
        calls.append("record")
        return record(*args, **kwargs)

    monkeypatch.setattr(prepared, "profile", spied_profile)
    monkeypatch.setattr(prepared, "record_trace", spied_record)
    return calls


def _without_timings(plan: Plan) -> dict:
    """A plan's JSON without what measures time (every ``*seconds*`` field and the
    recompute fraction, a ratio of measured seconds)."""

    def walk(value):
        if isinstance(value, dict):
            return {
                k: walk(v)
                for k, v in value.items()
                if "seconds" not in k and k != "recompute_fraction"
            }
        if isinstance(value, list):
            return [walk(v) for v in value]
        return value

    return walk(json.loads(plan.to_json()))


def _mlp(width: int = 32, depth: int = 3) -> torch.nn.Sequential:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers)


def test_optimize_again_reuses_the_profile_and_plans_as_without_the_cache(monkeypatch):
    """A second optimize of the same model and inputs profiles nothing, makes the plan an
    uncached call makes (timings aside) and leaves the model and the RNG as found."""
    autockpt.clear_cache()
    calls = _spy_on_profiling(monkeypatch)
    model, inputs = ZOO["gpt"]()
    planner = quiet_planner(model, inputs)  # plans, and keeps its profile for later calls
    assert calls == ["profile", "record"]
    budget = budget_between(planner, 0.4) / GIB
    state = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(7)
    rng = torch.get_rng_state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again = autockpt.optimize(model, inputs, budget_gb=budget)
        assert calls == ["profile", "record"], "the second call profiled again"
        assert torch.equal(torch.get_rng_state(), rng)
        assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
        cold = autockpt.optimize(model, inputs, budget_gb=budget, cache=False)
    assert calls == ["profile", "record"] * 2
    assert _without_timings(again.plan) == _without_timings(cold.plan)
    assert again.plan.segments, "the budget should need checkpointing"
    assert again.plan.minimum_peak_bytes == planner.minimum_peak_bytes
    assert_same_step(train_step(model, inputs), train_step(again, inputs))


def test_a_changed_model_inputs_or_options_never_reuse_a_stale_profile(monkeypatch):
    """Every change the profile or the recorded step depends on misses the cache."""
    autockpt.clear_cache()
    calls = _spy_on_profiling(monkeypatch)
    model, x = _mlp(), torch.randn(8, 32)

    def plan(model=model, x=x, **kwargs):
        quiet_planner(model, x, **kwargs)
        return calls.count("profile")

    def mse(out, target):
        return (out - target).square().mean()

    assert plan() == 1
    assert plan() == 1  # the same model, inputs and options: reused
    assert plan(x=torch.randn(8, 32)) == 1  # other values, same shapes: reused
    assert plan(x=torch.randn(16, 32)) == 2  # input shape
    assert plan(x=torch.randn(8, 64)[:, :32]) == 3  # a view of a larger storage
    assert plan(optimizer=torch.optim.AdamW(model.parameters())) == 4
    assert plan(optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)) == 5
    assert plan(accumulation_steps=2) == 6
    assert plan(loss_fn=lambda out: out.square().mean()) == 7
    assert plan(loss_fn=functools.partial(mse, target=torch.zeros(8, 32))) == 8
    assert plan(loss_fn=functools.partial(mse, target=torch.ones(8, 32))) == 8  # same shapes
    assert plan(loss_fn=functools.partial(mse, target=torch.ones(1, 32))) == 9
    assert plan(leaf_modules=["2"]) == 10
    model[1].inplace = True  # a module's setting its repr shows
    assert plan() == 11
    model[0].weight.requires_grad_(False)
    assert plan() == 12
    model[0].weight.requires_grad_(True)
    model[2].eval()  # a submodule's training flag
    assert plan() == 13
    model[2].train()
    model[4].weight = torch.nn.Parameter(model[2].weight)  # tied parameters
    assert plan() == 14
    assert plan(model=_mlp()) == 15  # another model object, even an identical one
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert plan() == 16
    assert plan(probe=False) == 17 and plan(probe=False) == 18  # shapes alone: not kept
    assert plan(cache=False) == 19


def test_a_budget_below_the_static_part_is_refused_before_profiling(monkeypatch):
    """12 MiB of parameters against a budget 1 MiB above them: refused right after capture
    (below parameters, gradients and AdamW's state), with where the memory goes, and the
    profile never ran."""
    calls = _spy_on_profiling(monkeypatch)
    model, x = _mlp(width=512, depth=12), torch.randn(8, 512)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert params > 12 * 2**20
    optimizer = torch.optim.AdamW(model.parameters())
    started = time.perf_counter()
    budget = params + x.nbytes + 2**20
    with pytest.raises(autockpt.InfeasibleBudgetError, match="before profiling") as refused:
        autockpt.optimize(model, x, budget_gb=budget / GIB, optimizer=optimizer)
    assert time.perf_counter() - started < 10
    assert calls == []
    error = refused.value
    assert error.lower_bound and error.budget_bytes == budget
    assert error.breakdown["parameters"] == error.breakdown["gradients"] == params
    assert error.breakdown["optimizer state"] >= 2 * params  # AdamW's two moments
    # a floor, named so and said as "at least"; no minimum (it needs the profile)
    assert error.floor_bytes == sum(error.breakdown.values()) > params
    assert error.floor_gb == error.floor_bytes / GIB
    assert error.minimum_bytes is None and error.minimum_gb is None
    assert f"at least {gib_up(error.floor_bytes)} GiB" in str(error)
    assert "minimum_peak_bytes" in str(error) and "autockpt frontier" in str(error)
    assert not optimizer.state  # the user's optimizer was never stepped


def test_a_budget_below_the_parameters_is_refused_before_capture(monkeypatch):
    """Below the parameters, buffers and inputs alone (an 8B model for one small GPU), the
    refusal comes before capture, which on a large export graph takes minutes; its floor is
    those three, said as "at least"."""

    def no_capture(*args, **kwargs):
        raise AssertionError("captured a model that cannot fit")

    monkeypatch.setattr("autockpt.planning.routes.capture", no_capture)
    model, x = _mlp(width=512, depth=12), torch.randn(8, 512)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    with pytest.raises(autockpt.InfeasibleBudgetError, match="at least") as refused:
        autockpt.optimize(model, x, budget_gb=1 / 1024)
    error = refused.value
    assert error.breakdown == {"parameters": params, "buffers": 0, "inputs": x.nbytes}
    assert error.floor_bytes == params + x.nbytes and error.minimum_bytes is None


def test_planning_reports_its_phases_through_logging_and_progress(caplog):
    autockpt.clear_cache()
    logger = logging.getLogger("autockpt")
    assert all(isinstance(h, logging.NullHandler) for h in logger.handlers)
    caplog.set_level(logging.INFO, logger="autockpt")
    model, x = _mlp(), torch.randn(8, 32)
    told: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        autockpt.optimize(model, x, budget_gb=1.0, progress=told.append)
    logged = [r.getMessage() for r in caplog.records if r.name == "autockpt"]
    for phase in ("capture", "profile", "record", "search", "verify"):
        assert any(m.startswith(f"{phase}: done in ") and m.endswith(" s") for m in logged), phase
    assert any(t.startswith("profiling") for t in told) and "measuring the plan" in told
    caplog.clear()
    planner = quiet_planner(model, x)  # the cache's: nothing profiled, and it says so
    logged = [r.getMessage() for r in caplog.records if r.name == "autockpt"]
    assert any("reused" in m for m in logged)
    assert not any(m.startswith("profile: done") for m in logged)
    later: list[str] = []
    planner.progress = later.append  # set between phases, as the CLI does
    planner.optimize(budget_gb=1.0)
    assert later == ["solving", "measuring the plan"]
