"""Every minimum autockpt states is a budget that succeeds (the issue "The budget contract",
items 1 and 10): ``Planner.minimum_peak_bytes``, the ``minimum_gb`` of every
``InfeasibleBudgetError`` (the front door's, the measure-and-tighten loop's), to the byte and
through the GiB the message prints; a budget refused before profiling states a floor under
its own name and no minimum. The units route's and ``fit_batch``'s minimums are planned at in
tests/test_nested.py and tests/test_fit.py."""

from __future__ import annotations

import dataclasses
import functools
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autockpt
from autockpt.errors import GIB, InfeasibleBudgetError, gib_up
from autockpt.planning.request import budget_in_bytes
from autockpt.planning.routes.captured import CapturedRoute
from autockpt_zoo.toy import ZOO, block_stack
from tests.conftest import budget_between, quiet_planner


def _stack() -> tuple[torch.nn.Module, torch.Tensor]:
    """Six blocks whose activations (256 rows) checkpointing can trade: a range to plan in."""
    model, _ = block_stack(blocks=6, width=64, batch=1)
    torch.manual_seed(0)
    return model, torch.randn(256, 64, requires_grad=True)


def _printed_gib(error: InfeasibleBudgetError) -> float:
    return float(re.search(r"minimum feasible ([0-9.]+) GiB", str(error)).group(1))


def test_a_budget_refused_before_profiling_states_a_floor_not_a_minimum():
    model, x = _stack()
    optimizer = torch.optim.AdamW(model.parameters())
    # above the parameters and inputs (below them the refusal comes before capture), below
    # what the step keeps with the gradients and AdamW's state
    static = sum(p.numel() * p.element_size() for p in model.parameters()) + x.nbytes
    with pytest.raises(InfeasibleBudgetError, match="before profiling") as refused:
        autockpt.optimize(model, x, budget_gb=(static + 2**12) / GIB, optimizer=optimizer)
    error = refused.value
    assert error.minimum_bytes is None and error.minimum_gb is None
    assert error.lower_bound and error.floor_bytes == sum(error.breakdown.values())
    assert error.floor_gb == error.floor_bytes / GIB
    message = str(error)
    assert f"at least {gib_up(error.floor_bytes)} GiB ({error.floor_bytes} bytes)" in message
    assert "Planner(model, inputs).minimum_peak_bytes" in message
    assert "autockpt frontier" in message
    # the way to the minimum the message names, taken: the minimum it gives succeeds
    planner = quiet_planner(model, x, optimizer=optimizer)
    assert planner.minimum_peak_bytes > error.floor_bytes
    fast = autockpt.optimize(
        model, x, budget_gb=planner.minimum_peak_bytes / GIB, optimizer=optimizer
    )
    assert fast.plan.measured_peak_bytes <= fast.plan.budget_bytes == planner.minimum_peak_bytes
    assert not optimizer.state


def test_the_front_doors_minimum_succeeds():
    """``autockpt.optimize`` below the minimum (above the floor): the error's ``minimum_gb``,
    and the GiB its message prints, succeed."""
    model, x = _stack()
    least = quiet_planner(model, x).minimum_peak_bytes
    with pytest.raises(InfeasibleBudgetError) as refused:
        autockpt.optimize(model, x, budget_gb=(least - 1) / GIB)
    error = refused.value
    assert not error.lower_bound and error.floor_bytes is None
    assert error.minimum_bytes == least and error.minimum_gb == least / GIB
    assert budget_in_bytes(_printed_gib(error)) >= least  # the printed GiB rounds up
    fast = autockpt.optimize(model, x, budget_gb=error.minimum_gb)
    assert fast.plan.budget_bytes == least
    assert fast.plan.measured_peak_bytes <= least


@pytest.mark.parametrize("name", ["block_stack", "untraceable_submodule", "gpt_checkpointed"])
def test_every_zoo_minimum_is_a_budget_that_succeeds(name):
    """The property over zoo models: ``minimum_peak_bytes / 2**30`` as ``budget_gb`` is the
    same byte count, and succeeds measured; a byte less is refused stating exactly it."""
    model, inputs = ZOO[name]()
    planner = quiet_planner(model, inputs)
    least = planner.minimum_peak_bytes
    assert budget_in_bytes(least / 2**30) == least
    with pytest.raises(InfeasibleBudgetError) as refused:
        planner.optimize(budget_gb=(least - 1) / GIB)  # refused by the search, no step run
    assert refused.value.minimum_bytes == least
    assert budget_in_bytes(_printed_gib(refused.value)) >= least
    fast = planner.optimize(budget_gb=refused.value.minimum_gb)
    assert fast.plan.budget_bytes == least
    assert fast.plan.measured_peak_bytes is not None
    assert planner.budgeted_bytes(autockpt.measure(fast, inputs, repeat=0)) <= least


def test_a_measured_excess_at_the_leanest_plan_is_in_the_stated_minimum(monkeypatch):
    """The report's pattern (a ViT 32 B short, a U-Net under 1 KB short): measured steps
    exceed their predictions by amounts that differ by plan, the leanest plan's most. The
    loop once stated the budget plus a byte (from another plan's excess), which then failed;
    it now measures the leanest plan and states its measured peak, which succeeds, and so
    does ``minimum_peak_bytes`` from then on."""
    model, x = _stack()
    planner = quiet_planner(model, x, cache=False)
    least, budget = planner.minimum_peak_bytes, budget_between(planner, 0.5)
    leanest = planner.search.leanest()
    assert budget > least and leanest.segments
    other_excess, leanest_excess = budget - least + 1, budget - least + 100
    planned: list = []
    plan_of, measure = CapturedRoute.plan_of, CapturedRoute.measure

    def recording_plan_of(self, solution, budget_bytes):
        planned.append(solution)
        return plan_of(self, solution, budget_bytes)

    def measured_over(self, result, timed=False):
        solution = planned[-1]
        is_leanest = [tuple(s) for s in solution.segments] == [
            tuple(s) for s in leanest.segments
        ] and solution.kept == leanest.kept
        over = leanest_excess if is_leanest else other_excess
        real = measure(self, result, timed=timed)
        return dataclasses.replace(real, peak_bytes=solution.peak_bytes + over)

    monkeypatch.setattr(CapturedRoute, "plan_of", recording_plan_of)
    monkeypatch.setattr(CapturedRoute, "measure", measured_over)
    with pytest.raises(InfeasibleBudgetError) as refused:
        planner.optimize(budget_gb=budget / GIB)
    error = refused.value
    assert error.minimum_bytes == least + leanest_excess == planner.route.leanest_measured_bytes
    assert "measured" in str(error)
    assert planner.minimum_peak_bytes == error.minimum_bytes  # the stated minimum from now on
    fast = planner.optimize(budget_gb=error.minimum_gb)
    assert fast.plan.budget_bytes == error.minimum_bytes
    assert fast.plan.measured_peak_bytes <= error.minimum_bytes
    # below it, refused at once with the same minimum (the leanest step is not run again)
    runs = len(planned)
    with pytest.raises(InfeasibleBudgetError) as again:
        planner.optimize(budget_gb=(error.minimum_bytes - 1) / GIB)
    assert again.value.minimum_bytes == error.minimum_bytes and len(planned) == runs
    # without verifying, the prediction's minimum still plans (what the replay promises)
    unverified = planner.optimize(budget_gb=least / GIB, verify=False)
    assert unverified.plan.predicted_peak_bytes <= least


def test_a_later_planner_states_the_measured_minimum_not_the_prediction(monkeypatch):
    """The planning cache keeps the leanest plan's measured peak: a second planner of the
    same model (a second ``optimize``) states it from the start, and refuses a budget
    below it without running a step, instead of restating the smaller prediction."""
    model, x = _stack()
    autockpt.clear_cache()
    first = quiet_planner(model, x)
    least = first.minimum_peak_bytes
    leanest = first.search.leanest()
    excess = 100
    measure = CapturedRoute.measure

    def leanest_over(self, result, timed=False):
        real = measure(self, result, timed=timed)
        return dataclasses.replace(real, peak_bytes=least + excess)  # every plan: the leanest's

    monkeypatch.setattr(CapturedRoute, "measure", leanest_over)
    monkeypatch.setattr(
        CapturedRoute, "solve", lambda self, budget, how: self.search.leanest()
    )  # every round plans the leanest plan
    with pytest.raises(InfeasibleBudgetError) as refused:
        first.optimize(budget_gb=least / GIB)
    assert refused.value.minimum_bytes == least + excess == first.minimum_peak_bytes
    steps: list = []
    monkeypatch.setattr(
        CapturedRoute, "measure", lambda self, result, timed=False: steps.append(result)
    )
    second = quiet_planner(model, x)
    assert second.search.leanest().segments == leanest.segments
    assert second.minimum_peak_bytes == least + excess
    assert second.breakdown["leanest plan's peak"] == least + excess
    with pytest.raises(InfeasibleBudgetError) as again:
        second.optimize(budget_gb=least / GIB)
    assert again.value.minimum_bytes == least + excess and not steps
    autockpt.clear_cache()


# -- a torchtitan-shaped Llama (written here: fused QKV, complex RoPE from a buffer, SwiGLU,
# RMSNorm, layers in a ModuleDict, a summed cross-entropy over float logits) ----------------


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, self.heads, self.head_dim) for t in self.wqkv(x).chunk(3, -1))
        q, k = _rotate(q, cis), _rotate(k, cis)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


def _rotate(x: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    cis = cis[: x.shape[1]].view(1, x.shape[1], 1, pairs.shape[-1])
    return torch.view_as_real(pairs * cis).flatten(3).type_as(x)


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.attention, self.attention_norm = _Attention(dim, heads), nn.RMSNorm(dim)
        self.ffn_norm = nn.RMSNorm(dim)
        self.w1, self.w2 = nn.Linear(dim, hidden, bias=False), nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cis)
        y = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(y)) * self.w3(y))


class _Llama(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): _Block(dim, heads, hidden) for i in range(layers)})
        self.norm, self.output = nn.RMSNorm(dim), nn.Linear(dim, vocab, bias=False)
        half = dim // heads // 2
        freqs = 1.0 / 500000.0 ** (torch.arange(half).float() / half)
        angles = torch.outer(torch.arange(1024).float(), freqs)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles), False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


def _cross_entropy(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum")


def test_a_torchtitan_shaped_llamas_leanest_plan_is_pinned():
    """The leanest plan of a torchtitan-style Llama 3 with its cross-entropy loss: no worse
    than checkpointing every block by hand, the range's low end below the step without
    checkpoints, and its minimum, asked for, succeeds measured."""
    torch.manual_seed(0)
    model = _Llama(vocab=512, dim=64, layers=3, heads=4, hidden=192)
    tokens, labels = torch.randint(0, 512, (2, 64)), torch.randint(0, 512, (2, 64))
    loss = functools.partial(_cross_entropy, labels=labels)
    planner = quiet_planner(model, tokens, loss_fn=loss, cache=False)
    least = planner.minimum_peak_bytes
    assert planner.per_block_segments
    assert least <= planner.predict(planner.per_block_segments)
    assert least < planner.no_checkpoint_peak_bytes
    fast = planner.optimize(budget_gb=least / GIB)
    assert fast.plan.measured_peak_bytes <= planner.minimum_peak_bytes
