"""The root's module calls, recorded from one run of its forward, and a model with some
submodules replaced: what planning a model that cannot be captured whole
(``autockpt/planning/nested.py``) and applying such a plan (``autockpt/rewrite/apply.py``)
both need.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn
from torch.utils import _pytree as pytree

from autockpt.base.inputs import Inputs
from autockpt.base.rng import RngStates, worst_case_draws
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
    """:func:`replace_submodules` of one module."""
    return replace_submodules(model, {path: replacement})


def replace_submodules(model: nn.Module, replacements: dict[str, nn.Module]) -> nn.Module:
    """A new instance of ``model``'s class sharing everything with it but the modules at the
    given paths, which are replaced. The root and each module on the way to a path are
    shallow copies with their own registries (so the user's tree is not changed); their
    parameters, buffers and other children are the user's own objects."""
    root = shallow_copy(model)
    copied: dict[str, nn.Module] = {"": root}
    for path, replacement in replacements.items():
        parent, prefix = root, ""
        *ancestors, name = path.split(".")
        for part in ancestors:
            prefix = f"{prefix}.{part}" if prefix else part
            if prefix not in copied:
                copied[prefix] = shallow_copy(parent._modules[part])
                parent._modules[part] = copied[prefix]
            parent = copied[prefix]
        parent._modules[name] = replacement
    return root


@dataclasses.dataclass(frozen=True)
class Call:
    """One module's calls in a run of the root's forward (:func:`record_calls`)."""

    path: str
    caller: str
    """The innermost module running when it was called ("" for the root's own code)."""
    order: int
    """Its first call's place among all module calls of the run."""
    count: int
    inputs: Inputs | None
    """Its first call's ``(args, kwargs)`` (detached, ``requires_grad`` as in the step);
    recorded only where :func:`record_calls` was asked to."""


@dataclasses.dataclass(frozen=True)
class Recorded:
    """One recorded run of the root's forward (:func:`record_calls`)."""

    calls: dict[str, Call]
    """Every submodule called, by qualified name."""
    python_draws: tuple[str, ...]
    """The global generators other than torch's that the run drew from (``"random"``,
    ``"numpy"``): their draws are not at their worst case, so a layer skipped by
    ``random() < p`` may not have been called (and may be in another step)."""


def record_calls(model: nn.Module, inputs: Inputs, wanted: Callable[[str, str], bool]) -> Recorded:
    """Every submodule call of one run of the root's forward, by qualified name, with the
    inputs of the first call of each module for which ``wanted(path, caller)`` is true
    (``caller``: the innermost module running, "" for the root's own code).

    The run keeps nothing for a backward (saved tensors are dropped as autograd packs
    them), so it holds one forward's temporaries and the recorded inputs, never the
    un-checkpointed step's activations; every ``requires_grad`` is what the real step
    gives. Scalar draws run at their worst case (every LayerDrop layer is called), and the
    model, the inputs and every random generator are left as found."""
    names = {id(m): name for name, m in model.named_modules()}
    stack: list[str] = [""]
    first: dict[str, tuple[str, int, Inputs | None]] = {}
    counts: dict[str, int] = {}

    def detached(t: torch.Tensor) -> torch.Tensor:
        return t.detach().requires_grad_(t.requires_grad)

    def before(module: nn.Module, args: tuple, kwargs: dict) -> None:
        path = names[id(module)]
        caller = stack[-1]
        counts[path] = counts.get(path, 0) + 1
        if path not in first:
            recorded = None
            if wanted(path, caller):
                recorded = Inputs(
                    pytree.tree_map_only(torch.Tensor, detached, tuple(args)),
                    pytree.tree_map_only(torch.Tensor, detached, dict(kwargs)),
                )
            first[path] = (caller, len(first), recorded)
        stack.append(path)

    def after(module: nn.Module, args: tuple, output: object) -> None:
        stack.pop()

    handles = []
    for name, module in model.named_modules():
        if name:
            handles.append(module.register_forward_pre_hook(before, with_kwargs=True, prepend=True))
            handles.append(module.register_forward_hook(after))
    try:
        with (
            as_found(model, inputs),
            torch.autograd.graph.saved_tensors_hooks(lambda t: None, _unpack_dropped),
            worst_case_draws(),
        ):
            before = RngStates.now()
            model(*inputs.args, **inputs.kwargs)
            moved = tuple(g for g in before.changed() if not g.startswith("torch"))
    finally:
        for handle in handles:
            handle.remove()
    calls = {
        path: Call(path, caller, order, counts[path], recorded)
        for path, (caller, order, recorded) in first.items()
    }
    return Recorded(calls, moved)


def _unpack_dropped(_: object) -> torch.Tensor:
    raise RuntimeError("record_calls runs no backward")


def sibling_path(model: nn.Module, path: str, usable: Callable[[str], bool]) -> str | None:
    """The nearest module that stands in for ``path`` in a container above it: the same
    place (the same names below) in another child of that container, of the same class as
    ``path`` and ``usable`` (``layers.3.attn`` for ``layers.5.attn``; nearest child first,
    before it first, then the next container up). Its recorded call stands in for a call
    the recorded run did not make: a routed expert, a layer skipped by a draw."""
    parts = path.split(".")
    own = type(model.get_submodule(path))
    for depth in range(len(parts) - 1, -1, -1):
        container = model.get_submodule(".".join(parts[:depth]))
        if not isinstance(container, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
            continue
        names = list(container._modules)
        here = names.index(parts[depth])
        for k in sorted(range(len(names)), key=lambda k: (abs(k - here), k > here)):
            if k == here:
                continue
            candidate = ".".join([*parts[:depth], names[k], *parts[depth + 1 :]])
            try:
                module = model.get_submodule(candidate)
            except AttributeError:
                continue
            if type(module) is own and usable(candidate):
                return candidate
    return None
