"""The kept export capture (NOTE [cache: captured graph], autockpt/planning/cache.py): a second
plan of the same model reuses it, a refused budget leaves it for the next one, and whatever a
forward branches on (an attribute, its configuration, its ``forward``) captures again."""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch
from torch import nn

import autockpt
from autockpt.errors import GIB
from autockpt.planning import routes
from autockpt.planning.cache import MAX_CAPTURES, MAX_ENTRIES, cache_size, captures_kept
from tests.conftest import assert_same_step, budget_between, quiet_planner, train_step


class Config:
    """A configuration object as transformers' are: read by the forward, described by
    ``to_dict()``."""

    def __init__(self, act: str = "tanh") -> None:
        self.act = act

    def to_dict(self) -> dict:
        return {"act": self.act}


class Branchy(nn.Module):
    """A root that branches on a shape (fx cannot trace it, so capture takes torch.export,
    which bakes ``scale`` and the configuration's activation into its graph)."""

    def __init__(self, depth: int = 4, width: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.scale = 0.5
        self.config = Config()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 1:
            x = x * self.scale
        act = torch.tanh if self.config.act == "tanh" else torch.sigmoid
        for layer in self.layers:
            x = act(layer(x))
        return x


@pytest.fixture
def captures(monkeypatch) -> list[str]:
    """Count the captures planning makes."""
    autockpt.clear_cache()
    made: list[str] = []
    real = routes.capture

    def counted(*args, **kwargs):
        captured = real(*args, **kwargs)
        made.append(captured.method)
        return captured

    monkeypatch.setattr(routes, "capture", counted)
    yield made
    autockpt.clear_cache()


def _optimize(model: nn.Module, x: torch.Tensor, budget_gb: float, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autockpt.optimize(model, x, budget_gb=budget_gb, **kwargs)


def test_a_second_plan_reuses_the_export_capture_and_plans_the_same(captures):
    model, x = Branchy(), torch.randn(8, 32)
    planner = quiet_planner(model, x)
    assert captures == ["export"]
    budget = budget_between(planner, 0.5) / GIB
    again = _optimize(model, x, budget)
    assert captures == ["export"], "the second plan captured again"
    cold = _optimize(model, x, budget, cache=False)
    assert captures == ["export"] * 2
    assert again.plan.segments == cold.plan.segments and again.plan.segments
    assert again.plan.predicted_peak_bytes == cold.plan.predicted_peak_bytes
    assert_same_step(train_step(model, x), train_step(again, x))


def test_a_refused_budget_leaves_the_capture_for_the_next_budget(captures):
    """Refused below the floor right after capture (parameters and their gradients), then
    below the minimum after profiling, then planned at the minimum: one capture."""
    model, x = Branchy(), torch.randn(8, 32)
    minimum = quiet_planner(model, x).minimum_peak_bytes
    autockpt.clear_cache()
    captures.clear()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    with pytest.raises(autockpt.InfeasibleBudgetError) as below_floor:
        _optimize(model, x, (params + x.nbytes + params // 2) / GIB)
    assert below_floor.value.lower_bound and captures == ["export"]
    with pytest.raises(autockpt.InfeasibleBudgetError) as below_minimum:
        _optimize(model, x, (minimum - 1) / GIB)
    assert below_minimum.value.minimum_bytes == minimum
    fitted = _optimize(model, x, minimum / GIB)
    assert captures == ["export"], "a budget after a refusal captured again"
    assert fitted.plan.predicted_peak_bytes <= minimum


@pytest.mark.parametrize("change", ["attribute", "configuration", "forward", "shape"])
def test_what_the_forward_branches_on_captures_again_and_trains_like_eager(captures, change):
    """A kept graph would run the old code: each change captures again, and the plan's
    model computes what the changed model computes."""
    model, x = Branchy(), torch.randn(8, 32)
    quiet_planner(model, x)
    if change == "attribute":
        model.scale = 0.25
    elif change == "configuration":
        model.config.act = "sigmoid"
    elif change == "forward":
        model.layers[0].forward = lambda inp, _l=model.layers[0]: nn.functional.linear(
            inp, _l.weight
        )
    else:  # a batch of 1 takes the other branch: outside the graph's dynamic range
        x = torch.randn(1, 32)
    fitted = _optimize(model, x, 1.0)
    assert captures == ["export"] * 2
    assert_same_step(train_step(model, x), train_step(fitted, x))


def test_another_batch_the_graph_takes_reuses_the_capture_and_plans_the_same(captures):
    """NOTE [cache: captured graph]: export kept the batch dynamic, so a plan for another
    batch size reuses the graph (what fit_batch's sizes do), plans what an uncached call
    plans at that size, and trains like eager."""
    model = Branchy()
    quiet_planner(model, torch.randn(8, 32))
    x = torch.randn(6, 32)
    planner = quiet_planner(model, x)
    assert captures == ["export"], "a size the graph takes was captured again"
    budget = budget_between(planner, 0.5) / GIB
    reused = _optimize(model, x, budget)
    cold = _optimize(model, x, budget, cache=False)
    assert captures == ["export"] * 2
    assert reused.plan.segments == cold.plan.segments and reused.plan.segments
    assert reused.plan.predicted_peak_bytes == cold.plan.predicted_peak_bytes
    assert_same_step(train_step(model, x), train_step(reused, x))


def test_both_stores_are_bounded_and_keep_no_model_alive(captures):
    """The preparations and the captures (one store each, autockpt/planning/cache.py)."""
    models = [Branchy() for _ in range(max(MAX_ENTRIES, MAX_CAPTURES) + 1)]
    for model in models:
        quiet_planner(model, torch.randn(4, 32))
    assert cache_size() == MAX_ENTRIES and captures_kept() == MAX_CAPTURES
    last = weakref.ref(models[-1])
    del models, model
    gc.collect()
    assert last() is None and cache_size() == 0 and captures_kept() == 0


def test_fx_captures_are_not_kept(captures):
    model, x = nn.Sequential(nn.Linear(8, 8), nn.Tanh()), torch.randn(4, 8)
    quiet_planner(model, x)
    quiet_planner(model, x)
    assert captures == ["fx", "fx"] and captures_kept() == 0
