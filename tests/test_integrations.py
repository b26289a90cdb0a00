"""The optimized model in the training loops people use: Hugging Face ``Trainer`` (fixed
length and dynamic padding), ``accelerate`` (``prepare``, gradient accumulation) and
Lightning. Each run is compared with the same run of the un-optimized model (losses,
gradients, parameters), and each checks that the plan's segments actually ran
(``torch.utils.checkpoint`` called once per segment and forward, no
``UncoveredCallWarning``). docs/integrations.md describes what these tests show."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import autockpt.rewrite.segment as rewrite_module
from autockpt.capture import Inputs, capture
from autockpt.errors import GIB, PlanMismatchError
from autockpt.measure import measure
from autockpt.rewrite import SegmentSpec, UncoveredCallWarning, rewrite, segments_of
from autockpt_zoo.toy import gpt
from tests.conftest import assert_same_step, budget_between, quiet_planner, tiny_gpt2, train_step

GPT_SIZE = {"layers": 2, "dim": 32, "batch": 4, "seq_len": 16}


@pytest.fixture
def checkpoint_calls(monkeypatch):
    """How many times a segment called ``torch.utils.checkpoint`` (once per segment and
    training forward when the plan runs)."""
    calls: list[int] = []
    real = rewrite_module.checkpoint

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(rewrite_module, "checkpoint", spy)
    return calls


def _uncovered(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, UncoveredCallWarning)]


# --------------------------------------------------------------------------------------------
# Hugging Face Trainer

HF_BATCH, HF_SEQ, HF_EXAMPLES = 4, 16, 8


def _examples(lengths: list[int]) -> list[dict[str, torch.Tensor]]:
    """Tokenized examples of the given lengths, as a tokenizer hands them over."""
    generator = torch.Generator().manual_seed(7)
    return [
        {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        for ids in (torch.randint(1, 128, (n,), generator=generator) for n in lengths)
    ]


def _pad(features: list[dict[str, torch.Tensor]], length: int | None = None) -> dict[str, Any]:
    """What ``DataCollatorWithPadding`` followed by causal-LM labels does: pad to the longest
    example (or to ``length``, ``padding="max_length"``) with token 0, mask 0 and label -100."""
    length = length or max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, f in enumerate(features):
        ids[row, : len(f["input_ids"])] = f["input_ids"]
        mask[row, : len(f["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _as_trainer_sends(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The batch plus the ``num_items_in_batch`` the Trainer adds to each call of a forward
    taking ``**kwargs``: the count of labels that enter the shifted causal-LM loss, divided
    by the parallel degree (so a float32 scalar)."""
    return {**batch, "num_items_in_batch": (batch["labels"][:, 1:] != -100).sum() / 1}


# variable lengths, every one at most HF_SEQ; the first batch's longest is below HF_SEQ
LENGTHS = [9, 12, 5, 7, 16, 3, 11, 8]


@pytest.fixture(scope="module")
def trainer_gpt2():
    """A tiny GPT2LMHeadModel and its result, planned for what the Trainer sends with batches
    padded to HF_SEQ (input_ids, attention_mask, labels, num_items_in_batch). Segments are
    given by hand: what is under test is the Trainer running them, not the search."""
    model = tiny_gpt2()
    inputs = Inputs.of(_as_trainer_sends(_pad(_examples(LENGTHS[:HF_BATCH]), HF_SEQ)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        captured = capture(model, inputs)
    n = len(captured.compute_nodes())
    fast = rewrite(
        model,
        captured,
        [SegmentSpec(n // 8, n // 2, True), SegmentSpec(n // 2, n - 8, True)],
        inputs,
    )
    return fast, captured


class _Grads:
    """A Trainer callback keeping every step's gradients (before the optimizer step)."""

    def __init__(self) -> None:
        self.grads: list[dict[str, torch.Tensor]] = []

    def callback(self):
        from transformers import TrainerCallback

        kept = self.grads

        class Keep(TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
                kept.append(
                    {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
                )

        return Keep()


def _train(
    model: nn.Module, tmp_path, collate, batch: int = HF_BATCH, **overrides: Any
) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """Two steps of ``transformers.Trainer`` over LENGTHS-long examples: losses and grads."""
    pytest.importorskip("accelerate")
    from transformers import Trainer, TrainingArguments

    grads = _Grads()
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=batch,
        use_cpu=True,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
        **overrides,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=_examples(LENGTHS),
        data_collator=collate,
        callbacks=[grads.callback()],
    )
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return losses, grads.grads


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


def _trains_like_eager(fast: nn.Module, tmp_path, collate, checkpoint_calls) -> None:
    expected = _train(tiny_gpt2(), tmp_path / "eager", collate)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _train(copy.deepcopy(fast), tmp_path / "fast", collate)
    assert _uncovered(caught) == []
    assert len(checkpoint_calls) == 2 * len(segments_of(fast)) > 0
    _assert_same_training(expected, got)


@pytest.mark.slow  # capturing GPT-2 with torch.export takes ~30 s on 2 cores
def test_trainer_with_batches_padded_to_the_planned_length(
    trainer_gpt2, tmp_path, checkpoint_calls
):
    """``padding="max_length"``: every batch has the planned shape, the Trainer's calls
    (with its ``num_items_in_batch``) run both segments, and training equals eager's."""
    fast, _ = trainer_gpt2
    _trains_like_eager(fast, tmp_path, lambda f: _pad(f, HF_SEQ), checkpoint_calls)


@pytest.mark.slow
def test_trainer_with_dynamic_padding_runs_the_plan(trainer_gpt2, tmp_path, checkpoint_calls):
    """Dynamic padding (pad to the longest example of each batch): batches no longer than
    planned run the plan and train exactly like eager. The graph was exported with the
    Trainer's ``num_items_in_batch`` in ``**kwargs`` and still keeps the batch and sequence
    sizes of the token inputs dynamic."""
    fast, captured = trainer_gpt2
    assert captured.method == "export"
    assert set(captured.dynamic_dims) == {
        f"{name}[{d}]" for name in ("input_ids", "attention_mask", "labels") for d in (0, 1)
    }
    first = _pad(_examples(LENGTHS[:HF_BATCH]))
    assert first["input_ids"].shape[1] < HF_SEQ  # the first batch is shorter than planned
    _trains_like_eager(fast, tmp_path, _pad, checkpoint_calls)


@pytest.mark.slow
def test_trainer_example_from_the_docs_within_budget(tmp_path, checkpoint_calls):
    """docs/integrations.md's flow end to end: ``optimize`` with what the Trainer sends, a
    budget 30% of the way from the leanest plan to none, verified by a measured step; the
    Trainer then trains exactly like eager with the plan's segments."""
    model = tiny_gpt2()
    batch = _as_trainer_sends(_pad(_examples(LENGTHS[:HF_BATCH]), HF_SEQ))
    planner = quiet_planner(model, batch)
    budget = budget_between(planner, 0.3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = planner.optimize(budget_gb=budget / GIB)
    assert fast.plan.segments and fast.plan.measured_peak_bytes <= budget
    checkpoint_calls.clear()  # verification ran the plan once
    _trains_like_eager(fast, tmp_path, lambda f: _pad(f, HF_SEQ), checkpoint_calls)


@pytest.mark.slow
def test_trainer_with_gradient_accumulation_is_planned_for_it(tmp_path, checkpoint_calls):
    """``gradient_accumulation_steps=2`` with the Trainer's AdamW: planned with an AdamW of
    the model and ``accumulation_steps=2``, the whole iteration (two micro-batches, the
    step) measures within the budget, and the Trainer trains exactly like eager."""
    model = tiny_gpt2()
    batch = _as_trainer_sends(_pad(_examples(LENGTHS[:2]), HF_SEQ))
    optimizer = torch.optim.AdamW(model.parameters())  # the Trainer's default, adamw_torch
    planner = quiet_planner(model, batch, optimizer=optimizer, accumulation_steps=2)
    budget = budget_between(planner, 0.3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = planner.optimize(budget_gb=budget / GIB)
    assert fast.plan.segments and fast.plan.measured_peak_bytes <= budget
    assert fast.plan.optimizer.name == "AdamW" and fast.plan.accumulation_steps == 2
    collate = lambda f: _pad(f, HF_SEQ)  # noqa: E731
    overrides = {"gradient_accumulation_steps": 2}
    expected = _train(tiny_gpt2(), tmp_path / "eager", collate, 2, **overrides)
    got = _train(copy.deepcopy(fast), tmp_path / "fast", collate, 2, **overrides)
    _assert_same_training(expected, got)


@pytest.mark.slow
def test_trainer_call_plan_takes_shorter_batches_within_budget(checkpoint_calls):
    """Planned with the Trainer's call (``num_items_in_batch`` through ``**kwargs``) under a
    budget, the result takes the Trainer's calls with fewer and shorter sequences (dynamic
    padding, a last partial batch): the graph runs them (its segments checkpoint, nothing
    warns), loss and gradients equal eager's, and a measured step is within the budget."""
    model = tiny_gpt2()
    batch = _as_trainer_sends(_pad(_examples(LENGTHS[:HF_BATCH]), HF_SEQ))
    planner = quiet_planner(model, batch)
    budget = budget_between(planner, 0.3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = planner.optimize(budget_gb=budget / GIB)
    assert fast.plan.segments and {"input_ids[0]", "input_ids[1]"} <= set(
        planner.capture.dynamic_dims
    )
    for examples in (LENGTHS[:3], LENGTHS[5:7]):  # 3 x 12 and 2 x 11 tokens
        smaller = _as_trainer_sends(_pad(_examples(examples)))
        assert smaller["input_ids"].shape[1] < HF_SEQ
        checkpoint_calls.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("error", UncoveredCallWarning)  # the graph runs them
            got = train_step(fast, smaller)
        assert len(checkpoint_calls) == len(fast.plan.segments)
        assert_same_step(train_step(copy.deepcopy(model), smaller), got)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert measure(fast, smaller, repeat=1).peak_bytes <= budget
    longer = _as_trainer_sends(_pad(_examples(LENGTHS[:HF_BATCH]), HF_SEQ + 4))
    with pytest.raises(PlanMismatchError, match="larger"):
        fast(**longer)


# --------------------------------------------------------------------------------------------
# accelerate


@pytest.fixture(scope="module")
def small_gpt():
    """The zoo's small GPT (fx capture, dropout on) as found, its result and the budget."""
    model, inputs = gpt(**GPT_SIZE)
    planner = quiet_planner(model, inputs)
    budget = budget_between(planner, 0.3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = planner.optimize(budget_gb=budget / GIB)
    assert fast.plan.capture_method == "fx" and fast.plan.segments
    return model, fast, inputs, budget


def _loader() -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(3)
    data = torch.utils.data.TensorDataset(
        torch.randint(0, 128, (16, GPT_SIZE["seq_len"]), generator=generator),
        torch.randint(0, 128, (16, GPT_SIZE["seq_len"]), generator=generator),
    )
    return torch.utils.data.DataLoader(
        data, batch_size=GPT_SIZE["batch"], shuffle=True, generator=torch.Generator().manual_seed(0)
    )


def _accelerate_run(model: nn.Module, accumulation: int) -> dict[str, Any]:
    """An AdamW loop under ``Accelerator.prepare`` with ``accumulation`` micro-batches per
    optimizer step: losses, first micro-batch's gradients and the final parameters."""
    accelerate = pytest.importorskip("accelerate")
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    prepared, optimizer, loader = accelerator.prepare(model, optimizer, _loader())
    losses, first_grads = [], None
    torch.manual_seed(1)
    for idx, targets in loader:
        with accelerator.accumulate(prepared):
            _, loss = prepared(idx, targets)
            accelerator.backward(loss)
            if first_grads is None:
                first_grads = {n: p.grad.clone() for n, p in prepared.named_parameters()}
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.detach())
    return {
        "prepared": prepared,
        "same": prepared is model,
        "losses": losses,
        "grads": first_grads,
        "params": {n: p.detach().clone() for n, p in prepared.named_parameters()},
    }


def test_accelerate_prepare_trains_the_plan_within_budget(small_gpt, checkpoint_calls):
    """``Accelerator().prepare(result, optimizer, dataloader)`` on the CPU hands the result
    back, its first step's loss and gradients equal eager's, its segments run at every
    forward, and a measured step of the prepared model stays within the budget."""
    model, fast, inputs, budget = small_gpt
    expected = _accelerate_run(copy.deepcopy(model), accumulation=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _accelerate_run(copy.deepcopy(fast), accumulation=1)
    assert _uncovered(caught) == []
    assert len(checkpoint_calls) == len(got["losses"]) * len(fast.plan.segments)
    assert got["same"] and got["prepared"].plan is fast.plan  # one process: handed back as is
    torch.testing.assert_close(got["losses"][0], expected["losses"][0], rtol=0, atol=0)
    assert got["grads"].keys() == expected["grads"].keys()
    for name, grad in expected["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=1e-6, atol=0, msg=name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert measure(got["prepared"], inputs, repeat=1).peak_bytes <= budget


def test_accelerate_gradient_accumulation_is_bit_identical(small_gpt, checkpoint_calls):
    """Gradient accumulation over two micro-batches with AdamW, four micro-batches: every
    loss and every parameter afterwards are bit-identical to the un-optimized model's
    (recompute replays dropout's masks; CPU kernels are deterministic)."""
    model, fast, _, _ = small_gpt
    expected = _accelerate_run(copy.deepcopy(model), accumulation=2)
    got = _accelerate_run(copy.deepcopy(fast), accumulation=2)
    assert len(got["losses"]) == 4
    assert len(checkpoint_calls) == 4 * len(fast.plan.segments)
    for a, b in zip(got["losses"], expected["losses"], strict=True):
        assert torch.equal(a, b)
    for name, param in expected["params"].items():
        assert torch.equal(got["params"][name], param), name
    assert any(  # the loop did train
        not torch.equal(param, dict(model.named_parameters())[name])
        for name, param in got["params"].items()
    )


# --------------------------------------------------------------------------------------------
# Lightning


def _lightning_run(net: nn.Module) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Two steps of ``lightning.Trainer`` on the CPU training a LightningModule around
    ``net``: the losses and the parameters afterwards."""
    lightning = pytest.importorskip("lightning")

    class LitGPT(lightning.LightningModule):
        def __init__(self, net: nn.Module) -> None:
            super().__init__()
            self.net = net
            self.losses: list[torch.Tensor] = []

        def training_step(self, batch, batch_idx):
            idx, targets = batch
            _, loss = self.net(idx, targets)
            self.losses.append(loss.detach().clone())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    module = LitGPT(net)
    trainer = lightning.Trainer(
        max_steps=2,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="lightning")  # num_workers advice and the like
        trainer.fit(module, train_dataloaders=_loader())
    return module.losses, {n: p.detach().clone() for n, p in net.named_parameters()}


def test_lightning_module_trains_the_plan(small_gpt, checkpoint_calls):
    """A LightningModule holding the result trains under ``lightning.Trainer``: the first
    step's loss equals eager's, the second too (the optimizer stepped the same), and both
    steps ran the plan's segments."""
    pytest.importorskip("lightning")
    model, fast, _, _ = small_gpt
    expected_losses, expected_params = _lightning_run(copy.deepcopy(model))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses, params = _lightning_run(copy.deepcopy(fast))
    assert _uncovered(caught) == []
    assert len(losses) == 2 and len(checkpoint_calls) == 2 * len(fast.plan.segments)
    torch.testing.assert_close(losses[0], expected_losses[0], rtol=0, atol=0)
    torch.testing.assert_close(losses[1], expected_losses[1], rtol=1e-6, atol=0)
    for name, param in expected_params.items():
        torch.testing.assert_close(params[name], param, rtol=1e-5, atol=1e-7, msg=name)
