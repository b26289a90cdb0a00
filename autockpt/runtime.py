"""Helpers shared by the stages that run real training steps (profile, measure, CLI).

A training step here is ``loss_fn(model(*args, **kwargs)).backward()``; these helpers pick
the loss, find the device, time on it, and make trial steps leave no trace in the model.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

if TYPE_CHECKING:
    from autockpt.trace import Inputs

LossFn = Callable[[Any], torch.Tensor]


def default_loss(output: Any) -> torch.Tensor:
    """The scalar to differentiate when the user gives no ``loss_fn``: the output's ``loss``
    field when it has one (Hugging Face style), else the sum over its floating tensors."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if isinstance(loss, torch.Tensor):
        return loss
    tensors = [
        t for t in pytree.tree_leaves(_as_pytree(output))
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad
    ]
    if not tensors:
        raise ValueError(
            "the model's output has no floating tensor that requires grad; pass loss_fn= "
            "mapping the output to a scalar loss"
        )
    return sum(t.float().sum() for t in tensors)


def _as_pytree(output: Any) -> Any:
    if hasattr(output, "to_tuple") and callable(output.to_tuple):
        return output.to_tuple()
    if dataclasses.is_dataclass(output) and not isinstance(output, type):
        return [getattr(output, f.name) for f in dataclasses.fields(output)]
    return output


def tensors_in(value: Any) -> list[torch.Tensor]:
    """Every tensor inside a nested output (tuples, dicts, dataclasses, ModelOutput)."""
    return [t for t in pytree.tree_leaves(_as_pytree(value)) if isinstance(t, torch.Tensor)]


def clear_grads(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


@contextmanager
def preserved_training_state(model: nn.Module) -> Iterator[None]:
    """Run trial steps without leaving a trace: buffers, parameter ``.grad`` and RNG states
    are restored on exit, so profiling or measuring never changes how training proceeds."""
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    grads = {name: p.grad for name, p in model.named_parameters()}
    # Trial steps start from no gradient: a backward would otherwise accumulate into the
    # caller's own .grad tensors in place, and restoring the references would not undo it.
    clear_grads(model)
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name in buffers:
                    b.copy_(buffers[name])
        for name, p in model.named_parameters():
            p.grad = grads.get(name)
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def device_of(model: nn.Module, inputs: Inputs) -> torch.device:
    for t in list(model.parameters()) + inputs.tensors():
        return t.device
    return torch.device("cpu")


def now(device: torch.device | None) -> float:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@contextmanager
def fake_step(model: nn.Module, inputs: Inputs) -> Iterator[Inputs]:
    """Run a step of ``model`` on fake tensors: shapes, dtypes, devices, strides and storage
    aliasing exactly as a real step, and no memory for data (design note 1 in
    ``autockpt/record.py``).

    Inside the block the model's parameters and buffers are replaced by fake twins (ties
    kept: one twin per tensor object) and the yielded inputs are fake; on exit the real
    tensors are back and untouched (a fake step's gradients land on the twins). Tensors the
    graph holds itself (constants an export capture lifted) are converted when first used.
    On the meta device there is nothing to fake: the model and inputs are yielded as given.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.utils.stateless import _reparametrize_module

    from autockpt.trace import Inputs as _Inputs

    if device_of(model, inputs).type == "meta":
        yield inputs
        return
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    twins: dict[int, torch.Tensor] = {}

    def twin(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in twins:
            fake = mode.from_tensor(t)
            if t.requires_grad and not fake.requires_grad:
                fake.requires_grad_(True)
            twins[id(t)] = fake
        return twins[id(t)]

    state = {name: twin(p) for name, p in model.named_parameters(remove_duplicate=False)}
    state |= {name: twin(b) for name, b in model.named_buffers(remove_duplicate=False)}
    fake_inputs = _Inputs(
        pytree.tree_map_only(torch.Tensor, twin, inputs.args),
        pytree.tree_map_only(torch.Tensor, twin, inputs.kwargs),
    )
    grads = {name: p.grad for name, p in model.named_parameters()}
    try:
        with _reparametrize_module(model, state), mode:
            yield fake_inputs
    finally:
        for name, p in model.named_parameters():  # a stray fake gradient never survives
            p.grad = grads.get(name)


def is_fake(t: torch.Tensor) -> bool:
    """Whether ``t`` has shape and no data (a fake or meta tensor)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor) or t.device.type == "meta"
