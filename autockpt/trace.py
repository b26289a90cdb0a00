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

    @property
    def graph(self) -> fx.Graph:
        return self.graph_module.graph

    def compute_nodes(self) -> list[fx.Node]:
        """Nodes in execution order that do work (everything but inputs, attributes, output)."""
        return [n for n in self.graph.nodes if n.op in ("call_function", "call_method", "call_module")]

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
    """
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
        fx_capture.warnings.append(
            f"torch.export could not capture the model either ({type(error).__name__}), so "
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

    def __init__(self, leaves: set[str], call_shape: _CallShape | None = None) -> None:
        super().__init__()
        self.leaves = leaves
        self.call_shape = call_shape
        self.failed_module: str | None = None
        self.saw_checkpoint = False

    def create_args_for_root(
        self, root_fn: Callable[..., Any], is_module: bool, concrete_args: Any = None
    ) -> tuple[Callable[..., Any], list[Any]]:
        if self.call_shape is None:
            return super().create_args_for_root(root_fn, is_module, concrete_args)
        return self.call_shape.root_call(self, root_fn)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name in self.leaves or super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m: nn.Module, forward: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_module is None:
                try:
                    self.failed_module = self.path_of_module(m)
                except NameError:
                    self.failed_module = None
            raise

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
        kwargs = {
            name: tracer.create_proxy("placeholder", name, (), {}) for name in self.keyword
        }

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
    """Trace with fx, turning each failing submodule into a leaf; return the capture, or
    ``(module, error)`` for a failure that a leaf cannot fix."""
    auto_leaves: list[str] = []
    concrete = _concrete_args(model, inputs, input_names)
    shape = _call_shape(model, inputs, input_names)
    for _ in range(_MAX_LEAF_RETRIES):
        tracer = _LeafTracer(leaves | set(auto_leaves), shape)
        with _watch_checkpoint_calls(tracer):
            try:
                graph = tracer.trace(model, concrete_args=concrete)
            except Exception as error:  # noqa: BLE001 - any tracing failure is handled below
                failed = tracer.failed_module
                if failed and failed not in auto_leaves and failed not in leaves:
                    auto_leaves.append(failed)
                    continue
                return (failed or "", error)
        _restore_placeholder_names(graph, model)
        gm = fx.GraphModule(tracer.root, graph, class_name=type(model).__name__)
        notes = []
        if tracer.saw_checkpoint:
            notes.append(_CHECKPOINT_WARNING)
            warnings.warn(_CHECKPOINT_WARNING, stacklevel=3)
        if auto_leaves:
            notes.append(
                "untraceable submodules run as opaque leaves: " + ", ".join(auto_leaves)
            )
        method = "fx+leaves" if auto_leaves else "fx"
        return Capture(gm, method, tuple(sorted(leaves | set(auto_leaves))), notes)
    return ("", RuntimeError(f"gave up after {_MAX_LEAF_RETRIES} leaf retries"))


_CHECKPOINT_WARNING = (
    "the model already calls torch.utils.checkpoint; graph capture inlines those calls, so "
    "autockpt's plan replaces them (the result no longer checkpoints where the code said)"
)


class _CheckpointSeen:
    """What :class:`_watch_checkpoint_calls` reports to when there is no fx tracer (export)."""

    saw_checkpoint = False


class _watch_checkpoint_calls:
    """Notice calls of ``torch.utils.checkpoint.checkpoint`` made while tracing.

    Tracing runs the model's Python code once, and checkpoint's own code runs the wrapped
    function directly under tracing, so the call would vanish silently; a profile hook on
    checkpoint's code objects is the one place that sees it.
    """

    def __init__(self, tracer: _LeafTracer | _CheckpointSeen) -> None:
        self.tracer = tracer
        from torch.utils import checkpoint as ckpt

        self.codes = {
            inspect.unwrap(fn).__code__
            for fn in (ckpt.checkpoint, ckpt.checkpoint_sequential)
        }

    def __enter__(self) -> None:
        self.previous = sys.getprofile()

        def hook(frame: Any, event: str, arg: Any) -> None:
            if event == "call" and frame.f_code in self.codes:
                self.tracer.saw_checkpoint = True

        sys.setprofile(hook)

    def __exit__(self, *exc: Any) -> None:
        sys.setprofile(self.previous)


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
    model: nn.Module, inputs: Inputs, notes: list[str],
    fx_failure: tuple[str, BaseException] | str | None,
) -> Capture:
    dropped: list[str] = []
    seen = _CheckpointSeen()
    with warnings.catch_warnings(), _quiet_torch_logs(), _watch_checkpoint_calls(seen):
        warnings.simplefilter("ignore")
        try:
            exported = torch.export.export(model, inputs.args, inputs.kwargs, strict=False)
        except Exception as error:  # noqa: BLE001 - retried once, else the first error stands
            # Outputs export cannot carry (a key/value cache object a model returns with
            # use_cache on) are left out; anything else fails the same way again.
            try:
                with _outputs_without_opaque_objects(model, dropped):
                    exported = torch.export.export(
                        model, inputs.args, inputs.kwargs, strict=False
                    )
            except Exception:  # noqa: BLE001
                raise error from None
        gm = exported.module()
    if seen.saw_checkpoint:
        notes.append(_CHECKPOINT_WARNING)
        warnings.warn(_CHECKPOINT_WARNING, stacklevel=3)
    if dropped:
        notes.append(
            "outputs that are not tensors or containers of them are returned as None by the "
            f"optimized model: {', '.join(sorted(set(dropped)))} (a training step does not "
            "use them; turn them off in the model, e.g. use_cache=False, to silence this)"
        )
    # Export's input guards are checked by our own fingerprint; the guard submodule is not
    # part of the user's tree, so drop it.
    guards = []
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and str(node.target).startswith("_guards"):
            guards.append(gm.get_submodule(str(node.target)))
            gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code(is_impure_node=_is_impure)
    extras = {
        name: getattr(gm, name) for name in ("_in_spec", "_out_spec") if hasattr(gm, name)
    }
    if guards and "_in_spec" in extras:
        extras[INPUT_CHECK] = _input_check(guards, extras["_in_spec"], inputs.signature())
    note = "captured with torch.export (non-strict)"
    if isinstance(fx_failure, str):
        note += f" because {fx_failure}"
    elif fx_failure is not None:
        module, error = fx_failure
        where = f"module '{module}'" if module else "the root module"
        note += f" because fx could not trace {where}: {type(error).__name__}: {error}"
    notes.append(note)
    return Capture(gm, "export", (), notes, extras)


INPUT_CHECK = "_autockpt_check_inputs"
"""Name of the attribute (a plain function ``check(args, kwargs)``) by which an export
capture's input guards reach the rewritten module."""


def _input_check(guards: list[Any], in_spec: Any, planned: str) -> Callable[[tuple, dict], None]:
    """Export specialises its graph to the example shapes and non-tensor inputs (a view to
    ``[4, -1]``); another batch shape would fail deep inside the graph with an
    unrelated message, or not at all. Export's own guards say it up front; this check runs
    them on every call of the optimized model and raises a typed error that says what to do."""
    from torch.fx._pytree import tree_flatten_spec

    def check_inputs(args: tuple, kwargs: dict) -> None:
        try:
            flat = tree_flatten_spec((list(args), kwargs), in_spec)
        except Exception:  # noqa: BLE001 - the graph's own input handling reports it
            return
        for guard in guards:
            try:
                guard(*flat)
            except AssertionError as error:
                raise PlanMismatchError(
                    f"this optimized model was planned for inputs {planned} and its graph "
                    f"is specialised to them ({error}); give batches of that shape (e.g. "
                    "drop_last=True) or plan again for this one"
                ) from None

    return check_inputs


_PLAIN_LEAVES = (torch.Tensor, int, float, bool, str, type(None))


@contextlib.contextmanager
def _outputs_without_opaque_objects(model: nn.Module, dropped: list[str]) -> Iterator[None]:
    """While exporting, ``model`` returns its output with every leaf that is not a tensor or
    a plain value (one pytree does not know how to take apart) replaced by ``None``; the
    class names of what was replaced are appended to ``dropped``. The model is restored on
    exit (the override is an instance attribute, removed again)."""
    had_own = "forward" in vars(model)
    previous = vars(model).get("forward")
    original = model.forward

    def strip(value: Any) -> Any:
        if isinstance(value, _PLAIN_LEAVES):
            return value
        dropped.append(type(value).__name__)
        return None

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        return torch.utils._pytree.tree_map(strip, original(*args, **kwargs))

    model.forward = forward
    try:
        yield
    finally:
        if had_own:
            model.forward = previous
        else:
            del model.forward


@contextlib.contextmanager
def _quiet_torch_logs() -> Iterator[None]:
    """torch.export logs whole graphs and guard diagnostics when it fails; we report the
    failure ourselves in one line, so its own loggers are hushed for the attempt."""
    loggers = [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)
               if name.startswith("torch")]
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


def _trace_error(module: str, error: BaseException, also: BaseException | None = None) -> TraceError:
    location, line = _user_frame(error)
    reason = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    if also is not None:
        reason += f"; torch.export also failed: {type(also).__name__}: {str(also).splitlines()[0] if str(also) else ''}"
    return TraceError(module, location, line, reason)


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
