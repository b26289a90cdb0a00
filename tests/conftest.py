"""Shared helpers: run one training step the same way on eager and optimized models; plan
quietly at a budget between the leanest plan and none; the tiny Hugging Face models tests
build from configs."""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("KINETO_LOG_LEVEL", "5")
# Spinning OpenMP workers starve each other on a small shared machine; sleep instead.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Measured node times are stored per machine (NOTE [timing: stored]); the suite keeps its
# own store, fresh per run, so no test reads times a previous run measured. The suite runs
# in pytest-xdist workers (pyproject.toml): each worker gets a store of its own, as one
# process of its own would (a worker inherits the first store's path from the controller).
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
_OWN_STORE = "AUTOCKPT_TESTS_OWN_STORE"
if "AUTOCKPT_CACHE_DIR" not in os.environ or (
    _WORKER and os.environ.get(_OWN_STORE) == os.environ["AUTOCKPT_CACHE_DIR"]
):
    import tempfile

    os.environ["AUTOCKPT_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"autockpt-tests-{_WORKER or ''}")
    os.environ[_OWN_STORE] = os.environ["AUTOCKPT_CACHE_DIR"]

import warnings  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from autockpt.api import Planner  # noqa: E402
from autockpt.base.runtime import default_loss, tensors_in  # noqa: E402
from autockpt.capture import Inputs  # noqa: E402
from autockpt.errors import GIB  # noqa: E402

# Two threads a process, or the cores shared among xdist's workers: two workers with two
# threads each on two cores would oversubscribe them.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))


def train_step(
    model: torch.nn.Module, example_inputs: Any, seed: int = 1234, loss_fn=None
) -> dict[str, Any]:
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
        "grads": {
            n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None
        },
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


def quiet_planner(model: nn.Module, inputs: Any, **kwargs: Any) -> Planner:
    """A :class:`Planner` made with its warnings (eval mode, leaves, export) silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Planner(model, inputs, **kwargs)


def budget_between(planner: Planner, fraction: float) -> int:
    """Bytes ``fraction`` of the way from the leanest plan's peak to no checkpointing."""
    low, high = planner.minimum_peak_bytes, planner.no_checkpoint_peak_bytes
    return int(low + fraction * (high - low))


def budget_gb_between(planner: Planner, fraction: float) -> float:
    """:func:`budget_between` in GiB, as ``optimize(budget_gb=...)`` takes it."""
    low, high = planner.minimum_peak_bytes, planner.no_checkpoint_peak_bytes
    return (low + fraction * (high - low)) / GIB


def tiny_gpt2() -> nn.Module:
    """A 2-layer Hugging Face GPT-2 LM head model from a config (seeded, training mode)."""
    transformers = pytest.importorskip("transformers")
    from autockpt_zoo.hf import quiet_transformers

    with quiet_transformers():
        config = transformers.GPT2Config(
            vocab_size=128,
            n_positions=32,
            n_embd=32,
            n_layer=2,
            n_head=2,
            use_cache=False,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
        )
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(config).train()


TINY_SPEECH = dict(
    hidden_size=32,
    num_hidden_layers=4,
    num_attention_heads=2,
    intermediate_size=64,
    conv_dim=(16, 16),
    conv_stride=(5, 2),
    conv_kernel=(10, 3),
    num_conv_pos_embeddings=16,
    num_conv_pos_embedding_groups=2,
)
"""The sizes of a tiny Hugging Face speech model (Wav2Vec2, HuBERT configs)."""
