"""Planning's expensive work kept between calls: ``optimize`` called again on the same model
and inputs (another budget, the same budget again) reuses the profile, the recorded step and
the leanest plan instead of measuring them again.

What is kept (:class:`Reused`) is plain data, no tensor, module or optimizer: the
:class:`~autockpt.costs.profile.Profile` (sizes, measured node times and workspaces), the
recorded step (:class:`~solvers.replay.MemoryTrace`), the leanest plan's
:class:`~solvers.Solution` (the stated minimum) and, once a verifying step has run it, that
plan's measured peak (the stated minimum from then on). An fx capture runs on every call (it
is cheap, and its graph's fingerprint is part of the key); a ``torch.export`` capture, which
takes most of planning on a large graph, is kept itself, by a key of its own (NOTE [cache:
captured graph]); the stage chain, the predictor and the search are rebuilt from the kept
data, so a planner made from the cache is the one an uncached call makes, with the first
call's measured times.

The key (:func:`cache_key`) holds everything these depend on: the model object (by ``id``;
its entry holds it by weak reference, so the cache keeps no model alive, unless the
``loss_fn`` in the key holds it), the graph's fingerprint and capture method, every
parameter's and buffer's name, shape, strides, dtype, device and ``requires_grad`` and how
they share storage, every module's class, training flag, ``extra_repr`` and hooks, the
inputs' structure and every tensor's shape, strides, dtype and device (other inputs: their
value, when a number, string or ``None``), the precision (parameter dtypes, autocast state),
the kernel choices that change workspaces (cuDNN and scaled-dot-product-attention switches),
and the request: scope, ``loss_fn`` (the same object), leaf modules, ``max_stages``,
sharding, the optimizer's class, parameter groups and hyperparameters, and
``accumulation_steps``. A ``functools.partial`` loss is the same loss when its function is
the same object and its arguments are equal (tensors: the same shapes and dtypes). What
cannot be described that way (an input of another kind, an unhashable ``loss_fn``) is not
cached. An attribute that a ``torch.nn`` module uses without
showing it in its ``repr`` is not in the key: after changing one, plan with ``cache=False``
or call :func:`clear_cache`.

The cache holds at most :data:`MAX_ENTRIES` entries (least recently used first out); an
entry goes when its model is garbage-collected. ``autockpt.clear_cache()`` empties the
cache; ``optimize(..., cache=False)`` and ``Planner(..., cache=False)`` neither read nor fill
it. A model whose root cannot be captured has its submodule calls planned as units
(autockpt/planning/nested.py): each distinct unit's preparation is kept, while finding the
units and measuring the whole step run again.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import weakref
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from autockpt.base.allocations import storage_bytes, storage_key
from autockpt.base.inputs import Inputs
from autockpt.base.precision import Precision
from autockpt.base.runtime import is_unusual
from autockpt.capture.captured import Capture
from autockpt.capture.export import takes_inputs
from autockpt.costs.profile import Profile
from autockpt.costs.timing import clear_store
from autockpt.planning.request import Request
from solvers import Solution
from solvers.replay import MemoryTrace

MAX_ENTRIES = 4
"""Prepared models kept at most. Each is plain data that grows with the graph's nodes, not
with its tensors: 0.06 MiB pickled for the zoo's GPT (185 nodes)."""


@dataclass(frozen=True)
class Reused:
    """What a later call with the same key takes instead of profiling and recording."""

    profile: Profile
    trace: MemoryTrace
    leanest: Solution
    as_written_shift: int | None = None
    """:func:`~autockpt.costs.as_written.as_written_shift`, once a planner of this key has
    computed it (``as_written_known``): its two fake steps are not run again."""
    as_written_known: bool = False
    leanest_measured_bytes: int | None = None
    """The leanest plan's measured eager step (in the budget's scope), once a planner of
    this key has run it (NOTE [routes: measured minimum]): a later planner states it as
    its minimum from the start, never the smaller prediction again."""


_lock = threading.RLock()


class _Kept:
    """Values kept per key for one model object: by weak reference to the model (an entry
    goes when its model is garbage-collected), at most ``limit`` of them (least recently
    used first out). The one mechanism both the preparations and the captures use."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._entries: OrderedDict[Hashable, tuple[weakref.ref[nn.Module], Any]] = OrderedDict()

    def get(self, model: nn.Module, found: Hashable | None) -> Any | None:
        """The value for ``found`` when it was kept for this very model object."""
        if found is None:
            return None
        with _lock:
            entry = self._entries.get(found)
            if entry is None or entry[0]() is not model:
                return None
            self._entries.move_to_end(found)
            return entry[1]

    def put(self, model: nn.Module, found: Hashable | None, value: Any) -> None:
        """Keep ``value`` for ``found`` and ``model``."""
        if found is None:
            return
        entries = self._entries

        def forget(ref: weakref.ref[nn.Module]) -> None:
            with _lock:
                if found in entries and entries[found][0] is ref:
                    del entries[found]

        with _lock:
            entries[found] = (weakref.ref(model, forget), value)
            entries.move_to_end(found)
            while len(entries) > self.limit:
                entries.popitem(last=False)

    def update(self, model: nn.Module, found: Hashable | None, change: Any) -> None:
        """Replace the value kept for ``found`` and ``model`` by ``change(value)`` (``None``:
        leave it), if it is still kept."""
        if found is None:
            return
        with _lock:
            entry = self._entries.get(found)
            if entry is not None and entry[0]() is model:
                changed = change(entry[1])
                if changed is not None:
                    self._entries[found] = (entry[0], changed)

    def clear(self) -> None:
        with _lock:
            self._entries.clear()

    def __len__(self) -> int:
        with _lock:
            return len(self._entries)


_entries = _Kept(MAX_ENTRIES)


class _Uncacheable(Exception):
    """Something the key cannot describe: the call is planned without the cache."""


def cache_key(
    model: nn.Module,
    inputs: Inputs,
    captured: Capture,
    request: Request,
    precision: Precision,
) -> Hashable | None:
    """The cache key of one preparation (the module docstring lists what it holds), or
    None when something in it cannot be described (then nothing is cached)."""
    try:
        found = (
            *_state(model, inputs, precision),
            captured.fingerprint(),
            captured.method,
            captured.dynamic_dims,
            request.scope,
            _loss(request.loss_fn),
            request.leaves,
            request.max_stages,
            request.sharding,
            _optimizer(model, request.optimizer),
            request.accumulation_steps,
            request.probe,
        )
        hash(found)
    except (_Uncacheable, TypeError, RuntimeError, NotImplementedError):
        return None
    return found


def _state(
    model: nn.Module, inputs: Inputs, precision: Precision | None, *, sizes: bool = True
) -> tuple[Any, ...]:
    """The part of a key that describes the model, the inputs and how the step runs: the
    model object (by ``id``), its tensors (and how they share storage), its modules, the
    inputs (without ``sizes``: each input tensor by its kind and rank alone), the precision
    and the kernel switches. Raises what :func:`cache_key` catches."""
    tensors = [
        *(p for _, p in model.named_parameters(remove_duplicate=False)),
        *(b for _, b in model.named_buffers(remove_duplicate=False)),
    ]
    leaves, spec = pytree.tree_flatten((inputs.args, inputs.kwargs))
    tensors += [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    return (
        id(model),
        tuple(
            (name, _tensor(p), _hooks(p))
            for name, p in model.named_parameters(remove_duplicate=False)
        ),
        tuple((name, _tensor(b)) for name, b in model.named_buffers(remove_duplicate=False)),
        _sharing(tensors),
        tuple(
            (name, type(m), m.training, m.extra_repr(), _hooks(m))
            for name, m in model.named_modules(remove_duplicate=False)
        ),
        str(spec),
        tuple(
            _input(leaf) if sizes or not isinstance(leaf, torch.Tensor) else _kind(leaf)
            for leaf in leaves
        ),
        precision,
        _switches(),
    )


def cached(model: nn.Module, found: Hashable | None) -> Reused | None:
    """The entry for ``found`` when it was made for this very model object."""
    return _entries.get(model, found)


def keep(model: nn.Module, found: Hashable | None, reused: Reused) -> None:
    """Keep ``reused`` for ``found``, dropping the least recently used beyond
    :data:`MAX_ENTRIES`; the entry goes when ``model`` is garbage-collected."""
    _entries.put(model, found, reused)


def remember_as_written(model: nn.Module, found: Hashable | None, shift: int | None) -> None:
    """Add the as-written shift to the entry for ``found``, if it is still kept for
    ``model`` (an entry made without it, before a plan asked for it)."""
    _entries.update(
        model,
        found,
        lambda kept: (
            None
            if kept.as_written_known
            else dataclasses.replace(kept, as_written_shift=shift, as_written_known=True)
        ),
    )


def remember_leanest_measured(model: nn.Module, found: Hashable | None, measured: int) -> None:
    """Keep the leanest plan's measured peak with the entry for ``found`` (kept for
    ``model``): the largest measured, so a later planner never states less."""
    _entries.update(
        model,
        found,
        lambda kept: (
            None
            if kept.leanest_measured_bytes is not None and measured <= kept.leanest_measured_bytes
            else dataclasses.replace(kept, leanest_measured_bytes=measured)
        ),
    )


def clear_cache(*, stored: bool = False) -> None:
    """Forget every kept preparation and capture (``autockpt.clear_cache()``); with ``stored``, also
    delete the node times stored on this machine (NOTE [timing: stored]): the next plan of
    each model measures them again."""
    _entries.clear()
    _captures.clear()
    if stored:
        clear_store()


def cache_size() -> int:
    """How many preparations are kept now (:func:`captures_kept`: how many captures)."""
    return len(_entries)


# -- the captured graph (NOTE [cache: captured graph]) -----------------------------------

MAX_CAPTURES = 2
"""Export captures kept at most. Each holds its graph's nodes and their fake values (no
storage) and refers to the model's own parameter and buffer objects (no copies), which the
model holds anyway; a submodule the user replaces since is held until the entry goes."""

_captures = _Kept(MAX_CAPTURES)


@dataclass(frozen=True)
class CaptureKey:
    """NOTE [cache: captured graph]: a capture's key, with and without the inputs' sizes."""

    exact: Hashable
    sizeless: Hashable


def capture_key(model: nn.Module, inputs: Inputs, request: Request) -> CaptureKey | None:
    """NOTE [cache: captured graph]. The key of one capture, or None (not kept).

    Why a capture is kept at all: on a large graph ``torch.export`` takes most of planning
    (lucidrains' KarrasUnet: 37-65 s of a 108 s first plan), and a second ``optimize`` of
    the same model, or a budget refused after capture, would take it again. Only export
    captures are kept (fx tracing is quick), for the model object they were made of, by
    weak reference.

    Why the key says more than the preparation's: the preparation's key holds the graph's
    fingerprint, so a forward that now takes another path misses it; a kept graph has no
    fingerprint to compare with, it *is* the graph. So the key adds what a forward's
    Python reads besides tensors and their modules' ``repr``: each module's plain
    attributes (numbers, strings, flags, tuples of them), its configuration object
    (transformers' ``config``, by its ``to_dict()``), the class's ``forward`` and a
    ``forward`` set on the instance (a wrapper's), and the grad mode. What it still cannot
    see (a global the forward reads, an object attribute of another kind) is why
    ``cache=False`` and ``autockpt.clear_cache()`` exist: after such a change, a kept
    graph would run the old code.

    Why a capture is also found for inputs of other sizes (the ``sizeless`` key): export
    keeps batch and sequence sizes dynamic where it can, and its graph then runs every
    size its input check takes; that is how the optimized model runs other batches. So
    :func:`captured_before` hands it to inputs of other sizes it takes (fit_batch plans
    many sizes of one model: a tiny Hugging Face GPT-2 spent 36 s of an 82 s fit_batch in
    five captures of one graph), and a size it does not take is captured anew."""
    if not request.cache:
        return None
    try:
        rest = (
            _code_state(model),
            torch.is_grad_enabled(),
            request.leaves,
            request.sharding.units,
            request.target,  # a meta model is traced as the target's device
        )
        key = CaptureKey(
            *(
                (*_state(model, inputs, request.precision, sizes=sizes), *rest)
                for sizes in (True, False)
            )
        )
        hash(key)
    except (_Uncacheable, TypeError, RuntimeError, NotImplementedError):
        return None
    return key


def captured_before(model: nn.Module, key: CaptureKey | None, inputs: Inputs) -> Capture | None:
    """The export capture kept for ``key`` when it was made of this very model object: for
    the same inputs, or for inputs of other sizes that its graph takes (NOTE [cache:
    captured graph])."""
    kept = None if key is None else _captures.get(model, key.sizeless)
    if kept is None:
        return None
    captured, made_for = kept
    if made_for == key.exact or takes_inputs(captured, inputs):
        return captured
    return None


def keep_capture(model: nn.Module, key: CaptureKey | None, captured: Capture) -> None:
    """Keep an export capture for ``key`` (at most :data:`MAX_CAPTURES`, least recently
    used first out; the entry goes when ``model`` is garbage-collected), in place of one
    kept for inputs of other sizes."""
    if captured.method == "export" and key is not None:
        _captures.put(model, key.sizeless, (captured, key.exact))


def captures_kept() -> int:
    """How many captures are kept now."""
    return len(_captures)


_PLAIN = (bool, int, float, complex, str, type(None), torch.dtype, torch.device)


def _code_state(model: nn.Module) -> tuple[Any, ...]:
    """What a module's Python may branch on besides its tensors (NOTE [cache: captured
    graph]): plain attributes, a configuration's ``to_dict()``, the forward functions.
    Objects are described by value or ``id``, never held: a key that held a bound
    ``forward`` would hold its module, and the entry would keep the model alive."""
    configs: dict[int, str] = {}
    described = []
    for name, module in model.named_modules(remove_duplicate=False):
        plain = []
        for attribute, value in vars(module).items():
            if isinstance(value, _PLAIN) or (
                isinstance(value, tuple) and all(isinstance(v, _PLAIN) for v in value)
            ):
                plain.append((attribute, value))
            elif not isinstance(value, (nn.Module, torch.Tensor, dict)) and callable(
                getattr(value, "to_dict", None)
            ):
                if id(value) not in configs:
                    try:
                        configs[id(value)] = repr(value.to_dict())
                    except Exception as error:  # noqa: BLE001 - not describable: not kept
                        raise _Uncacheable(f"{attribute}.to_dict() failed") from error
                plain.append((attribute, configs[id(value)]))
        own_forward = vars(module).get("forward")
        described.append(
            (
                name,
                getattr(type(module), "forward", None),
                None if own_forward is None else id(own_forward),
                tuple(sorted(plain, key=lambda item: item[0])),
            )
        )
    return tuple(described)


def _tensor(t: torch.Tensor) -> tuple[Any, ...]:
    if is_unusual(t):
        # no strides or storage of its own (sparse, quantized, a wrapper subclass): the
        # object is planned around (NOTE [runtime: unusual state]); its bytes are static
        return (
            type(t),
            str(t.layout),
            t.is_quantized,
            tuple(t.shape),
            storage_bytes(t),
            t.dtype,
            str(t.device),
            t.requires_grad,
        )
    return (
        type(t),
        tuple(t.shape),
        t.stride(),
        t.storage_offset(),
        t.untyped_storage().nbytes(),
        t.dtype,
        str(t.device),
        t.requires_grad,
    )


def _kind(t: torch.Tensor) -> tuple[Any, ...]:
    """A tensor without its sizes: what a graph that takes other sizes still fixes."""
    return (type(t), str(t.layout), t.dim(), t.dtype, str(t.device), t.requires_grad)


def _sharing(tensors: list[torch.Tensor]) -> tuple[tuple[int, int], ...]:
    """Which tensors are the same object and which share a storage (ties, views): by the
    position of the first of each, so that the key does not hold addresses."""
    objects: dict[int, int] = {}
    storages: dict[Any, int] = {}
    return tuple(
        (objects.setdefault(id(t), i), storages.setdefault(storage_key(t), i))
        for i, t in enumerate(tensors)
    )


def _hooks(owner: Any) -> tuple[tuple[int, ...], ...]:
    """The handles of the hooks on a module or a parameter (each registration has its own)."""
    names = (
        "_forward_pre_hooks",
        "_forward_hooks",
        "_backward_pre_hooks",
        "_backward_hooks",
        "_post_accumulate_grad_hooks",
    )
    return tuple(tuple(getattr(owner, name, None) or ()) for name in names)


def _input(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        return _tensor(leaf)
    if leaf is None or isinstance(leaf, (bool, int, float, complex, str, torch.dtype)):
        return (type(leaf), leaf)
    raise _Uncacheable(f"an input of type {type(leaf).__name__}")


def _loss(loss_fn: Any) -> Any:
    """The loss in the key: the object itself, or a ``functools.partial`` by its function
    and arguments, tensors by their shapes (a loop that makes a new partial for each batch
    of targets asks for the same loss)."""
    if isinstance(loss_fn, functools.partial):
        try:
            return (
                functools.partial,
                _loss(loss_fn.func),
                tuple(_input(a) for a in loss_fn.args),
                tuple(sorted((k, _input(v)) for k, v in loss_fn.keywords.items())),
            )
        except _Uncacheable:
            pass
    return loss_fn


def _switches() -> tuple[Any, ...]:
    """Global settings that change which kernels run, so their workspaces and what they save,
    the default dtype (of tensors a forward makes without one) and the hooks registered on
    every module."""
    cuda = torch.backends.cuda
    cudnn = torch.backends.cudnn
    return (
        torch.get_default_dtype(),
        cudnn.enabled,
        cudnn.benchmark,
        cudnn.deterministic,
        cuda.flash_sdp_enabled(),
        cuda.mem_efficient_sdp_enabled(),
        cuda.math_sdp_enabled(),
        tuple(
            tuple(getattr(torch.nn.modules.module, f"_global_{kind}_hooks", None) or ())
            for kind in ("forward_pre", "forward", "backward_pre", "backward")
        ),
    )


def _optimizer(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> Any:
    """The optimizer's class, its parameter groups (as positions among the model's
    parameters) and their hyperparameters: what its state and its step's allocations follow."""
    if optimizer is None:
        return None
    position = {id(p): i for i, p in enumerate(model.parameters())}
    groups = tuple(
        (
            tuple(position[id(p)] for p in group["params"]),
            repr(sorted((k, v) for k, v in group.items() if k != "params")),
        )
        for group in optimizer.param_groups
    )
    return (type(optimizer), groups, repr(sorted(optimizer.defaults.items())))


def remember_profile(model: nn.Module, found: Hashable | None, profile: Profile) -> None:
    """Replace the profile of the entry for ``found`` (kept for ``model``) with ``profile``:
    the same node seconds, with step factors measured since (NOTE [timing: step
    factors])."""
    _entries.update(model, found, lambda kept: dataclasses.replace(kept, profile=profile))
