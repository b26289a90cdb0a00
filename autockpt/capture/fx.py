"""The fx path of capture: symbolic tracing with leaves, retried until the graph is faithful.

Models as libraries ship them are handled on the way: a decorated ``forward(*args,
**kwargs)`` wrapper is traced as the user calls it (:class:`_CallShape`), and a submodule
whose code fx cannot trace, or whose code does what an fx graph would not keep (the watch,
``autockpt/capture/watch.py``), becomes a leaf and tracing is retried
(:func:`_trace_fx_with_leaves`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch.fx as fx
from torch import nn

from autockpt.base.inputs import Inputs
from autockpt.base.rng import RngStates, rng_as_found
from autockpt.capture.captured import Capture
from autockpt.capture.guards import raise_guard
from autockpt.capture.watch import (
    _CHECKPOINT_WARNING,
    _GENERATOR_NAMES,
    _definition,
    _leaf_note,
    _Sighting,
    _Unfaithful,
    _unique,
    _untraceable_reason,
    _Watch,
    leaf_note,
)

_MAX_LEAF_RETRIES = 64


class _LeafTracer(fx.Tracer):
    """An fx tracer that remembers which submodule raised, so that it can become a leaf.

    Buffers are traced as attributes (``proxy_buffer_attributes``): code that slices a
    buffer by a size read from the input (a causal mask) then traces instead of failing.
    The condition of an ``assert`` in a submodule's code becomes a ``torch._assert`` guard
    in the graph, and that of a raise on values (``if torch.isnan(x).any(): raise``) a
    check of its own (:mod:`autockpt.capture.guards`), so a submodule that checks its input
    is traced through instead of becoming a leaf.
    """

    proxy_buffer_attributes = True

    def __init__(
        self, leaves: set[str], call_shape: _CallShape | None = None, boundaries: bool = False
    ) -> None:
        super().__init__()
        self.leaves = leaves
        self.call_shape = call_shape
        self.failed_module: str | None = None
        self.saw_checkpoint = False
        # Fidelity (see _Watch): the module whose own code runs now ("" = the root). With
        # ``boundaries``, also the global generators' states when that code last started or
        # resumed running, and every module whose own code moved them, with the generators
        # it moved: the witness for draws no C call shows (NumPy's), at the cost of reading
        # every generator's state at every module call, so only when one is known to hide.
        self.running: list[str] = [""]
        self.drawn: dict[str, set[str]] = {}
        self.boundaries = boundaries
        self._rng_mark: RngStates | None = None

    def trace(self, root: Any, concrete_args: Any = None) -> fx.Graph:
        self._rng_mark = RngStates.now() if self.boundaries else None
        graph = super().trace(root, concrete_args)
        self._own_code_ran()
        return graph

    def _own_code_ran(self) -> None:
        """Close a stretch of the current module's own code: the generators that moved
        since the last mark moved in it (a child's stretch is closed when it returns)."""
        if not self.boundaries:
            return
        now = RngStates.now()
        if self._rng_mark is not None:
            moved = self._rng_mark.changed(now)
            if moved:
                self.drawn.setdefault(self.running[-1], set()).update(moved)
        self._rng_mark = now

    def create_args_for_root(
        self, root_fn: Callable[..., Any], is_module: bool, concrete_args: Any = None
    ) -> tuple[Callable[..., Any], list[Any]]:
        if self.call_shape is None:
            return super().create_args_for_root(root_fn, is_module, concrete_args)
        return self.call_shape.root_call(self, root_fn)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name in self.leaves or super().is_leaf_module(
            m, module_qualified_name
        )

    def call_module(
        self, m: nn.Module, forward: Callable[..., Any], args: tuple, kwargs: dict
    ) -> Any:
        try:
            path: str | None = self.path_of_module(m)
        except NameError:  # a module made in forward: its code counts as its caller's
            path = None
        if path is not None and self.is_leaf_module(m, path):
            path = None  # not traced into: none of its code runs now
        if path is not None:
            self._own_code_ran()
            self.running.append(path)
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_module is None:
                try:
                    self.failed_module = self.path_of_module(m)
                except NameError:
                    self.failed_module = None
            raise
        finally:
            if path is not None:
                self._own_code_ran()
                self.running.pop()

    def to_bool(self, obj: fx.Proxy) -> bool:
        # The condition of an assert, or of a raise on values, in a submodule's code is a
        # guard in the graph, not a branch (autockpt/capture/guards.py, NOTE [capture:
        # checks on values]; why not in the root's own code): the trace goes on along the
        # path that does not raise. Any other truth test of a traced value fails as before.
        if self.running[-1]:
            goes_on = raise_guard(self, obj)
            if goes_on is not None:
                return goes_on
        return super().to_bool(obj)

    def create_arg(self, a: Any) -> Any:
        # Dataclass outputs (e.g. a ModelOutput) become a node that rebuilds them at run time.
        if dataclasses.is_dataclass(a) and not isinstance(a, type):
            values = {f.name: getattr(a, f.name) for f in dataclasses.fields(a) if f.init}
            return self.create_node(
                "call_function", _dataclass_builder(type(a)), (self.create_arg(values),), {}
            )
        return super().create_arg(a)


@dataclass(frozen=True)
class _CallShape:
    """How the traced forward is called: which parameters arrive positionally and which by
    keyword. Used for forwards that fx cannot read its own signature from: a decorated
    ``forward(self, *args, **kwargs)`` wrapper around the real one (Hugging Face's
    ``can_return_tuple`` / ``check_model_inputs``), whose code fx would try to rewrite. The
    traced function then calls the forward exactly as the user does, with one input per
    given argument, and the parameters not given keep their defaults."""

    positional: tuple[str, ...]
    keyword: tuple[str, ...]

    def root_call(
        self, tracer: fx.Tracer, root_fn: Callable[..., Any]
    ) -> tuple[Callable[..., Any], list[Any]]:
        args = [tracer.create_proxy("placeholder", name, (), {}) for name in self.positional]
        kwargs = {name: tracer.create_proxy("placeholder", name, (), {}) for name in self.keyword}

        def call(root: nn.Module) -> Any:
            return root_fn(root, *args, **kwargs)

        return call, [tracer.root]


def _call_shape(
    model: nn.Module, inputs: Inputs, input_names: Iterable[str] | None
) -> _CallShape | None:
    """A :class:`_CallShape` when ``model.forward`` is a decorated wrapper (fx's own
    argument handling breaks on those), else ``None``."""
    forward = type(model).forward
    if inspect.unwrap(forward) is forward:
        return None
    params = list(inspect.signature(forward).parameters.values())[1:]
    positional_params = [
        p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if input_names is not None and not inputs.args and not inputs.kwargs:
        return _CallShape((), tuple(input_names))
    if len(inputs.args) > len(positional_params):
        raise TypeError(
            f"{type(model).__name__}.forward takes {len(positional_params)} positional "
            f"arguments, got {len(inputs.args)}"
        )
    return _CallShape(tuple(positional_params[: len(inputs.args)]), tuple(inputs.kwargs))


@functools.cache
def _dataclass_builder(cls: type) -> Callable[[dict[str, Any]], Any]:
    """A named function that rebuilds a ``cls`` output in the traced graph (generated code
    can call a function, but cannot spell a class literal as an argument)."""

    def build(values: dict[str, Any]) -> Any:
        return cls(**values)

    build.__name__ = build.__qualname__ = f"build_{cls.__name__}"
    return build


def _trace_fx_with_leaves(
    model: nn.Module, inputs: Inputs, leaves: set[str], input_names: Iterable[str] | None
) -> Capture | tuple[str, BaseException]:
    """Trace with fx, turning each failing submodule into a leaf, and each submodule whose
    own code fx would not keep (a random draw, an autograd-mode switch, a buffer
    assignment: :class:`_Watch`) into a leaf too, so that it runs eagerly inside the graph;
    return the capture, or ``(module, error)`` for what a leaf cannot fix (an
    :class:`_Unfaithful` error when it is the root's own code that fx would not keep). The
    global generators and the model's buffer and parameter slots are as found after every
    attempt: tracing runs the model's code, but consumes no random numbers, and the next
    attempt must not read the proxies fx left in slots the model assigns."""
    auto_leaves: list[str] = []
    failed_leaves: dict[str, str] = {}  # module -> why fx could not trace it
    fidelity_notes: dict[str, str] = {}
    concrete = _concrete_args(model, inputs, input_names)
    shape = _call_shape(model, inputs, input_names)
    boundaries = False
    for _ in range(_MAX_LEAF_RETRIES):
        tracer = _LeafTracer(leaves | set(auto_leaves), shape, boundaries)
        watch = _Watch(tracer, lambda tracer=tracer: tracer.running[-1], model)
        with rng_as_found() as found_rng, _slots_as_found(model), watch:
            try:
                graph = tracer.trace(model, concrete_args=concrete)
            except Exception as error:  # noqa: BLE001 - any tracing failure is handled below
                failed = tracer.failed_module
                if failed and failed not in auto_leaves and failed not in leaves:
                    auto_leaves.append(failed)
                    failed_leaves[failed] = _untraceable_reason(error)
                    continue
                return (failed or "", error)
            moved = set(found_rng.changed())
        if not boundaries and moved - {d.generator for d in watch.draws}:
            boundaries = True  # a draw no C call showed: find its module by the states
            continue
        found = _unfaithful_code(model, tracer, watch)
        if "" in found:
            return ("", _Unfaithful(found[""]))
        new = [m for m in found if not any(m.startswith(f"{o}.") for o in found)]
        if new:
            for module in new:
                # leaves found inside it earlier are never reached now
                inside = [m for m in auto_leaves if m.startswith(f"{module}.")]
                auto_leaves = [m for m in auto_leaves if m not in inside]
                failed_leaves = {m: r for m, r in failed_leaves.items() if m not in inside}
                fidelity_notes = {m: n for m, n in fidelity_notes.items() if m not in inside}
                auto_leaves.append(module)
                fidelity_notes[module] = _leaf_note(module, found[module])
            continue
        _restore_placeholder_names(graph, model)
        gm = fx.GraphModule(tracer.root, graph, class_name=type(model).__name__)
        notes = []
        if tracer.saw_checkpoint:
            notes.append(_CHECKPOINT_WARNING)
            warnings.warn(_CHECKPOINT_WARNING, stacklevel=3)
        notes += _untraceable_notes(failed_leaves)
        notes += fidelity_notes.values()
        method = "fx+leaves" if auto_leaves else "fx"
        return Capture(gm, method, tuple(sorted(leaves | set(auto_leaves))), notes)
    return ("", RuntimeError(f"gave up after {_MAX_LEAF_RETRIES} leaf retries"))


def _untraceable_notes(failed: dict[str, str]) -> list[str]:
    """One note per reason fx could not trace submodules that became leaves, naming every
    module it holds for (the layers of a stack fail on the same line)."""
    modules: dict[str, list[str]] = {}
    for module, reason in failed.items():
        modules.setdefault(reason, []).append(module)
    return [
        leaf_note(
            names,
            f"{reason}; {'each' if len(names) > 1 else 'it'} runs as one call the plan "
            "cannot checkpoint inside",
        )
        for reason, names in modules.items()
    ]


@contextlib.contextmanager
def _slots_as_found(model: nn.Module) -> Iterator[None]:
    """Put back the tensor object of every buffer and parameter slot of ``model`` on exit.
    Only slots: fx tracing computes on proxies, so it never writes a tensor's values, but
    it leaves a proxy in a slot the forward assigns. (The capture as a whole runs under
    :func:`autockpt.base.runtime.as_found`, which also restores values.)"""
    held = [(m, dict(m._buffers), dict(m._parameters)) for m in model.modules()]
    try:
        yield
    finally:
        for m, buffers, parameters in held:
            for slots, found in ((m._buffers, buffers), (m._parameters, parameters)):
                if slots.keys() != found.keys() or any(slots[k] is not v for k, v in found.items()):
                    slots.clear()
                    slots.update(found)


def _unfaithful_code(
    model: nn.Module, tracer: _LeafTracer, watch: _Watch
) -> dict[str, list[_Sighting]]:
    """Modules ("" for the root) whose own code drew from a global generator, switched
    a mode or assigned a buffer or parameter while fx traced it, with what it did and
    where. A generator that moved with no C call seen to move it (NumPy's draws are not C
    calls to a profile hook) is reported at the module's ``forward``."""
    found: dict[str, list[_Sighting]] = {}
    for sighting in watch.switches + watch.draws + watch.assignments:
        found.setdefault(sighting.module, []).append(sighting)
    for module, generators in tracer.drawn.items():
        seen = {d.generator for d in watch.draws if d.module == module}
        for generator in sorted(generators - seen):
            owner = model.get_submodule(module) if module else model
            location, line = _definition(type(owner).forward)
            what = f"a draw from {_GENERATOR_NAMES.get(generator, generator)}"
            found.setdefault(module, []).append(_Sighting(module, what, location, line, generator))
    return {module: _unique(sightings) for module, sightings in found.items()}


def _concrete_args(
    model: nn.Module, inputs: Inputs, input_names: Iterable[str] | None = None
) -> dict[str, Any] | None:
    """Specialise forward parameters the caller did not pass to their defaults, so that
    ``if mask is not None`` branches trace; raise TypeError for unknown keyword inputs."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    names = [p.name for p in params]
    unknown = set(inputs.kwargs) - set(names)
    if unknown and not any(p.kind is p.VAR_KEYWORD for p in params):
        raise TypeError(
            f"{type(model).__name__}.forward has no parameter(s) {sorted(unknown)}; "
            f"its parameters are {names}"
        )
    concrete: dict[str, Any] = {}
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    given = {p.name for p in positional[: len(inputs.args)]} | set(inputs.kwargs)
    if input_names is not None and not inputs.args and not inputs.kwargs:
        given = set(input_names)
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.name in given:
            continue
        if p.default is inspect.Parameter.empty:
            raise TypeError(f"example inputs lack the required argument '{p.name}'")
        concrete[p.name] = p.default
    return concrete or None


def _restore_placeholder_names(graph: fx.Graph, model: nn.Module) -> None:
    """fx may rename placeholders of specialised arguments (``mask`` -> ``mask_1``); callers
    pass them by their real names, so the generated signature must use those."""
    try:
        names = list(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return
    for node in graph.nodes:
        if node.op != "placeholder":
            continue
        base = str(node.target).lstrip("*")
        if base not in names:
            stripped = base.rsplit("_", 1)[0]
            if stripped in names:
                node.target = node.target.replace(base, stripped)
