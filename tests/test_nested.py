"""Per-module plans (autockpt/planning/nested.py): a root whose own forward cannot be
captured (an input check by value, a LayerDrop loop, routing on a value, a reused block)
runs eagerly and the submodules it calls are planned as units under the one budget."""

from __future__ import annotations

import copy
import dataclasses
import json
import random
import warnings

import jsonschema
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autockpt
from autockpt import InfeasibleBudgetError, Plan, PlanMismatchError, TraceError
from autockpt.api import Planner
from autockpt.base.rng import worst_case_draws
from autockpt.errors import GIB, PrecisionWarning
from autockpt_zoo.toy import CheckedLM, LayerDropEncoder
from autockpt_zoo.toy import DropoutMLP as Block
from tests.conftest import TINY_SPEECH, assert_same_step, train_step
from tests.test_plan import SCHEMA

VOCAB = 10


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
    assert planner.nested is not None
    assert [unit.path for unit in planner.nested.units] == ["body", "head"]
    # no repeated class: nothing to checkpoint by hand, and the un-checkpointed step never ran
    assert planner.nested.per_block_peak_bytes is None
    error = planner.nested.error  # what fx and export said about the root's own code
    assert error.module == "" and error.in_root_code and "labels.max()" in error.source_line
    assert isinstance(fast, Checked) and plan.submodule is None
    assert [unit.path for unit in plan.units] == ["body"] and fast.body.plan == plan.units[0].plan
    assert plan.model == "Checked" and plan.segments
    assert plan.no_checkpoint_peak_bytes > plan.budget_bytes >= plan.predicted_peak_bytes
    assert any("cannot be captured" in note and "labels.max()" in note for note in plan.notes)
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
    jsonschema.validate(json.loads(plan.to_json()), SCHEMA)
    again = autockpt.apply(model, plan, inputs)
    assert isinstance(again, Checked) and again.plan == plan
    assert again.body.plan == plan.units[0].plan
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
    data.pop("units")
    assert Plan.from_dict(data).units == ()
    for bad in (3, [{"path": "body"}], [{"path": "", "plan": data}]):
        data["units"] = bad
        with pytest.raises(autockpt.PlanFormatError, match="unit"):
            Plan.from_dict(data)


def test_plans_of_one_submodule_still_apply(planned):
    # plans written before units: the graph fields are the submodule's (field "submodule")
    model, inputs, _, fast = planned
    inner = fast.plan.units[0].plan
    old = dataclasses.replace(inner, model="Checked", submodule="body")
    old = dataclasses.replace(old, input_signature=fast.plan.input_signature)
    again = autockpt.apply(model, old, inputs)
    assert isinstance(again, Checked) and again.body.plan.segments == inner.segments
    assert_same_step(train_step(copy.deepcopy(model), inputs), train_step(again, inputs))


def test_budget_below_the_minimum_states_an_achievable_one(planned):
    model, inputs, planner, _ = planned
    with pytest.raises(InfeasibleBudgetError) as caught:
        planner.optimize(budget_gb=(planner.minimum_peak_bytes - 1) / GIB)
    assert caught.value.minimum_bytes >= planner.minimum_peak_bytes
    assert "body" in str(caught.value)
    fits = planner.optimize(budget_gb=caught.value.minimum_bytes / GIB)
    assert autockpt.measure(fits, inputs, repeat=0, warmup=0).peak_bytes <= fits.plan.budget_bytes


def test_per_plan_queries_name_the_units(planned):
    planner = planned[2]
    with pytest.raises(AttributeError, match="as units \\('body', 'head'\\)"):
        planner.solve(planner.minimum_peak_bytes)


def test_reports_that_need_one_graph_refuse_with_a_reason(planned):
    from autockpt.report import ReportError, frontier

    model, inputs, planner, _ = planned
    with pytest.raises(ReportError, match="planned as units"):
        frontier(planner)
    with pytest.raises(autockpt.errors.AutockptError, match="shapes alone"):
        autockpt.fit_batch(
            model,
            lambda n: {"x": torch.randn(n, 32, 8), "labels": torch.randint(0, VOCAB, (n, 32))},
            budget_gb=planner.minimum_peak_bytes / GIB,
        )


def test_a_result_of_units_plans_again_in_another_precision():
    cls, make_inputs, _ = PATTERNS["label-check"]
    torch.manual_seed(0)
    model, inputs = cls().train(), make_inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        planner = Planner(model, inputs)
        budget = (planner.minimum_peak_bytes + planner.no_checkpoint_peak_bytes) // 2
        fast = autockpt.optimize(model, inputs, budget_gb=budget / GIB)
        strict = autockpt.optimize(
            model, inputs, budget_gb=budget / GIB, on_precision_change="raise"
        )
    planned = fast.plan
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.warns(PrecisionWarning, match="planning its units again"):
            fast(**inputs)
        assert fast.plan is not planned and "bfloat16 autocast" in fast.plan.notes[-1]
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # planned for it now: no unit warns
            expected = train_step(copy.deepcopy(model), inputs)
            got = train_step(fast, inputs)
            peak = autockpt.measure(fast, inputs, repeat=0, warmup=0).peak_bytes
        assert_same_step(expected, got)
        assert peak <= budget
        with pytest.raises(PlanMismatchError, match="on_precision_change='raise'"):
            strict(**inputs)


def test_no_capturable_submodule_raises_each_levels_first_failure():
    class Flat(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(8, 8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.sum() > 0:
                return x @ self.weight
            return x

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = Flat()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.max() > 100:
                raise ValueError("too large")
            return self.inner(x)

    with pytest.raises(TraceError, match="x.sum") as caught:
        autockpt.optimize(Flat(), torch.randn(2, 8), budget_gb=1.0)
    assert caught.value.tried == ()
    with pytest.raises(TraceError, match="x.max") as caught:
        autockpt.optimize(Outer(), torch.randn(2, 8), budget_gb=1.0)
    assert len(caught.value.tried) == 1 and "'inner'" in caught.value.tried[0]
    assert "x.sum" in caught.value.tried[0] and "x.sum" in str(caught.value)


class Routed(nn.Module):
    """Routing on a value between layers: one of two experts runs (planned: either)."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Linear(8, dim)
        self.first = Block(dim)
        self.experts = nn.ModuleList(Block(dim) for _ in range(2))
        self.last = Block(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(self.embed(x))
        h = self.experts[int(h.mean() > 0)](h)
        return self.last(h)


class Reused(nn.Module):
    """A block called after every layer (shared weights): not a unit, it runs as written."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Linear(8, dim)
        self.shared = Block(dim)
        self.layers = nn.ModuleList(Block(dim) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        if h.abs().max() > 1e4:  # a value check: the root cannot be captured
            raise ValueError("diverged")
        for layer in self.layers:
            h = self.shared(layer(h))
        return h


class _ByHand(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.inner, *args, use_reentrant=False)


def _per_block_by_hand(model: nn.Module, container: str) -> nn.Module:
    """``model`` with each block of ``container`` checkpointed whole, as users write it."""
    hand = copy.deepcopy(model)
    blocks = hand.get_submodule(container)
    for name, block in list(blocks.named_children()):
        blocks._modules[name] = _ByHand(block)
    return hand


def _measured(model: nn.Module, inputs) -> int:
    with worst_case_draws():  # every LayerDrop layer runs, as planned
        return autockpt.measure(model, inputs, repeat=0, warmup=0).peak_bytes


PATTERNS = {
    "layerdrop": (LayerDropEncoder, lambda: {"x": torch.randn(4, 64, 8)}, "layers"),
    "label-check": (
        CheckedLM,
        lambda: {"idx": torch.randint(0, 64, (4, 64)), "labels": torch.randint(0, 64, (4, 64))},
        "blocks",
    ),
    "routing": (Routed, lambda: {"x": torch.randn(4, 64, 8)}, "experts"),
    "reused": (Reused, lambda: {"x": torch.randn(4, 64, 8)}, "layers"),
}


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_units_train_like_eager_within_budget(pattern):
    cls, make_inputs, container = PATTERNS[pattern]
    torch.manual_seed(0)
    model, inputs = cls().train(), make_inputs()
    reference = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        planner = Planner(model, inputs)
        low, high = planner.minimum_peak_bytes, planner.no_checkpoint_peak_bytes
        assert low < high
        fast = planner.optimize(budget_gb=((low + high) // 2) / GIB)
        lean = planner.optimize(budget_gb=low / GIB)  # the stated minimum is achievable
    units = [unit.path for unit in planner.nested.units]
    blocks = [f"{container}.{name}" for name, _ in model.get_submodule(container).named_children()]
    assert set(blocks) <= set(units)  # every block is a unit (LayerDrop: the worst case)
    assert type(fast) is cls and fast.plan.units
    for seed in (0, 1, 2):
        assert_same_step(
            train_step(copy.deepcopy(model), inputs, seed=seed), train_step(fast, inputs, seed=seed)
        )
    for result in (fast, lean):
        assert _measured(result, inputs) <= result.plan.budget_bytes
    # at least as lean as checkpointing each block by hand
    assert low <= _measured(_per_block_by_hand(model, container), inputs)
    for name, value in model.state_dict().items():  # planning left the model as found
        assert torch.equal(value, reference.state_dict()[name]), name
    if pattern == "reused":
        assert "shared" not in units
        assert any("'shared' is called 3 times" in note for note in fast.plan.notes)


def test_the_models_own_checks_still_run():
    cls, make_inputs, _ = PATTERNS["label-check"]
    torch.manual_seed(0)
    model, inputs = cls().train(), make_inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        planner = Planner(model, inputs)
        fast = planner.optimize(budget_gb=planner.minimum_peak_bytes / GIB)
    with pytest.raises(ValueError, match="vocabulary"):
        fast(inputs["idx"], torch.full_like(inputs["labels"], 64))


class PythonLayerDrop(nn.Module):
    """LayerDrop drawn with Python's ``random`` (x-transformers' pattern): no worst case
    can be forced, so a recorded run may skip layers a later step runs."""

    def __init__(self, dim: int = 32, depth: int = 4, p: float = 0.5) -> None:
        super().__init__()
        self.embed = nn.Linear(8, dim)
        self.layers = nn.ModuleList(Block(dim) for _ in range(depth))
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            if self.training and random.random() < self.p:
                continue
            h = layer(h)
        return h


def test_layers_skipped_by_python_draws_are_planned_for_the_worst_case():
    torch.manual_seed(0)
    model, x = PythonLayerDrop().train(), torch.randn(4, 64, 8)
    random.seed(3)  # this run skips some layers
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        planner = Planner(model, x)
        low, high = planner.minimum_peak_bytes, planner.no_checkpoint_peak_bytes
        fast = planner.optimize(budget_gb=((low + high) // 2) / GIB)
    units = {unit.path for unit in planner.nested.units}
    assert {f"layers.{k}" for k in range(4)} <= units
    assert planner.nested.python_draws == ("random",)
    assert any("random's generator" in note for note in fast.plan.notes)
    for seed in range(6):  # whichever layers a step runs, it fits
        random.seed(seed)
        peak = autockpt.measure(fast, x, repeat=0, warmup=0).peak_bytes
        assert peak <= fast.plan.budget_bytes
        random.seed(seed)
        expected = train_step(copy.deepcopy(model), x, seed=seed)
        random.seed(seed)
        assert_same_step(expected, train_step(fast, x, seed=seed))


class _Stats:
    """A plain object a block returns beside its output (not a tensor container)."""

    def __init__(self, scale: torch.Tensor) -> None:
        self.scale = scale


class WithStats(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.block = Block(dim)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, _Stats]:
        return self.block(x), _Stats(x.detach().abs().mean())


class ReadsStats(nn.Module):
    """The root reads an object its layers return: a unit must hand it back whole."""

    def __init__(self, dim: int = 32, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(8, dim)
        self.layers = nn.ModuleList(WithStats(dim) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h, stats = layer(h)
            if stats.scale > 1e4:
                raise ValueError("diverged")
        return h


def test_a_layer_returning_objects_the_root_reads_is_descended_into():
    torch.manual_seed(0)
    model, x = ReadsStats().train(), torch.randn(4, 64, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        planner = Planner(model, x)
        fast = planner.optimize(budget_gb=planner.minimum_peak_bytes / GIB)
    units = {unit.path for unit in planner.nested.units}
    assert {f"layers.{k}.block" for k in range(3)} <= units and "layers.0" not in units
    assert autockpt.measure(fast, x, repeat=0, warmup=0).peak_bytes <= fast.plan.budget_bytes
    assert_same_step(train_step(copy.deepcopy(model), x), train_step(fast, x))


class _Cache:
    """A key-value cache as Hugging Face passes one to each layer: filled as the run goes."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []


class Cached(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.block = Block(dim)

    def forward(self, x: torch.Tensor, cache: _Cache) -> torch.Tensor:
        mixed = x + sum(k.mean() for k in cache.keys) if cache.keys else x
        out = self.block(mixed)
        cache.keys.append(out)
        return out


class CachedStack(nn.Module):
    """A root with a check by value, a frozen positional embedding on integer positions,
    and layers that are given a cache the later layers read."""

    def __init__(self, dim: int = 32, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(8, dim)
        self.positions = nn.Embedding(64, dim).requires_grad_(False)
        self.layers = nn.ModuleList(Cached(dim) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.abs().max() > 1e4:
            raise ValueError("diverged")
        h = self.embed(x) + self.positions(torch.arange(x.shape[1]))
        cache = _Cache()
        for layer in self.layers:
            h = layer(h, cache)
        return h


def test_a_call_given_a_cache_is_descended_into_and_a_frozen_lookup_is_the_roots():
    """Planned on its own after the run, a layer given the run's cache would see it full
    (tensors of the recorded run's graph): its block is the unit instead. The frozen
    embedding saves nothing for a backward: no unit, no loss to plan for."""
    torch.manual_seed(0)
    model, x = CachedStack().train(), torch.randn(4, 64, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        planner = Planner(model, x)
        fast = planner.optimize(budget_gb=planner.minimum_peak_bytes / GIB)
    units = {unit.path for unit in planner.nested.units}
    assert units == {"embed"} | {f"layers.{k}.block" for k in range(3)}
    assert_same_step(train_step(copy.deepcopy(model), x), train_step(fast, x))


@pytest.mark.slow
@pytest.mark.parametrize("name, body", [("Wav2Vec2", "wav2vec2"), ("Hubert", "hubert")])
def test_ctc_models_are_planned_across_their_encoder_layers(name, body):
    # their defaults: LayerDrop 0.1 (a draw in the encoder's loop) and SpecAugment (numpy)
    transformers = pytest.importorskip("transformers")
    from autockpt_zoo.hf import quiet_transformers

    with quiet_transformers():
        config = getattr(transformers, f"{name}Config")(
            **TINY_SPEECH,
            vocab_size=12,
            do_stable_layer_norm=True,
            feat_extract_norm="layer",
            pad_token_id=0,
        )
        assert config.layerdrop > 0 and config.mask_time_prob > 0
        torch.manual_seed(0)
        model = getattr(transformers, f"{name}ForCTC")(config).train()
    inputs = {"input_values": torch.randn(2, 4000), "labels": torch.randint(1, 12, (2, 20))}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        planner = Planner(model, inputs)
        budget = (planner.minimum_peak_bytes + planner.no_checkpoint_peak_bytes) // 2
        fast = planner.optimize(budget_gb=budget / GIB)
    layers = [f"{body}.encoder.layers.{k}" for k in range(config.num_hidden_layers)]
    assert set(layers) <= {unit.path for unit in planner.nested.units}
    assert type(fast) is type(model) and fast.plan.units
    # at least as lean as Hugging Face's own checkpointing of every encoder layer
    hand = copy.deepcopy(model)
    getattr(hand, "activation_checkpointing_enable", hand.gradient_checkpointing_enable)()
    assert planner.minimum_peak_bytes <= _measured(hand, inputs)
    assert _measured(fast, inputs) <= fast.plan.budget_bytes
    for seed in (0, 1):
        np.random.seed(seed)  # SpecAugment draws its masks with numpy
        expected = train_step(copy.deepcopy(model), inputs, seed=seed)
        np.random.seed(seed)
        assert_same_step(expected, train_step(fast, inputs, seed=seed))
