"""Stage 6 — rewrite: a new module whose forward calls ``torch.utils.checkpoint`` per segment.

Rules the result keeps (and why):

* It *is* the user's module tree: the result's parameters, buffers and submodules are the
  original objects, registered under the same names in the same order. ``state_dict()``
  keys and ``parameters()`` order are unchanged, so optimizers, saved checkpoints and
  FSDP/DDP wrapping keep working, and ``.to()`` moves the one copy of every tensor.
* Each checkpointed segment becomes a parameter-free submodule ``_autockpt_segment_<k>``
  whose code resolves attributes against the live root module at call time (never against
  copies), called through ``checkpoint(..., use_reentrant=False)``.
* RNG state is preserved only for segments with random ops (dropout), so recomputed masks
  equal the forward's and outputs and gradients equal eager's.
* Buffers that the forward mutates (batch-norm running statistics, counters) are
  snapshotted when a segment runs forward; its recompute runs on those values and restores
  the current ones afterwards, so they advance once per step and read as in the forward.
* Without autograd (``torch.no_grad()``), segments run plainly: there is nothing to save.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils.checkpoint import checkpoint

from autockpt.trace import INPUT_CHECK, Capture

SEGMENT_PREFIX = "_autockpt_segment_"


@dataclass(frozen=True)
class SegmentSpec:
    """A checkpointed run of compute nodes ``[first, end)`` (indices into the capture's
    compute nodes) and how to replay it faithfully."""

    first: int
    end: int
    preserve_rng: bool
    restore_buffers: tuple[str, ...] = ()


class CheckpointSegment(nn.Module):
    """One checkpointed segment. Holds no parameters: the code it runs looks attributes up
    on the root module at call time, so the root's (possibly moved or sharded) tensors are
    the ones used."""

    def __init__(self, fn: Callable[..., Any], spec: SegmentSpec, first_node: str, last_node: str) -> None:
        super().__init__()
        self._fn = fn
        self.spec = spec
        self.first_node = first_node
        self.last_node = last_node
        object.__setattr__(self, "_root", None)

    def bind(self, root: nn.Module) -> None:
        # A plain attribute, not a registered child: the root must not become its own
        # submodule (that would loop named_modules() and duplicate state_dict keys).
        object.__setattr__(self, "_root", root)

    def extra_repr(self) -> str:
        return (
            f"{self.first_node} .. {self.last_node}, preserve_rng={self.spec.preserve_rng}, "
            f"restore_buffers={list(self.spec.restore_buffers)}"
        )

    def forward(self, *args: Any) -> Any:
        root = self._root
        if root is None:
            raise RuntimeError("checkpoint segment is not bound to a root module")
        run = functools.partial(self._fn, root)
        if not torch.is_grad_enabled():
            return run(*args)
        return checkpoint(
            run,
            *args,
            use_reentrant=False,
            preserve_rng_state=self.spec.preserve_rng,
            context_fn=functools.partial(_contexts, root, self.spec.restore_buffers),
        )


def _contexts(root: nn.Module, buffer_names: tuple[str, ...]) -> tuple[Any, Any]:
    if not buffer_names:
        return contextlib.nullcontext(), contextlib.nullcontext()
    state = _BufferState(root, buffer_names)
    return state.forward_context(), state.recompute_context()


class _BufferState:
    """The forward remembers the buffers as it found them; the recompute runs on exactly
    those values (a buffer read and then updated in place later in the step would otherwise
    be seen updated) and leaves the buffers as it found them (so running statistics advance
    once per step)."""

    def __init__(self, root: nn.Module, names: tuple[str, ...]) -> None:
        self.buffers = [root.get_buffer(name) for name in names]
        self.at_forward: list[torch.Tensor] = []

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        self.at_forward = [b.detach().clone() for b in self.buffers]
        yield

    @contextlib.contextmanager
    def recompute_context(self) -> Iterator[None]:
        current = [b.detach().clone() for b in self.buffers]
        self._load(self.at_forward)
        try:
            yield
        finally:
            self._load(current)

    def _load(self, values: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for buffer, value in zip(self.buffers, values, strict=True):
                buffer.copy_(value)


def rewrite(model: nn.Module, capture: Capture, segments: Sequence[SegmentSpec]) -> fx.GraphModule:
    """Build the checkpointed module for ``segments`` (sorted, disjoint node ranges)."""
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

    targets: dict[str, Any] = dict(modules)
    for node in graph.nodes:
        if node.op in ("get_attr", "call_module") and node.target not in targets:
            targets[node.target] = lookup(node.target)
    result = fx.GraphModule(targets, graph, class_name=f"{type(model).__name__}Checkpointed")
    _adopt_tree(result, model, modules)
    _attach_constants(result, capture, lookup)
    for name, value in capture.extra_attributes.items():
        setattr(result, name, value)
    # Kept through copy.deepcopy (GraphModule re-applies these after copying).
    preserved = result.meta.setdefault("_user_preserved_attributes", {})
    preserved["_autockpt_original"] = _OriginalRef(model, model.training)
    preserved["forward"] = types.MethodType(_forward_in_any_mode, result)
    if INPUT_CHECK in capture.extra_attributes:
        preserved[INPUT_CHECK] = capture.extra_attributes[INPUT_CHECK]
    for name, value in preserved.items():
        object.__setattr__(result, name, value)
    result._deepcopy_hooks = [_readopt_after_deepcopy]
    return result


class _OriginalRef:
    """The user's module, held without registering it (it must not become a child), and the
    training mode the graph was captured in."""

    def __init__(self, module: nn.Module, captured_training: bool) -> None:
        self.module = module
        self.captured_training = captured_training


def _forward_in_any_mode(self: fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
    """Run the checkpointed graph in the mode it was captured in; in the other mode (e.g.
    ``.eval()`` after capturing in training mode) run the original forward on the same
    tree, since capture baked mode-dependent branches (``training=self.training``) in."""
    original: _OriginalRef = self._autockpt_original
    if self.training == original.captured_training:
        check_inputs = getattr(self, INPUT_CHECK, None)
        if check_inputs is not None:
            check_inputs(args, kwargs)
        return type(self).forward(self, *args, **kwargs)
    original.module.training = self.training
    # An engine wrapping the result (fully_shard) replaces the tensors the root holds
    # directly, on the result only; the original must run on the current ones.
    original.module._parameters.update(self._parameters)
    original.module._buffers.update(self._buffers)
    return original.module(*args, **kwargs)


def _adopt_tree(result: fx.GraphModule, model: nn.Module, segments: dict[str, nn.Module]) -> None:
    _mirror_tree(result, model)
    for name, module in segments.items():
        result._modules[name] = module
        module.bind(result)


def _readopt_after_deepcopy(copied: fx.GraphModule) -> None:
    """GraphModule's deepcopy keeps only modules its graph names; re-adopt the whole copied
    tree so the copy, like the original, has every parameter and buffer of the model."""
    segments = {
        name: module for name, module in copied._modules.items() if isinstance(module, CheckpointSegment)
    }
    _adopt_tree(copied, copied._autockpt_original.module, segments)


def _emit_segment(
    lookup: Callable[[str], Any], graph: fx.Graph, env: dict[fx.Node, fx.Node],
    nodes: list[fx.Node], spec: SegmentSpec, name: str,
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
    for node in inside:
        sub_env[node] = sub.node_copy(node, lambda n: sub_env[n])
    sub.output(tuple(sub_env[node] for node in outputs))
    fn = _compile(lookup, sub)

    call = graph.call_module(name, tuple(env[node] for node in inputs))
    for k, node in enumerate(outputs):
        env[node] = graph.create_node("call_function", operator.getitem, (call, k), name=node.name)
    return CheckpointSegment(fn, spec, inside[0].name, inside[-1].name)


def _compile(lookup: Callable[[str], Any], graph: fx.Graph) -> Callable[..., Any]:
    """Python code for ``graph`` as a plain function ``fn(root, *inputs)``.

    fx generates a ``forward(self, ...)`` method; taking it off its class gives a function
    whose ``self`` is whatever module we pass, so attribute look-ups hit the live root.
    """
    targets = {
        node.target: lookup(node.target)
        for node in graph.nodes if node.op in ("get_attr", "call_module")
    }
    holder = fx.GraphModule(targets, graph)
    return type(holder).forward


def _resolve(model: nn.Module, target: str) -> Any:
    obj: Any = model
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _attach_constants(result: nn.Module, capture: Capture, lookup: Callable[[str], Any]) -> None:
    """Attributes the graph reads that are not in the user's tree (tensor constants made by
    capture) are attached to the result at the same path, as plain attributes."""
    for node in capture.graph.nodes:
        if node.op != "get_attr":
            continue
        try:
            _resolve(result, node.target)
        except AttributeError:
            owner_path, _, name = node.target.rpartition(".")
            owner = _resolve(result, owner_path) if owner_path else result
            object.__setattr__(owner, name, lookup(node.target))


def _mirror_tree(result: nn.Module, model: nn.Module) -> None:
    """Make ``result`` hold ``model``'s own parameters, buffers and children, same order."""
    result._parameters.clear()
    result._buffers.clear()
    result._modules.clear()
    result._non_persistent_buffers_set.clear()
    result._parameters.update(model._parameters)
    result._buffers.update(model._buffers)
    result._non_persistent_buffers_set.update(model._non_persistent_buffers_set)
    result._modules.update(model._modules)
    result.training = model.training
    for name, value in vars(model).items():
        if name.startswith("_") or name == "training" or name in vars(result):
            continue
        if isinstance(value, (nn.Module, torch.Tensor)):
            continue
        setattr(result, name, value)


def _validate(segments: Sequence[SegmentSpec], num_nodes: int) -> None:
    previous_end = 0
    for spec in segments:
        if not (previous_end <= spec.first < spec.end <= num_nodes):
            raise ValueError(
                f"segments must be sorted, disjoint, non-empty node ranges within 0..{num_nodes}; "
                f"got {[(s.first, s.end) for s in segments]}"
            )
        previous_end = spec.end
