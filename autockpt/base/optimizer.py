"""The user's optimizer in the budget: a stand-in that steps like it, and never touches it.

A user budgets the loop they run (``zero_grad``, forward, backward, ``optimizer.step()``),
so what a plan must fit is the whole iteration from steady state: the optimizer's state
(Adam's ``exp_avg`` and ``exp_avg_sq``, SGD's ``momentum_buffer``, any optimizer's own) is
resident for the whole iteration, and its step makes temporaries of its own while the
gradients are alive (``foreach`` and ``fused`` implementations allocate lists of
intermediates). Neither is known from a table of classes: autockpt runs a *stand-in* of
the user's optimizer (:func:`stand_in`: a copy with the same class and hyperparameters,
over other tensors, with state of its own and none of the user's hooks) on fake tensors while recording
the step (``autockpt/costs/record.py``, NOTE [record: optimizer step]), and on the real
parameters when it measures one (``autockpt/measure.py``). The user's optimizer, its state,
``param_groups`` and step counts stay as found.

Why a copy and not the optimizer itself: the state it makes on its first step is created
lazily (``torch.optim`` fills ``self.state`` inside ``step``), and a real step would also
move the parameters and the step counts. Why ``type(optimizer).step``: an instance may have
its ``step`` wrapped (an LR scheduler counts calls that way); the stand-in calls the class's.
"""

from __future__ import annotations

import copy
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Collection

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from autockpt.base.allocations import StorageSet
from autockpt.base.runtime import outside_the_forward
from autockpt.errors import OptimizerError


def check_optimizer(optimizer: object, model: nn.Module) -> torch.optim.Optimizer:
    """``optimizer`` if it is one autockpt can budget for ``model``, else
    :class:`~autockpt.errors.OptimizerError` (before any work): a ``torch.optim.Optimizer``
    whose parameters are parameters of ``model`` (all of them or a subset; frozen ones have
    no gradient, so no state). An optimizer of tensors outside the model updates memory the
    plan does not see: plan the model those tensors belong to."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise OptimizerError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}: pass "
            "the optimizer your training loop steps (e.g. torch.optim.AdamW(model.parameters()))"
        )
    own = {id(p) for p in model.parameters()}
    outside = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in own]
    if outside:
        shapes = ", ".join(str(list(p.shape)) for p in outside[:3])
        raise OptimizerError(
            f"the {type(optimizer).__name__} holds {len(outside)} tensor(s) that are not "
            f"parameters of this {type(model).__name__} (shapes {shapes}"
            f"{', ...' if len(outside) > 3 else ''}); build the optimizer from the model you "
            "plan (model.parameters()), or plan the model those tensors belong to"
        )
    return optimizer


def stand_in(
    optimizer: torch.optim.Optimizer, tensor_of: Callable[[torch.Tensor], torch.Tensor]
) -> torch.optim.Optimizer:
    """A copy of ``optimizer`` over ``tensor_of(p)`` for each of its parameters ``p``: the
    same class, hyperparameters and defaults, no state yet, no instance hooks, and no dict
    or list shared with the original (stepping it leaves the user's optimizer as found)."""
    copied = copy.copy(optimizer)
    vars(copied).pop("step", None)  # an instance-level wrapper (an LR scheduler's counter)
    copied.state = defaultdict(dict)
    copied.param_groups = [
        {**group, "params": [tensor_of(p) for p in group["params"]]}
        for group in optimizer.param_groups
    ]
    copied.defaults = dict(optimizer.defaults)
    for hooks in (  # the user's hooks act on the user's optimizer, not on a stand-in
        "_optimizer_step_pre_hooks",
        "_optimizer_step_post_hooks",
        "_optimizer_state_dict_pre_hooks",
        "_optimizer_state_dict_post_hooks",
        "_optimizer_load_state_dict_pre_hooks",
        "_optimizer_load_state_dict_post_hooks",
    ):
        if hooks in vars(copied):
            setattr(copied, hooks, OrderedDict())
    return copied


def step(optimizer: torch.optim.Optimizer) -> None:
    """One step of (a stand-in of) an optimizer, as the training loop takes it; an optimizer
    whose step needs a closure (L-BFGS) is refused with :class:`OptimizerError`. Inside a
    fake step its writes to the parameters are not the forward's (NOTE [runtime: parameters
    the forward writes])."""
    try:
        with outside_the_forward():
            type(optimizer).step(optimizer)
    except TypeError as error:
        if "closure" in str(error):
            raise OptimizerError(
                f"{type(optimizer).__name__}.step needs a closure (it evaluates the loss "
                "several times per step); autockpt budgets optimizers stepped as "
                "optimizer.step()"
            ) from error
        raise


def state_bytes(optimizer: torch.optim.Optimizer, stepped: Collection[int]) -> int:
    """Bytes of the state ``optimizer`` keeps after a step in which the parameters whose
    ``id`` is in ``stepped`` have a gradient (the others have none, so get no state): a
    stand-in stepped once on fake tensors, before anything is profiled. No memory for data
    is allocated and the user's optimizer is left as found."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    twins: dict[int, torch.Tensor] = {}

    def twin(p: torch.Tensor) -> torch.Tensor:
        if id(p) not in twins:
            fake = mode.from_tensor(p)
            if id(p) in stepped:
                with mode:
                    fake.grad = torch.zeros_like(fake)
            twins[id(p)] = fake
        return twins[id(p)]

    stepping = stand_in(optimizer, twin)
    with mode:
        step(stepping)
    return StorageSet().add(state_tensors(stepping))


def state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor in the optimizer's state (what stays resident between steps)."""
    found: list[torch.Tensor] = []
    for per_param in optimizer.state.values():
        for value in per_param.values():
            if isinstance(value, torch.Tensor):
                found.append(value)
    return found


def zero_grad(parameters: list[torch.Tensor]) -> None:
    """``optimizer.zero_grad()`` as torch does it by default (``set_to_none=True``)."""
    for p in parameters:
        p.grad = None


def parameters_of(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters, once each, in group order."""
    seen: set[int] = set()
    found = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in seen:
                seen.add(id(p))
                found.append(p)
    return found
