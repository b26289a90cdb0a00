"""Stage 1 — graph capture: turn an ``nn.Module`` and example inputs into an fx graph.

Three capture paths are tried in order, each one only when the previous one fails:

1. ``fx``: :class:`torch.fx.Tracer` symbolic tracing of the whole model. Modules from
   ``torch.nn`` and the user's ``leaf_modules`` stay single ``call_module`` nodes.
2. ``fx+leaves``: when tracing fails inside a submodule, that submodule (the innermost one
   that raised) becomes a leaf and tracing is retried. A leaf is run as an opaque call, so
   its parameters and buffers stay in place and its memory is still profiled.
3. ``export``: when the failure is in the root's own code (nothing to make a leaf), the model
   is captured with ``torch.export.export(strict=False)``, whose training IR keeps dropout,
   batch-norm statistics updates and parameter names. Export is also preferred over an fx
   capture whose automatic leaves hold most of the parameters (a Hugging Face body that
   branches on shapes would be one opaque node), when it succeeds.

Models as libraries ship them are handled on the way: a decorated ``forward(*args,
**kwargs)`` wrapper is traced as the user calls it, and output objects export cannot carry
(a key/value cache) are returned as ``None``, with a note in :attr:`Capture.warnings`.

The graph must run what the model runs. Tracing executes the forward's Python once, so three
things it sees would not survive in an fx graph: a random draw made without a traced input
(``torch.rand([]) < p`` for LayerDrop, ``random.random()``), which fx would bake in as a
constant, a switch of the autograd mode or autocast (``torch.no_grad()``), which fx does
not record, and an assignment to a registered buffer or parameter (``self.steps =
self.steps + 1``), whose new value fx computes but never stores. :class:`_Watch` sees them
while tracing; the innermost submodule whose own code did it becomes a leaf (it runs
eagerly inside the graph, so it draws anew, its mode holds and it assigns), and the root's
own code falls back to export, which keeps torch draws as operators, ``no_grad`` regions as
``wrap_with_set_grad_enabled`` and buffer assignments as in-place updates; an export graph
that baked a Python or NumPy draw, lost a mode switch or an assignment, is refused with a
:class:`TraceError` naming the line. Every fallback is said in :attr:`Capture.warnings`.
Tracing consumes no random numbers.

Export graphs keep the batch size and the sequence length dynamic where the model allows
(:func:`_dynamic_shapes`), so smaller batches run the plan; where export cannot, the graph
is specialised to the example shapes, as the notes say. Calls are checked against the graph
before it runs (:func:`_input_check`).

Every path yields a graph whose ``get_attr`` / ``call_module`` targets are qualified names in
the *original* module tree, so the rewritten module can keep using the user's own parameter
and buffer objects (``state_dict()`` keys stay the same, optimizers keep working).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import inspect
import io
import linecache
import logging
import os
import random
import sys
import traceback
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from autockpt.errors import PlanMismatchError, TraceError
from autockpt.rng import RngStates, rng_as_found
from autockpt.runtime import as_found

_TORCH_DIR = os.path.dirname(torch.__file__)
_MAX_LEAF_RETRIES = 64


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


@dataclass
class Capture:
    """A captured forward: the graph plus what the rest of the pipeline needs to know about it.

    ``graph_module`` is a GraphModule built over the original model's tree; only its ``graph``
    and code generator are used downstream, never its copied attributes.
    """

    graph_module: fx.GraphModule
    method: str
    leaf_modules: tuple[str, ...]
    warnings: list[str] = field(default_factory=list)
    extra_attributes: dict[str, Any] = field(default_factory=dict)
    dynamic_dims: tuple[str, ...] = ()
    """Input dimensions an export graph takes at any size (``"input_ids[1]"``); the others
    are specialised to the example's. Empty for fx graphs, which are shape-generic."""

    @property
    def graph(self) -> fx.Graph:
        return self.graph_module.graph

    @property
    def shape_generic(self) -> bool:
        """Whether the graph runs other input sizes than the example's: every fx graph, and
        an export graph with dynamic dimensions (its guards check the fixed ones)."""
        return self.method != "export" or bool(self.dynamic_dims)

    def compute_nodes(self) -> list[fx.Node]:
        """Nodes in execution order that do work (everything but inputs, attributes, output)."""
        return [
            n for n in self.graph.nodes if n.op in ("call_function", "call_method", "call_module")
        ]

    def fingerprint(self) -> str:
        """Structural hash of the graph: ops, targets (with the class of each called
        module) and wiring, independent of weights."""
        digest = hashlib.sha256()
        for node in self.graph.nodes:
            digest.update(f"{node.op}|{node.name}|{_target_name(node.target)}|".encode())
            if node.op == "call_module":
                # A module's name says nothing about what it does: Identity -> Dropout
                # changes RNG use, ReLU -> BatchNorm adds mutated buffers.
                module = self.graph_module.get_submodule(node.target)
                digest.update(f"{_target_name(type(module))}|".encode())
            digest.update(repr(_arg_names(node.args)).encode())
            digest.update(repr(_arg_names(node.kwargs)).encode())
        return digest.hexdigest()[:16]


def capture(
    model: nn.Module,
    inputs: Inputs,
    *,
    leaf_modules: Iterable[str] = (),
    method: str | None = None,
    input_names: Iterable[str] | None = None,
) -> Capture:
    """Capture ``model``'s forward as an fx graph, falling back as the module docstring says.

    ``method`` forces one path ("fx" also allows automatic leaves, "export"); ``None`` tries
    them in order. ``input_names`` names the forward parameters that will be passed when
    ``inputs`` is empty (re-applying a saved plan with no example inputs); the others are
    specialised to their defaults, exactly as when the plan was made. Raises
    :class:`TraceError` naming the module and source line when every path fails.

    Tracing runs the forward's Python code, which may assign to the model (fx stores a
    proxy where a forward replaces a buffer) or draw random numbers: the model, the inputs
    and the global generators are left as found (:func:`autockpt.runtime.as_found`).
    """
    with as_found(model, inputs):
        return _capture(model, inputs, leaf_modules, method, input_names)


def _capture(
    model: nn.Module,
    inputs: Inputs,
    leaf_modules: Iterable[str],
    method: str | None,
    input_names: Iterable[str] | None,
) -> Capture:
    leaves = set(leaf_modules)
    _check_leaf_names(model, leaves)
    notes: list[str] = []
    fx_failure: tuple[str, BaseException] | None = None
    if method in (None, "fx", "fx+leaves"):
        result = _trace_fx_with_leaves(model, inputs, leaves, input_names)
        if isinstance(result, Capture):
            if method is None and _mostly_opaque(model, result, leaves):
                return _prefer_export(model, inputs, result)
            return result
        fx_failure = result
        if method is not None:
            raise _trace_error(*fx_failure)
    if method in (None, "export"):
        try:
            return _capture_export(model, inputs, notes, fx_failure)
        except TraceError:
            raise
        except Exception as export_error:  # noqa: BLE001 - reported with the fx failure
            if fx_failure is None:
                raise _trace_error("", export_error) from export_error
            module, error = fx_failure
            raise _trace_error(module, error, also=export_error) from error
    raise ValueError(f"unknown capture method {method!r}; use 'fx', 'export' or None")


_MAX_OPAQUE_SHARE = 0.5


def _mostly_opaque(model: nn.Module, captured: Capture, user_leaves: set[str]) -> bool:
    """Whether the automatic leaves of an fx capture hold more than half of the model's
    parameters. A leaf is one node to the planner: nothing inside it can be checkpointed
    apart, so a capture that is mostly leaves (a Hugging Face model whose body branches on
    shapes becomes a single leaf) leaves the planner nothing to choose from."""
    auto = [name for name in captured.leaf_modules if name not in user_leaves]
    if not auto:
        return False
    total = sum(p.numel() for p in model.parameters())
    opaque: set[int] = set()
    for name in auto:
        opaque |= {id(p) for p in model.get_submodule(name).parameters()}
    held = sum(p.numel() for p in model.parameters() if id(p) in opaque)
    return total > 0 and held > _MAX_OPAQUE_SHARE * total


def _prefer_export(model: nn.Module, inputs: Inputs, fx_capture: Capture) -> Capture:
    """Capture with torch.export instead of a mostly-opaque fx graph; keep the fx capture
    when export fails too (e.g. value-dependent control flow inside the leaves)."""
    leaves = ", ".join(fx_capture.leaf_modules)
    try:
        reason = f"fx would run {leaves} as opaque leaves holding most of the parameters"
        return _capture_export(model, inputs, [], reason)
    except Exception as error:  # noqa: BLE001 - the fx capture still works
        why = error.reason if isinstance(error, TraceError) else type(error).__name__
        fx_capture.warnings.append(
            f"torch.export could not capture the model either ({why}), so "
            f"{leaves} stay opaque leaves: the plan cannot checkpoint inside them"
        )
        return fx_capture


# ---------------------------------------------------------------------------------------------
# fx path


class _LeafTracer(fx.Tracer):
    """An fx tracer that remembers which submodule raised, so that it can become a leaf.

    Buffers are traced as attributes (``proxy_buffer_attributes``): code that slices a
    buffer by a size read from the input (a causal mask) then traces instead of failing.
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
    failed_leaves: list[str] = []
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
                    failed_leaves.append(failed)
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
                failed_leaves = [m for m in failed_leaves if m not in inside]
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
        if failed_leaves:
            notes.append("untraceable submodules run as opaque leaves: " + ", ".join(failed_leaves))
        notes += fidelity_notes.values()
        method = "fx+leaves" if auto_leaves else "fx"
        return Capture(gm, method, tuple(sorted(leaves | set(auto_leaves))), notes)
    return ("", RuntimeError(f"gave up after {_MAX_LEAF_RETRIES} leaf retries"))


@contextlib.contextmanager
def _slots_as_found(model: nn.Module) -> Iterator[None]:
    """Put back the tensor object of every buffer and parameter slot of ``model`` on exit.
    Only slots: fx tracing computes on proxies, so it never writes a tensor's values, but
    it leaves a proxy in a slot the forward assigns. (The capture as a whole runs under
    :func:`autockpt.runtime.as_found`, which also restores values.)"""
    held = [(m, dict(m._buffers), dict(m._parameters)) for m in model.modules()]
    try:
        yield
    finally:
        for m, buffers, parameters in held:
            for slots, found in ((m._buffers, buffers), (m._parameters, parameters)):
                if slots.keys() != found.keys() or any(slots[k] is not v for k, v in found.items()):
                    slots.clear()
                    slots.update(found)


_CHECKPOINT_WARNING = (
    "the model already calls torch.utils.checkpoint; graph capture inlines those calls, so "
    "autockpt's plan replaces them (the result no longer checkpoints where the code said)"
)


# ---------------------------------------------------------------------------------------------
# fidelity: what tracing runs that a graph would not keep (docs/design.md, "What capture keeps
# faithful")


@dataclass(frozen=True)
class _Sighting:
    """One thing a module's own code did while being traced that a graph does not keep:
    a random draw from a global generator (``generator`` set), an assignment to a
    registered buffer or parameter (``slot``: its qualified name) or a switch of the
    autograd mode or autocast (``before``/``after``: grad mode around a
    ``set_grad_enabled``)."""

    module: str
    what: str
    location: str
    source_line: str
    generator: str | None = None
    before: bool | None = None
    after: bool | None = None
    slot: str | None = None
    parameter: bool = False  # ``slot`` is a parameter's

    def describe(self) -> str:
        return f"{self.what} at {self.location}"


class _Unfaithful(Exception):
    """The root's own code does something fx would not keep (a draw, a mode switch, a
    buffer assignment); no leaf can fix it, so the capture falls back to torch.export or
    refuses."""

    def __init__(self, sightings: list[_Sighting]) -> None:
        self.sightings = sightings
        first = sightings[0]
        self.location, self.source_line = first.location, first.source_line
        super().__init__(_what_fx_loses(sightings))


_GENERATOR_NAMES = {
    "torch": "torch's generator",
    "torch.cuda": "torch's CUDA generator",
    "random": "Python's random",
    "numpy": "NumPy's global generator",
}


def _what_fx_loses(sightings: list[_Sighting]) -> str:
    draws = [s for s in sightings if s.generator is not None]
    assignments = [s for s in sightings if s.slot is not None]
    switches = [s for s in sightings if s.generator is None and s.slot is None]
    parts = []
    if draws:
        parts.append(
            "draws random numbers in Python ("
            + "; ".join(s.describe() for s in draws)
            + "), which fx would run once and bake into the graph as constants"
        )
    if switches:
        parts.append(
            "switches the autograd mode or autocast ("
            + "; ".join(s.describe() for s in switches)
            + "), which fx does not record"
        )
    if assignments:
        parts.append(
            "assigns a registered buffer or parameter ("
            + "; ".join(s.describe() for s in assignments)
            + "), which fx does not record (its graph computes the new value, never stores it)"
        )
    return " and ".join(parts)


def _leaf_note(module: str, sightings: list[_Sighting]) -> str:
    draws = any(s.generator is not None for s in sightings)
    assignments = any(s.slot is not None for s in sightings)
    switches = any(s.generator is None and s.slot is None for s in sightings)
    why = []
    if draws:
        why.append("each step draws anew")
    if switches:
        why.append("the mode it sets holds when it runs")
    if assignments:
        why.append("the value it assigns is stored when it runs")
    because = " and ".join(why)
    return f"module '{module}' {_what_fx_loses(sightings)}; it runs as a leaf so {because}"


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


def _unique(sightings: list[_Sighting]) -> list[_Sighting]:
    seen: set[tuple[str, str]] = set()
    kept = []
    for s in sightings:
        if (s.what, s.location) not in seen:
            seen.add((s.what, s.location))
            kept.append(s)
    return kept


def _definition(fn: Any) -> tuple[str, str]:
    code = getattr(inspect.unwrap(fn), "__code__", None)
    if code is None:
        return "<unknown>", ""
    line = linecache.getline(code.co_filename, code.co_firstlineno).strip()
    return f"{code.co_filename}:{code.co_firstlineno}", line


class _CheckpointSeen:
    """What :class:`_Watch` reports checkpoint calls to when there is no fx tracer (export)."""

    saw_checkpoint = False


_TORCH_DRAWS = frozenset(
    """rand randn randint randperm rand_like randn_like randint_like bernoulli bernoulli_
    multinomial normal normal_ poisson uniform_ random_ exponential_ geometric_ cauchy_
    log_normal_ dropout dropout_ feature_dropout alpha_dropout feature_alpha_dropout rrelu
    rrelu_ native_dropout binomial _standard_gamma _sample_dirichlet""".split()
)
_DRAW_NAMES = _TORCH_DRAWS | {"random", "getrandbits", "seed", "randbytes"}
"""Names of the C functions that can draw from a global generator (torch's samplers, the
C methods of Python's ``Random``); NumPy's are not C calls a profile hook sees."""
_GRAD_SWITCHES = {
    "no_grad.__enter__": "torch.no_grad",
    "enable_grad.__enter__": "torch.enable_grad",
    "set_grad_enabled.__init__": "torch.set_grad_enabled",
    "set_grad_enabled.__enter__": "torch.set_grad_enabled",
    "set_grad_enabled.clone": "torch.set_grad_enabled",
}


@dataclass(frozen=True)
class _WatchedCode:
    """Code objects and files :class:`_Watch` looks for (resolved once)."""

    checkpoints: frozenset[Any]
    modes: dict[Any, str]  # __enter__ code of a mode construct -> its name
    set_grad: Any
    grad_file: str
    construct_files: frozenset[str]  # where the mode constructs' own code lives
    contextlib_file: str  # torch's decorator wrapper (``@torch.no_grad()``)
    slot_writers: dict[Any, str]  # code of nn.Module's slot setters -> its value argument


@functools.cache
def _watched_code() -> _WatchedCode:
    import torch.cpu.amp.autocast_mode as cpu_autocast
    import torch.cuda.amp.autocast_mode as cuda_autocast
    from torch.amp import autocast_mode
    from torch.autograd import grad_mode
    from torch.utils import _contextlib
    from torch.utils import checkpoint as ckpt

    return _WatchedCode(
        checkpoints=frozenset(
            inspect.unwrap(fn).__code__ for fn in (ckpt.checkpoint, ckpt.checkpoint_sequential)
        ),
        modes={
            inspect.unwrap(grad_mode.inference_mode.__enter__).__code__: "torch.inference_mode",
            inspect.unwrap(autocast_mode.autocast.__enter__).__code__: "torch.autocast",
        },
        set_grad=torch._C._set_grad_enabled,
        grad_file=grad_mode.__file__,
        construct_files=frozenset(
            m.__file__ for m in (grad_mode, autocast_mode, cpu_autocast, cuda_autocast)
        ),
        contextlib_file=_contextlib.__file__,
        slot_writers={
            nn.Module.__setattr__.__code__: "value",
            nn.Module.register_buffer.__code__: "tensor",
            nn.Module.register_parameter.__code__: "param",
        },
    )


class _Watch:
    """A profile hook over one capture attempt (fx or export).

    Tracing runs the model's Python code once; this hook sees what that code does that the
    graph will not keep, and attributes it to ``scope()`` (the module whose own code runs):

    * calls of ``torch.utils.checkpoint`` (tracing inlines them);
    * draws from a global generator (torch's, Python's ``random``, NumPy's): fx runs them
      once and bakes the value in. The hook compares the generator states around each C
      call that can draw, so only calls that did draw are reported, with their line;
    * switches of the autograd mode (``no_grad``, ``enable_grad``, ``set_grad_enabled``,
      ``inference_mode``, also as decorators) and of ``autocast``: fx records none of
      them. ``before``/``after`` say the grad mode around a ``set_grad_enabled``;
    * assignments to a registered buffer or parameter of ``model``'s tree
      (``self.steps = self.steps + 1``, ``register_buffer`` of an existing name): fx
      computes the new value but stores it nowhere (it leaves a proxy in the slot), so
      the graph would never advance the buffer. Assigning the very tensor the slot holds
      (``self.mask = self.mask.to(x.device)`` on export's fake tensors) is no change.
    """

    def __init__(
        self,
        seen: _LeafTracer | _CheckpointSeen,
        scope: Callable[[], str] = lambda: "",
        model: nn.Module | None = None,
    ) -> None:
        self.seen = seen
        self.scope = scope
        self.model = model
        self.draws: list[_Sighting] = []
        self.switches: list[_Sighting] = []
        self.assignments: list[_Sighting] = []
        self.internal: set[str] = set()  # generators torch's helper libraries drew from
        self._pending: dict[int, Any] = {}
        self._code = _watched_code()
        self._paths: dict[int, str] | None = None

    def __enter__(self) -> _Watch:
        self.previous = sys.getprofile()
        sys.setprofile(self._hook)
        return self

    def __exit__(self, *exc: Any) -> None:
        sys.setprofile(self.previous)

    def _hook(self, frame: Any, event: str, arg: Any) -> None:
        # Runs at every call while tracing: the common case returns after a set lookup. It
        # must never raise: Python would drop the hook and raise into the traced code.
        try:
            if event == "c_call":
                if arg is self._code.set_grad:
                    self._pending[id(frame)] = (None, torch.is_grad_enabled())
                elif getattr(arg, "__name__", None) in _DRAW_NAMES:
                    generator = _generator_of(arg)
                    if generator is not None:
                        with _outside_dispatch_modes():
                            self._pending[id(frame)] = ((generator, arg), RngStates.now())
            elif event == "call":
                code = frame.f_code
                if code in self._code.checkpoints:
                    self.seen.saw_checkpoint = True
                elif code in self._code.modes:
                    site = self._switch_site(frame)
                    if site is not None:
                        what = self._code.modes[code]
                        self.switches.append(_Sighting(self.scope(), what, *site))
                elif code in self._code.slot_writers and self.model is not None:
                    self._slot_write(frame, self._code.slot_writers[code])
            elif self._pending and event in ("c_return", "c_exception"):
                pending = self._pending.pop(id(frame), None)
                if pending is not None:
                    self._resolve(frame, *pending)
        except Exception:  # noqa: BLE001 - a sighting lost; the generators are still compared
            self._pending.pop(id(frame), None)

    def _resolve(self, frame: Any, draw: tuple[str, Any] | None, before: Any) -> None:
        if draw is None:  # a set_grad_enabled call returned
            what = self._grad_switch(frame)
            site = self._switch_site(frame) if what is not None else None
            if what is not None and site is not None:
                after = torch.is_grad_enabled()
                sighting = _Sighting(self.scope(), what, *site, before=before, after=after)
                self.switches.append(sighting)
            return
        generator, fn = draw
        with _outside_dispatch_modes():  # export traces under fake-tensor modes
            moved = before.changed()
        if generator not in moved:
            return  # called on traced values (a graph node) or drew nothing
        owner = getattr(fn, "__self__", None)
        prefix = {"random": "random", "numpy": "numpy.random"}.get(generator)
        if prefix is None:
            prefix = "Tensor" if isinstance(owner, torch.Tensor) else "torch"
        location, line = self._site(frame)
        if location.startswith(_TOOL_DIRS):
            self.internal.add(generator)  # torch's own shape reasoning, not the model
            return
        what = f"{prefix}.{getattr(fn, '__name__', fn)}"
        self.draws.append(_Sighting(self.scope(), what, location, line, generator=generator))

    def _slot_write(self, frame: Any, value_name: str) -> None:
        """An ``nn.Module`` slot setter was called: record it when the model's own code
        assigns a buffer or parameter slot of the model's tree (torch's bookkeeping, such as
        export swapping fake tensors in, and plain attributes are not the model's state)."""
        caller = frame.f_back
        if caller is None:
            return
        filename = caller.f_code.co_filename
        if filename.startswith(_SKIPPED_DIRS) or filename.startswith("<"):
            return
        local = frame.f_locals
        owner, name = local.get("self"), local.get("name")
        if not isinstance(owner, nn.Module) or not isinstance(name, str):
            return
        buffers = vars(owner).get("_buffers", {})
        parameters = vars(owner).get("_parameters", {})
        if value_name == "value" and name not in buffers and name not in parameters:
            return  # a plain attribute (or a submodule)
        held = buffers.get(name, parameters.get(name))
        if held is not None and local.get(value_name) is held:
            return  # the tensor the slot holds, put back
        if self._paths is None:
            assert self.model is not None
            self._paths = {
                id(m): path for path, m in self.model.named_modules(remove_duplicate=False)
            }
        path = self._paths.get(id(owner))
        if path is None:
            return  # a module made in forward: not the model's state
        slot = f"{path}.{name}" if path else name
        parameter = name in parameters or value_name == "param"
        what = f"{'parameter' if parameter else 'buffer'} '{slot}' assigned"
        location = f"{filename}:{caller.f_lineno}"
        line = linecache.getline(filename, caller.f_lineno).strip()
        self.assignments.append(
            _Sighting(self.scope(), what, location, line, slot=slot, parameter=parameter)
        )

    def _grad_switch(self, frame: Any) -> str | None:
        """The construct a ``_set_grad_enabled`` call came from (``torch.no_grad``...), or
        ``None`` when it is one restoring the mode on exit."""
        qualname = None
        while frame is not None and frame.f_code.co_filename == self._code.grad_file:
            qualname = getattr(frame.f_code, "co_qualname", frame.f_code.co_name)
            frame = frame.f_back
        if qualname is None:
            return "torch._C._set_grad_enabled"
        if "__exit__" in qualname or qualname.endswith("__call__"):
            return None
        return _GRAD_SWITCHES.get(qualname, f"torch.{qualname}")

    def _switch_site(self, frame: Any) -> tuple[str, str] | None:
        """Where the user's code entered the mode construct that ``frame`` runs in: the
        frame right outside the construct's own code, or a decorated function's definition
        (``@torch.no_grad()``). ``None`` when torch's own code switched (export does,
        around its tracing): that is not the model's."""
        while frame is not None and frame.f_code.co_filename in self._code.construct_files:
            frame = frame.f_back
        if frame is None:
            return None
        name = frame.f_code.co_filename
        if name == self._code.contextlib_file:
            func = frame.f_locals.get("func")
            code = getattr(inspect.unwrap(func), "__code__", None) if func is not None else None
            if code is None or code.co_filename.startswith(_SKIPPED_DIRS):
                return None
            return _definition(func)
        if name.startswith(_SKIPPED_DIRS) or name.startswith("<"):
            return None
        return f"{name}:{frame.f_lineno}", linecache.getline(name, frame.f_lineno).strip()

    def _site(self, frame: Any) -> tuple[str, str]:
        """``file:line`` and source of the user's code behind ``frame``: the first frame
        outside torch, the random modules and this package."""
        while frame is not None:
            name = frame.f_code.co_filename
            if not (name.startswith(_SKIPPED_DIRS) or name.startswith("<")):
                line = linecache.getline(name, frame.f_lineno).strip()
                return f"{name}:{frame.f_lineno}", line
            frame = frame.f_back
        return "<unknown>", ""


def _skipped_dirs() -> tuple[str, ...]:
    dirs = [_TORCH_DIR, os.path.dirname(__file__), random.__file__]
    try:
        import numpy

        dirs.append(os.path.dirname(numpy.__file__))
    except ImportError:  # pragma: no cover
        pass
    return tuple(dirs)


_SKIPPED_DIRS = _skipped_dirs()


def _tool_dirs() -> tuple[str, ...]:
    """Libraries torch itself runs while tracing that draw from Python's ``random``:
    SymPy shuffles its assumption checks (``random.shuffle``) when export reasons about
    symbolic sizes. Their draws are not the model's (capture restores the generators)."""
    try:
        import sympy
    except ImportError:  # pragma: no cover
        return ()
    return (os.path.dirname(sympy.__file__),)


_TOOL_DIRS = _tool_dirs()


@contextlib.contextmanager
def _outside_dispatch_modes() -> Iterator[None]:
    """Compare generator states as real tensors also while export traces (its fake-tensor
    mode would refuse ``torch.equal`` on them)."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        yield


def _generator_of(fn: Any) -> str | None:
    """The global generator a C function can draw from, by what it is: a method of
    Python's ``Random`` or a torch function or tensor method that samples; ``None`` for
    anything else."""
    owner = getattr(fn, "__self__", None)
    name = getattr(fn, "__name__", "")
    if isinstance(owner, random.Random):
        return "random"
    if name in _TORCH_DRAWS and (
        isinstance(owner, torch.Tensor) or str(getattr(fn, "__module__", "")).startswith("torch")
    ):
        return "torch"
    return None


def given_input_names(model: nn.Module, inputs: Inputs) -> tuple[str, ...]:
    """The forward parameters that ``inputs`` fills, in signature order."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return ()
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    given = {p.name for p in positional[: len(inputs.args)]} | set(inputs.kwargs)
    return tuple(p.name for p in params if p.name in given)


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


# ---------------------------------------------------------------------------------------------
# export path


def _capture_export(
    model: nn.Module,
    inputs: Inputs,
    notes: list[str],
    fx_failure: tuple[str, BaseException] | str | None,
) -> Capture:
    # Export runs twice: with static shapes under the watch (what the model's Python does
    # while traced, as on the fx path), then with dynamic sizes, unwatched: export's shape
    # reasoning makes many Python calls in SymPy, and a profile hook on each of them more
    # than quadrupled its time (tiny GPT-2: 1.0 s, 4.5 s watched). The model's code runs the
    # same way in both (the same example inputs): what the first saw holds for the second.
    dropped: list[str] = []
    seen = _CheckpointSeen()
    watch = _Watch(seen, model=model)
    with rng_as_found() as found, warnings.catch_warnings(), _quiet_torch_logs(), watch:
        warnings.simplefilter("ignore")
        exported = _export(model, inputs, None, dropped)
        moved = found.changed()
    _check_export_kept(model, watch, moved, fx_failure)
    dynamic = _dynamic_shapes(model, inputs)
    dynamic_failure: BaseException | None = None
    if dynamic is not None:
        with rng_as_found(), warnings.catch_warnings(), _quiet_torch_logs():
            warnings.simplefilter("ignore")
            try:
                sized = _export(model, inputs, dynamic, dropped)
            except Exception as error:  # noqa: BLE001 - the static graph stands
                dynamic_failure = error
            else:
                # Symbolic sizes can turn a size computation into a value read (DeBERTa's
                # relative positions: ``.item()``), which planning must refuse; the static
                # graph computes those sizes as constants.
                if _value_reads(sized) > _value_reads(exported):
                    dynamic_failure = RuntimeError(
                        "with symbolic sizes the graph reads tensor values (.item())"
                    )
                else:
                    exported = sized
    gm = exported.module()
    assigned = _keep_assignments(gm, watch, fx_failure)
    if seen.saw_checkpoint:
        notes.append(_CHECKPOINT_WARNING)
        warnings.warn(_CHECKPOINT_WARNING, stacklevel=3)
    if dropped:
        notes.append(
            "outputs that are not tensors or containers of them are returned as None by the "
            f"optimized model: {', '.join(sorted(set(dropped)))} (a training step does not "
            "use them; turn them off in the model, e.g. use_cache=False, to silence this)"
        )
    # The guard submodule is not part of the user's tree: it is taken out of the graph and
    # run by the input check instead (rewrite.py runs it before the graph).
    guards = []
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and str(node.target).startswith("_guards"):
            guards.append(gm.get_submodule(str(node.target)))
            gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code(is_impure_node=_is_impure)
    extras = {name: getattr(gm, name) for name in ("_in_spec", "_out_spec") if hasattr(gm, name)}
    layouts = _input_layouts(gm, dict(exported.range_constraints))
    dims = tuple(
        f"{name}[{d}]"
        for name, layout in layouts
        if layout is not None
        for d, size in enumerate(layout[1])
        if isinstance(size, tuple)
    )
    if "_in_spec" in extras:
        extras[INPUT_CHECK] = _input_check(guards, extras["_in_spec"], inputs.signature(), layouts)
    note = "captured with torch.export (non-strict)"
    if isinstance(fx_failure, str):
        note += f" because {fx_failure}"
    elif fx_failure is not None:
        module, error = fx_failure
        where = f"module '{module}'" if module else "the root module"
        if isinstance(error, _Unfaithful):
            note += f" because {where}'s own code {error}"
        else:
            note += f" because fx could not trace {where}: {type(error).__name__}: {error}"
    notes.append(note)
    if assigned:
        notes.append(
            f"torch.export keeps the assignment of {', '.join(assigned)} in forward as an "
            "in-place update of the registered tensor at the end of the forward: its values "
            "advance exactly as in eager, and the slot keeps holding the same tensor object"
        )
    if dynamic_failure is not None:
        first = str(dynamic_failure).strip().splitlines()[0] if str(dynamic_failure) else ""
        notes.append(
            "torch.export could not keep batch and sequence sizes dynamic "
            f"({type(dynamic_failure).__name__}: {first}), so the graph is specialised to "
            "the planned input shapes: a call with other shapes raises PlanMismatchError"
        )
    elif dims:
        notes.append(
            f"the graph takes other sizes in {', '.join(dims)} (torch.export keeps them "
            "dynamic; its guards refuse sizes the model's code branches on) and the planned "
            "size in every other dimension: smaller batches and sequences run the plan, "
            "larger ones follow `on_larger_input`"
        )
    elif dynamic is not None:
        notes.append(
            "torch.export fixed every input size while tracing, so the graph is specialised "
            "to the planned input shapes: a call with other shapes raises PlanMismatchError"
        )
    return Capture(gm, "export", (), notes, extras, dims)


def _value_reads(exported: Any) -> int:
    """How many nodes of an exported graph read a tensor's value into Python."""
    reads = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default)
    return sum(
        1 for node in exported.graph_module.graph.nodes
        if node.op == "call_function" and node.target in reads
    )


def _dynamic_shapes(model: nn.Module, inputs: Inputs) -> Any | None:
    """Export's ``dynamic_shapes`` for the example inputs: the batch dimension (dim 0) of
    every tensor and the sequence dimension (dim 1) of every integer or boolean tensor of
    rank 2 or more (token ids, attention masks, labels, positions), each as ``Dim.AUTO``:
    export keeps a dimension dynamic where the model allows it and silently specialises
    it where the model fixes it (a size-1 example, a view to a literal shape, a table of
    fixed length). Floating tensors keep their other sizes (channels, features, a
    sequence of embeddings). Every other input gets ``None`` (all sizes fixed): 0-dim
    tensors, non-tensors and ``None``, wherever they are passed, ``**kwargs`` included. The
    spec is for the forward as :func:`_keywords_as_parameters` shows it to export, which
    :func:`_export` does whenever it is given a spec. ``None`` when nothing is marked or
    export's helper cannot map the inputs to the forward's parameters."""
    from torch.export import Dim, ShapesCollection

    shapes = ShapesCollection()
    marked = False
    for t in inputs.tensors():
        dims = {}
        if t.dim() >= 1:
            dims[0] = Dim.AUTO
        if t.dim() >= 2 and not (t.is_floating_point() or t.is_complex()):
            dims[1] = Dim.AUTO
        if dims:
            shapes[t] = dims
            marked = True
    if not marked:
        return None
    try:
        with _keywords_as_parameters(model, inputs):
            return shapes.dynamic_shapes(model, inputs.args, inputs.kwargs)
    except Exception:  # noqa: BLE001 - exported with static shapes instead
        return None


def _keyword_parameters(model: nn.Module, inputs: Inputs) -> inspect.Signature | None:
    """The forward's signature with each keyword input that its ``**kwargs`` receives as a
    keyword-only parameter of its own, and no ``**kwargs``; ``None`` when no input goes
    through ``**kwargs`` or such a signature cannot be written (a keyword that is not an
    identifier, or has the name of a positional-only parameter)."""
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None
    params = list(signature.parameters.values())
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    extra = [name for name in inputs.kwargs if name not in named]
    if not extra:
        return None
    kept = [p for p in params if p.kind is not p.VAR_KEYWORD]
    try:
        added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY) for name in extra]
        return signature.replace(parameters=kept + added)
    except (TypeError, ValueError):
        return None


@contextlib.contextmanager
def _keywords_as_parameters(model: nn.Module, inputs: Inputs) -> Iterator[None]:
    """While exporting with dynamic shapes, ``model.forward`` shows the keyword inputs its
    ``**kwargs`` receive (the Trainer's ``num_items_in_batch``) as parameters of their own
    (:func:`_keyword_parameters`). torch.export checks ``dynamic_shapes`` against the
    forward's signature, where such inputs sit in a dict under the ``**kwargs`` parameter's
    name, and later matches it against the inputs in call order, where they sit at the top
    level (pytorch/pytorch#150022, up to at least torch 2.13): no spec passes both, and
    export fails ("Must provide a tree_name when there might be a mismatch"), so a Hugging
    Face causal LM planned with the Trainer's call was specialised to the planned shapes.
    With parameters of their own both views agree. The call is unchanged (the override
    passes everything on), and so is the graph: its placeholders are named after the
    keywords either way, and its input spec is the call's. The model is restored on exit
    (the override is an instance attribute, removed again); without such inputs nothing
    is changed."""
    signature = _keyword_parameters(model, inputs)
    if signature is None:
        yield
        return
    original = model.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        return original(*args, **kwargs)

    forward.__signature__ = signature  # type: ignore[attr-defined]
    with _forward_replaced(model, forward):
        yield


@contextlib.contextmanager
def _forward_replaced(model: nn.Module, forward: Callable[..., Any]) -> Iterator[None]:
    """``model.forward`` is ``forward`` (an instance attribute) until exit, then what the
    instance had again: its own attribute, or none (the class's method)."""
    had_own = "forward" in vars(model)
    previous = vars(model).get("forward")
    model.forward = forward
    try:
        yield
    finally:
        if had_own:
            model.forward = previous
        else:
            del model.forward


def _export(
    model: nn.Module, inputs: Inputs, dynamic: Any | None, dropped: list[str]
) -> torch.export.ExportedProgram:
    """``torch.export.export(strict=False)``, retried once with outputs export cannot
    carry (a key/value cache object a model returns with use_cache on) left out (their
    class names are appended to ``dropped``); anything else fails the same way again, and
    the first error stands."""

    def run() -> torch.export.ExportedProgram:
        with contextlib.ExitStack() as stack:
            if dynamic is not None:  # the spec is for the forward as this shows it
                stack.enter_context(_size_oblivious())
                stack.enter_context(_keywords_as_parameters(model, inputs))
            return torch.export.export(
                model, inputs.args, inputs.kwargs, strict=False, dynamic_shapes=dynamic
            )

    try:
        return run()
    except Exception as error:  # noqa: BLE001 - retried once, else the first error stands
        try:
            with _outputs_without_opaque_objects(model, dropped):
                return run()
        except Exception:  # noqa: BLE001
            raise error from None


_Size = int | tuple[int, int | None]
"""A dimension of an export graph's input: its fixed size, or the range (lowest, highest
or ``None``) of a dimension export kept dynamic."""
_Layouts = list[tuple[str, tuple[torch.dtype, tuple[_Size, ...]] | None]]


def _size_oblivious() -> contextlib.AbstractContextManager[Any]:
    """Export with sizes reasoned about for every value, 0 and 1 included
    (``backed_size_oblivious``): by default export assumes each dynamic size is at least 2
    and takes a branch such as ``if x.shape[0] > 1`` without a guard, so a last batch of
    one would be refused (:func:`_input_layouts`); with it, such a branch becomes a guard
    and a batch of one runs where the model allows it. A private switch of torch's: where
    it is missing, export's default stands."""
    try:
        from torch.fx.experimental import _config
    except ImportError:  # pragma: no cover
        return contextlib.nullcontext()
    if not hasattr(_config, "backed_size_oblivious"):  # pragma: no cover
        return contextlib.nullcontext()
    return _config.patch(backed_size_oblivious=True)


def _input_layouts(gm: fx.GraphModule, ranges: dict[Any, Any]) -> _Layouts:
    """For each input of an export graph, in its flattened order: its name and, for a
    tensor, its dtype and sizes. A dynamic size comes with the range export traced it
    for (``range_constraints``): without :func:`_size_oblivious` export assumes a dynamic
    size is at least 2 and may take a branch that is wrong for 1 (``if x.shape[0] > 1``)
    without leaving a guard for it, so a size outside the range is refused like a fixed
    size that differs."""
    from torch.utils._sympy.numbers import int_oo

    def size_range(size: torch.SymInt) -> tuple[int, int | None]:
        bounds = ranges.get(size.node.expr)
        if bounds is None:
            return (2, None)
        try:
            lowest = max(0, int(bounds.lower))
        except (TypeError, ValueError):
            lowest = 2
        try:
            highest = None if bounds.upper == int_oo else int(bounds.upper)
        except (TypeError, ValueError, OverflowError):
            highest = None
        return (lowest, highest)

    layouts: _Layouts = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            layouts.append((node.name, None))
            continue
        sizes = tuple(d if isinstance(d, int) else size_range(d) for d in value.shape)
        layouts.append((node.name, (value.dtype, sizes)))
    return layouts


def _keep_assignments(
    gm: fx.GraphModule, watch: _Watch, fx_failure: tuple[str, BaseException] | str | None
) -> tuple[str, ...]:
    """Check that the export graph keeps every buffer assignment the forward made, and
    return the assigned buffers' names.

    Non-strict export turns ``self.steps = self.steps + 1`` into an in-place
    ``copy_(steps, new)`` at the end of the graph: the values advance as in eager, but the
    tensor object stays the same. Export drops an assignment to a parameter, and may drop
    one next to a ``no_grad`` region; an in-place copy cannot change a buffer's shape or
    dtype (a table rebuilt for a new size). Each of those is refused with a
    :class:`TraceError` naming the line. A copy in place would also change the tensor
    that autograd saved where the forward read the old value (``h * self.steps`` before
    the assignment; eager saved the old object, which no one changes), so the reads of a
    buffer the graph copies into read a clone of it, made where the graph first reads it.
    That holds for every such copy: export also writes one for ``self.mask =
    self.mask.to(x.dtype)``, which puts back the very tensor the slot holds."""
    copies: dict[str, fx.Node] = {}
    for node in gm.graph.nodes:
        if (
            node.op == "call_function"
            and node.target is torch.ops.aten.copy_.default
            and isinstance(node.args[0], fx.Node)
            and node.args[0].op == "get_attr"
        ):
            copies[str(node.args[0].target)] = node
    sightings = _unique(watch.assignments)
    lost = [
        s
        for s in sightings
        if s.parameter or s.slot not in copies or not _same_layout(gm, copies[s.slot])
    ]
    if lost:
        in_root = isinstance(fx_failure, tuple) and not fx_failure[0]
        raise _not_kept(
            lost,
            "the forward assigns a registered buffer or parameter (",
            "), which torch.export does not keep as an in-place update of the same "
            "buffer (a parameter, another shape or dtype, or dropped by export), and fx "
            "cannot keep it either in code that cannot run as a leaf; update the buffer in "
            "place instead (self.buf.copy_(...) or self.buf.add_(...))",
            in_root,
        )
    for copy_node in copies.values():  # also those export made of a no-op assignment
        _read_a_clone(gm.graph, copy_node)
    return tuple(sorted({str(s.slot) for s in sightings}))


def _same_layout(gm: fx.GraphModule, copy_node: fx.Node) -> bool:
    """Whether the value ``copy_node`` writes has the shape and dtype of the buffer it
    writes (a static shape: a size that follows the input cannot be copied in place)."""
    value = copy_node.args[1]
    new = value.meta.get("val") if isinstance(value, fx.Node) else None
    if not isinstance(new, torch.Tensor):
        return True  # unknown: the copy itself checks at run time
    try:
        held = gm.get_buffer(str(copy_node.args[0].target))
    except AttributeError:
        return False
    sizes = tuple(new.shape)
    return (
        new.dtype == held.dtype
        and all(isinstance(d, int) for d in sizes)
        and sizes == tuple(held.shape)
    )


def _read_a_clone(graph: fx.Graph, copy_node: fx.Node) -> None:
    """Make the graph's reads of the buffer ``copy_node`` updates read a clone taken before
    the first of them (see :func:`_keep_assignments`). Left as it is when a reader may
    write it (an in-place op, a higher-order op) or reads it after the copy (the forward's
    own ``self.buf.copy_(...)`` followed by a read of the new values): those must reach the
    buffer itself."""
    attr = copy_node.args[0]
    assert isinstance(attr, fx.Node)
    readers = [user for user in attr.users if user is not copy_node]
    if not readers:
        return
    order = {node: i for i, node in enumerate(graph.nodes)}
    for reader in readers:
        target = reader.target
        if not isinstance(target, torch._ops.OpOverload) or target._schema.is_mutable:
            return
        if order[reader] > order[copy_node]:
            return
    first = min(readers, key=order.__getitem__)
    with graph.inserting_before(first):
        clone = graph.call_function(torch.ops.aten.clone.default, (attr,))
    if "val" in attr.meta:
        clone.meta["val"] = attr.meta["val"]
    for reader in readers:
        reader.replace_input_with(attr, clone)


def _check_export_kept(
    model: nn.Module,
    watch: _Watch,
    moved: tuple[str, ...],
    fx_failure: tuple[str, BaseException] | str | None,
) -> None:
    """Refuse an export graph that does not run what the model runs. Export traces on fake
    tensors, so a torch draw stays an operator of the graph, but a draw from Python's
    ``random`` or NumPy runs once and its value is baked in (any generator that moved
    while exporting drew for real). A mode switch that changes nothing while export traces
    (``enable_grad`` with grad already on, matters only under a caller's ``no_grad``) and
    ``inference_mode`` leave no trace in its graph; ``no_grad`` and ``set_grad_enabled``
    regions that do change the mode are kept (``wrap_with_set_grad_enabled``), as are
    ``autocast`` regions."""
    in_root = isinstance(fx_failure, tuple) and not fx_failure[0]
    drawn = {d.generator for d in watch.draws}
    moved = tuple(g for g in moved if g not in watch.internal or g in drawn)
    if moved:
        draws = [d for d in watch.draws if d.generator in moved]
        if not draws:
            location, line = _definition(type(model).forward)
            what = "a draw from " + ", ".join(_GENERATOR_NAMES.get(g, g) for g in moved)
            draws = [_Sighting("", what, location, line, moved[0])]
        raise _not_kept(
            draws,
            "the forward draws random numbers in Python (",
            "): torch.export ran the draw once and baked its value into the graph, and fx "
            "cannot keep it either in code that cannot run as a leaf",
            in_root,
        )
    lost = [
        s
        for s in watch.switches
        if s.what == "torch.inference_mode" or (s.before is not None and s.before == s.after)
    ]
    if lost:
        raise _not_kept(
            lost,
            "the forward switches the autograd mode in a way torch.export does not record (",
            ": a switch that changes nothing while it traces, or inference_mode), and fx "
            "cannot keep it either in code that cannot run as a leaf",
            in_root,
        )


def _not_kept(found: list[Any], opening: str, closing: str, in_root: bool) -> TraceError:
    """The error for model code an export capture did not keep: every sighting listed
    between ``opening`` and ``closing``, located at the first one."""
    first = found[0]
    reason = opening + "; ".join(s.describe() for s in found) + closing
    return TraceError(
        first.module, first.location, first.source_line, reason, in_root_code=in_root
    )


INPUT_CHECK = "_autockpt_check_inputs"
"""Name of the attribute (a plain function ``check(args, kwargs)``) by which an export
capture's input guards reach the rewritten module."""


def _input_check(
    guards: list[Any],
    in_spec: Any,
    planned: str,
    layouts: _Layouts,
) -> Callable[[tuple, dict], None]:
    """Export specialises its graph to the example's dtypes, to the sizes it could not
    keep dynamic (all of them when exported with static shapes) and to non-tensor inputs
    (a view to ``[4, -1]``); another shape would fail deep inside the graph with an
    unrelated message, or not at all. This check runs on every call of the optimized model
    before the graph: each tensor's dtype, rank, fixed sizes and the range of each dynamic
    size (:func:`_input_layouts`), then export's own guards (relations between sizes), and
    raises a typed error that says what to do. Whether a size is larger than planned is
    the rewrite's check, the same as for fx graphs (``on_larger_input``)."""
    from torch.fx._pytree import tree_flatten_spec

    dynamic = any(
        layout is not None and any(isinstance(size, tuple) for size in layout[1])
        for _, layout in layouts
    )
    specialised = (
        "its graph takes other sizes only where torch.export kept them dynamic"
        if dynamic
        else "its graph is specialised to them"
    )

    def refuse(detail: str) -> None:
        raise PlanMismatchError(
            f"this optimized model was planned for inputs {planned} and {specialised} "
            f"({detail}); give inputs of the planned shape there (e.g. drop_last=True, "
            "padding to the planned length) or plan again for this one"
        )

    def check_inputs(args: tuple, kwargs: dict) -> None:
        try:
            flat = tree_flatten_spec((list(args), kwargs), in_spec)
        except Exception:  # noqa: BLE001 - the graph's own input handling reports it
            return
        if len(flat) == len(layouts):
            for (name, layout), value in zip(layouts, flat, strict=True):
                if layout is None or not isinstance(value, torch.Tensor):
                    continue
                dtype, sizes = layout
                if value.dtype != dtype or value.dim() != len(sizes):
                    shape = f"{list(value.shape)}:{str(value.dtype).removeprefix('torch.')}"
                    refuse(f"{name} is {shape}; the graph takes rank {len(sizes)} {dtype}")
                for d, (got, want) in enumerate(zip(value.shape, sizes, strict=True)):
                    if isinstance(want, int) and got != want:
                        refuse(f"{name} has size {got} in dimension {d}, fixed at {want}")
                    if isinstance(want, tuple) and not (
                        want[0] <= got and (want[1] is None or got <= want[1])
                    ):
                        bounds = f"{want[0]}..{'' if want[1] is None else want[1]}"
                        refuse(
                            f"{name} has size {got} in dimension {d}; torch.export traced "
                            f"that dynamic size for {bounds}"
                        )
        for guard in guards:
            try:
                guard(*flat)
            except AssertionError as error:
                refuse(str(error))

    return check_inputs


_PLAIN_LEAVES = (torch.Tensor, int, float, bool, str, type(None))


@contextlib.contextmanager
def _outputs_without_opaque_objects(model: nn.Module, dropped: list[str]) -> Iterator[None]:
    """While exporting, ``model`` returns its output with every leaf that is not a tensor or
    a plain value (one pytree does not know how to take apart) replaced by ``None``; the
    class names of what was replaced are appended to ``dropped``. The model is restored on
    exit (the override is an instance attribute, removed again)."""
    original = model.forward

    def strip(value: Any) -> Any:
        if isinstance(value, _PLAIN_LEAVES):
            return value
        dropped.append(type(value).__name__)
        return None

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        return torch.utils._pytree.tree_map(strip, original(*args, **kwargs))

    with _forward_replaced(model, forward):
        yield


@contextlib.contextmanager
def _quiet_torch_logs() -> Iterator[None]:
    """torch.export logs whole graphs and guard diagnostics when it fails; we report the
    failure ourselves in one line, so its own loggers are hushed for the attempt."""
    loggers = [
        logging.getLogger(name)
        for name in list(logging.root.manager.loggerDict)
        if name.startswith("torch")
    ]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def _is_impure(node: fx.Node) -> bool:
    if node.op in ("placeholder", "output"):
        return True
    return node.is_impure()


# ---------------------------------------------------------------------------------------------
# helpers


def _check_leaf_names(model: nn.Module, leaves: set[str]) -> None:
    names = {name for name, _ in model.named_modules()}
    missing = sorted(leaves - names)
    if missing:
        raise ValueError(f"leaf_modules name modules that do not exist: {missing}")


def _trace_error(
    module: str, error: BaseException, also: BaseException | None = None
) -> TraceError:
    if isinstance(error, _Unfaithful):
        location, line = error.location, error.source_line
        reason = f"its own code {error}"
    else:
        location, line = _user_frame(error)
        reason = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    if also is not None:
        reason += f"; torch.export also failed: {type(also).__name__}: {str(also).splitlines()[0] if str(also) else ''}"
    # fx failed in the root's own code and export was tried too: nothing reaches inside
    return TraceError(module, location, line, reason, in_root_code=not module and also is not None)


def _user_frame(error: BaseException) -> tuple[str, str]:
    """The deepest traceback frame outside torch: the user's line that broke tracing."""
    frames = traceback.extract_tb(error.__traceback__)
    for frame in reversed(frames):
        if frame.filename.startswith(_TORCH_DIR) or frame.filename.startswith("<"):
            continue
        if os.path.dirname(__file__) == os.path.dirname(frame.filename):
            continue
        line = frame.line or linecache.getline(frame.filename, frame.lineno or 0).strip()
        return f"{frame.filename}:{frame.lineno}", line
    return "<unknown>", ""


def _target_name(target: Any) -> str:
    if isinstance(target, str):
        return target
    module = getattr(target, "__module__", "") or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or str(target)
    return f"{module}.{name}"


def _arg_names(value: Any) -> Any:
    return torch.fx.node.map_arg(value, lambda n: f"%{n.name}") if value is not None else None
