"""Planning inside a submodule: a root whose own forward checks its inputs by value (neither
fx nor export can capture it) is planned inside its body; the root's code runs eagerly."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autockpt
from autockpt import InfeasibleBudgetError, Plan, PlanMismatchError, TraceError
from autockpt.api import Planner
from autockpt.errors import GIB
from tests.conftest import TINY_SPEECH, assert_same_step, train_step

VOCAB = 10


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(torch.relu(self.fc1(self.norm(x)))))


class Body(nn.Module):
    """A plain stack of blocks (with dropout and batch-norm statistics): capturable."""

    def __init__(self, dim: int, depth: int) -> None:
        super().__init__()
        self.embed = nn.Linear(8, dim)
        self.bn = nn.BatchNorm1d(dim)
        self.layers = nn.ModuleList(Block(dim) for _ in range(depth))

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        h = self.bn((self.embed(x) * scale).transpose(1, 2)).transpose(1, 2)
        for layer in self.layers:
            h = layer(h)
        return h


class Checked(nn.Module):
    """Like Wav2Vec2ForCTC: an input check by value, then body, head and loss. The root's
    own code also scales the input by a parameter (the body's input needs a gradient) and
    counts steps in a buffer."""

    def __init__(self, dim: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.input_scale = nn.Parameter(torch.ones(8))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.body = Body(dim, depth)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        if labels is not None and labels.max() >= VOCAB:
            raise ValueError("labels must be below the vocabulary size")
        self.steps += 1
        logits = self.head(self.drop(self.body(x * self.input_scale, scale=2.0)))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return {"loss": loss, "logits": logits}


def _case() -> tuple[Checked, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = Checked().train()
    inputs = {"x": torch.randn(4, 32, 8), "labels": torch.randint(0, VOCAB, (4, 32))}
    return model, inputs


@pytest.fixture(scope="module")
def found():
    """The user's model and inputs, and what the model was before planning."""
    model, inputs = _case()
    state = {name: t.clone() for name, t in model.state_dict().items()}
    return model, inputs, dict(model._modules), state, torch.get_rng_state()


@pytest.fixture(scope="module")
def planned(found):
    model, inputs = found[:2]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        planner = Planner(model, inputs)
        # a budget the unmodified step does not fit
        budget = (planner.minimum_peak_bytes + planner.no_checkpoint_peak_bytes) // 2
        fast = planner.optimize(budget_gb=budget / GIB)
    return model, inputs, planner, fast


def test_the_users_model_is_untouched(found, planned):
    # first: later tests train the result, which moves the shared buffers
    model, _, children, state, rng = found
    fast = planned[3]
    assert torch.equal(torch.get_rng_state(), rng)
    assert list(model._modules) == list(children)
    assert all(model._modules[k] is v for k, v in children.items())
    assert type(model.body) is Body and fast.body is not model.body
    assert fast.head is model.head and fast.body.layers is model.body.layers
    for name, value in model.state_dict().items():
        assert torch.equal(value, state[name]), name
    assert all(p.grad is None for p in model.parameters())


def test_plans_inside_the_body_and_trains_like_eager(planned):
    model, inputs, planner, fast = planned
    plan = fast.plan
    assert planner.nested is not None and planner.nested.path == "body"
    error = planner.nested.error  # what fx and export said about the root's own code
    assert error.module == "" and error.in_root_code and "labels.max()" in error.source_line
    assert isinstance(fast, Checked) and plan.submodule == "body"
    assert plan.model == "Checked" and plan.segments
    assert plan.no_checkpoint_peak_bytes > plan.budget_bytes >= plan.predicted_peak_bytes
    assert any("data-dependent control flow" in note and "'body'" in note for note in plan.notes)
    assert list(fast.state_dict()) == list(model.state_dict())
    assert [id(p) for p in fast.parameters()] == [id(p) for p in model.parameters()]
    for seed in (0, 1, 2):
        expected = train_step(copy.deepcopy(model), inputs, seed=seed)
        got = train_step(fast, inputs, seed=seed)
        assert_same_step(expected, got)
    measured = autockpt.measure(fast, inputs, repeat=0, warmup=0)
    assert measured.peak_bytes <= plan.budget_bytes
    assert plan.measured_peak_bytes is not None and plan.measured_peak_bytes <= plan.budget_bytes
    # outside training mode the body runs its own forward
    fast.eval(), model.eval()
    with torch.no_grad():
        torch.testing.assert_close(fast(**inputs)["logits"], model(**inputs)["logits"])
    fast.train(), model.train()


def test_plan_round_trips_and_apply_reproduces_it(planned):
    model, inputs, _, fast = planned
    plan = Plan.from_json(fast.plan.to_json())
    assert plan == fast.plan
    again = autockpt.apply(model, plan, inputs)
    assert isinstance(again, Checked) and again.plan == plan
    assert [s.first_node for s in again.body.plan.segments] == [s.first_node for s in plan.segments]
    assert_same_step(train_step(copy.deepcopy(model), inputs), train_step(again, inputs))
    with pytest.raises(PlanMismatchError, match="example_inputs"):
        autockpt.apply(model, plan)
    with pytest.raises(PlanMismatchError, match="inputs"):
        autockpt.apply(model, plan, {"x": torch.randn(2, 32, 8), "labels": inputs["labels"][:2]})


def test_segments_name_their_modules_from_the_root(planned):
    model, plan = planned[0], planned[3].plan
    modules = {name for name, _ in model.named_modules()}
    for seg in plan.segments:  # node names are the body's graph's; module paths the model's
        for module in (seg.first_module, seg.last_module):
            assert module in modules and (module == "body" or module.startswith("body."))


def test_plans_written_before_the_field_still_load(planned):
    data = json.loads(planned[3].plan.to_json())
    data.pop("submodule")
    assert Plan.from_dict(data).submodule is None
    data["submodule"] = 3
    with pytest.raises(autockpt.PlanFormatError, match="submodule"):
        Plan.from_dict(data)


def test_budget_below_the_minimum_states_an_achievable_one(planned):
    model, inputs, planner, _ = planned
    with pytest.raises(InfeasibleBudgetError) as caught:
        planner.optimize(budget_gb=(planner.minimum_peak_bytes - 1) / GIB)
    assert caught.value.minimum_bytes >= planner.minimum_peak_bytes
    assert "body" in str(caught.value)
    fits = planner.optimize(budget_gb=caught.value.minimum_bytes / GIB)
    assert autockpt.measure(fits, inputs, repeat=0, warmup=0).peak_bytes <= fits.plan.budget_bytes


def test_per_plan_queries_name_the_submodule(planned):
    planner = planned[2]
    with pytest.raises(AttributeError, match="inside submodule 'body'"):
        planner.solve(planner.minimum_peak_bytes)


def test_no_capturable_submodule_raises_the_root_error():
    class Flat(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(8, 8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.sum() > 0:
                return x @ self.weight
            return x

    with pytest.raises(TraceError, match="x.sum"):
        autockpt.optimize(Flat(), torch.randn(2, 8), budget_gb=1.0)


@pytest.mark.slow
@pytest.mark.parametrize("name, body", [("Wav2Vec2", "wav2vec2"), ("Hubert", "hubert")])
def test_ctc_models_are_planned_inside_their_body(name, body):
    transformers = pytest.importorskip("transformers")
    from autockpt_zoo.hf import quiet_transformers

    with quiet_transformers():
        config = getattr(transformers, f"{name}Config")(
            **TINY_SPEECH,
            vocab_size=12,
            layerdrop=0.0,
            mask_time_prob=0.0,
            do_stable_layer_norm=True,
            feat_extract_norm="layer",
            pad_token_id=0,
        )
        torch.manual_seed(0)
        model = getattr(transformers, f"{name}ForCTC")(config).train()
    inputs = {"input_values": torch.randn(2, 1600), "labels": torch.randint(1, 12, (2, 20))}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        planner = Planner(model, inputs)
        budget = (planner.minimum_peak_bytes + planner.no_checkpoint_peak_bytes) // 2
        fast = planner.optimize(budget_gb=budget / GIB)
    assert type(fast) is type(model) and fast.plan.submodule == body and fast.plan.segments
    assert fast.get_submodule(body) is not model.get_submodule(body)
    assert_same_step(train_step(copy.deepcopy(model), inputs), train_step(fast, inputs))
    measured = autockpt.measure(fast, inputs, repeat=0, warmup=0)
    assert measured.peak_bytes <= fast.plan.budget_bytes
