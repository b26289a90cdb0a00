"""Which parameters one training step trains, and which node's backward makes each gradient.

Backward creates a parameter's gradient when it reaches the parameter's *last* forward user,
so that node is where the gradient's bytes appear. The profile (autockpt/costs/profile.py)
charges them there (``NodeProfile.param_grad_bytes``), and the planning stage reads the same
answer (:func:`trained_parameters`). Its own module because it reads the graph and the
model only: neither the fake step nor the probe.
"""

from __future__ import annotations

import torch.fx as fx
from torch import nn

from autockpt.capture.captured import Capture


def trained_parameters(
    model: nn.Module, capture: Capture, index_of: dict[fx.Node, int]
) -> dict[int, tuple[nn.Parameter, int]]:
    """The parameters that require a gradient and that the graph uses, by ``id``, each with
    the index of its *last* forward user (backward meets it first, and creates its
    gradient there)."""
    params = {name: p for name, p in model.named_parameters(remove_duplicate=False)}
    trainable = {id(p) for p in params.values() if p.requires_grad}
    last_user: dict[int, tuple[nn.Parameter, int]] = {}

    def touch(param: nn.Parameter, i: int) -> None:
        if id(param) in trainable:
            last_user[id(param)] = (param, max(last_user.get(id(param), (param, -1))[1], i))

    for node in capture.graph.nodes:
        if node.op == "get_attr" and node.target in params:
            for user in node.users:
                if user in index_of:
                    touch(params[node.target], index_of[user])
        elif node.op == "call_module":
            for p in model.get_submodule(node.target).parameters():
                touch(p, index_of[node])
    return last_user


def _param_grad_attribution(
    model: nn.Module, capture: Capture, index_of: dict[fx.Node, int]
) -> tuple[dict[int, int], int]:
    """Bytes of parameter gradients by the node whose backward creates them: the *last*
    forward user of the parameter (backward meets it first)."""
    grads: dict[int, int] = {}
    for p, i in trained_parameters(model, capture, index_of).values():
        grads[i] = grads.get(i, 0) + p.numel() * p.element_size()
    trainable = {id(p): p for p in model.parameters() if p.requires_grad}
    total = sum(p.numel() * p.element_size() for p in trainable.values())
    return grads, total
