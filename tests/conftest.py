"""Shared helpers: run one training step the same way on eager and optimized models."""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("KINETO_LOG_LEVEL", "5")
# Spinning OpenMP workers starve each other on a small shared machine; sleep instead.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

from autockpt.runtime import default_loss, tensors_in  # noqa: E402
from autockpt.trace import Inputs  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def train_step(model: torch.nn.Module, example_inputs: Any, seed: int = 1234, loss_fn=None) -> dict[str, Any]:
    """One seeded forward + backward; returns loss, gradients and buffers by name."""
    inputs = Inputs.of(example_inputs)
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(seed)
    output = model(*inputs.args, **inputs.kwargs)
    loss = (loss_fn or default_loss)(output)
    loss.backward()
    result = {
        "loss": loss.detach().clone(),
        "outputs": [t.detach().clone() for t in tensors_in(output)],
        "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None},
        "buffers": {n: b.detach().clone() for n, b in model.named_buffers()},
        "rng": torch.get_rng_state(),
    }
    for p in model.parameters():
        p.grad = None
    return result


def assert_same_step(expected: dict[str, Any], got: dict[str, Any]) -> None:
    """Loss, outputs, every parameter gradient and every buffer equal (up to float reassociation)."""
    torch.testing.assert_close(got["loss"], expected["loss"], rtol=1e-5, atol=1e-6)
    assert len(got["outputs"]) == len(expected["outputs"])
    for out, ref in zip(got["outputs"], expected["outputs"], strict=True):
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    assert got["grads"].keys() == expected["grads"].keys()
    for name, grad in expected["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=name)
    assert got["buffers"].keys() == expected["buffers"].keys()
    for name, buffer in expected["buffers"].items():
        torch.testing.assert_close(got["buffers"][name], buffer, rtol=1e-5, atol=1e-6, msg=name)
    assert torch.equal(got["rng"], expected["rng"]), "RNG advanced differently from eager"


@pytest.fixture
def tmp_plan(tmp_path):
    return tmp_path / "plan.json"
