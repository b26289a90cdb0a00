"""The module tree a plan's graph was captured from, and the check that it is still there.

Why
---
A captured graph holds the code of the modules it traced through: ``torch.export`` inlines
every module and reads weights by path (``get_attr``); fx inlines every module that is not a
leaf. An optimized model resolves those paths on the live tree at each call, so replacing a
module after planning changes what the paths lead to, not what the graph computes. The case
that matters is adapters: ``peft.get_peft_model(optimized, LoraConfig(...))`` replaces each
targeted ``Linear`` by a LoRA layer holding it as ``base_layer``; an export graph (or an fx
graph that traced through the layer) keeps computing ``x @ W.T`` with the base weight, and
the adapters are silently bypassed. The plan's memory is also not the adapted model's (the
base weights stop needing gradients).

So a result remembers the class of every module of the model it was made from
(:class:`ModuleTree`), and each training call checks it (:func:`check_tree`): a module whose
class changed raises :class:`~autockpt.errors.PlanMismatchError` saying the order that works
(adapt, then optimize). A module replaced by another of the same class (a fresh ``Linear``)
is fine: the graph resolves its parameters at call time and computes what eager computes.
Adapter layers also carry state that a graph bakes in (merged, disabled, which adapter is
active: ``merge_adapter()``, ``disable_adapter()``, ``set_adapter()``); it is remembered and
checked the same way, duck-typed on PEFT's tuner layers.

Calls without autograd or in the other training mode run the original forward on the live
tree (``autockpt/rewrite/``), adapters and all, so they are not checked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autockpt.errors import PlanMismatchError

__all__ = ["ModuleTree", "check_tree", "tree_problem"]


@dataclass(frozen=True)
class ModuleTree:
    """The modules of a model by path, parents before children (``named_modules()``
    order), with their classes; and the state of each adapter layer among them."""

    classes: tuple[tuple[str, type], ...] = ()
    adapters: tuple[tuple[str, Any], ...] = ()

    @staticmethod
    def of(model: nn.Module) -> ModuleTree:
        modules = list(model.named_modules())
        return ModuleTree(
            tuple((path, type(module)) for path, module in modules),
            tuple(
                (path, state)
                for path, module in modules
                if (state := _adapter_state(module)) is not None
            ),
        )

    def change(self, model: nn.Module) -> str | None:
        """How ``model``'s tree differs from this one (None: it does not)."""
        found: dict[str, nn.Module | None] = {}
        for path, cls in self.classes:
            if not path:
                module: nn.Module | None = model
            else:
                parent_path, _, name = path.rpartition(".")
                parent = found.get(parent_path)
                module = parent._modules.get(name) if parent is not None else None
            found[path] = module
            if not isinstance(module, cls):
                where = f"module '{path}'" if path else "the root module"
                now = "gone" if module is None else f"a {_class_name(type(module))}"
                return f"{where} is {now}; it was a {_class_name(cls)} when planned"
        for path, state in self.adapters:
            module = found.get(path)
            if module is not None and _adapter_state(module) != state:
                return (
                    f"the adapter layer '{path}' changed state (merged, disabled or active "
                    f"adapters: {state} when planned, {_adapter_state(module)} now)"
                )
        return None


def check_tree(module: nn.Module, tree: ModuleTree | None) -> None:
    """Raise :class:`PlanMismatchError` when ``module``'s tree is not the one its graph was
    captured from (see the module docstring); nothing when ``tree`` is None."""
    problem = tree_problem(module, tree)
    if problem:
        raise PlanMismatchError(problem)


@torch.compiler.assume_constant_result
def tree_problem(module: nn.Module, tree: ModuleTree | None) -> str:
    """:func:`check_tree`'s verdict: the error's message, or "". Under ``torch.compile`` it
    runs once per trace, outside the graph: a compiled graph is guarded on the modules it
    reads, so a replaced module traces again and checks again."""
    change = tree.change(module) if tree is not None else None
    if change is None:
        return ""
    return (
        f"this optimized {type(module).__name__} was planned for another module tree: "
        f"{change}. Its checkpointed graph holds the planned modules' code and would not "
        "run the new ones (adapters such as LoRA would be bypassed), and the plan's memory "
        "is not the new model's. Apply adapters first, then optimize: "
        "`model = peft.get_peft_model(model, config); model = autockpt.optimize(model, ...)` "
        "(or plan again after changing the model)"
    )


def _adapter_state(module: nn.Module) -> Any:
    """A PEFT tuner layer's state that a traced graph bakes in (None for other modules)."""
    if not all(
        hasattr(module, a) for a in ("merged_adapters", "_disable_adapters", "_active_adapter")
    ):
        return None
    active = module._active_adapter
    return (
        tuple(module.merged_adapters),
        bool(module._disable_adapters),
        (active,) if isinstance(active, str) else tuple(active),
    )


def _class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
