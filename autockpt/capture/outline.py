"""Module calls kept on the export path: an inlined submodule call folded back into one node.

NOTE [capture: module calls]. Some submodules must stay *module calls* in the graph, whatever
path captured it: FSDP2's ``fully_shard`` all-gathers a unit's parameters in a forward
pre-hook of the unit's module (and frees them in a post-hook), and hooks fire only when the
module is called. fx keeps such a module as a leaf (``capture(..., module_calls=...)`` adds
it to the leaves); ``torch.export`` inlines every module call, so the export path asks
export to preserve the call's signature (``preserve_module_call_signature``: the flat
inputs and outputs of the call, with the pytree specs of its ``(args, kwargs)`` and of its
result, in :attr:`torch.export.ExportedProgram.module_call_graph`) and then folds the call's
nodes back into one ``call_module`` node of the user's submodule (:func:`outline_calls`),
called with the arguments the model's code gave it. Downstream, the node is a leaf like any
fx leaf: the profile runs the module whole, segments hold it whole, the rewritten model
calls the real module (in forward and in a segment's recompute), so its hooks fire.

Which nodes are the call's: those whose module path (``nn_module_stack``, read by
:func:`autockpt.capture.captured.module_paths`) contains the submodule. The fold is made
only when it is exact: the nodes read nothing from outside the call but its preserved
inputs and attributes (the module reads its own parameters when called), nothing outside
reads a node of the call but its preserved outputs (a buffer the call assigns would be read
by export's in-place copy at the end of the graph), the inputs are all computed before the
call's first node, and the module is called once. Otherwise the call stays inlined and
:func:`outline_calls` says why; the caller decides whether that is an error (under FSDP it
is: autockpt/planning/sharding.py ``check_units_called``).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.export.graph_signature import ConstantArgument
from torch.utils import _pytree as pytree

from autockpt.capture.captured import module_paths

_COMPUTE = ("call_function", "call_method", "call_module")


def outline_calls(
    gm: fx.GraphModule,
    exported: torch.export.ExportedProgram,
    model: nn.Module,
    paths: tuple[str, ...],
) -> tuple[tuple[str, ...], dict[str, str]]:
    """Fold each call of a submodule in ``paths`` that ``exported`` (exported with
    ``preserve_module_call_signature=paths``) inlined into ``gm`` (its ``module()``) back
    into one ``call_module`` node of ``model``'s submodule (NOTE [capture: module calls]);
    ``gm`` holds the user's submodule at that path afterwards, so the node's target names
    its class. Returns the paths folded, in ``paths`` order, and why each other one was not."""
    entries = {entry.fqn: entry for entry in exported.module_call_graph}
    nodes = {node.name: node for node in gm.graph.nodes}
    folded: list[str] = []
    why: dict[str, str] = {}
    for path in paths:
        entry = entries.get(path)
        if any(fqn.startswith(f"{path}@") for fqn in entries):
            why[path] = "it is called more than once per step"
        elif entry is None or entry.signature is None:
            why[path] = "it is not called in forward"
        else:
            reason = _fold(gm.graph, nodes, path, entry.signature)
            if reason is None:
                folded.append(path)
                gm.set_submodule(path, model.get_submodule(path), strict=False)
            else:
                why[path] = reason
    if folded:
        gm.graph.lint()
        gm.recompile()
    return tuple(folded), why


def _fold(graph: fx.Graph, nodes: dict[str, fx.Node], path: str, signature: Any) -> str | None:
    """Replace the nodes of ``path``'s call in ``graph`` by one ``call_module`` node (and
    ``getitem`` nodes for the parts of its result the graph reads); ``nodes`` maps names to
    nodes and is updated with the new ones. Returns why not, leaving the graph as it was."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    region = [n for n in graph.nodes if n.op in _COMPUTE and path in module_paths(n)]
    if not region:
        return "its call left no operations in the graph"
    flat_in = [_value(nodes, spec) for spec in signature.inputs]
    if any(v is _MISSING for v in flat_in):
        return "torch.export did not keep its inputs"
    flat_out = [_value(nodes, spec) for spec in signature.outputs]
    inside = set(region)
    inputs = {v for v in flat_in if isinstance(v, fx.Node)}
    outputs = {v for v in flat_out if isinstance(v, fx.Node) and v in inside}
    for node in region:
        for used in node.all_input_nodes:
            if used in inside or used in inputs or used.op == "get_attr" or _is_size(used):
                continue
            return f"its code reads '{used.name}', which is not one of its arguments"
        if node not in outputs and any(user not in inside for user in node.users):
            return f"'{node.name}', computed inside it, is read outside its result"
    if any(order[v] > order[region[0]] for v in inputs):
        return "an argument is computed after its call begins"
    getters = _getters(signature.out_spec)
    if getters is None or len(getters) != len(flat_out):
        return f"its result ({signature.out_spec.type.__name__}) is not a tensor, tuple or dict"
    args, kwargs = pytree.tree_unflatten(flat_in, signature.in_spec)
    first = region[0]
    with graph.inserting_before(first):
        call = graph.call_module(path, tuple(args), dict(kwargs))
        call.meta["nn_module_stack"] = _stack_through(first, path)
        for value, keys in zip(flat_out, getters, strict=True):
            if not isinstance(value, fx.Node) or value not in inside:
                continue
            part = call
            for key in keys:
                part = graph.call_function(operator.getitem, (part, key))
            part.meta.update({k: value.meta[k] for k in ("val", "tensor_meta") if k in value.meta})
            part.meta["nn_module_stack"] = call.meta["nn_module_stack"]
            value.replace_all_uses_with(part)
            nodes[value.name] = part
    attributes = {a for node in region for a in node.all_input_nodes if a.op == "get_attr"}
    for node in reversed(region):
        graph.erase_node(node)
    for attr in attributes:
        if not attr.users:
            graph.erase_node(attr)
    return None


_MISSING = object()


def _value(nodes: dict[str, fx.Node], spec: Any) -> Any:
    """A flat input or output of a preserved call: the node named by a tensor or size
    argument, the value of a constant one, ``_MISSING`` when the graph lacks the node."""
    if isinstance(spec, ConstantArgument):
        return spec.value
    return nodes.get(spec.name, _MISSING)


def _getters(spec: pytree.TreeSpec) -> list[tuple[Any, ...]] | None:
    """For each leaf of a call's result spec, the keys that reach it (``()``: the result
    itself); None when a container on the way is not a tuple, list or dict."""
    if spec.is_leaf():
        return [()]
    if spec.type not in (tuple, list, dict) and not _is_namedtuple(spec.type):
        return None
    keys = spec.context if spec.type is dict else range(spec.num_children)
    found: list[tuple[Any, ...]] = []
    for key, child in zip(keys, spec.children_specs, strict=True):
        inner = _getters(child)
        if inner is None:
            return None
        found.extend((key, *rest) for rest in inner)
    return found


def _is_size(node: fx.Node) -> bool:
    """Whether ``node`` is a symbolic size (export reads a dynamic size once and every user
    of that size shares the node): called whole, the module reads its own sizes from its
    arguments, which the input check and export's guards keep equal to the graph's."""
    return isinstance(node.meta.get("val"), torch.SymInt | torch.SymBool | torch.SymFloat)


def _is_namedtuple(cls: type) -> bool:
    return issubclass(cls, tuple) and hasattr(cls, "_fields")


def _stack_through(node: fx.Node, path: str) -> dict[str, Any]:
    """``node``'s ``nn_module_stack`` from the outermost module down to ``path``'s entry:
    where a call of ``path`` sits, as fx records a leaf's call."""
    stack = node.meta.get("nn_module_stack") or {}
    depth = module_paths(node).index(path) + 1
    return dict(list(stack.items())[:depth])
