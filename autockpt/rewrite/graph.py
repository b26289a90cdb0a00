"""Graph surgery: the captured graph with each planned node range replaced by a call of its
checkpoint segment, compiled to Python once per graph and cached.

The segments are parameter-free ``CheckpointSegment`` s held as plain attributes
``_autockpt_segment_<k>`` (not registered children: ``named_modules()`` stays the user's),
whose code resolves attributes against the live root module at call time (never against
copies).
"""

from __future__ import annotations

import dataclasses
import operator
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch.fx as fx
from torch import nn

from autockpt.base.inputs import Inputs
from autockpt.base.tree import ModuleTree
from autockpt.capture.captured import Capture
from autockpt.capture.export import INPUT_CHECK
from autockpt.errors import PlanMismatchError
from autockpt.rewrite.result import (
    _STATE,
    _call_shape,
    _checkpointed_class,
    _Checkpointing,
    _forward_signature,
    shallow_copy,
)
from autockpt.rewrite.segment import CheckpointSegment, SegmentSpec, _keep_begin, _keep_end

SEGMENT_PREFIX = "_autockpt_segment_"


def rewrite(
    model: nn.Module,
    capture: Capture,
    segments: Sequence[SegmentSpec],
    inputs: Inputs | None = None,
) -> nn.Module:
    """The user's model back, checkpointing ``segments`` (sorted, disjoint node ranges).

    ``inputs`` are the example inputs the plan was made for: training calls that give
    other arguments run the original forward (with a warning), and larger tensors are
    refused (``on_larger_input``). Without them every training call with autograd runs
    the graph.
    """
    nodes = capture.compute_nodes()
    _validate(segments, len(nodes))
    starts = {spec.first: spec for spec in segments}

    def lookup(target: str) -> Any:
        # Parameters, buffers and submodules come from the user's model; constants that
        # capture created (fx tensor constants, export's lifted constants) from the capture.
        try:
            return _resolve(model, target)
        except AttributeError:
            return _resolve(capture.graph_module, target)

    graph, modules = _splice(capture, nodes, starts, lookup)
    targets: dict[str, Any] = dict(modules)
    for node in graph.nodes:
        if node.op in ("get_attr", "call_module") and node.target not in targets:
            targets[node.target] = lookup(node.target)
    code = _code(targets, graph)
    return _assemble(model, capture, modules, code, lookup, inputs)


def _splice(
    capture: Capture,
    nodes: list[fx.Node],
    starts: dict[int, SegmentSpec],
    lookup: Callable[[str], Any],
) -> tuple[fx.Graph, dict[str, CheckpointSegment]]:
    """The captured graph with each segment replaced by a call of its module: the result's code."""
    graph = fx.Graph()
    graph._codegen = capture.graph._codegen
    env: dict[fx.Node, fx.Node] = {}
    modules: dict[str, CheckpointSegment] = {}
    position = {node: i for i, node in enumerate(nodes)}
    skip_until = -1
    # Inputs first: fx puts a specialised argument's placeholder next to its guard, i.e.
    # after earlier compute nodes, and a segment emitted at its first node needs them all.
    for node in [n for n in capture.graph.nodes if n.op == "placeholder"]:
        env[node] = graph.node_copy(node, lambda n: env[n])
    for node in capture.graph.nodes:
        if node in env:
            continue
        i = position.get(node)
        if i is not None and i < skip_until:
            continue
        if i is not None and i in starts:
            spec = starts[i]
            name = f"{SEGMENT_PREFIX}{len(modules)}"
            modules[name] = _emit_segment(lookup, graph, env, nodes, spec, name)
            skip_until = spec.end
            continue
        env[node] = graph.node_copy(node, lambda n: env[n])
    for node in list(graph.nodes):
        if node.op == "get_attr" and not node.users:
            graph.erase_node(node)  # now read inside a segment only
    graph.lint()
    return graph, modules


def _assemble(
    model: nn.Module,
    capture: Capture,
    modules: dict[str, CheckpointSegment],
    code: Callable[..., Any],
    lookup: Callable[[str], Any],
    inputs: Inputs | None,
) -> nn.Module:
    """The copy of ``model`` that runs ``code``, holding what it reads: what the user gets back."""
    result = shallow_copy(model, _checkpointed_class(type(model)))
    added = list(modules)
    for name, segment in modules.items():
        object.__setattr__(result, name, segment)  # not a registered child: module docstring
        segment.bind(result)
    added += _attach_constants(result, capture, lookup)
    # What the generated code reads from ``self`` besides the tree (export's pytree specs).
    for name, value in capture.extra_attributes.items():
        object.__setattr__(result, name, value)
        added.append(name)
    signature = _forward_signature(type(model))
    planned = _call_shape(signature, inputs.args, inputs.kwargs) if inputs is not None else None
    vars(result)[_STATE] = _Checkpointing(
        code=code,
        captured_training=model.training,
        shape_generic=capture.shape_generic,
        signature=signature,
        planned=planned,
        input_check=capture.extra_attributes.get(INPUT_CHECK),
        attributes=tuple(added),
        tree=ModuleTree.of(model),
        exported=capture.method == "export",
    )
    return result


def _emit_segment(
    lookup: Callable[[str], Any],
    graph: fx.Graph,
    env: dict[fx.Node, fx.Node],
    nodes: list[fx.Node],
    spec: SegmentSpec,
    name: str,
) -> CheckpointSegment:
    """Add one segment's call to ``graph`` and return the module that runs it."""
    inside = nodes[spec.first : spec.end]
    inside_set = set(inside)
    inputs: list[fx.Node] = []
    attrs: list[fx.Node] = []
    for node in inside:
        for used in node.all_input_nodes:
            if used in inside_set:
                continue
            bucket = attrs if used.op == "get_attr" else inputs
            if used not in bucket:
                bucket.append(used)
    outputs = [node for node in inside if any(user not in inside_set for user in node.users)]

    sub = fx.Graph()
    sub_env: dict[fx.Node, fx.Node] = {}
    for node in inputs:
        sub_env[node] = sub.placeholder(node.name)
    for node in attrs:
        sub_env[node] = sub.node_copy(node, lambda n: sub_env[n])
    kept = {node: (op, index) for node, op, index in spec.kept_ops}
    for node in inside:
        if node.name in kept:  # markers around a kept node (_KeepCalls, eager mechanism)
            key = len(kept) + len(sub_env)  # unique within the segment
            sub.call_function(_keep_begin, (key, kept[node.name][0]))
            made = sub.node_copy(node, lambda n: sub_env[n])
            sub_env[node] = sub.call_function(_keep_end, (key, made))
        else:
            sub_env[node] = sub.node_copy(node, lambda n: sub_env[n])
    missing = set(kept) - {node.name for node in inside}
    if missing:
        raise PlanMismatchError(
            f"the plan keeps outputs of {sorted(missing)}, which segment {inside[0].name} .. "
            f"{inside[-1].name} of this graph does not hold; re-plan this model"
        )
    sub.output(tuple(sub_env[node] for node in outputs))
    fn = _compile(lookup, sub)
    if any(_runs_user_python(node, lookup) for node in inside):
        spec = dataclasses.replace(spec, python_rng=True)

    call = graph.call_module(name, tuple(env[node] for node in inputs))
    for k, node in enumerate(outputs):
        env[node] = graph.create_node("call_function", operator.getitem, (call, k), name=node.name)
    return CheckpointSegment(fn, spec, inside[0].name, inside[-1].name)


_LIBRARY_CODE = frozenset({"torch", "operator", "_operator", "builtins", "math", "autockpt"})


def _runs_user_python(node: fx.Node, lookup: Callable[[str], Any]) -> bool:
    """Whether running ``node`` runs Python code of the user's (a leaf module that is not
    one of torch's, a function fx kept as a call): code that may draw from Python's
    ``random`` or NumPy. Torch's operators and modules draw from torch's generators only."""
    if node.op == "call_module":
        owner = type(lookup(str(node.target))).__module__
    elif node.op == "call_function":
        owner = getattr(node.target, "__module__", None) or ""
    else:
        return False
    return owner.split(".")[0] not in _LIBRARY_CODE


def _compile(lookup: Callable[[str], Any], graph: fx.Graph) -> Callable[..., Any]:
    """Python code for ``graph`` as a plain function ``fn(root, *inputs)``.

    fx generates a ``forward(self, ...)`` method; taking it off its class gives a function
    whose ``self`` is whatever module we pass, so attribute look-ups hit the live root.
    """
    targets = {
        node.target: lookup(node.target)
        for node in graph.nodes
        if node.op in ("get_attr", "call_module")
    }
    return _code(targets, graph)


def _code(targets: dict[str, Any], graph: fx.Graph) -> Callable[..., Any]:
    """fx's generated ``forward(self, ...)`` for ``graph``, as a plain function: the holder
    module is thrown away and ``self`` is whatever module the caller passes.

    The same code is the same function: one already generated from the same source text
    with the same global objects is reused (:data:`_GENERATED`). ``torch.compile`` guards
    on the functions a forward runs, so a new function object per result makes dynamo
    recompile a model class for every result, even one of the same plan, and fall back to
    eager once its recompile limit (8) is spent. (The tree and precision checks, which take
    the module at trace time, are guarded on it too: autockpt/base/tree.py, precision.py.)"""
    holder = fx.GraphModule(targets, graph)
    fn = type(holder).forward
    return _GENERATED.setdefault((holder.code, _globals_key(fn)), fn)


_GENERATED: weakref.WeakValueDictionary[tuple[Any, ...], Callable[..., Any]] = (
    weakref.WeakValueDictionary()
)
"""Generated functions by (source text, global objects): an entry lives as long as a
result (or a segment) holds its function."""


def _globals_key(fn: Callable[..., Any]) -> tuple[tuple[str, int], ...]:
    """The global objects ``fn``'s code reads, by name and identity. Identities are safe to
    compare: a cached function keeps its globals alive (no id is reused while its entry
    lives), and so does the candidate while it is looked up."""
    return tuple(sorted((name, id(value)) for name, value in fn.__globals__.items()))


def _resolve(model: nn.Module, target: str) -> Any:
    obj: Any = model
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _attach_constants(
    result: nn.Module, capture: Capture, lookup: Callable[[str], Any]
) -> list[str]:
    """Attributes the graph reads that are not in the user's tree (tensor constants made by
    capture) are attached to the result at the same path, as plain attributes. Returns the
    names attached to the root itself (not part of the user's model: pickling drops them)."""
    attached = []
    for node in capture.graph.nodes:
        if node.op != "get_attr":
            continue
        try:
            _resolve(result, node.target)
        except AttributeError:
            owner_path, _, name = node.target.rpartition(".")
            owner = _resolve(result, owner_path) if owner_path else result
            object.__setattr__(owner, name, lookup(node.target))
            if not owner_path:
                attached.append(name)
    return attached


def _validate(segments: Sequence[SegmentSpec], num_nodes: int) -> None:
    previous_end = 0
    for spec in segments:
        if not (previous_end <= spec.first < spec.end <= num_nodes):
            raise ValueError(
                f"segments must be sorted, disjoint, non-empty node ranges within 0..{num_nodes}; "
                f"got {[(s.first, s.end) for s in segments]}"
            )
        previous_end = spec.end
