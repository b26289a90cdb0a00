"""Stage 6 — rewrite: the user's model back, with a forward that checkpoints per segment.

Rules the result keeps (and why):

* It is an instance of the user's own class (a generated subclass, like FSDP2's
  ``fully_shard``): a shallow copy of the user's module sharing its parameters, buffers,
  children and attributes, with registries of its own, so the user's model is left as
  found. ``state_dict()`` keys and ``parameters()`` order are unchanged, so optimizers,
  saved checkpoints and FSDP/DDP wrapping keep working, ``.to()`` moves the one copy of
  every tensor, and the class's own methods (``save_pretrained``, ``generate``) are there.
* Its ``forward`` has the original's signature. Calls the plan covers (training mode,
  autograd on, the planned arguments, tensors no larger than planned) run the captured
  graph; every other call runs the original forward on the same tree (see :func:`_forward`).
* Each checkpointed segment is a parameter-free ``CheckpointSegment`` held as a plain
  attribute ``_autockpt_segment_<k>`` (not a registered child: ``named_modules()`` stays the
  user's) whose code resolves attributes against the live root module at call time (never
  against copies), called through ``checkpoint(..., use_reentrant=False)``.
* It pickles as the plain model plus its plan and is rebuilt on load by re-applying the
  plan; ``copy.deepcopy`` copies the tree and re-binds the segments to the copy.
* RNG state is preserved only for segments with random ops (dropout), so recomputed masks
  equal the forward's and outputs and gradients equal eager's. A segment that runs the
  user's own Python (a leaf module) also replays Python's and NumPy's generators when its
  forward drew from them (``_PythonRng``): checkpoint preserves torch's only.
* Buffers that the forward mutates or replaces (batch-norm running statistics, counters,
  a table built on the first call) are snapshotted (object and values) when a segment runs
  forward; its recompute runs on those and puts the current ones back afterwards, so they
  advance once per step and read as in the forward.
* Without autograd (``torch.no_grad()``), segments run plainly: there is nothing to save.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import dataclasses
import functools
import inspect
import operator
import re
import threading
import types
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from autockpt.errors import CompileWarning, PlanMismatchError, UncoveredCallWarning
from autockpt.precision import check_call as check_precision
from autockpt.rng import PythonRngStates
from autockpt.runtime import put_back
from autockpt.trace import INPUT_CHECK, Capture, Inputs, without_defaults
from autockpt.tree import ModuleTree, check_tree

if TYPE_CHECKING:
    from autockpt.plan import Plan

SEGMENT_PREFIX = "_autockpt_segment_"


@dataclass(frozen=True)
class SegmentSpec:
    """A checkpointed run of compute nodes ``[first, end)`` (indices into the capture's
    compute nodes) and how to replay it faithfully."""

    first: int
    end: int
    preserve_rng: bool
    restore_buffers: tuple[str, ...] = ()
    python_rng: bool = False
    """Whether the segment runs the user's own Python code (a leaf module), which may draw
    from Python's ``random`` or NumPy: those generators are then replayed at recompute too
    (:func:`_contexts`). Set by :func:`rewrite` from the graph."""
    kept_ops: tuple[tuple[str, str, int], ...] = ()
    """Operator calls whose outputs the checkpoint keeps from the forward instead of
    recomputing them (selective recompute): ``(node, operator, index)``, node ``node``'s
    call of ``operator``, the ``index``-th call of that operator in the segment's forward
    (design note in :class:`_KeepCalls`)."""


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
        self._keep = _KeepCalls(spec.kept_ops) if spec.kept_ops else None
        """What to keep; under ``torch.compile`` the selective-checkpoint policy naming the
        calls (:func:`_keep_contexts`), in eager the markers around each kept node
        (:class:`_KeepFrame`)."""
        object.__setattr__(self, "_root", None)

    def bind(self, root: nn.Module) -> None:
        # A plain attribute, not a registered child: the root must not become its own
        # submodule (that would loop named_modules() and duplicate state_dict keys).
        object.__setattr__(self, "_root", root)

    def extra_repr(self) -> str:
        kept = f", kept_ops={len(self.spec.kept_ops)}" if self.spec.kept_ops else ""
        return (
            f"{self.first_node} .. {self.last_node}, preserve_rng={self.spec.preserve_rng}, "
            f"restore_buffers={list(self.spec.restore_buffers)}{kept}"
        )

    def forward(self, *args: Any) -> Any:
        root = self._root
        if root is None:
            raise RuntimeError("checkpoint segment is not bound to a root module")
        run = functools.partial(self._fn, root)
        if not torch.is_grad_enabled():
            return run(*args)
        options: dict[str, Any] = {}
        if torch.compiler.is_compiling():
            # compile accepts only the selective-checkpoint pair here (see _contexts)
            if self._keep is not None:
                options["context_fn"] = functools.partial(_keep_contexts, self._keep.wanted)
        elif self.spec.restore_buffers or self.spec.python_rng or self._keep is not None:
            options["context_fn"] = functools.partial(
                _contexts, root, self.spec.restore_buffers, self.spec.python_rng,
                self._keep is not None,
            )
        return checkpoint(
            run,
            *args,
            use_reentrant=False,
            preserve_rng_state=self.spec.preserve_rng,
            **options,
        )


def _contexts(
    root: nn.Module,
    buffer_names: tuple[str, ...],
    python_rng: bool = False,
    keep: bool = False,
) -> tuple[Any, Any]:
    """The pair of contexts (forward, recompute) that restores a segment's mutated buffers,
    with ``python_rng`` replays Python's and NumPy's generators (:class:`_PythonRng`), and
    with ``keep`` keeps the outputs of the segment's kept nodes (:class:`_KeepFrame`).

    Eager only. Under ``torch.compile`` a segment passes no ``context_fn`` (compile accepts
    only ``TorchDispatchMode`` pairs there), and needs none: AOTAutograd functionalizes the
    step, so a buffer's in-place update becomes one copy-back at the end of the compiled
    forward, and the recompute in the compiled backward is pure (it replays the forward's
    values and mutates nothing). Segments without such buffers pass none either way.
    """
    pairs = []
    if buffer_names:
        state = _BufferState(root, buffer_names)
        pairs.append((state.forward_context(), state.recompute_context()))
    if python_rng:
        replay = _PythonRng()
        pairs.append((replay.forward_context(), replay.recompute_context()))
    if keep:
        frame = _KeepFrame()
        pairs.append((frame.context(recomputing=False), frame.context(recomputing=True)))
    if len(pairs) == 1:
        return pairs[0]
    return _together([f for f, _ in pairs]), _together([r for _, r in pairs])


@contextlib.contextmanager
def _together(contexts: list[Any]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        yield


class _KeepCalls:
    """Selective recompute: a segment keeps the outputs of chosen operator calls from its
    forward, and its recompute uses them instead of running those calls again. Two
    mechanisms, one plan:

    * **Eager**: the segment's code calls :func:`_keep_begin` and :func:`_keep_end` around
      each kept node (:func:`_emit_segment`), and the checkpoint's context pair is a
      :class:`_KeepFrame`. Only the kept node's own few operators pass through a dispatch
      mode, which catches its allocating operator's outputs in the forward and hands them
      back in the recompute (autograd still records the node there, so its saved inputs are
      recomputed as the checkpoint expects). torch's
      ``create_selective_checkpoint_contexts`` would do the same through a dispatch mode
      around every operator of the segment, twice: measured 35-38 us per operator call on a
      2-core CPU, more than most kept operators save there.
    * **Under torch.compile**: that pair is what compile accepts, and it costs nothing at
      run time (the policy runs while tracing): :func:`_keep_contexts`, a policy naming
      the calls ``(operator, index)``, the ``index``-th call of that operator in the
      segment's forward as the plan simulator recorded it (``autockpt.api.kept_calls``).
      The forward and the recompute run the same code, so each counts from 0 on its own.

    Operators are resolved once here, so policies compare objects, not names."""

    def __init__(self, calls: tuple[tuple[str, str, int], ...]) -> None:
        wanted: dict[Any, set[int]] = {}
        for _, name, index in calls:
            wanted.setdefault(_operator(name), set()).add(int(index))
        self.wanted = {op: frozenset(indices) for op, indices in wanted.items()}


_KEEP_FRAMES = threading.local()
"""Per thread, the stack of :class:`_KeepFrame` s whose checkpoint is running (forward or
recompute)."""


class _KeepFrame:
    """One checkpoint call's kept outputs: stored by the forward, handed back once by the
    recompute. A frame lives as long as the checkpoint keeps its context pair, so an output
    the recompute never reaches (it stopped early) dies with the checkpoint, as replay
    rule 6 says."""

    def __init__(self) -> None:
        self.outputs: dict[int, Any] = {}
        self.recomputing = False
        self.mode: TorchDispatchMode | None = None

    @contextlib.contextmanager
    def context(self, recomputing: bool) -> Iterator[None]:
        stack = _frames()
        self.recomputing = recomputing
        stack.append(self)
        try:
            yield
        finally:
            if self.mode is not None:  # the recompute stopped early inside a kept node
                mode, self.mode = self.mode, None
                mode.__exit__(None, None, None)
            stack.pop()


def _frames() -> list[_KeepFrame]:
    stack = getattr(_KEEP_FRAMES, "stack", None)
    if stack is None:
        stack = _KEEP_FRAMES.stack = []
    return stack


class _CatchOutputs(TorchDispatchMode):
    """In the forward, around one kept node: runs its operators and keeps the outputs of the
    first call of ``op`` (detached: the same storage, no graph)."""

    def __init__(self, frame: _KeepFrame, key: int, op: Any) -> None:
        super().__init__()
        self.frame, self.key, self.op = frame, key, op

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is self.op and self.key not in self.frame.outputs:
            self.frame.outputs[self.key] = torch.utils._pytree.tree_map_only(
                torch.Tensor, torch.Tensor.detach, out
            )
        return out


class _HandBack(TorchDispatchMode):
    """In the recompute, around one kept node: the first call of ``op`` returns what the
    forward kept instead of running (the frame lets go of it); other operators run."""

    def __init__(self, frame: _KeepFrame, key: int, op: Any) -> None:
        super().__init__()
        self.frame, self.key, self.op = frame, key, op

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is self.op and self.key in self.frame.outputs:
            return self.frame.outputs.pop(self.key)
        return func(*args, **(kwargs or {}))


def _keep_begin(key: int, op_name: str) -> None:
    """Before kept node ``key`` (generated segment code): inside a running checkpoint,
    catch (forward) or hand back (recompute) its ``op_name`` output."""
    if torch.compiler.is_compiling():
        return  # the selective-checkpoint policy does it (_keep_contexts)
    stack = _frames()
    if not stack:
        return  # run without a checkpoint (no autograd)
    frame = stack[-1]
    op = _operator(op_name)
    mode = _HandBack(frame, key, op) if frame.recomputing else _CatchOutputs(frame, key, op)
    mode.__enter__()
    frame.mode = mode


def _keep_end(key: int, value: Any) -> Any:
    """After kept node ``key``: leave what :func:`_keep_begin` entered; ``value`` passes
    through (it orders this call after the node)."""
    if torch.compiler.is_compiling():
        return value
    stack = _frames()
    if stack and stack[-1].mode is not None:
        mode, stack[-1].mode = stack[-1].mode, None
        mode.__exit__(None, None, None)
    return value


def _keep_contexts(wanted: dict[Any, frozenset[int]]) -> tuple[Any, Any]:
    """The selective-checkpoint context pair keeping the ``wanted`` calls (a module-level
    function: ``torch.compile`` traces a ``context_fn`` that is a plain function)."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    counts: dict[bool, dict[Any, int]] = {False: {}, True: {}}  # this call's, per mode

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        indices = wanted.get(op)
        if indices is None:
            return CheckpointPolicy.PREFER_RECOMPUTE
        seen = counts[bool(ctx.is_recompute)]
        index = seen.get(op, 0)
        seen[op] = index + 1
        if index in indices:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


@functools.cache
def _operator(name: str) -> Any:
    """``"aten.mm.default"`` -> ``torch.ops.aten.mm.default``."""
    namespace, op, overload = name.split(".")
    try:
        return getattr(getattr(getattr(torch.ops, namespace), op), overload)
    except AttributeError as error:
        raise PlanMismatchError(
            f"the plan keeps the output of operator {name!r}, which this torch does not have; "
            "re-plan with this torch"
        ) from error


class _PythonRng:
    """Checkpoint's ``preserve_rng_state`` covers torch's generators only. A leaf module
    that draws from Python's ``random`` or NumPy (``if random.random() < p``) would draw
    other numbers when recomputed, take another path and leave those generators advanced
    twice. The forward notes their states around the segment; when it drew, the recompute
    runs from the states the forward started from and puts back the ones it found, so the
    recompute repeats the forward's draws and consumes none."""

    def __init__(self) -> None:
        self.at_forward: PythonRngStates | None = None
        self.drew = False

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        self.at_forward = PythonRngStates.now()
        yield
        self.drew = bool(self.at_forward.changed())

    @contextlib.contextmanager
    def recompute_context(self) -> Iterator[None]:
        if not self.drew or self.at_forward is None:
            yield
            return
        current = PythonRngStates.now()
        self.at_forward.restore()
        try:
            yield
        finally:
            current.restore()


class _BufferState:
    """The forward remembers each buffer as it found it: the tensor object in its module's
    slot and a copy of its values. The recompute runs with exactly those in place (a buffer
    updated in place later in the step, or replaced by a new tensor, would otherwise be seen
    changed) and then puts back whatever it found (so running statistics and counters
    advance once per step). Slots are looked up by (module, name) at each entry and restored
    by reassignment: a forward may replace a buffer (timm's ConViT builds its table on the
    first call), and copying remembered values into the replacement would overwrite it."""

    def __init__(self, root: nn.Module, names: tuple[str, ...]) -> None:
        self.root = root
        self.names = names
        self.at_forward: list[tuple[nn.Module, str, Any, torch.Tensor | None]] = []

    def _take(self) -> list[tuple[nn.Module, str, Any, torch.Tensor | None]]:
        found = []
        for name in self.names:
            path, _, attr = name.rpartition(".")
            module = self.root.get_submodule(path)
            held = module._buffers.get(attr, _ABSENT)
            values = held.detach().clone() if isinstance(held, torch.Tensor) else None
            found.append((module, attr, held, values))
        return found

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        self.at_forward = self._take()
        yield

    @contextlib.contextmanager
    def recompute_context(self) -> Iterator[None]:
        current = self._take()
        _put(self.at_forward)
        try:
            yield
        finally:
            _put(current)


_ABSENT = object()


def _put(found: list[tuple[nn.Module, str, Any, torch.Tensor | None]]) -> None:
    for module, attr, held, values in found:
        if held is _ABSENT:
            module._buffers.pop(attr, None)
            continue
        module._buffers[attr] = held
        if values is not None:
            put_back(held, values, if_changed=False)


def rewrite(
    model: nn.Module, capture: Capture, segments: Sequence[SegmentSpec],
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
    code = _code(targets, graph)

    result = shallow_copy(model, _checkpointed_class(type(model)))
    added = list(modules)
    for name, segment in modules.items():
        object.__setattr__(result, name, segment)  # not a registered child: see the docstring
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
        for node in graph.nodes if node.op in ("get_attr", "call_module")
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
    the module at trace time, are guarded on it too: autockpt/tree.py, precision.py.)"""
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


# ---------------------------------------------------------------------------------------------
# the model the user gets back

_STATE = "_autockpt"
"""Instance attribute holding a result's :class:`_Checkpointing` (its plan, graph code and
checks); its presence is what makes a module a checkpointed result."""

ON_LARGER_INPUT = ("error", "warn")
"""What a result does with a training call whose tensors are larger than planned."""

# nn.Module's own registries and hook tables: a shallow copy gets its own, so that adding a
# parameter, a child or a hook to the result leaves the user's module as it was.
_REGISTRIES = tuple(
    name for name, value in vars(nn.Module()).items() if isinstance(value, (dict, set))
)


@dataclass(frozen=True)
class CallShape:
    """How the forward is called: the parameters a call gives (positional ones by their
    names, ``**kwargs`` entries by key, sorted) and, for each, the shape and dtype of every
    tensor in it."""

    names: tuple[str, ...]
    tensors: tuple[tuple[tuple[tuple[int, ...], torch.dtype], ...], ...]

    def describe(self) -> str:
        return ", ".join(
            name + "".join(
                f" {list(shape)}:{str(dtype).removeprefix('torch.')}" for shape, dtype in tensors
            )
            for name, tensors in zip(self.names, self.tensors, strict=True)
        )


@dataclass(eq=False)
class _Checkpointing:
    """What a result knows beyond the user's module: the graph's code and when to run it."""

    code: Callable[..., Any]
    captured_training: bool
    # fx graphs are; export graphs are where export kept sizes dynamic (Capture.shape_generic)
    shape_generic: bool
    signature: inspect.Signature | None
    planned: CallShape | None
    input_check: Callable[[tuple, dict], None] | None
    attributes: tuple[str, ...]  # instance attributes the result adds to the user's module
    plan: Plan | None = None
    on_larger_input: str = "error"
    warned: set[Any] = dataclasses.field(default_factory=set)
    tree: ModuleTree | None = None  # the modules the graph was captured from (tree.py)
    exported: bool = False  # a torch.export graph: specialised to the planned precision

    def __deepcopy__(self, memo: dict[int, Any]) -> _Checkpointing:
        # Code, signature, checks and plan are immutable; only what was warned about is
        # the copy's own.
        return dataclasses.replace(self, warned=set(self.warned))

    def warn_once(self, key: Any, message: str, stacklevel: int) -> None:
        if key not in self.warned:
            self.warned.add(key)
            warnings.warn(message, UncoveredCallWarning, stacklevel=stacklevel + 1)


def is_checkpointed(module: nn.Module) -> bool:
    """Whether ``module`` is a model returned by ``optimize``/``apply``/``rewrite``."""
    return _STATE in vars(module)


def plain_module(module: nn.Module) -> nn.Module:
    """The model a result was made from, as a plain instance of the user's class sharing
    everything with the result (tree, registries, attributes, mode) but what checkpointing
    added; ``module`` itself when it is not a result. What is pickled, and what planning
    again starts from (capturing the result would plan a plan)."""
    state: _Checkpointing | None = vars(module).get(_STATE)
    if state is None:
        return module
    plain = object.__new__(type(module)._autockpt_base)
    skip = {_STATE, *state.attributes}
    vars(plain).update({k: v for k, v in vars(module).items() if k not in skip})
    return plain


def segments_of(module: nn.Module) -> dict[str, CheckpointSegment]:
    """The checkpoint segments of a result, by attribute name, in graph order (they are
    plain attributes, not registered children, so ``named_modules()`` does not list them)."""
    return {
        name: value for name, value in vars(module).items() if isinstance(value, CheckpointSegment)
    }


_CLASSES: dict[type, type] = {}


def _checkpointed_class(base: type) -> type:
    """The subclass of ``base`` that results of ``base`` models are instances of (one per
    class, like FSDP2's ``FSDP<Name>``). It keeps ``base``'s name, module and qualified
    name: libraries record the class name (Hugging Face writes it to ``config.architectures``
    on ``save_pretrained`` and its Trainer's label smoothing picks the causal-LM loss by
    ``_get_name()``), and a renamed class would be saved, or trained, as another model."""
    cls = _CLASSES.get(base)
    if cls is None:
        cls = types.new_class(base.__name__, (base,), exec_body=functools.partial(_class_body, base))
        _CLASSES[base] = cls
    return cls


def _class_body(base: type, namespace: dict[str, Any]) -> None:
    @functools.wraps(base.forward)  # the original signature, for inspect.signature and HF
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return _forward(self, base, args, kwargs)

    namespace.update(
        __module__=base.__module__,
        __qualname__=base.__qualname__,
        __doc__=base.__doc__,
        forward=forward,
        plan=property(_get_plan, _set_plan, doc="The :class:`~autockpt.Plan` applied."),
        on_larger_input=property(_get_on_larger_input, _set_on_larger_input, doc=(
            'What a training call with tensors larger than planned does: "error" (default) '
            'raises PlanMismatchError, "warn" warns once per shape and runs the graph.'
        )),
        __reduce_ex__=_reduce_ex,
        __deepcopy__=_deepcopy,
        __copy__=_copy,
        _autockpt_base=base,
    )


def _forward(self: nn.Module, base: type, args: tuple, kwargs: dict) -> Any:
    """Run the checkpointed graph for the calls the plan covers, the original forward for
    every other one, on the same tree.

    The graph is used only in the mode it was captured in (capture baked mode-dependent
    branches in, ``training=self.training``) and only with autograd on (without it there is
    nothing to save, and eager's forward is exact). A training call that gives other
    arguments than planned (no ``labels``, an extra ``attention_mask``, the
    ``num_items_in_batch`` a Trainer adds) cannot run a graph traced without them: it runs
    the original forward, and says so once per argument set, since it then is neither
    checkpointed nor within the budget. Larger tensors than planned run an fx graph
    correctly but not within the budget: ``on_larger_input`` decides (error by default).
    """
    state: _Checkpointing | None = vars(self).get(_STATE)
    if (
        state is None
        or self.training != state.captured_training
        or not torch.is_grad_enabled()
    ):
        return base.forward(self, *args, **kwargs)
    # A module replaced after planning (LoRA adapters) would be bypassed by the graph, and
    # another precision changes its memory: autockpt/tree.py, autockpt/precision.py.
    check_tree(self, state.tree)
    check_precision(self, state.plan, state.exported, state.warned)
    if torch.compiler.is_compiling():
        budget = state.plan.budget_bytes if state.plan is not None else None
        _warn_if_compiled_unverified(state.code, state.warned, type(self).__name__, budget)
    given = without_defaults(state.signature, kwargs)  # the call as the graph knows it
    if state.planned is not None:
        call = _call_shape(state.signature, args, given)
        if call is None:  # not a valid call: the original forward says why
            return base.forward(self, *args, **kwargs)
        if call.names != state.planned.names:
            state.warn_once(("names", call.names), (
                f"{type(self).__name__} called in training with ({', '.join(call.names)}) "
                "runs un-checkpointed, outside the plan's budget: the plan covers calls with "
                f"({', '.join(state.planned.names)}); plan with these inputs to checkpoint them"
            ), stacklevel=5)  # the caller of model(...)
            return base.forward(self, *args, **kwargs)
        if state.input_check is not None:  # export's own guards name the failing dimension
            state.input_check(args, given)
        _check_size(self, state, call)
    elif state.input_check is not None:
        state.input_check(args, given)
    return state.code(self, *args, **given)


_VERIFIED_COMPILED = "verified compiled"
"""The key in a result's ``warned`` set that says its plan is run under the
``torch.compile`` it was planned and verified with (:func:`mark_verified_compiled`)."""

COMPILED_OVERSHOOT = "from 13% under to 25% over"
"""How far compiled steps of plans verified eagerly were measured from their budget
(docs/integrations.md, "torch.compile"), for the :class:`CompileWarning`."""


def mark_verified_compiled(module: nn.Module) -> None:
    """Say that every optimized model in ``module``'s tree is handed back under the
    ``torch.compile`` its plan is verified with (``optimize(torch.compile(model), ...)``):
    tracing it is expected and does not warn. Copies (``copy.deepcopy``) keep the mark."""
    for found in module.modules():
        state: _Checkpointing | None = vars(found).get(_STATE)
        if state is not None:
            state.warned.add(_VERIFIED_COMPILED)


@torch.compiler.assume_constant_result
def _warn_if_compiled_unverified(
    code: Callable[..., Any], warned: set[Any], name: str, budget_bytes: int | None
) -> bool:
    """Warn, once per generated code (one plan of one model), that ``torch.compile`` is
    tracing a result whose plan was verified for eager steps only; whether it warned is the
    (constant) result.

    Under ``torch.compile`` it runs once per trace, outside the graph, on copies of its
    arguments: the mark of a result verified compiled is read from its ``warned`` set, but
    what was said is kept here, by the graph's code (shared by the results of one plan,
    :func:`_code`, and guarded by dynamo already). It never takes the module: a module
    passed to a function dynamo runs at trace time is guarded by identity, so every result
    of the class would be traced again."""
    if _VERIFIED_COMPILED in warned or code in _WARNED_COMPILED:
        return False
    _WARNED_COMPILED.add(code)
    budget = f"its budget ({budget_bytes} bytes)" if budget_bytes is not None else "its plan"
    warnings.warn(
        f"torch.compile is tracing an optimized {name}; {budget} was verified for eager "
        "steps only. A compiled step keeps other tensors than the eager one (what the "
        "compiled backward saves outside the checkpointed segments, zero gradients for "
        "outputs the loss does not use), and compiled steps of eagerly verified plans were "
        f"measured {COMPILED_OVERSHOOT} their budgets. To have the budget hold for the "
        "compiled step, compile first: autockpt.optimize(torch.compile(model), ...) plans "
        "and verifies the compiled step",
        CompileWarning,
        stacklevel=2,
    )
    return True


_WARNED_COMPILED: weakref.WeakSet[Callable[..., Any]] = weakref.WeakSet()
"""The generated codes (plans) whose compiled trace has warned."""


def _check_size(self: nn.Module, state: _Checkpointing, call: CallShape) -> None:
    planned = state.planned
    assert planned is not None
    if not state.shape_generic:
        if call.tensors != planned.tensors:
            raise PlanMismatchError(
                f"this optimized {type(self).__name__} was planned for inputs "
                f"({planned.describe()}) and its graph is specialised to them; got "
                f"({call.describe()}). Give batches of that shape (e.g. drop_last=True) or "
                "plan again for this one"
            )
        return
    if not _exceeds(call, planned):
        return
    if state.on_larger_input == "warn":
        state.warn_once(("larger", call.tensors), (
            f"{type(self).__name__} called in training with ({call.describe()}), larger "
            f"than planned ({planned.describe()}): it runs the plan, but the step's peak "
            "memory may exceed the budget"
        ), stacklevel=6)
        return
    raise PlanMismatchError(
        f"this optimized {type(self).__name__} was planned for inputs ({planned.describe()}) "
        f"and its budget holds for those sizes; this call gives ({call.describe()}), which "
        "is larger, so the step's peak memory could exceed the budget. Give batches no "
        "larger than planned, plan again for the largest batch, or set "
        "`model.on_larger_input = 'warn'` to run it anyway"
    )


def _exceeds(call: CallShape, planned: CallShape) -> bool:
    """Whether any tensor of ``call`` is larger than its planned counterpart in some
    dimension or in element size (or the tensors do not correspond at all)."""
    for got, want in zip(call.tensors, planned.tensors, strict=True):
        if len(got) != len(want):
            return True
        for (shape, dtype), (planned_shape, planned_dtype) in zip(got, want, strict=True):
            if len(shape) != len(planned_shape) or dtype.itemsize > planned_dtype.itemsize:
                return True
            if any(x > y for x, y in zip(shape, planned_shape, strict=True)):
                return True
    return False


def _forward_signature(cls: type) -> inspect.Signature | None:
    """``cls.forward``'s signature without ``self`` (None when it cannot be read)."""
    try:
        signature = inspect.signature(cls.forward)
    except (TypeError, ValueError):
        return None
    params = list(signature.parameters.values())
    if params and params[0].kind in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
        params = params[1:]
    return signature.replace(parameters=params)


def _call_shape(
    signature: inspect.Signature | None, args: tuple, kwargs: dict
) -> CallShape | None:
    """The :class:`CallShape` of ``forward(*args, **kwargs)`` (None: not a valid call). A
    keyword argument passed as its very default object (``attention_mask=None``) counts as
    not given: the forward cannot tell the two apart (:func:`autockpt.trace.without_defaults`)."""
    if signature is None:
        return None
    try:
        bound = signature.bind(*args, **without_defaults(signature, kwargs))  # idempotent
    except TypeError:
        return None
    entries: list[tuple[str, Any]] = []
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            entries += sorted(value.items())
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            entries += [(f"{name}[{i}]", item) for i, item in enumerate(value)]
        else:
            entries.append((name, value))
    return CallShape(
        tuple(name for name, _ in entries),
        tuple(
            tuple(
                (tuple(leaf.shape), leaf.dtype)
                for leaf in torch.utils._pytree.tree_leaves(value)
                if isinstance(leaf, torch.Tensor)
            )
            for _, value in entries
        ),
    )


def shallow_copy(module: nn.Module, cls: type | None = None) -> nn.Module:
    """A new instance of ``cls`` (default: ``module``'s class) sharing everything with
    ``module`` (parameters, buffers, children, attributes such as a config) but the
    registries and hook tables, which are copies: changing the copy's tree leaves the
    user's as found. Given another class, a ``forward`` set on the instance is left out: it
    is bound to the original object."""
    result = object.__new__(cls or type(module))
    state = dict(vars(module))
    if cls is not None:
        state.pop("forward", None)
    for name in _REGISTRIES:
        if name in state:
            state[name] = copy.copy(state[name])
    vars(result).update(state)
    return result


def _get_plan(self: nn.Module) -> Plan | None:
    return vars(self)[_STATE].plan


def _set_plan(self: nn.Module, plan: Plan | None) -> None:
    vars(self)[_STATE].plan = plan


def _get_on_larger_input(self: nn.Module) -> str:
    return vars(self)[_STATE].on_larger_input


def _set_on_larger_input(self: nn.Module, value: str) -> None:
    if value not in ON_LARGER_INPUT:
        raise ValueError(f"on_larger_input must be one of {ON_LARGER_INPUT}, got {value!r}")
    vars(self)[_STATE].on_larger_input = value


def _deepcopy(self: nn.Module, memo: dict[int, Any]) -> nn.Module:
    """A full copy: every tensor, module and attribute copied, the segments with them and
    bound to the copy (their root is in the same memo), the plan shared."""
    copied = object.__new__(type(self))
    memo[id(self)] = copied
    for name, value in vars(self).items():
        vars(copied)[name] = copy.deepcopy(value, memo)
    return copied


def _copy(self: nn.Module) -> nn.Module:
    """A shallow copy, as ``copy.copy`` makes of any module (the same registries)."""
    copied = object.__new__(type(self))
    vars(copied).update(vars(self))
    return copied


def _reduce_ex(self: nn.Module, protocol: Any) -> tuple[Any, ...]:
    """Pickle as the plain model plus the plan; loading re-applies the plan
    (:func:`_rebuild`). The generated class and the graph's code are not picklable, and
    need not be: the plan rebuilds them, checked against the model's graph again."""
    state: _Checkpointing = vars(self)[_STATE]
    if state.plan is None:
        raise TypeError(
            f"this checkpointed {type(self).__name__} was made by rewrite() without a plan, "
            "so it cannot be rebuilt on load; pickle a model from autockpt.optimize or "
            "autockpt.apply, or the original model"
        )
    return _rebuild, (plain_module(self), state.plan, state.captured_training, state.on_larger_input)


def _rebuild(plain: nn.Module, plan: Plan, captured_training: bool, on_larger_input: str) -> nn.Module:
    """Re-apply ``plan`` to an unpickled plain model, captured in the mode it was planned
    in (a result saved in eval mode would otherwise capture another graph), and leave every
    module's mode as it was saved. An fx plan is re-captured from the plan alone; an export
    plan needs example inputs, rebuilt as zeros of the planned shapes and dtypes."""
    from autockpt.api import apply

    modes = {name: module.training for name, module in plain.named_modules()}
    inputs = None
    if plan.capture_method == "export":
        parameter = next(plain.parameters(), None)
        device = parameter.device if parameter is not None else torch.device("cpu")
        inputs = inputs_like(plan.input_signature, device)
    plain.train(captured_training)
    try:
        result = apply(plain, plan, inputs)
    finally:
        for name, module in plain.named_modules():
            module.training = modes[name]
    result.training = modes[""]
    result.on_larger_input = on_larger_input
    return result


_TENSOR = re.compile(r"Tensor\[([0-9, ]*)\]:(\w+)")


def inputs_like(signature: str, device: torch.device | str = "meta") -> Inputs:
    """Example inputs as a plan's ``input_signature`` describes them (``Inputs.signature``):
    zero tensors of the recorded shapes and dtypes on ``device``, the recorded plain values.
    Raises ValueError for a signature holding values it cannot rebuild (an object)."""
    try:
        args, kwargs = ast.literal_eval(signature)
    except (ValueError, SyntaxError, TypeError) as error:
        raise ValueError(f"cannot read the input signature {signature!r}: {error}") from None

    def build(leaf: Any) -> Any:
        if not isinstance(leaf, str):
            raise ValueError(f"unexpected {leaf!r} in the input signature {signature!r}")
        match = _TENSOR.fullmatch(leaf)
        if match:
            shape = [int(d) for d in match[1].split(",") if d.strip()]
            return torch.zeros(shape, dtype=getattr(torch, match[2]), device=device)
        try:
            return ast.literal_eval(leaf)
        except (ValueError, SyntaxError):
            raise ValueError(
                f"the input signature {signature!r} records a {leaf} object, which cannot "
                "be rebuilt from it"
            ) from None

    tree_map = torch.utils._pytree.tree_map
    return Inputs(tuple(tree_map(build, list(args))), dict(tree_map(build, kwargs)))


def planned_inputs(signature: str) -> Inputs | None:
    """Shape-only (meta) inputs as a plan's ``input_signature`` records them, for checking
    calls of a result applied without example inputs; None when it cannot be read."""
    try:
        return inputs_like(signature, "meta")
    except ValueError:
        return None
