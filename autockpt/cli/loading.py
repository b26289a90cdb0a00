"""What the commands load from names the user gives: a model SPEC, a loss, a plan file.

``package.module:factory`` specs are imported from the current directory and checked to
return ``(model, example_inputs[, loss_fn])``; every failure becomes a :class:`SpecError`
(or a plan error) with one readable line, never a traceback. torch loads only once a
factory has been called.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

from autockpt.cli.exits import SpecError


def load_spec(spec: str, loss: str | None = None) -> tuple[Any, Any, Any]:
    """Import ``package.module:factory`` and call it; return ``(model, example_inputs,
    loss_fn)``: the factory's third item when it returns one, else ``--loss``'s function
    (which wins when both are given), else None (the default loss)."""
    return _call_factory(spec, load_factory(spec), loss=loss)


def load_factory(spec: str, what: str = "model SPEC") -> Callable[..., Any]:
    """Import ``package.module:factory`` and return the factory (not called)."""
    if ":" not in spec:
        shape = "package.module:factory" if what == "model SPEC" else "package.module:function"
        raise SpecError(f"{what} must look like {shape}, got {spec!r}")
    module_name, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # noqa: BLE001 - any import failure is the user's SPEC
        raise SpecError(
            f"cannot import {module_name!r}: {type(error).__name__}: {error}"
        ) from error
    factory: Callable[[], Any] | None = getattr(module, attr, None)
    if not callable(factory):
        raise SpecError(f"{module_name!r} has no callable {attr!r}")
    return factory


def _call_factory(
    spec: str, factory: Callable[..., Any], *args: Any, loss: str | None = None
) -> tuple[Any, Any, Any]:
    """``factory(*args)``, checked to return ``(model, example_inputs)`` or ``(model,
    example_inputs, loss_fn)``; ``loss`` (``--loss``) names a loss function that replaces
    the factory's. Returns the three, the loss None when neither gives one."""
    try:
        result = factory(*args)
    except Exception as error:  # noqa: BLE001
        call = f"{spec}({', '.join(map(repr, args))})" if args else spec
        raise SpecError(f"{call} raised {type(error).__name__}: {error}") from error
    shape = "(model, example_inputs) or (model, example_inputs, loss_fn)"
    if not (isinstance(result, tuple) and len(result) in (2, 3)):
        raise SpecError(f"{spec} must return {shape}, got {type(result).__name__}")
    from torch import nn

    if not isinstance(result[0], nn.Module):
        raise SpecError(
            f"{spec} must return {shape} with a torch.nn.Module first, got "
            f"{type(result[0]).__name__}"
        )
    loss_fn = result[2] if len(result) == 3 else None
    if loss_fn is not None and not callable(loss_fn):
        raise SpecError(
            f"{spec} returned a loss_fn that is not callable ({type(loss_fn).__name__}): "
            "return a function of the model's output that gives the scalar loss"
        )
    if loss is not None:
        loss_fn = load_factory(loss, "--loss")
    return result[0], result[1], loss_fn


def _load_plan(path: str) -> Any:
    from autockpt.plan import Plan

    try:
        return Plan.load(path)
    except FileNotFoundError as error:
        raise FileNotFoundError(f"plan file {path} not found") from error
    except OSError as error:
        from autockpt.errors import PlanFormatError

        raise PlanFormatError(f"cannot read plan file {path}: {error.strerror or error}") from error
