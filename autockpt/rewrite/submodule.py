"""A submodule's own call, and a model with one submodule replaced: what planning inside a
submodule (``autockpt/planning/nested.py``) and applying such a plan
(``autockpt/rewrite/apply.py``) both need.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils import _pytree as pytree

from autockpt.base.inputs import Inputs
from autockpt.base.runtime import as_found
from autockpt.rewrite.result import shallow_copy


class _Reached(BaseException):
    """Raised by the pre-hook once the submodule's call is recorded: the run stops there.
    A BaseException (like GeneratorExit), so a forward's ``except Exception`` around the
    call cannot swallow it and run on into the un-checkpointed step."""


def submodule_inputs(model: nn.Module, path: str, inputs: Inputs) -> Inputs | None:
    """The ``(args, kwargs)`` of the root's first call of the submodule at ``path``, from a
    run of the root's forward that stops at that call (``None``: the forward never calls it).

    Tensors are detached, keeping the ``requires_grad`` they had, so the submodule is planned
    for the gradients the real step asks of it. The model, the inputs and every random
    generator are left as found (:func:`autockpt.base.runtime.as_found`): the prefix may draw
    dropout masks, move statistics or count steps.
    """
    recorded: list[Inputs] = []

    def detached(t: torch.Tensor) -> torch.Tensor:
        return t.detach().requires_grad_(t.requires_grad)

    def record(module: nn.Module, args: tuple, kwargs: dict) -> None:
        recorded.append(
            Inputs(
                pytree.tree_map_only(torch.Tensor, detached, tuple(args)),
                pytree.tree_map_only(torch.Tensor, detached, dict(kwargs)),
            )
        )
        raise _Reached

    # first among the hooks: the replacement module, which has none, is called with these
    handle = model.get_submodule(path).register_forward_pre_hook(
        record, with_kwargs=True, prepend=True
    )
    try:
        with as_found(model, inputs):
            model(*inputs.args, **inputs.kwargs)
    except _Reached:
        pass
    finally:
        handle.remove()
    return recorded[0] if recorded else None


def replace_submodule(model: nn.Module, path: str, replacement: nn.Module) -> nn.Module:
    """A new instance of ``model``'s class sharing everything with it but the module at
    ``path``, which is ``replacement``. The root and each module on the way to ``path`` are
    shallow copies with their own registries (so the user's tree is not changed); their
    parameters, buffers and other children are the user's own objects."""
    root = shallow_copy(model)
    parent = root
    *ancestors, name = path.split(".")
    for part in ancestors:
        clone = shallow_copy(parent._modules[part])
        parent._modules[part] = clone
        parent = clone
    parent._modules[name] = replacement
    return root
