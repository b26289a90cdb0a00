"""PEFT / LoRA: adapters applied before ``optimize`` train like eager (only the adapters
get gradients); adapters applied after it are refused with a typed error naming the order
that works, never silently bypassed by the checkpointed graph."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from autockpt.api import Planner
from autockpt.errors import GIB, PlanMismatchError
from tests.conftest import assert_same_step, train_step

peft = pytest.importorskip("peft")

WIDTH, BATCH = 32, 128


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, 2 * WIDTH)
        self.act = nn.GELU()
        self.drop = nn.Dropout(0.1)
        self.fc2 = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(self.act(self.fc1(x))))


class Tower(nn.Module):
    """Residual blocks and a head; ``export=True`` branches on the input's shape in the root
    forward, so the graph is captured with torch.export (weights read by path)."""

    def __init__(self, export: bool = False) -> None:
        super().__init__()
        self.export = export
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.export and x.shape[0] > 1:
            x = x * 1.0
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _tower(export: bool = False) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return Tower(export).train(), torch.randn(BATCH, WIDTH)


def _lora(dropout: float = 0.0, **extra) -> peft.LoraConfig:
    # init_lora_weights=False: B is random too, so the adapters change outputs and gradients
    return peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["fc1", "fc2"],
        lora_dropout=dropout,
        init_lora_weights=False,
        **extra,
    )


def _optimize(model: nn.Module, x: torch.Tensor) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        planner = Planner(model, x)
        low, high = planner.minimum_peak_bytes, planner.no_checkpoint_peak_bytes
        fast = planner.optimize(budget_gb=(low + 0.5 * (high - low)) / GIB)
    assert fast.plan.segments, "the budget should need checkpointing"
    return fast


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_lora_applied_before_optimize_trains_like_eager(dropout):
    model, x = _tower()
    adapted = peft.get_peft_model(model, _lora(dropout))
    expected = train_step(copy.deepcopy(adapted), x)
    fast = _optimize(adapted, x)
    got = train_step(fast, x)
    assert_same_step(expected, got)
    trained = set(got["grads"])
    assert trained and all("lora_" in name for name in trained), trained
    assert trained == {n for n, p in adapted.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("export", [False, True], ids=["fx", "export"])
def test_lora_applied_after_optimize_is_refused_not_bypassed(export):
    """Without the check, the export graph keeps computing ``x @ W.T`` with the base
    weights (the adapters get no gradient); the error says to adapt first."""
    model, x = _tower(export)
    fast = _optimize(model, x)
    assert (fast.plan.capture_method == "export") == export
    adapted = peft.get_peft_model(fast, _lora())
    with pytest.raises(PlanMismatchError, match="Apply adapters first, then optimize") as error:
        train_step(adapted, x)
    assert "peft.tuners.lora" in str(error.value)
    for name, p in adapted.named_parameters():
        assert p.grad is None, name
    # without autograd the original forward runs on the live tree: the adapters run
    reference = peft.get_peft_model(_tower(export)[0], _lora())
    reference.load_state_dict(adapted.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(adapted.eval()(x), reference.eval()(x))
        assert not torch.allclose(reference(x), _tower(export)[0].eval()(x))  # adapters count


def test_changing_adapter_state_after_optimize_is_refused():
    """A traced graph bakes in whether the adapters are enabled, merged and which is active."""
    model, x = _tower()
    adapted = peft.get_peft_model(model, _lora())
    fast = _optimize(adapted, x)
    with fast.disable_adapter(), pytest.raises(PlanMismatchError, match="changed state"):
        train_step(fast, x)
    train_step(fast, x)  # enabled again: the planned state


def test_lora_with_a_task_type_after_optimize_is_refused():
    """The reported case: a Hugging Face model, optimized, then wrapped for causal LM (PEFT
    then calls the model with arguments of its own)."""
    pytest.importorskip("transformers")
    from autockpt_zoo.hf import gpt2

    model, inputs = gpt2(layers=2, hidden=32, heads=2, batch=2, seq_len=16, dropout=0.0)
    fast = _optimize_hf(model, inputs)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["c_attn"], task_type="CAUSAL_LM", fan_in_fan_out=True
    )
    adapted = peft.get_peft_model(fast, config)
    with pytest.raises(PlanMismatchError, match="Apply adapters first"):
        adapted(**inputs).loss.backward()


def _optimize_hf(model: nn.Module, inputs: dict) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        planner = Planner(model, inputs)
        low, high = planner.minimum_peak_bytes, planner.no_checkpoint_peak_bytes
        return planner.optimize(budget_gb=(low + 0.5 * (high - low)) / GIB)


@pytest.mark.slow
def test_lora_on_a_hugging_face_model_before_optimize_trains_like_eager():
    pytest.importorskip("transformers")
    from autockpt_zoo.hf import gpt2

    model, inputs = gpt2(layers=2, hidden=32, heads=2, batch=2, seq_len=16, dropout=0.0)
    config = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["c_attn", "c_proj"],
        task_type="CAUSAL_LM",
        fan_in_fan_out=True,
        init_lora_weights=False,
    )
    adapted = peft.get_peft_model(model, config)
    expected = train_step(copy.deepcopy(adapted), inputs)
    fast = _optimize_hf(adapted, inputs)
    assert fast.plan.segments
    got = train_step(fast, inputs)
    assert_same_step(expected, got)
    assert got["grads"] and all("lora_" in name for name in got["grads"])


def test_lora_after_optimize_is_refused_under_torch_compile():
    """The check runs once per compiled trace, outside the graph; a replaced module makes
    the compiled model trace again, and check again."""
    model, x = _tower()
    fast = _optimize(model, x)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(fast, backend="aot_eager")
        compiled(x).sum().backward()  # the planned tree: compiles and runs
        peft.get_peft_model(fast, _lora())
        with pytest.raises(PlanMismatchError, match="Apply adapters first"):
            compiled(x)
    finally:
        torch._dynamo.reset()
