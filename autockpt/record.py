"""Stage 2b — record: one training step of the captured graph as attributed allocation events.

The plan simulator (:mod:`solvers.replay`) replays what this module records; see its
docstring for why a replay of recorded allocations. How a step is recorded, and why
(numbered notes the code points back to):

1. **Sizes come from fake tensors.** Planning must fit where the plan fits, so the step the
   plan avoids is never run with real tensors. The graph runs on fake tensors
   (:func:`autockpt.runtime.fake_step`): every operator returns tensors with the real
   shapes, dtypes, strides, devices and storage aliasing, and no data. A dispatch mode
   (:class:`autockpt.allocations.StorageTracker`) sees every storage an operator returns (an allocation) and,
   through a weak reference, when it dies (a free); the graph runs like its generated code
   (values die after their last use) and backward runs through the real autograd engine,
   so gradient buffers, gradient sums and parameter gradients appear in the engine's own
   order. Backward operators belong to the compute node that created their autograd node
   (sequence numbers). On the meta device the same tracker runs on the meta tensors.
2. **Workspaces come from real kernels, one node at a time.** What no operator returns (a
   convolution's im2col buffer, a kernel's scratch space) is invisible to a dispatch mode.
   :func:`autockpt.profile.profile` measures it per node on real tensors while only a lean
   working set is alive (:class:`autockpt.profile.NodeWorkspace`), and :func:`record_trace`
   adds it to the node's windows: one allocation of that many bytes over each window
   (:func:`_with_workspaces`). The window's peak then equals what the allocator reaches
   there; elsewhere the extra bytes can only over-count, never under-count.
3. **Early stop.** A checkpoint's recompute stops at the segment's last save for backward;
   the recorder notes, per node, how many events precede its last save (``last_pack``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from autockpt.allocations import StorageTracker, returned_short, static_tensor_bytes
from autockpt.profile import CaptureInterpreter, placeholder_values
from autockpt.runtime import (
    LossFn,
    default_loss,
    fake_step,
    preserved_training_state,
    tensors_in,
)
from autockpt.trace import Capture, Inputs
from solvers.replay import BACKWARD, FORWARD, LOSS, MemoryTrace, Window

__all__ = ["record_trace"]


def record_trace(
    model: nn.Module,
    capture: Capture,
    inputs: Inputs,
    *,
    loss_fn: LossFn | None = None,
    forward_workspace: Mapping[int, int] | None = None,
    backward_workspace: Mapping[int, int] | None = None,
    loss_workspace: int = 0,
    hidden_saved: Mapping[int, int] | None = None,
    device_forward_ops: Mapping[int, Sequence[tuple[str, int]]] | None = None,
) -> MemoryTrace:
    """Record one step of ``capture``'s graph as attributed allocation events, on fake
    tensors (note 1): nothing the size of an activation is allocated.

    ``forward_workspace[i]`` / ``backward_workspace[i]`` are the bytes node ``i``'s kernels
    allocate beyond the tensors its operators return, ``loss_workspace`` the loss's, and
    ``hidden_saved[i]`` what node ``i``'s forward leaves allocated until its backward (note
    2; all measured by :func:`autockpt.profile.profile`). The model, its gradients, buffers
    and the RNG are as they were afterwards.
    """
    loss_fn = loss_fn or default_loss
    nodes = capture.compute_nodes()
    index_of = {node: i for i, node in enumerate(nodes)}
    static = static_tensor_bytes(model, inputs)
    with preserved_training_state(model), fake_step(model, inputs) as fake_inputs:
        trace, fake_ops = _record(model, capture, fake_inputs, index_of, loss_fn, static)
    forward_workspace = dict(forward_workspace or {})
    backward_workspace = dict(backward_workspace or {})
    hidden_saved = dict(hidden_saved or {})
    if device_forward_ops:
        _add_what_fake_kernels_miss(trace, fake_ops, device_forward_ops, hidden_saved)
    if forward_workspace or backward_workspace or loss_workspace or hidden_saved:
        trace = _with_workspaces(
            trace,
            forward_workspace or {},
            backward_workspace or {},
            loss_workspace,
            hidden_saved or {},
        )
    return trace


def _add_what_fake_kernels_miss(
    trace: MemoryTrace,
    fake_ops: Mapping[int, list[tuple[str, int]]],
    device_ops: Mapping[int, Sequence[tuple[str, int]]],
    hidden: dict[int, int],
) -> None:
    """Note 2, second half: where an operator of a node's forward returned more on the
    device than on fake tensors (``aten::mkldnn_rnn_layer`` returns its reserve buffer on
    the CPU and an empty one from its fake kernel), the difference joins the node's hidden
    saved bytes (such buffers are what the backward needs). Operators are compared one by
    one, in order; a node whose two runs called different operators is left as recorded."""
    forward_window = {win.node: w for w, win in enumerate(trace.windows) if win.phase == FORWARD}
    for node, real in device_ops.items():
        fake = fake_ops.get(forward_window.get(node, -1), [])
        missed = returned_short(list(fake), list(real))
        if missed:
            hidden[node] = hidden.get(node, 0) + missed


def _with_workspaces(
    trace: MemoryTrace,
    forward: Mapping[int, int],
    backward: Mapping[int, int],
    loss: int,
    hidden_saved: Mapping[int, int],
) -> MemoryTrace:
    """``trace`` with what the probe saw and fake tensors cannot (note 2): one workspace
    allocation spanning each window that has one, and each node's hidden saved bytes from
    the start of its forward to the end of its backward, saved by that node (so a plan that
    checkpoints the node drops and recomputes them like its other saved tensors).

    A node's backward may be split into several windows (several autograd nodes); each gets
    the node's backward workspace, which over-counts only if two of them peak together."""
    windows = trace.windows
    last_backward: dict[int, int] = {}
    forward_window: dict[int, int] = {}
    for w, win in enumerate(windows):
        if win.phase == BACKWARD:
            last_backward[win.node] = w
        elif win.phase == FORWARD:
            forward_window[win.node] = w
    sizes = list(trace.sizes)
    before: dict[int, list[int]] = {}  # window -> allocation ids whose event opens it
    after: dict[int, list[int]] = {}  # window -> allocation ids whose event closes it

    def span(size: int, opens: int, closes: int, at_start: bool) -> int:
        a = len(sizes)
        sizes.append(size)
        (before if at_start else after).setdefault(opens, []).append(a)
        after.setdefault(closes, []).append(a)
        return a

    for w, win in enumerate(windows):
        size = {FORWARD: forward, BACKWARD: backward}.get(win.phase, {}).get(win.node, 0)
        if win.phase == LOSS:
            size = loss
        if size > 0:
            span(size, w, w, at_start=True)
    saved = [list(ids) for ids in trace.saved]
    for node, size in sorted(hidden_saved.items()):
        if size > 0 and node in last_backward and node in forward_window:
            # allocated as the forward starts: before the node's saves, so a recompute that
            # stops after its last save (note 3) makes them again
            saved[node].append(span(size, forward_window[node], last_backward[node], True))
    # One pass in time order; windows only advance along the event list.
    events: list[tuple[int, int]] = []
    position = [0] * (len(trace.events) + 1)  # old event index -> new one (for last_pack)
    window = -1

    def advance_to(target: int) -> None:
        nonlocal window
        while window < target:
            if window >= 0:
                events.extend((a, window) for a in after.get(window, []))
            window += 1
            if window < len(windows):
                events.extend((a, window) for a in before.get(window, []))

    for e, (a, w) in enumerate(trace.events):
        advance_to(w)
        position[e] = len(events)
        events.append((a, w))
    advance_to(len(windows))
    position[len(trace.events)] = len(events)
    return dataclasses.replace(
        trace,
        events=tuple(events),
        sizes=tuple(sizes),
        saved=tuple(tuple(sorted(ids)) for ids in saved),
        last_pack=tuple(position[p] if p >= 0 else p for p in trace.last_pack),
    )


class _NodeRunner(CaptureInterpreter):
    """Runs the captured graph like its generated code (values die after their last use),
    announces each compute node (``on_node``) and each save (``on_pack``), and notes per
    node the allocations it reads, returns and saves."""

    def __init__(
        self, model: nn.Module, capture: Capture, index_of: dict[fx.Node, int], key: Any
    ) -> None:
        super().__init__(model, capture, garbage_collect_values=True)
        self.index_of = index_of
        self.key = key  # storage -> allocation id (None for storages the tracker ignores)
        n = len(index_of)
        self.reads: list[list[Any]] = [[] for _ in range(n)]
        self.outputs: list[list[Any]] = [[] for _ in range(n)]
        self.saved: list[list[Any]] = [[] for _ in range(n)]
        self.graph_outputs: list[Any] = []
        self.on_node: Any = None
        self.on_pack: Any = None  # called with the node's index at each save (note 3)

    def run_node(self, n: fx.Node) -> Any:
        i = self.index_of.get(n)
        if i is None:
            result = super().run_node(n)
            if n.op == "output":
                self.graph_outputs = [self.key(t) for t in tensors_in(result)]
            return result
        if self.on_node is not None:
            self.on_node(i)
        saved: list[Any] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved.append(self.key(t))
            if self.on_pack is not None:
                self.on_pack(i)
            return t

        args = fx.node.map_arg((n.args, n.kwargs), lambda a: self.env.get(a))
        self.reads[i] = [self.key(t) for t in tensors_in(args)]
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            result = super().run_node(n)
        self.saved[i] = saved
        self.outputs[i] = [self.key(t) for t in tensors_in(result)]
        return result


def _forward_sequence_numbers(result: Any, known: set[int]) -> set[int]:
    """Sequence numbers of the autograd nodes reachable from ``result`` and not yet known."""
    found: set[int] = set()
    stack = [t.grad_fn for t in tensors_in(result) if t.grad_fn is not None]
    seen: set[int] = set()
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        seq = fn._sequence_nr()
        if seq in known or type(fn).__name__ == "AccumulateGrad":
            continue
        found.add(seq)
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return found


def _record(
    model: nn.Module,
    capture: Capture,
    inputs: Inputs,
    index_of: dict[fx.Node, int],
    loss_fn: LossFn,
    static: int,
) -> tuple[MemoryTrace, dict[int, list[tuple[str, int]]]]:
    """One step of the graph under :class:`autockpt.allocations.StorageTracker` (note 1), on whatever tensors
    ``model`` and ``inputs`` hold (fake or meta); also the operators each window called and
    the bytes of new storage each returned."""
    statics = list(model.parameters()) + list(model.buffers()) + inputs.tensors()
    static_storages = [t.untyped_storage() for t in statics]  # kept alive: ids stay unique
    tracker = StorageTracker({id(s) for s in static_storages})
    tracker.op_log = {}
    n = len(index_of)
    windows: list[Window] = []
    seq_owner: dict[int, int] = {}
    created: set[int] = set()
    last_pack = [-1] * n

    runner = _NodeRunner(model, capture, index_of, tracker.key)

    def on_node(i: int) -> None:
        windows.append(Window(FORWARD, i))
        tracker.window = len(windows) - 1

    def on_pack(i: int) -> None:  # note 3: events so far precede node i's latest save
        last_pack[i] = len(tracker.events)

    runner.on_node = on_node
    runner.on_pack = on_pack

    def backward_window_of(seq: int) -> int | None:
        node = seq_owner.get(seq)
        if node is None:
            return None
        if windows[-1] != Window(BACKWARD, node):
            windows.append(Window(BACKWARD, node))
        return len(windows) - 1

    original_run_node = runner.run_node

    def run_node(node: fx.Node) -> Any:
        result = original_run_node(node)
        i = index_of.get(node)
        if i is not None:
            for seq in _forward_sequence_numbers(result, created):
                seq_owner.setdefault(seq, i)
                created.add(seq)
        return result

    runner.run_node = run_node  # type: ignore[method-assign]
    with tracker:
        output = capture.graph._codegen.process_outputs(
            runner.run(*placeholder_values(capture, model, inputs), enable_io_processing=False)
        )
        runner.env.clear()  # the interpreter would hold the graph's outputs through backward
        windows.append(Window(LOSS, -1))
        tracker.window = len(windows) - 1
        loss = loss_fn(output)
        del output
        tracker.backward_window_of = backward_window_of
        runner.on_pack = None
        loss.backward()
        del loss
    del static_storages
    device = next((t.device for t in statics), torch.device("cpu"))

    def ids(keys: list[Any]) -> tuple[int, ...]:
        return tuple(sorted({k for k in keys if k is not None}))

    return MemoryTrace(
        num_nodes=n,
        windows=tuple(windows),
        events=tuple(tracker.events),
        sizes=tuple(tracker.sizes),
        reads=tuple(ids(runner.reads[i]) for i in range(n)),
        outputs=tuple(ids(runner.outputs[i]) for i in range(n)),
        saved=tuple(ids(runner.saved[i]) for i in range(n)),
        output_allocations=ids(runner.graph_outputs),
        static_bytes=static,
        source="storages",
        # torch.get_rng_state() is a CPU tensor: a checkpoint's RNG stash counts where the
        # budget counts CPU memory, and on the meta device (target unknown) to be safe.
        rng_state_bytes=torch.get_rng_state().nbytes if device.type in ("cpu", "meta") else 0,
        last_pack=tuple(last_pack),
    ), tracker.op_log
