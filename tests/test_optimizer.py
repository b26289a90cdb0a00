"""The optimizer in the budget (autockpt/base/optimizer.py, NOTE [record: optimizer step]):
the whole training iteration from steady state, predicted within 1% of what the allocator
counts and measured within the budget, for AdamW, SGD with momentum and an optimizer with a
state of its own; gradient accumulation; the user's optimizer as found."""

from __future__ import annotations

import copy
import json

import jsonschema
import pytest
import torch

import autockpt
from autockpt.errors import GIB, OptimizerError, PlanMismatchError
from autockpt.plan import Plan
from autockpt.planning.sharding import Sharding, rank_problem
from autockpt_zoo.toy import ZOO, gpt
from solvers import ChainProblem
from tests.conftest import budget_between, quiet_planner

SCHEMA = json.loads(open("docs/plan.schema.json").read())


class Shadowed(torch.optim.Optimizer):
    """Not a torch.optim class: keeps a shadow copy of every parameter and an update that
    allocates, stepped the way a user's own optimizer would be."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["shadow"] = p.detach().clone()
                    state["calls"] = 0
                update = p.grad * group["lr"] + 0.01 * (p - state["shadow"])
                p.sub_(update)
                state["shadow"].lerp_(p, 0.1)
                state["calls"] += 1


OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, foreach=True),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9),
    "own-state": Shadowed,
}


def _snapshot(optimizer: torch.optim.Optimizer) -> tuple:
    state = {
        id(p): {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()}
        for p, s in optimizer.state.items()
    }
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return state, groups, [[id(p) for p in g["params"]] for g in optimizer.param_groups]


def _same(a: tuple, b: tuple) -> bool:
    state_a, groups_a, ids_a = a
    state_b, groups_b, ids_b = b
    if groups_a != groups_b or ids_a != ids_b or state_a.keys() != state_b.keys():
        return False
    for key, entries in state_a.items():
        for name, value in entries.items():
            other = state_b[key][name]
            if torch.is_tensor(value) and not torch.equal(value, other):
                return False
            if not torch.is_tensor(value) and value != other:
                return False
    return True


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_whole_iteration_predicted_within_one_percent_and_measured_within_budget(name):
    model, inputs = gpt()
    optimizer = OPTIMIZERS[name](model.parameters())
    parameters = [p.detach().clone() for p in model.parameters()]
    planner = quiet_planner(model, inputs, optimizer=optimizer)
    without = quiet_planner(model, inputs)
    # the optimizer's state is resident: every plan's prediction grows by at least it
    assert planner.minimum_peak_bytes > without.minimum_peak_bytes
    for fraction in (0.0, 0.5):
        budget = budget_between(planner, fraction)
        fast = planner.optimize(budget_gb=budget / GIB)
        measured = autockpt.measure(fast, inputs, optimizer=optimizer, repeat=0).peak_bytes
        predicted = fast.plan.predicted_peak_bytes
        assert measured <= fast.plan.budget_bytes
        assert abs(predicted - measured) <= 0.01 * measured, (name, fraction)
        assert fast.plan.measured_peak_bytes == measured
        assert fast.plan.optimizer.name == type(optimizer).__name__
        assert fast.plan.optimizer.state_bytes > 0
    # planning and measuring stepped stand-ins only: the user's optimizer never ran
    assert len(optimizer.state) == 0
    assert all(torch.equal(a, b) for a, b in zip(parameters, model.parameters(), strict=True))


def test_an_optimizer_with_state_is_left_as_found():
    model, inputs = gpt()
    optimizer = torch.optim.AdamW(model.parameters())
    autockpt.base.runtime.default_loss(model(*inputs)).backward()
    optimizer.step()  # the loop has run: state and step counts exist
    optimizer.zero_grad()
    before = _snapshot(optimizer)
    parameters = [p.detach().clone() for p in model.parameters()]
    planner = quiet_planner(model, inputs, optimizer=optimizer)
    planner.optimize(budget_gb=budget_between(planner, 0.3) / GIB)
    assert _same(before, _snapshot(optimizer))
    assert all(torch.equal(a, b) for a, b in zip(parameters, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters())


def test_accumulating_four_micro_batches_keeps_gradients_resident():
    model, inputs = gpt()
    optimizer = torch.optim.AdamW(model.parameters())
    once = quiet_planner(model, inputs, optimizer=optimizer)
    four = quiet_planner(model, inputs, optimizer=optimizer, accumulation_steps=4)
    gradients = four.profile.param_grad_bytes
    assert dict(four.trace.resident)["accumulated gradients"] == gradients
    assert four.no_checkpoint_peak_bytes > once.no_checkpoint_peak_bytes
    fast = four.optimize(budget_gb=budget_between(four, 0.3) / GIB)
    measured = autockpt.measure(
        fast, inputs, optimizer=optimizer, accumulation_steps=4, repeat=0
    ).peak_bytes
    assert measured <= fast.plan.budget_bytes
    assert abs(fast.plan.predicted_peak_bytes - measured) <= 0.01 * measured
    assert fast.plan.accumulation_steps == 4


def test_training_with_the_plan_equals_eager_over_steps():
    model, inputs = ZOO["resnet"]()
    eager = copy.deepcopy(model)
    opt_eager = torch.optim.AdamW(eager.parameters())
    optimizer = torch.optim.AdamW(model.parameters())
    planner = quiet_planner(model, inputs, optimizer=optimizer)
    fast = planner.optimize(budget_gb=budget_between(planner, 0.2) / GIB)
    loss = autockpt.base.runtime.default_loss
    for _ in range(3):
        for net, opt in ((eager, opt_eager), (fast, optimizer)):
            opt.zero_grad()
            loss(net(inputs)).backward()
            opt.step()
    for a, b in zip(eager.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_plan_records_the_optimizer_and_round_trips():
    model, inputs = gpt()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    planner = quiet_planner(model, inputs, optimizer=optimizer, accumulation_steps=2)
    plan = planner.optimize(budget_gb=budget_between(planner, 0.5) / GIB).plan
    assert Plan.from_json(plan.to_json()) == plan
    jsonschema.validate(json.loads(plan.to_json()), SCHEMA)
    assert plan.optimizer.state_bytes == planner.profile.param_grad_bytes  # one momentum each
    assert plan.accumulation_steps == 2
    assert "SGD" in plan.summary() and "2 micro-batches" in plan.summary()
    old = json.loads(plan.to_json())
    del old["optimizer"], old["accumulation_steps"]
    assert Plan.from_dict(old).optimizer is None  # plans written before: optimizer outside
    again = autockpt.apply(model, plan, inputs, optimizer=optimizer)
    assert again.plan == plan
    with pytest.raises(PlanMismatchError, match="covers a SGD"):
        autockpt.apply(model, plan, inputs, optimizer=torch.optim.AdamW(model.parameters()))


def test_bad_optimizers_are_refused_before_any_work(monkeypatch):
    monkeypatch.setattr("autockpt.planning.routes.capture", lambda *a, **k: pytest.fail("captured"))
    model, inputs = gpt()
    other, _ = gpt(seed=1)
    with pytest.raises(OptimizerError, match="not parameters of this GPT"):
        autockpt.optimize(
            model, inputs, budget_gb=1.0, optimizer=torch.optim.SGD(other.parameters(), lr=1)
        )
    with pytest.raises(OptimizerError, match='scope="activations"'):
        autockpt.optimize(
            model,
            inputs,
            budget_gb=1.0,
            scope="activations",
            optimizer=torch.optim.AdamW(model.parameters()),
        )
    with pytest.raises(OptimizerError, match="torch.optim.Optimizer"):
        autockpt.optimize(model, inputs, budget_gb=1.0, optimizer=object())
    with pytest.raises(ValueError, match="accumulation_steps"):
        autockpt.optimize(model, inputs, budget_gb=1.0, accumulation_steps=0)


def test_an_optimizer_that_needs_a_closure_is_refused():
    model, inputs = gpt()
    with pytest.raises(OptimizerError, match="closure"):
        quiet_planner(model, inputs, optimizer=torch.optim.LBFGS(model.parameters()))


def test_a_subset_of_the_parameters_is_planned_for_what_it_holds():
    model, inputs = gpt()
    head = [p for name, p in model.named_parameters() if name.startswith("h.0.")]
    optimizer = torch.optim.AdamW(head)
    planner = quiet_planner(model, inputs, optimizer=optimizer)
    assert dict(planner.trace.resident)["optimizer state"] == 2 * sum(p.nbytes for p in head) + (
        4 * len(head)  # AdamW's step counts: one float each
    )


def test_fsdp_ranks_keep_a_shard_of_the_optimizer_state():
    problem = ChainProblem(
        saved_bytes=[100, 100],
        input_bytes=[0, 10],
        forward_seconds=[1.0, 1.0],
        budget_bytes=10**6,
        static_bytes=1000 + 4000,
        param_grad_bytes=(500, 500),
    )
    model, _ = gpt()
    kwargs = dict(parameters=1000, gradients=1000, buffers=0, inputs=0, optimizer_state=4000)
    ddp_shift, ddp_memory = rank_problem(
        problem, ((0, 1), (1, 2)), None, model, Sharding(2, "ddp"), **kwargs
    )
    ddp = ddp_shift.rank
    assert ddp_memory.optimizer_state == 4000
    assert ddp.static_bytes - problem.static_bytes == 1000 + 65536  # buckets + margin
    units = ("h.0", "h.1")
    _, fsdp_memory = rank_problem(
        problem, ((0, 1), (1, 2)), _FakeCapture(), model, Sharding(2, "fsdp", units), **kwargs
    )
    assert fsdp_memory.optimizer_state == 2000
    assert fsdp_memory.static == fsdp_memory.parameters + 2000


class _FakeCapture:
    def compute_nodes(self) -> list:
        return []
