"""Tracing a meta model as the device it will run on (NOTE [capture: meta traced as a device]).

NOTE [capture: meta traced as a device]. ``torch.export`` records what the kernels it traces
return, strides included, and keeps what they imply: a ``.contiguous()`` after scaled-dot-
product attention's transpose is a copy node where the kernel's output is not laid out for
it (the meta device's math path) and nothing where it is (the fused kernels). An export graph
traced on meta is therefore another graph than the same model's on the device: its plan
does not apply there, and it counts a copy per attention layer the run never makes. So a
meta model is exported as its planning step runs (NOTE [runtime: meta runs as a device]):
parameters, buffers and inputs replaced by the fake step's twins (``fake_twin``), in a fake mode
with a shape environment (export keeps sizes dynamic in it). The graph module export hands
back holds those fake tensors; they are put back as meta tensors of the same layout, so the
capture holds no tensor of a finished fake mode.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from autockpt.base.inputs import Inputs
from autockpt.base.runtime import device_of, fake_twin

__all__ = ["on_meta_again", "traced_as_device"]


@contextmanager
def traced_as_device(model: nn.Module, inputs: Inputs) -> Iterator[Inputs]:
    """Inside, a meta ``model`` holds fake CPU twins of its parameters and
    buffers, and the yielded inputs are twins of ``inputs``; any other model and its inputs
    are yielded as they are."""
    if device_of(model, inputs).type != "meta":
        yield inputs
        return
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch.nn.utils.stateless import _reparametrize_module

    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    twins: dict[int, torch.Tensor] = {}

    def twin(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in twins:
            twins[id(t)] = fake_twin(mode, t)  # the fake step's own twin (runtime.py)
        return twins[id(t)]

    parameters: dict[int, nn.Parameter] = {}  # one per tensor: ties stay ties
    for p in model.parameters():
        parameters[id(p)] = nn.Parameter(twin(p), requires_grad=p.requires_grad)
    state: dict[str, torch.Tensor] = {
        name: parameters[id(p)] for name, p in model.named_parameters(remove_duplicate=False)
    }
    state |= {name: twin(b) for name, b in model.named_buffers(remove_duplicate=False)}
    faked = Inputs(
        pytree.tree_map_only(torch.Tensor, twin, inputs.args),
        pytree.tree_map_only(torch.Tensor, twin, inputs.kwargs),
    )
    with _reparametrize_module(model, state, tie_weights=True):
        yield faked


def on_meta_again(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with every fake tensor it holds (parameters, buffers, lifted constants) replaced
    by a meta tensor of the same shape, strides and dtype (NOTE [capture: meta traced as a
    device])."""
    from torch._subclasses.fake_tensor import FakeTensor

    def meta(t: torch.Tensor) -> torch.Tensor:
        return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="meta")

    for module in gm.modules():
        for name, p in list(module._parameters.items()):
            if isinstance(p, FakeTensor) or isinstance(getattr(p, "data", None), FakeTensor):
                module._parameters[name] = nn.Parameter(meta(p), requires_grad=p.requires_grad)
        for name, b in list(module._buffers.items()):
            if isinstance(b, FakeTensor):
                module._buffers[name] = meta(b)
        for name, value in list(vars(module).items()):
            if isinstance(value, FakeTensor):
                setattr(module, name, meta(value))
    return gm
