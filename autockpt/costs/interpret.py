"""Running a captured graph on the user's module tree: the one interpreter the profile, the
recorder and the probe subclass, and the placeholder binding they share.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from autockpt.base.inputs import Inputs
from autockpt.base.runtime import META_RUNS_AS, meta_runs_as_device
from autockpt.capture.captured import Capture


def placeholder_values(capture: Capture, model: nn.Module, inputs: Inputs) -> list[Any]:
    """The flat list of values for the graph's placeholders, in graph order."""
    placeholders = [n for n in capture.graph.nodes if n.op == "placeholder"]
    spec = capture.extra_attributes.get("_in_spec")
    if spec is not None:
        from torch.fx._pytree import tree_flatten_spec

        return list(tree_flatten_spec((list(inputs.args), inputs.kwargs), spec))
    import inspect

    signature = inspect.signature(model.forward)
    bound = signature.bind(*inputs.args, **inputs.kwargs)
    # a keyword the forward takes through ``**kwargs`` is its own placeholder when fx traces
    # the call as the user makes it (trace.py, _CallShape)
    catch_all = [p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD]
    extra = bound.arguments.get(catch_all[0], {}) if catch_all else {}
    values = []
    for node in placeholders:
        name = str(node.target)
        if name in bound.arguments:
            values.append(bound.arguments[name])
        elif name in extra:
            values.append(extra[name])
        elif name.startswith("*"):  # fx's placeholder for ``*args`` / ``**kwargs``
            empty: Any = {} if name.startswith("**") else ()
            values.append(bound.arguments.get(name.lstrip("*"), empty))
        elif node.args:
            values.append(node.args[0])
        else:
            raise TypeError(f"no value for the graph input '{name}'")
    return values


def run_graph(
    capture: Capture, model: nn.Module, inputs: Inputs, interpreter: fx.Interpreter | None = None
) -> Any:
    """Run the captured graph on the original module tree and return the user-facing output."""
    interp = interpreter or CaptureInterpreter(model, capture)
    # Inputs are flattened and outputs rebuilt here, once (the interpreter would otherwise
    # rebuild an export graph's pytree output a second time).
    flat = interp.run(*placeholder_values(capture, model, inputs), enable_io_processing=False)
    return capture.graph._codegen.process_outputs(flat)


class CaptureInterpreter(fx.Interpreter):
    """Runs a capture's graph on the user's module tree. Attributes the tree lacks are
    constants that capture created (torch.export lifts tensors a forward builds, e.g. with
    ``torch.tensor``, into ``lifted_tensor_<k>``); they are read from the capture."""

    def __init__(self, model: nn.Module, capture: Capture, **kwargs: Any) -> None:
        super().__init__(model, graph=capture.graph, **kwargs)
        self.capture_module = capture.graph_module

    def run_node(self, n: fx.Node) -> Any:
        """Run ``n``; a meta model's graph names the device it was traced on (an export
        graph's ``device=meta`` arguments and metadata asserts), and its step runs on fake
        tensors of :data:`META_RUNS_AS` (NOTE [runtime: meta runs as a device])."""
        if n.op == "call_function" and meta_runs_as_device() and _names_meta(n):
            with self._set_current_node(n):
                args, kwargs = self.map_nodes_to_values((n.args, n.kwargs), n)
                args, kwargs = pytree.tree_map(_off_meta, (args, kwargs))
                return getattr(self, n.op)(n.target, args, kwargs)
        return super().run_node(n)

    def fetch_attr(self, target: str) -> Any:
        try:
            return super().fetch_attr(target)
        except RuntimeError:
            obj: Any = self.capture_module
            for part in target.split("."):
                obj = getattr(obj, part)
            return obj


def _is_meta(value: Any) -> bool:
    return (isinstance(value, torch.device) and value.type == "meta") or (
        isinstance(value, str) and value == "meta"
    )


def _names_meta(n: fx.Node) -> bool:
    found = []
    fx.node.map_aggregate((n.args, n.kwargs), lambda v: found.append(v) if _is_meta(v) else v)
    return bool(found)


def _off_meta(value: Any) -> Any:
    return META_RUNS_AS if _is_meta(value) else value
