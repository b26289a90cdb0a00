"""What capture hands on: the graph, how it was captured, and its structural fingerprint.

A :class:`Capture` is what every later stage reads (the profile, the chain, the recorder,
the rewrite); its :meth:`Capture.fingerprint` is how a saved plan recognises the graph it
was made for.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx


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
    counted_out_positions: bool = False
    """Whether every packed-sequence test of transformers' masks, while exporting, read
    positions the model counted out itself (NOTE [capture: Hugging Face's causal mask])."""

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

    def fingerprint(self, *, devices: bool = False) -> str:
        """Structural hash of the graph: ops, targets (with the class of each called
        module) and wiring, independent of weights and of the device it was captured on
        (``devices=True``: the hash before devices were left out, for plans saved then)."""
        digest = hashlib.sha256()
        for node in self.graph.nodes:
            digest.update(f"{node.op}|{node.name}|{_target_name(node.target)}|".encode())
            if node.op == "call_module":
                # A module's name says nothing about what it does: Identity -> Dropout
                # changes RNG use, ReLU -> BatchNorm adds mutated buffers.
                module = self.graph_module.get_submodule(node.target)
                digest.update(f"{_target_name(type(module))}|".encode())
            digest.update(repr(_arg_names(node.args, devices)).encode())
            digest.update(repr(_arg_names(node.kwargs, devices)).encode())
        return digest.hexdigest()[:16]


def module_paths(node: fx.Node) -> list[str]:
    """The qualified names, in the captured model, of the modules whose code made ``node``,
    outermost first: its ``nn_module_stack`` (fx and ``torch.export`` graphs both record it;
    export marks a module's later calls as ``name@1``, the same module), then a
    ``call_module`` node's target. The one reader of that metadata."""
    paths = []
    for key, value in (node.meta.get("nn_module_stack") or {}).items():
        # fx and export store (qualified name, class); older graphs keyed by the name only
        path = value[0] if isinstance(value, tuple) and value and isinstance(value[0], str) else key
        paths.append(".".join(part.split("@")[0] for part in str(path).split(".")))
    if node.op == "call_module":
        paths.append(str(node.target))
    return paths


def node_module(node: fx.Node) -> str:
    """The qualified name of the innermost module whose code made ``node``
    (:func:`module_paths`); ``""`` for the root's own code (fx records no stack there)."""
    paths = module_paths(node)
    return paths[-1] if paths else ""


def _target_name(target: Any) -> str:
    if isinstance(target, str):
        return target
    module = getattr(target, "__module__", "") or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or str(target)
    return f"{module}.{name}"


def _arg_names(value: Any, devices: bool = False) -> Any:
    """``value`` as the fingerprint reads it: nodes by name, and every device as one word.
    Why devices are left out: a plan is made where the run is not (on the meta device, on a
    CPU before launch) and applied where it runs; an export graph writes the device it was
    traced on into its operators' arguments (``arange(..., device='meta')``), and shapes and
    dtypes, not the device, are what a plan's identity needs (docs/design.md, "Plans move
    between devices")."""
    if value is None:
        return None
    named = torch.fx.node.map_arg(value, lambda n: f"%{n.name}")
    if devices:
        return named
    return torch.utils._pytree.tree_map(
        lambda leaf: "<device>" if isinstance(leaf, torch.device) else leaf, named
    )
