"""Example inputs in call form, and the rule for keywords given as their default.

:class:`Inputs` is a data type every stage takes (capture, profile, record, measure, the
result's call checks), so it lives on the ground floor, not in the capture stage.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class Inputs:
    """Example inputs in call form: ``model(*args, **kwargs)``."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    @staticmethod
    def of(example_inputs: Any) -> Inputs:
        """Accept a Tensor, a tuple/list of positional arguments or a dict of keyword ones."""
        if isinstance(example_inputs, Inputs):
            return example_inputs
        if isinstance(example_inputs, torch.Tensor):
            return Inputs((example_inputs,), {})
        if isinstance(example_inputs, dict):
            return Inputs((), dict(example_inputs))
        if isinstance(example_inputs, (tuple, list)):
            return Inputs(tuple(example_inputs), {})
        raise TypeError(
            "example_inputs must be a Tensor, a tuple of positional arguments or a dict of "
            f"keyword arguments, got {type(example_inputs).__name__}"
        )

    def as_called(self, model: nn.Module) -> Inputs:
        """These inputs without keywords given as their parameter's very default object
        (``attention_mask=None``): the forward cannot tell such a call from one that leaves
        them out, and the optimized model treats both alike, so plans are made for that call
        (:func:`without_defaults`)."""
        try:
            signature = inspect.signature(model.forward)
        except (TypeError, ValueError):
            return self
        return Inputs(self.args, without_defaults(signature, self.kwargs))

    def tensors(self) -> list[torch.Tensor]:
        leaves = torch.utils._pytree.tree_leaves((self.args, self.kwargs))
        return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]

    def signature(self) -> str:
        """Shapes, dtypes and structure of the inputs: what a plan is specialised to."""

        def describe(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                return f"Tensor{list(value.shape)}:{str(value.dtype).removeprefix('torch.')}"
            if isinstance(value, (int, float, bool, str, type(None))):
                return repr(value)
            return type(value).__name__

        spec = torch.utils._pytree.tree_map(describe, (list(self.args), self.kwargs))
        return repr(spec)


def without_defaults(signature: inspect.Signature | None, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` without the named parameters given as their very default object: one rule
    for the calls plans are made for and the calls an optimized model receives."""
    if signature is None:
        return kwargs
    params = signature.parameters
    return {
        name: value
        for name, value in kwargs.items()
        if name not in params or value is not params[name].default
    }


def given_input_names(model: nn.Module, inputs: Inputs) -> tuple[str, ...]:
    """The forward parameters that ``inputs`` fills, in signature order."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return ()
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    given = {p.name for p in positional[: len(inputs.args)]} | set(inputs.kwargs)
    return tuple(p.name for p in params if p.name in given)
