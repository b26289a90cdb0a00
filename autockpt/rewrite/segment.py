"""One checkpointed segment at run time: ``torch.utils.checkpoint`` around a piece of the
graph, with what that needs to equal eager.

* RNG: torch's state is preserved only for segments with random ops (dropout), so that the
  recompute draws the forward's masks; a segment that runs the user's own Python replays
  Python's and NumPy's generators too (:class:`_PythonRng`).
* Buffers the forward mutates (batch-norm statistics, counters, a table built on the first
  call), and parameters it updates in place (EDM2's forced weight normalisation), are
  snapshotted when the segment runs forward and restored around its recompute
  (:class:`_BufferState`), so that they advance once per step and the recompute sees the
  values the forward saw.
* Selective recompute: kept operator outputs are caught in the forward and handed back in
  the recompute (:class:`_KeepCalls`; markers in eager, torch's selective-checkpoint
  policy under ``torch.compile``).
* Without autograd (``torch.no_grad()``), segments run plainly: there is nothing to save.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from autockpt.base.rng import PythonRngStates
from autockpt.base.runtime import put_back
from autockpt.errors import PlanMismatchError

if TYPE_CHECKING:
    pass


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

    def __init__(
        self, fn: Callable[..., Any], spec: SegmentSpec, first_node: str, last_node: str
    ) -> None:
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
                _contexts,
                root,
                self.spec.restore_buffers,
                self.spec.python_rng,
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
    first call), and copying remembered values into the replacement would overwrite it.

    A name may be a parameter's: one the forward updates in place (NOTE [runtime: parameters
    the forward writes]) is remembered and put back the same way, so the recompute starts
    from the value the forward saw before its update, and the updated value is back after
    it. Parameters are never removed or replaced here: only their values move."""

    def __init__(self, root: nn.Module, names: tuple[str, ...]) -> None:
        self.root = root
        self.names = names
        self.at_forward: list[tuple[dict[str, Any], str, Any, torch.Tensor | None]] = []

    def _take(self) -> list[tuple[dict[str, Any], str, Any, torch.Tensor | None]]:
        found = []
        for name in self.names:
            path, _, attr = name.rpartition(".")
            module = self.root.get_submodule(path)
            slots = module._parameters if attr in module._parameters else module._buffers
            held = slots.get(attr, _ABSENT)
            values = held.detach().clone() if isinstance(held, torch.Tensor) else None
            found.append((slots, attr, held, values))
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


def _put(found: list[tuple[dict[str, Any], str, Any, torch.Tensor | None]]) -> None:
    for slots, attr, held, values in found:
        if held is _ABSENT:
            slots.pop(attr, None)
            continue
        slots[attr] = held
        if values is not None:
            put_back(held, values, if_changed=False)
