"""The user's model back: ``optimize``/``apply`` return an instance of the user's own class
with the original forward signature, which runs the checkpointed graph for the calls the plan
covers and the original forward for every other one (saying so when that costs the budget),
refuses larger inputs than planned, pickles, deep-copies, and leaves the user's model as it
was. The Hugging Face half checks what its users call: ``save_pretrained``/``from_pretrained``,
``generate``, calls with other keyword sets, and a ``transformers.Trainer`` run."""

from __future__ import annotations

import copy
import inspect
import io
import json
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import autockpt
import autockpt.rewrite.segment as rewrite_module
from autockpt.api import Planner
from autockpt.capture import Inputs, capture
from autockpt.errors import PlanMismatchError
from autockpt.rewrite import (
    SegmentSpec,
    UncoveredCallWarning,
    is_checkpointed,
    rewrite,
    segments_of,
)
from autockpt_zoo.toy import gpt
from tests.conftest import assert_same_step, budget_gb_between, tiny_gpt2, train_step

GPT_SIZE = {"layers": 2, "dim": 32, "batch": 4, "seq_len": 16}


@pytest.fixture(scope="module")
def planned():
    """A small GPT (fx capture, inputs ``(idx, targets)``) as found, its optimized result,
    the example inputs and a snapshot of the model's own attributes before planning."""
    model, inputs = gpt(**GPT_SIZE)
    before = dict(vars(model))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        planner = Planner(model, inputs)
        fast = planner.optimize(budget_gb=budget_gb_between(planner, 0.3))
    assert fast.plan.capture_method == "fx" and fast.plan.segments
    return model, fast, inputs, before, planner


@pytest.fixture
def checkpoint_calls(monkeypatch):
    calls: list[int] = []
    real = rewrite_module.checkpoint

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(rewrite_module, "checkpoint", spy)
    return calls


def _recorded(call) -> tuple[Any, list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = call()
    return out, [w for w in caught if issubclass(w.category, UncoveredCallWarning)]


# --------------------------------------------------------------------------------------------
# the object


def test_result_is_an_instance_of_the_users_class_with_its_signature(planned):
    model, fast, _, _, planner = planned
    assert isinstance(fast, type(model)) and type(fast) is not type(model)
    assert is_checkpointed(fast) and not is_checkpointed(model)
    # the class keeps the user's name (libraries record it) and is made once per class
    assert type(fast).__name__ == type(model).__name__
    assert type(fast).__module__ == type(model).__module__
    assert type(planner.rewrite([])) is type(fast)
    assert inspect.signature(fast.forward) == inspect.signature(model.forward)
    assert fast.plan.input_names == ("idx", "targets")
    # one module tree: names, tensors and state-dict keys are the user's
    assert [n for n, _ in fast.named_modules()] == [n for n, _ in model.named_modules()]
    assert [id(p) for p in fast.parameters()] == [id(p) for p in model.parameters()]
    assert list(fast.state_dict()) == list(model.state_dict())
    assert segments_of(fast) and all(
        name not in dict(fast.named_modules()) for name in segments_of(fast)
    )


def test_the_users_model_is_left_as_found(planned):
    model, fast, inputs, before, _ = planned
    assert vars(model).keys() == before.keys()
    assert all(vars(model)[k] is v for k, v in before.items())
    assert "forward" not in vars(model) and type(model).__name__ == "GPT"
    # the result's registries are its own: what is added to it is not added to the model
    handle = fast.register_forward_hook(lambda *args: None)
    try:
        assert not model._forward_hooks
    finally:
        handle.remove()
    clone = copy.deepcopy(fast)
    clone.extra = nn.Linear(2, 2)
    assert "extra" not in model._modules and "extra" in clone._modules


def test_state_dict_round_trips_and_loads_into_the_original(planned):
    model, fast, inputs, _, _ = planned
    clone = copy.deepcopy(fast)
    with torch.no_grad():
        for p in clone.parameters():
            p.mul_(0.5)
    saved = clone.state_dict()
    fresh, _ = gpt(**GPT_SIZE)
    fresh.load_state_dict(saved)
    clone.load_state_dict(model.state_dict())
    assert_same_step(train_step(copy.deepcopy(model), inputs), train_step(clone, inputs))


# --------------------------------------------------------------------------------------------
# which forward runs


def test_calls_the_plan_does_not_cover_run_the_original_forward(planned, checkpoint_calls):
    """A training call with other arguments than planned cannot run the graph: it runs the
    original forward (same result as eager), with one warning per argument set; evaluation
    and no_grad calls run it silently; the planned call runs the checkpoints."""
    model, fast, (idx, targets), _, _ = planned
    eager = copy.deepcopy(model)
    fast = copy.deepcopy(fast)  # its own warnings
    torch.manual_seed(3)
    expected = eager(idx)
    torch.manual_seed(3)
    got, caught = _recorded(lambda: fast(idx))
    torch.testing.assert_close(got[0], expected[0])
    assert got[1] is None and checkpoint_calls == []
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "runs un-checkpointed" in message
    assert "the plan covers calls with (idx, targets)" in message and "(idx)" in message
    _, again = _recorded(lambda: fast(idx))
    assert again == []  # once per argument set
    # the planned call, by position or by keyword, runs the segments
    _, silent = _recorded(lambda: fast(idx=idx, targets=targets)[1].backward())
    assert silent == [] and len(checkpoint_calls) == len(fast.plan.segments)
    # evaluation mode and no_grad run the original forward, silently
    for mode, grad in ((False, True), (True, False)):
        fast.train(mode)
        with torch.set_grad_enabled(grad):
            _, caught = _recorded(lambda: fast(idx))
        assert caught == []
    fast.train()
    assert len(checkpoint_calls) == len(fast.plan.segments)


def test_a_larger_batch_is_refused_unless_asked_to_warn(planned):
    model, fast, (idx, targets), _, _ = planned
    fast = copy.deepcopy(fast)
    bigger = (torch.cat([idx, idx]), torch.cat([targets, targets]))
    longer = (torch.cat([idx, idx], 1), torch.cat([targets, targets], 1))
    for batch in (bigger, longer):
        with pytest.raises(PlanMismatchError, match=r"planned for inputs \(idx \[4, 16\]:int64"):
            fast(*batch)
    with pytest.raises(ValueError, match="on_larger_input"):
        fast.on_larger_input = "ignore"
    fast.on_larger_input = "warn"
    got, caught = _recorded(lambda: train_step(fast, bigger))
    assert len(caught) == 1 and "larger than planned" in str(caught[0].message)
    assert_same_step(train_step(copy.deepcopy(model), bigger), got)
    _, again = _recorded(lambda: train_step(fast, bigger))
    assert again == []


def test_a_smaller_batch_runs_the_plan_within_budget(planned, checkpoint_calls):
    """fx graphs are shape-generic: a smaller last batch runs the checkpoints, trains like
    eager, and peaks (allocator-measured) under the plan's budget."""
    model, fast, (idx, targets), _, _ = planned
    smaller = (idx[:2, :12].contiguous(), targets[:2, :12].contiguous())
    _, caught = _recorded(
        lambda: assert_same_step(
            train_step(copy.deepcopy(model), smaller), train_step(fast, smaller)
        )
    )
    assert caught == [] and len(checkpoint_calls) == len(fast.plan.segments)
    measured = autockpt.measure(fast, smaller, repeat=1)
    assert measured.peak_bytes <= fast.plan.budget_bytes


# --------------------------------------------------------------------------------------------
# pickling and copies


def test_torch_save_and_load_rebuild_the_result(planned):
    """Pickled as the plain model plus the plan, re-applied on load: same class, plan and
    segments, its own tensors, the mode and switch it was saved with, and a step equal to
    eager's. Saved beside the original model, the two still share their tensors."""
    model, fast, inputs, _, _ = planned
    buffer = io.BytesIO()
    fast.on_larger_input = "warn"
    fast.eval()
    try:
        torch.save({"model": model, "fast": fast}, buffer)
    finally:
        fast.on_larger_input = "error"
        fast.train()
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    back, original = loaded["fast"], loaded["model"]
    assert type(back) is type(fast) and is_checkpointed(back) and not is_checkpointed(original)
    assert back.plan == fast.plan
    assert [(s.first_node, s.last_node) for s in segments_of(back).values()] == [
        (s.first_node, s.last_node) for s in segments_of(fast).values()
    ]
    assert not back.training and back.on_larger_input == "warn"
    assert [id(p) for p in back.parameters()] == [id(p) for p in original.parameters()]
    assert all(a is not b for a, b in zip(back.parameters(), fast.parameters(), strict=True))
    back.train()
    assert_same_step(train_step(copy.deepcopy(model), inputs), train_step(back, inputs))


def test_a_result_without_a_plan_refuses_to_pickle(planned):
    _, _, _, _, planner = planned
    bare = planner.rewrite([(0, 1)])
    with pytest.raises(TypeError, match="without a plan"):
        torch.save(bare, io.BytesIO())


def test_apply_to_a_result_plans_the_users_model(planned):
    model, fast, inputs, _, _ = planned
    again = autockpt.apply(fast, fast.plan, inputs)
    assert type(again) is type(fast) and again.plan == fast.plan
    assert_same_step(train_step(copy.deepcopy(model), inputs), train_step(again, inputs))


# --------------------------------------------------------------------------------------------
# Hugging Face


HF_BATCH, HF_SEQ = 4, 16


def _hf_batch(seed: int = 1) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, 128, (HF_BATCH, HF_SEQ), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


@pytest.fixture(scope="module")
def hf():
    """A tiny GPT2LMHeadModel as found and optimized for ``(input_ids, labels)``."""
    model = tiny_gpt2()
    inputs = _hf_batch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        planner = Planner(model, inputs)
        fast = planner.optimize(budget_gb=budget_gb_between(planner, 0.3), verify=False)
    assert fast.plan.segments and fast.plan.input_names == ("input_ids", "labels")
    return model, fast, inputs


def test_hf_result_is_the_users_pretrained_model(hf):
    from transformers import GPT2LMHeadModel, PreTrainedModel

    model, fast, inputs = hf
    assert isinstance(fast, PreTrainedModel) and isinstance(fast, GPT2LMHeadModel)
    assert inspect.signature(fast.forward) == inspect.signature(model.forward)
    for method in (
        "save_pretrained",
        "generate",
        "gradient_checkpointing_enable",
        "prepare_inputs_for_generation",
        "get_input_embeddings",
        "resize_token_embeddings",
    ):
        assert callable(getattr(fast, method)), method
    assert fast._get_name() == "GPT2LMHeadModel"  # Trainer's label smoothing reads it
    assert "input_ids" in fast.prepare_inputs_for_generation(inputs["input_ids"])
    assert_same_step(train_step(copy.deepcopy(model), inputs), train_step(fast, inputs))


def test_hf_save_pretrained_and_from_pretrained(hf, tmp_path):
    from transformers import GPT2LMHeadModel

    model, fast, inputs = hf
    fast.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["GPT2LMHeadModel"]
    back = GPT2LMHeadModel.from_pretrained(tmp_path)
    assert type(back) is GPT2LMHeadModel
    for name, tensor in fast.state_dict().items():
        torch.testing.assert_close(back.state_dict()[name], tensor, msg=name)


def test_hf_generate_runs_the_original_forward(hf):
    model, fast, inputs = hf
    prompt = inputs["input_ids"][:1, :4]
    clone = copy.deepcopy(fast)
    _, caught = _recorded(lambda: clone.generate(prompt, max_new_tokens=4, do_sample=False))
    assert caught == []  # generate runs without autograd
    clone.eval()
    reference = copy.deepcopy(model).eval()
    expected = reference.generate(prompt, max_new_tokens=4, do_sample=False)
    torch.testing.assert_close(clone.generate(prompt, max_new_tokens=4, do_sample=False), expected)


def test_hf_calls_with_other_keywords_run_and_say_so_in_training(hf):
    model, fast, inputs = hf
    fast = copy.deepcopy(fast)
    ids, labels = inputs["input_ids"], inputs["labels"]
    mask = torch.ones_like(ids)
    reference = copy.deepcopy(model)
    for kwargs, covers in (
        ({"input_ids": ids}, "(input_ids)"),
        (
            {"input_ids": ids, "attention_mask": mask, "labels": labels},
            "(input_ids, attention_mask, labels)",
        ),
    ):
        torch.manual_seed(5)
        expected = reference(**kwargs)
        torch.manual_seed(5)
        got, caught = _recorded(lambda kwargs=kwargs: fast(**kwargs))
        torch.testing.assert_close(got.logits, expected.logits)
        assert len(caught) == 1 and covers in str(caught[0].message)
        assert "(input_ids, labels)" in str(caught[0].message)
    # an argument given as its default is not another call: the plan covers it
    _, caught = _recorded(lambda: fast(input_ids=ids, labels=labels, attention_mask=None))
    assert caught == []
    fast.eval()
    with torch.no_grad():
        _, caught = _recorded(lambda: fast(input_ids=ids, attention_mask=mask))
    assert caught == []


def test_hf_torch_save_and_load_reapply_an_export_plan(hf):
    model, fast, inputs = hf
    assert fast.plan.capture_method == "export"
    buffer = io.BytesIO()
    torch.save(fast, buffer)
    buffer.seek(0)
    back = torch.load(buffer, weights_only=False)
    assert (
        type(back) is type(fast)
        and back.plan == fast.plan
        and len(segments_of(back)) == len(segments_of(fast))
    )
    assert_same_step(train_step(copy.deepcopy(model), inputs), train_step(back, inputs))


def test_hf_gradient_checkpointing_enable_keeps_the_plan(hf, checkpoint_calls):
    model, fast, inputs = hf
    clone = copy.deepcopy(fast)
    clone.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert clone.is_gradient_checkpointing
    reference = copy.deepcopy(model)
    assert_same_step(train_step(reference, inputs), train_step(clone, inputs))
    assert len(checkpoint_calls) >= len(clone.plan.segments)


class _FirstSteps:
    """A Trainer callback keeping every step's gradients (before the optimizer step)."""

    def __init__(self) -> None:
        self.grads: list[dict[str, torch.Tensor]] = []

    def hook(self):
        from transformers import TrainerCallback

        steps = self

        class Keep(TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
                steps.grads.append(
                    {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
                )

        return Keep()


def _train(model: nn.Module, tmp_path) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """Two steps of ``transformers.Trainer`` on a tiny in-memory data set: losses and grads."""
    pytest.importorskip("accelerate")
    from transformers import Trainer, TrainingArguments

    data = [
        {"input_ids": ids, "labels": ids.clone()}
        for ids in torch.randint(
            1, 128, (2 * HF_BATCH, HF_SEQ), generator=torch.Generator().manual_seed(7)
        )
    ]
    steps = _FirstSteps()
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=HF_BATCH,
        use_cpu=True,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[steps.hook()])
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return losses, steps.grads


def _assert_same_training(expected, got) -> None:
    (losses, grads), (ref_losses, ref_grads) = got, expected
    assert len(losses) == len(ref_losses) == 2
    for a, b in zip(losses, ref_losses, strict=True):
        assert a == pytest.approx(b, rel=1e-5)
    assert len(grads) == len(ref_grads) == 2
    for step, ref in zip(grads, ref_grads, strict=True):
        assert step.keys() == ref.keys()
        for name, grad in ref.items():
            torch.testing.assert_close(step[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_hf_trainer_runs_the_plan_when_planned_with_what_it_sends(tmp_path, checkpoint_calls):
    """Trainer keeps the columns the forward's signature names and adds
    ``num_items_in_batch``; planned with that argument, its steps run the checkpoints and
    give the un-optimized model's losses and gradients."""
    model = tiny_gpt2()
    # what the Trainer passes: a float count of the labels that enter the loss
    batch = {**_hf_batch(), "num_items_in_batch": torch.tensor(float(HF_BATCH * (HF_SEQ - 1)))}
    inputs = Inputs.of(batch)
    captured = capture(model, inputs)  # segments given by hand: no profile needed here
    n = len(captured.compute_nodes())
    fast = rewrite(
        model,
        captured,
        [SegmentSpec(n // 8, n // 2, True), SegmentSpec(n // 2, n - 8, True)],
        inputs,
    )
    expected = _train(tiny_gpt2(), tmp_path / "eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _train(fast, tmp_path / "fast")
    assert not [w for w in caught if issubclass(w.category, UncoveredCallWarning)]
    assert len(checkpoint_calls) == 2 * 2
    _assert_same_training(expected, got)


def test_hf_trainer_trains_a_result_planned_without_its_arguments(hf, tmp_path):
    """Planned with ``(input_ids, labels)`` only, the Trainer's calls run the original
    forward: training is still exactly eager's, and the user is told why it is not
    checkpointed."""
    model, fast, _ = hf
    expected = _train(copy.deepcopy(model), tmp_path / "eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _train(copy.deepcopy(fast), tmp_path / "fast")
    uncovered = [str(w.message) for w in caught if issubclass(w.category, UncoveredCallWarning)]
    assert len(uncovered) == 1 and "num_items_in_batch" in uncovered[0]
    _assert_same_training(expected, got)
