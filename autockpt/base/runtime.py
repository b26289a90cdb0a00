"""Helpers shared by the stages that run real training steps (profile, measure, CLI).

A training step here is ``loss_fn(model(*args, **kwargs)).backward()``; these helpers pick
the loss, find the device, time on it, and make trial steps leave no trace in the model,
the caller's inputs or the global random generators (:func:`as_found`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import gc
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.utils import _pytree as pytree

from autockpt.base.inputs import Inputs
from autockpt.base.rng import RngStates
from autockpt.errors import DefaultLossWarning

LossFn = Callable[[Any], torch.Tensor]


DEFAULT_LOSS = "default"
"""What a plan records as its loss when no ``loss_fn`` was given (:func:`default_loss`)."""

_summed_once = False  # whether the summed-output message was given in this process


def default_loss(output: Any) -> torch.Tensor:
    """The scalar to differentiate when the user gives no ``loss_fn``: the output's ``loss``
    field when it has one (Hugging Face style), else the sum over its floating tensors.

    The sum is rarely the loss a user trains with, and a loss's own kernels and
    intermediates are part of the step's peak (a cross-entropy over logits keeps a
    logits-sized tensor), so the first summed step in a process says so once
    (:class:`autockpt.DefaultLossWarning`)."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if isinstance(loss, torch.Tensor):
        return loss
    _say_summed_once()
    return _summed(output)


def unit_loss(output: Any) -> torch.Tensor:
    """The loss a unit of a larger step is planned with (autockpt/planning/nested.py): the
    sum of its floating outputs, so the gradient reaching them has the shape the real step
    gives it. Quiet: the loss the user trains with is the root's, planned and measured
    around the units."""
    return _summed(output)


def _summed(output: Any) -> torch.Tensor:
    tensors = [
        t
        for t in pytree.tree_leaves(_as_pytree(output))
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad
    ]
    if not tensors:
        raise ValueError(
            "the model's output has no floating tensor that requires grad; pass loss_fn= "
            "mapping the output to a scalar loss"
        )
    return sum(t.float().sum() for t in tensors)


DATA_DEPENDENT = (DataDependentOutputException, DynamicOutputShapeException)
"""What fake tensors raise where an operator's result depends on values (``.item()``,
``nonzero``)."""


def loss_on_fake(loss_fn: LossFn, output: Any) -> tuple[torch.Tensor, bool]:
    """``loss_fn(output)`` on the fake step's output, and False; for a loss that reads a
    value (``.item()``: fake tensors have none), the sum of the output's floating tensors
    instead, and True. Such a loss is measured: the probe runs it on real tensors and the
    recorder moves the loss's windows to what the allocator saw (NOTE [record: loss
    windows]); plans say so."""
    try:
        return loss_fn(output), False
    except DATA_DEPENDENT:
        return _summed(output), True


def _say_summed_once() -> None:
    global _summed_once
    if _summed_once:
        return
    _summed_once = True
    warnings.warn(
        "no loss_fn given and the model's output has no `loss`: autockpt differentiates the "
        "sum of the output's floating tensors, and plans and checks the budget for that loss. "
        "The loss you train with has its own memory (a cross-entropy keeps a logits-sized "
        "tensor): pass loss_fn= (command line: --loss package.module:function, or a factory "
        "returning (model, example_inputs, loss_fn)).",
        DefaultLossWarning,
        stacklevel=3,
    )


def loss_name(loss_fn: LossFn | None) -> str:
    """How a plan names its loss: ``"default"`` (:func:`default_loss`), else the callable's
    ``module:qualname`` (a ``functools.partial`` by its function), so that a plan applied or
    verified with another loss can tell."""
    if loss_fn is None or loss_fn is default_loss or loss_fn is unit_loss:
        return DEFAULT_LOSS
    target = loss_fn.func if isinstance(loss_fn, functools.partial) else loss_fn
    module = getattr(target, "__module__", None) or type(target).__module__
    qualname = getattr(target, "__qualname__", None) or type(target).__qualname__
    return f"{module}:{qualname}"


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
def as_found(model: nn.Module, inputs: Any = ()) -> Iterator[None]:
    """Run a block (planning, profiling, a measured step) and leave everything as it was
    found: the model, the caller's input tensors and the global random generators.

    * Every submodule's training flag, and which tensor object each buffer and parameter
      slot holds: a forward may *replace* a registered buffer (timm's ConViT builds its
      table on the first call), so slots are put back by reassignment, buffers the block
      registered are removed, one it set to ``None`` comes back. Each original buffer
      object gets its original values back (in place; its original shape if it was
      resized). Copying saved values into whatever object sits in the slot now would
      write a placeholder into the new table.
    * Parameter ``.grad`` (the same objects, never accumulated into: the block starts from
      no gradient). Parameter values are not copied: trial steps never step an optimizer.
    * Input tensors (``inputs``: anything holding tensors, e.g.
      :class:`~autockpt.base.inputs.Inputs`) that the block wrote -- a forward that updates its
      input in place -- get their values back, from a host copy taken on entry (no device
      memory); tensors it did not write are not touched, so their version counters do not move.
      A leaf input's ``.grad`` is restored like a parameter's.
    * torch's CPU and CUDA, Python's and NumPy's global generators (:mod:`autockpt.base.rng`).
    """
    rng = RngStates.now()
    state = _ModelState(model)
    held = _InputState(inputs)
    # Trial steps start from no gradient: a backward would otherwise accumulate into the
    # caller's own .grad tensors in place, and restoring the references would not undo it.
    for t, _ in state.grads + held.grads:
        t.grad = None
    try:
        yield
    finally:
        try:
            state.restore()
            held.restore()
        finally:
            rng.restore()


@contextmanager
def preserved_training_state(model: nn.Module) -> Iterator[None]:
    """:func:`as_found` for the model alone: trial steps on it leave no trace in training."""
    with as_found(model):
        yield


_ABSENT = object()


class _ModelState:
    """The model's slots and values on entry to :func:`as_found` (one entry per module
    object, shared ones once)."""

    def __init__(self, model: nn.Module) -> None:
        self.modules = list(model.modules())
        self.training = [m.training for m in self.modules]
        self.buffers = [dict(m._buffers) for m in self.modules]
        self.non_persistent = [set(m._non_persistent_buffers_set) for m in self.modules]
        self.parameters = [dict(m._parameters) for m in self.modules]
        self.values: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for buffers in self.buffers:
            for b in buffers.values():
                if b is not None and id(b) not in self.values:
                    self.values[id(b)] = (b, b.detach().clone())
        self.grads = [(p, p.grad) for p in model.parameters()]

    def restore(self) -> None:
        for m, training, buffers, non_persistent, parameters in zip(
            self.modules,
            self.training,
            self.buffers,
            self.non_persistent,
            self.parameters,
            strict=True,
        ):
            m.training = training
            _put_slots(m._buffers, buffers)
            _put_slots(m._parameters, parameters)
            m._non_persistent_buffers_set.clear()
            m._non_persistent_buffers_set.update(non_persistent)
        for b, saved in self.values.values():
            put_back(b, saved)
        for p, grad in self.grads:
            p.grad = grad


def _put_slots(slots: dict[str, Any], found: dict[str, Any]) -> None:
    """Make ``slots`` hold exactly the objects of ``found``, in its order."""
    if len(slots) == len(found) and all(slots.get(k, _ABSENT) is v for k, v in found.items()):
        return
    slots.clear()
    slots.update(found)


def put_back(t: torch.Tensor, saved: torch.Tensor, *, if_changed: bool = True) -> None:
    """Give the tensor object ``t`` the values (and shape) of ``saved``. With ``if_changed``
    only when they differ (kernels update running statistics without bumping version
    counters: values are the witness, and an untouched tensor keeps its version); the
    comparison waits for the device, so a training step's hot path passes False."""
    if is_fake(t):
        return
    with torch.no_grad():
        if t.shape == saved.shape and t.dtype == saved.dtype and t.device == saved.device:
            if not (if_changed and torch.equal(t, saved)):
                t.copy_(saved)
        else:  # resized in place (or its data swapped): the original shape comes back too
            t.data = saved


class _InputState:
    """The caller's input tensors on entry to :func:`as_found`: version counter and a host
    copy of the values of each, and a leaf's ``.grad``."""

    def __init__(self, inputs: Any) -> None:
        self.tensors: list[tuple[torch.Tensor, int, torch.Tensor | None]] = []
        seen: set[int] = set()
        for t in tensors_in(inputs):
            if id(t) in seen:
                continue
            seen.add(id(t))
            copy = None if is_fake(t) else t.detach().to("cpu", copy=True)
            self.tensors.append((t, _version(t), copy))
        self.grads = [(t, t.grad) for t, _, _ in self.tensors if t.is_leaf and t.requires_grad]

    def restore(self) -> None:
        for t, version, copy in self.tensors:
            # an inference tensor has no version counter: compare its values instead
            if copy is not None and (version is None or _version(t) != version):
                put_back(t, copy.to(t.device))
        for t, grad in self.grads:
            t.grad = grad


def _version(t: torch.Tensor) -> int | None:
    return None if t.is_inference() else t._version


def device_of(model: nn.Module, inputs: Inputs) -> torch.device:
    for t in list(model.parameters()) + inputs.tensors():
        return t.device
    return torch.device("cpu")


def now(device: torch.device | None) -> float:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@contextmanager
def fake_step(
    model: nn.Module, inputs: Inputs, twins: dict[int, torch.Tensor] | None = None
) -> Iterator[Inputs]:
    """Run a step of ``model`` on fake tensors: shapes, dtypes, devices, strides and storage
    aliasing exactly as a real step, and no memory for data (NOTE [record: fake sizes]).

    Inside the block the model's parameters and buffers are replaced by fake twins (ties
    kept: one twin per tensor object) and the yielded inputs are fake; on exit the real
    tensors are back and untouched (a fake step's gradients land on the twins). Tensors the
    graph holds itself (constants an export capture lifted) are converted when first used.
    On the meta device there is nothing to fake: the model and inputs are yielded as given.
    ``twins``, when given, is filled with each real tensor's twin, by ``id`` of the real one
    (what an optimizer's stand-in steps: autockpt/base/optimizer.py).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.utils.stateless import _reparametrize_module

    if device_of(model, inputs).type == "meta":
        yield inputs
        return
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    twins = {} if twins is None else twins

    def twin(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in twins:
            fake = mode.from_tensor(t)
            if t.requires_grad and not fake.requires_grad:
                fake.requires_grad_(True)
            twins[id(t)] = fake
        return twins[id(t)]

    state = {name: twin(p) for name, p in model.named_parameters(remove_duplicate=False)}
    state |= {name: twin(b) for name, b in model.named_buffers(remove_duplicate=False)}
    fake_inputs = Inputs(
        pytree.tree_map_only(torch.Tensor, twin, inputs.args),
        pytree.tree_map_only(torch.Tensor, twin, inputs.kwargs),
    )
    grads = {name: p.grad for name, p in model.named_parameters()}
    try:
        with _reparametrize_module(model, state), mode, caches_as_found(model):
            yield fake_inputs
    finally:
        for name, p in model.named_parameters():  # a stray fake gradient never survives
            p.grad = grads.get(name)


@contextmanager
def caches_as_found(model: nn.Module) -> Iterator[None]:
    """Empty, on exit, every ``functools.lru_cache`` of the model's own code that the block
    filled (NOTE [runtime: caches]).

    NOTE [runtime: caches]. Model code caches tensors across calls: Hugging Face's BEiT
    builds its relative position index once per window size in a process-wide
    ``lru_cache``. Run on fake tensors (a fake step, ``torch.export``'s tracing), it caches
    a *fake* index, and every later real step of any instance (the user's eager model
    included) gets it back and fails (``DataDependentOutputException``) or computes with a
    tensor that has no data. A cache is state the block must leave as found; emptying the
    caches it filled costs the model one recomputation. Which caches: those defined in the
    modules and classes of the model's own modules (directly, or one closure deep, as
    ``transformers.pytorch_utils.compile_compatible_method_lru_cache`` hides its cache),
    torch's own excepted; "filled" is a cache miss counted during the block."""
    before = {id(cache): cache.cache_info().misses for cache in _model_caches(model)}
    try:
        yield
    finally:
        for cache in _model_caches(model):
            if cache.cache_info().misses != before.get(id(cache), 0):
                cache.cache_clear()


def _model_caches(model: nn.Module) -> list[Any]:
    """The ``lru_cache`` wrappers reachable from the classes of ``model``'s modules and the
    modules defining them (NOTE [runtime: caches])."""
    namespaces: dict[int, dict[str, Any]] = {}
    for module in model.modules():
        for cls in type(module).__mro__:
            if cls.__module__.split(".")[0] in ("torch", "builtins"):
                continue
            namespaces.setdefault(id(cls), vars(cls))
            defining = sys.modules.get(cls.__module__)
            if defining is not None:
                namespaces.setdefault(id(defining), vars(defining))
    caches: dict[int, Any] = {}
    for namespace in namespaces.values():
        for value in list(namespace.values()):
            function = getattr(value, "__func__", value)  # staticmethod, classmethod
            candidates = [function]
            for cell in getattr(function, "__closure__", None) or ():
                try:
                    candidates.append(cell.cell_contents)
                except ValueError:  # an empty cell
                    continue
            for candidate in candidates:
                if isinstance(candidate, functools._lru_cache_wrapper):
                    caches[id(candidate)] = candidate
    return list(caches.values())


def is_fake(t: torch.Tensor) -> bool:
    """Whether ``t`` has shape and no data (a fake or meta tensor)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor) or t.device.type == "meta"


def warn_if_eval(model: nn.Module) -> None:
    if not model.training:
        name = type(model).__name__
        warnings.warn(
            f"{name} is in eval mode; autockpt plans a training step, so it planned {name} "
            "in training mode (as after .train()) and left it, and the result, in eval mode. "
            "Call .train() on the result before training: in eval mode it runs the original "
            "forward without checkpoints (models from from_pretrained() start in eval mode).",
            UserWarning,
            stacklevel=3,
        )


@contextmanager
def training_mode(model: nn.Module) -> Iterator[None]:
    """Put a model in eval mode into training mode for planning; on exit every module has
    its mode back. A model in training mode is left alone: submodules the user keeps in
    eval (frozen batch norm) are planned as they will run."""
    if model.training:
        yield
        return
    modes = [(module, module.training) for module in model.modules()]
    model.train()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def release_freed_heap() -> None:
    """Return the C heap's freed memory to the system, between planning's phases.

    Why: the probe and the verifying step free what they allocate, but glibc keeps freed
    heap pages mapped, so the process's resident memory (what an out-of-memory killer on a
    CPU host sees) stays at its high-water mark, and the next phase's differently sized
    allocations add to it (measured on a GPT whose eager step is 1144 MiB: 622 MiB of freed
    heap kept after verification). ``malloc_trim(0)`` hands those pages back; a no-op where
    the C library has no such call."""
    gc.collect()  # fake tensors and graphs in reference cycles hold storages too
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
