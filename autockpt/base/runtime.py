"""Helpers shared by the stages that run real training steps (profile, measure, CLI).

A training step here is ``loss_fn(model(*args, **kwargs)).backward()``; these helpers pick
the loss, find the device, time on it, and make trial steps leave no trace in the model,
the caller's inputs or the global random generators (:func:`as_found`).
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import dataclasses
import functools
import gc
import sys
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    unset_fake_temporarily,
)
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from autockpt.base.inputs import Inputs
from autockpt.base.rng import RngStates
from autockpt.errors import (
    DefaultLossWarning,
    FakeTensorLeakError,
)

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


# NOTE [runtime: the loss on fake tensors]. Planning calls ``loss_fn`` on a fake step's
# output. A loss that caches a tensor it builds on its first call (targets per batch size,
# what a ``fit_batch`` user writes since that loss sees only the output) would cache a
# FakeTensor made under the fake step's mode, and every later real step would compute a
# fake loss and fake gradients in silence. Two guards. (1) The loss runs with that mode set
# aside (``unset_fake_temporarily``): operators on the fake output still run in the output's
# own mode and stay fake, while tensors made from nothing (``torch.randint``, ``arange``)
# are real, of the sizes the fake ones would have had, so the recorded step is the same and
# such a cache holds real targets. (2) What can still leak (a tensor made *from* the
# output and kept) reaches a real step: every step ``autockpt.measure`` runs, verification
# included, checks that its output and loss are not fake (:func:`check_real_step`) and
# raises :class:`FakeTensorLeakError` saying how to fix the loss.


def loss_on_fake(loss_fn: LossFn, output: Any) -> tuple[torch.Tensor, bool]:
    """``loss_fn(output)`` on the fake step's output, and False; for a loss that reads a
    value (``.item()``: fake tensors have none), the sum of the output's floating tensors
    instead, and True. Such a loss is measured: the probe runs it on real tensors and the
    recorder moves the loss's windows to what the allocator saw (NOTE [record: loss
    windows]); plans say so.

    The loss runs with the fake step's tensor mode set aside: what it computes from the
    fake output is fake (a fake tensor's operators run in its own mode), and what it makes
    from nothing is real (NOTE [runtime: the loss on fake tensors])."""
    try:
        with unset_fake_temporarily():
            return loss_fn(output), False
    except DATA_DEPENDENT:
        return _summed(output), True


def check_real_step(output: Any, loss: Any) -> None:
    """Raise :class:`FakeTensorLeakError` when a real step's output or loss is a fake tensor:
    the model or the loss computed with a fake tensor kept from planning (NOTE [runtime:
    the loss on fake tensors]). Called by every real step autockpt measures, before its
    backward; a real tensor's check costs an ``isinstance``."""
    from torch._subclasses.fake_tensor import FakeTensor

    if any(isinstance(t, FakeTensor) for t in tensors_in(output)):
        raise FakeTensorLeakError(
            "the model returned a fake tensor from real inputs: its forward used a tensor it "
            "kept from an earlier call made on fake tensors (while planning). Build such "
            "tensors from the inputs on each call, or register them as buffers"
        )
    if isinstance(loss, FakeTensor):
        raise FakeTensorLeakError(
            "the loss of a real step is a fake tensor: loss_fn kept a tensor it made while "
            "autockpt planned on fake tensors (e.g. targets cached per batch size on the "
            "first call) and computed with it again, so the loss has no value and the "
            "gradients are fake. Build such tensors on each call from the output "
            "(torch.arange(out.shape[0], device=out.device)), or pass the targets in the "
            "inputs or in a functools.partial / closure made outside the loss; then plan again"
        )


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
      no gradient). Parameter values are not copied (trial steps never step an optimizer),
      except those of parameters a fake step saw the forward write in place (EDM2's forced
      weight normalisation): those get their values back from host copies (NOTE [runtime:
      parameters the forward writes]).
    * Buffers and parameters whose values are not one dense tensor (sparse, quantized,
      meta, a wrapper subclass) are put back by identity only (NOTE [runtime: unusual
      state]).
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
    token = _LISTENERS.set((*_LISTENERS.get(), state.keep_written))
    try:
        yield
    finally:
        _LISTENERS.reset(token)
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
                if b is not None and id(b) not in self.values and has_plain_values(b):
                    self.values[id(b)] = (b, b.detach().clone())
        self.grads = [(p, p.grad) for p in model.parameters()]
        self.own = {id(p) for p in model.parameters()}
        self.written: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        """Host copies of the parameters the forward writes in place (NOTE [runtime:
        parameters the forward writes])."""
        self.keep_written([p for p in model.parameters() if _WRITTEN_BY_FORWARD.get(id(p)) is p])

    def keep_written(self, parameters: list[torch.Tensor]) -> None:
        """Keep host copies of those of ``parameters`` that are this model's and not kept
        yet: their values as found, since no real step has run in the block before a fake
        step finds them written."""
        for p in parameters:
            if id(p) in self.own and id(p) not in self.written and has_plain_values(p):
                self.written[id(p)] = (p, p.detach().to("cpu", copy=True))

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
        for p, host in self.written.values():
            put_back(p, host.to(p.device))
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
            # values only of a dense tensor with data (NOTE [runtime: unusual state])
            copy = t.detach().to("cpu", copy=True) if has_plain_values(t) else None
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


# NOTE [runtime: meta runs as a device]. A model built on the meta device has shapes and no
# device, and torch picks kernels by device: on meta, ``scaled_dot_product_attention`` runs
# the math path (seq x seq scores and softmax saved, in float32 even for bfloat16 inputs)
# and autocast casts nothing (no autocast dispatch key exists for meta). The step the user
# launches runs on a GPU, with fused attention (flash / memory-efficient: the output and a
# log-sum-exp saved) and autocast's casts. So a meta tensor's fake twin is a fake tensor of
# ``META_RUNS_AS`` (the CPU): CPU's kernel choice is fused attention, as a GPU's is for the
# targets autockpt knows (autockpt/base/target.py: the same saved tensors, to the
# log-sum-exp's padding), and CPU autocast casts fake tensors (autockpt/base/precision.py
# enters it for a GPU's autocast on a machine without one). A fake CUDA tensor is not used:
# its backward needs a CUDA context (the autograd engine's device threads), which a machine
# without a GPU does not have.
META_RUNS_AS = torch.device("cpu")
"""The device a meta tensor's fake twin reports (NOTE [runtime: meta runs as a device])."""

_META_AS_DEVICE: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "autockpt_meta_as_device", default=False
)


def meta_runs_as_device() -> bool:
    """Whether the running fake step is a meta model's, on fake :data:`META_RUNS_AS`
    tensors: a graph traced on meta then makes its new tensors there too."""
    return _META_AS_DEVICE.get()


def fake_twin(mode: Any, t: torch.Tensor) -> torch.Tensor:
    """A fake tensor of ``mode`` standing for ``t``: a tensor without dense values gets a
    dense stand-in of its shape, what the step's bookkeeping reads of it (NOTE [runtime:
    unusual state]); a meta one is a fake tensor of :data:`META_RUNS_AS` (NOTE [runtime:
    meta runs as a device]); any other, ``mode``'s own twin."""
    if is_unusual(t):
        return _stand_in(mode, t)
    if t.device.type == "meta":
        return mode.fake_tensor_converter.from_meta_and_device(mode, t, META_RUNS_AS)
    return mode.from_tensor(t)


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
    Meta tensors get fake twins of the planning device (NOTE [runtime: meta runs as a
    device]).
    ``twins``, when given, is filled with each real tensor's twin, by ``id`` of the real one
    (what an optimizer's stand-in steps: autockpt/base/optimizer.py). Inside a
    :func:`parameters_written` block, either way, the parameters the forward writes in
    place are told (NOTE [runtime: parameters the forward writes]); elsewhere nothing
    watches the step's operators.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.utils.stateless import _reparametrize_module

    parameters = dict(model.named_parameters(remove_duplicate=False))
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    twins = {} if twins is None else twins

    def twin(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in twins:
            fake = fake_twin(mode, t)
            if t.requires_grad and not fake.requires_grad:
                fake.requires_grad_(True)
            twins[id(t)] = fake
        return twins[id(t)]

    state = {name: twin(p) for name, p in parameters.items()}
    state |= {name: twin(b) for name, b in model.named_buffers(remove_duplicate=False)}
    fake_inputs = Inputs(
        pytree.tree_map_only(torch.Tensor, twin, inputs.args),
        pytree.tree_map_only(torch.Tensor, twin, inputs.kwargs),
    )
    grads = {name: p.grad for name, p in model.named_parameters()}
    writes = _watch({name: state[name] for name in parameters})
    on_meta = device_of(model, inputs).type == "meta"
    token = _META_AS_DEVICE.set(on_meta or _META_AS_DEVICE.get())
    try:
        with (
            _reparametrize_module(model, state),
            mode,
            writes or contextlib.nullcontext(),
            caches_as_found(model),
        ):
            yield fake_inputs
    finally:
        _META_AS_DEVICE.reset(token)
        for name, p in model.named_parameters():  # a stray fake gradient never survives
            p.grad = grads.get(name)
        _tell(writes, parameters)  # outside the fake mode: listeners copy real values


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


# NOTE [runtime: parameters the forward writes]. A forward may update a *parameter* in place
# (EDM2's forced weight normalisation: ``with torch.no_grad(): self.weight.copy_(...)``). A
# checkpointed segment that recomputes such a forward runs the update again, on the updated
# value: gradients and, after optimizer steps, parameters differ from eager's. Such
# parameters are treated as mutated buffers are: the profile's fake step finds them
# (:class:`_ParameterWrites`, by operator schema, so ``.data.copy_`` counts too; an
# optimizer's step does not, :func:`outside_the_forward`), planning adds them to the
# profile's mutated state (autockpt/planning/prepared.py), and each segment that touches one
# remembers its object and values at forward and recomputes on exactly those
# (``restore_buffers``; autockpt/rewrite/segment.py). One mechanism, not a second: the
# plan field keeps its name and lists parameters beside buffers. Planning's own real steps
# (the probe, verification) would move them too, so :func:`as_found` keeps host copies of
# the parameters a fake step found written: blocks already running hear of them before
# their first real step (the fake step runs first), later blocks read
# :data:`_WRITTEN_BY_FORWARD` when they start. Why a weak registry of parameter objects:
# what a forward writes is a property of the model's code, learnt once per parameter, and
# it must reach every later ``as_found`` (``optimize`` after ``Planner``, ``measure`` of
# the result) without keeping a model alive or copying every parameter of every model.

_WRITTEN_BY_FORWARD: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
"""Parameters a fake step saw the forward write in place, by ``id`` (a tensor's ``==`` is
elementwise, so no ``WeakSet``; an entry goes with its parameter), NOTE [runtime: parameters
the forward writes]."""

_LISTENERS: contextvars.ContextVar[tuple[Callable[[list[torch.Tensor]], None], ...]] = (
    contextvars.ContextVar("autockpt_parameter_writes", default=())
)
"""Each running :func:`as_found` block: what it does on hearing of parameters the forward
writes (keeps their values)."""

_COLLECTORS: contextvars.ContextVar[tuple[set[str], ...]] = contextvars.ContextVar(
    "autockpt_parameters_written", default=()
)
"""Each running :func:`parameters_written` block: the names it collects."""

_OUTSIDE_THE_FORWARD: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "autockpt_outside_the_forward", default=False
)
"""Set by :func:`outside_the_forward`: writes to parameters now are not the forward's."""


def heard_written(written: dict[str, torch.Tensor]) -> None:
    """The forward writes the parameters ``written`` (name: real object) in place: a fake
    step saw it, or a profile reused from an earlier call says so. Every running
    :func:`as_found` block keeps their values from now on, and so does every later one
    (NOTE [runtime: parameters the forward writes])."""
    for p in written.values():
        _WRITTEN_BY_FORWARD[id(p)] = p
    for listener in _LISTENERS.get():
        listener([*written.values()])
    for names in _COLLECTORS.get():
        names.update(written)


@contextmanager
def parameters_written() -> Iterator[set[str]]:
    """The names of the parameters that fake steps run inside the block saw the forward
    write in place, filled as they run (NOTE [runtime: parameters the forward writes])."""
    names: set[str] = set()
    token = _COLLECTORS.set((*_COLLECTORS.get(), names))
    try:
        yield names
    finally:
        _COLLECTORS.reset(token)


@contextmanager
def outside_the_forward() -> Iterator[None]:
    """A block inside a fake step whose writes to parameters are not the forward's (an
    optimizer's step: autockpt/base/optimizer.py)."""
    token = _OUTSIDE_THE_FORWARD.set(True)
    try:
        yield
    finally:
        _OUTSIDE_THE_FORWARD.reset(token)


class _ParameterWrites(TorchDispatchMode):
    """Inside a fake step: which of the model's parameters (their fake twins, by storage)
    an operator writes in place, by its schema (NOTE [runtime: parameters the forward
    writes]). Costs one lookup per operator; operators that write nothing return at once."""

    def __init__(self, twins: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.names: dict[int, list[str]] = {}
        for name, t in twins.items():
            if t.layout == torch.strided:
                self.names.setdefault(id(t.untyped_storage()), []).append(name)
        self.found: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        written = _written_arguments(func)
        if written and not _OUTSIDE_THE_FORWARD.get():
            for position, name in written:
                value = args[position] if position < len(args) else kwargs.get(name)
                for t in tensors_in(value):
                    if t.layout == torch.strided:
                        self.found.update(self.names.get(id(t.untyped_storage()), ()))
        return func(*args, **kwargs)


def _watch(twins: dict[str, torch.Tensor]) -> _ParameterWrites | None:
    """The watch for a fake step whose parameters are ``twins`` (by name), inside a
    :func:`parameters_written` block; elsewhere None (the recorded step, the model as
    written: the profile's fake step has told what they would find), since it costs a Python
    dispatch per operator (+17% on the zoo GPT's fake structure pass)."""
    return _ParameterWrites(twins) if _COLLECTORS.get() else None


def _tell(writes: _ParameterWrites | None, parameters: dict[str, torch.Tensor]) -> None:
    """Tell what ``writes`` found, by the real ``parameters``' names and objects."""
    if writes is not None and writes.found:
        heard_written({name: parameters[name] for name in sorted(writes.found)})


@functools.cache
def _written_arguments(func: Any) -> tuple[tuple[int, str], ...]:
    """Position and name of each argument ``func`` writes in place, by its schema."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return ()
    return tuple(
        (k, argument.name)
        for k, argument in enumerate(schema.arguments)
        if argument.alias_info is not None and argument.alias_info.is_write
    )


# NOTE [runtime: unusual state]. A model may hold tensors whose values are not one dense
# strided storage: openai/whisper registers ``alignment_heads`` as a sparse COO buffer, and
# models carry quantized, meta or wrapper-subclass (DTensor, float8) tensors. Comparing or
# copying their values (``torch.equal`` has no sparse kernel) and reading their storage
# fail, and a fake tensor of a quantized one cannot be made. The rule: such a tensor is left
# as found by *identity* (its slot gets the very object back; no value is compared or
# copied); a fake step gives it a dense stand-in of its shape and dtype with zero strides
# (one element of memory), which is what the step's bookkeeping reads of it; its bytes
# count as its parts' storages (autockpt/base/allocations.py). That is exact for what the
# forward does not read. A captured forward that does read one is refused before
# profiling with :class:`UnusualStateError` naming it (autockpt/planning/prepared.py):
# fake steps would compute with the stand-in, and the probe cannot time it.


def is_unusual(t: torch.Tensor) -> bool:
    """Whether ``t``'s values are not one dense strided storage (NOTE [runtime: unusual
    state]): sparse, nested or other non-strided layouts, quantized, a wrapper subclass."""
    return (
        t.layout != torch.strided
        or t.is_quantized
        or hasattr(t, "__tensor_flatten__")
        or isinstance(t, nn.parameter.UninitializedTensorMixin)
    )


def has_plain_values(t: torch.Tensor) -> bool:
    """Whether ``t`` has dense values autockpt may compare and copy: not unusual (NOTE
    [runtime: unusual state]) and not fake or meta."""
    return not is_unusual(t) and not is_fake(t)


def _stand_in(mode: Any, t: torch.Tensor) -> torch.Tensor:
    """A fake, dense stand-in of ``t`` (NOTE [runtime: unusual state]): its shape and dtype
    (a quantized one's integer dtype), zero strides, so one element of storage."""
    dtype = t.dtype
    if t.is_quantized:
        dtype = {torch.quint8: torch.uint8, torch.qint8: torch.int8}.get(dtype, torch.int32)
    with mode:
        device = META_RUNS_AS if t.device.type == "meta" else t.device
        return torch.empty_strided(tuple(t.shape), (0,) * t.dim(), dtype=dtype, device=device)


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
