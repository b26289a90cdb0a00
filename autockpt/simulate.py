"""The plan simulator: replay one training step's allocations under any checkpoint plan.

Why a replay of recorded allocations rather than a formula
----------------------------------------------------------
The budget is what the allocator reports (``max_memory_allocated`` on CUDA, the profiler's
allocator events on CPU). Between the tensors a graph names there are many the graph does not
name: gradient buffers flowing between nodes, a gradient summed from two users, a kernel's
workspace, the loss's own temporaries, parameter gradients that ``AccumulateGrad`` creates in
backward order. A stage-level formula guesses them; this module *records* them once, in one
eager step of the captured graph, and then reschedules exactly the allocations a plan moves:

* **record** (:func:`record_trace`): run the graph node by node with every allocation and free
  as an event (the PyTorch profiler's allocator events on real devices; a storage tracker on
  the meta device, see below). Every event belongs to a *window*: the forward of node ``i``,
  the loss, or the backward of node ``i`` (backward functions are mapped to the node that
  created them through autograd sequence numbers). Per node the recorder also notes which
  allocations it reads, returns and hands to autograd (``saved_tensors_hooks``).
* **replay** (:func:`simulate`): under non-reentrant ``torch.utils.checkpoint`` semantics a
  plan changes three things, and only these are rescheduled:

  1. A tensor made in the forward that eager keeps for backward is now freed at the latest of
     its remaining reasons to live: its last forward use, the backward of a *kept* node that
     saves it, the backward of a segment it enters (the checkpoint keeps a segment's inputs
     for the recompute), or its eager free when no node saves it (a model output the loss
     holds). Saves by nodes inside a segment no longer hold it.
  2. Before the first backward window of a segment, the segment's forward allocations are
     replayed (the recompute). A recomputed tensor that a segment node saves lives until that
     node's backward frees it, exactly where eager freed the original; the others die after
     their last use inside the recompute.
  3. Everything else (gradients, loss, parameter gradients, workspaces) happens as in eager.

  The peak is the static part (parameters, buffers, inputs) plus the highest running sum.

The replay is exact for what it moves and keeps everything else as measured, so its error is
limited to effects it ignores: the checkpoint's own bookkeeping (RNG state, a few hundred
bytes per segment), early-stopped recomputes that skip trailing nodes, and allocator
behaviour that depends on the order of frees (caching on CUDA). docs/memory.md lists them.

On the meta device there is no allocator; a dispatch mode sees every storage an operator
returns and a weak-reference callback sees it die. Kernel workspaces are invisible there, so
meta-device plans are memory-exact only for named tensors.
"""

from __future__ import annotations

import bisect
import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("KINETO_LOG_LEVEL", "5")

import torch  # noqa: E402
import torch.fx as fx  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from autockpt.runtime import (  # noqa: E402
    LossFn,
    clear_grads,
    default_loss,
    device_of,
    preserved_training_state,
    tensors_in,
)
from autockpt.trace import Capture, Inputs  # noqa: E402

__all__ = ["MemoryTrace", "PlanSimulation", "Window", "record_trace", "simulate"]

PROLOGUE, FORWARD, LOSS, BACKWARD = "prologue", "forward", "loss", "backward"
_NODE_MARK = "autockpt::node::"
_LOSS_MARK = "autockpt::loss"


@dataclass(frozen=True)
class Window:
    """A stretch of the eager step: ``phase`` is forward, loss or backward; ``node`` is the
    compute node's index (-1 for the loss and for backward functions of the loss)."""

    phase: str
    node: int


@dataclass(frozen=True)
class MemoryTrace:
    """One eager training step as allocation events, attributed to the graph's nodes.

    ``events`` holds ``(allocation, window)`` pairs in time order: the first occurrence of an
    allocation id is its allocation, the second its free. ``sizes[a]`` is the bytes of
    allocation ``a``. Per compute node: the allocations it reads (``reads``), returns
    (``outputs``) and saves for backward (``saved``). ``output_allocations`` are those of the
    graph's output. ``static_bytes`` is what is alive before the step starts (parameters,
    buffers, inputs). ``source`` is ``"allocator"`` (profiler events) or ``"storages"``
    (meta-device storage tracker: no kernel workspaces).
    """

    num_nodes: int
    windows: tuple[Window, ...]
    events: tuple[tuple[int, int], ...]
    sizes: tuple[int, ...]
    reads: tuple[tuple[int, ...], ...]
    outputs: tuple[tuple[int, ...], ...]
    saved: tuple[tuple[int, ...], ...]
    output_allocations: tuple[int, ...]
    static_bytes: int
    source: str
    rng_state_bytes: int = 0

    def eager_peak_bytes(self) -> int:
        """The recorded step's own peak (static part included)."""
        return simulate(self, []).peak_bytes


@dataclass(frozen=True)
class PlanSimulation:
    """Predicted peak of one step under a plan, and where it happens."""

    peak_bytes: int
    peak_phase: str
    peak_node: int
    forward_peak_bytes: int
    backward_peak_bytes: int


@dataclass
class _Positions:
    """Where a plan's timeline puts each eager window (``slot``) and each recompute."""

    slot_of_window: list[int]
    recompute_slot: dict[int, int]
    phase_of_slot: dict[int, tuple[str, int]] = field(default_factory=dict)


def simulate(
    trace: MemoryTrace,
    segments: Sequence[tuple[int, int]],
    preserve_rng: Sequence[bool] | None = None,
    _debug: list | None = None,
) -> PlanSimulation:
    """Replay ``trace`` with the given checkpointed node ranges ``[first, stop)`` (sorted,
    disjoint, within the graph's compute nodes) and return the predicted peak.

    ``preserve_rng[k]`` says that segment ``k`` stashes the RNG state (it has random ops):
    the checkpoint then holds one state tensor from its forward to the end of its backward
    and another while it recomputes (``trace.rng_state_bytes`` each)."""
    n = trace.num_nodes
    segment_of = [-1] * n
    for k, (first, stop) in enumerate(segments):
        if not 0 <= first < stop <= n:
            raise ValueError(f"segment [{first}, {stop}) is outside the {n} compute nodes")
        for i in range(first, stop):
            if segment_of[i] != -1:
                raise ValueError(f"segments overlap at node {i}")
            segment_of[i] = k

    windows = trace.windows
    # Eager order of every event, and each allocation's alloc / free event index.
    alloc_event: dict[int, int] = {}
    free_event: dict[int, int] = {}
    for e, (a, _) in enumerate(trace.events):
        if a in alloc_event:
            free_event[a] = e
        else:
            alloc_event[a] = e
    window_of_event = [w for _, w in trace.events]
    last_event_of_window: dict[int, int] = {}
    for e, w in enumerate(window_of_event):
        last_event_of_window[w] = e

    # Backward windows per node, in time order.
    backward_windows: dict[int, list[int]] = {}
    forward_window: dict[int, int] = {}
    for w, win in enumerate(windows):
        if win.phase == BACKWARD and win.node >= 0:
            backward_windows.setdefault(win.node, []).append(w)
        elif win.phase == FORWARD:
            forward_window[win.node] = w

    # The plan's timeline: eager windows in order, each segment's recompute inserted right
    # before the first backward window of any of its nodes.
    first_backward_of_segment: dict[int, int] = {}
    last_backward_of_segment: dict[int, int] = {}
    for node, ws in backward_windows.items():
        k = segment_of[node]
        if k >= 0:
            first_backward_of_segment[k] = min(first_backward_of_segment.get(k, ws[0]), ws[0])
            last_backward_of_segment[k] = max(last_backward_of_segment.get(k, ws[-1]), ws[-1])
    slot_of_window = [0] * len(windows)
    recompute_slot: dict[int, int] = {}
    recompute_before = {w: k for k, w in first_backward_of_segment.items()}
    slot = 0
    slot_phase: dict[int, tuple[str, int]] = {}
    for w, win in enumerate(windows):
        if w in recompute_before:
            k = recompute_before[w]
            recompute_slot[k] = slot
            slot_phase[slot] = ("recompute", segments[k][0])
            slot += 1
        slot_of_window[w] = slot
        slot_phase[slot] = (win.phase, win.node)
        slot += 1

    def at(w: int, e: int) -> tuple[int, float]:
        return (slot_of_window[w], e)

    def end_of(w: int) -> tuple[int, float]:
        return (slot_of_window[w], last_event_of_window.get(w, -1) + 0.5)

    def end_of_last_backward(node: int) -> tuple[int, float] | None:
        ws = backward_windows.get(node)
        return end_of(ws[-1]) if ws else None

    savers: dict[int, list[int]] = {}
    for i, allocations in enumerate(trace.saved):
        for a in allocations:
            savers.setdefault(a, []).append(i)
    readers: dict[int, list[int]] = {}
    for i, allocations in enumerate(trace.reads):
        for a in allocations:
            readers.setdefault(a, []).append(i)
    graph_outputs = set(trace.output_allocations)

    segment_touched = bool(segments)
    # (position, +bytes / -bytes, tag): the tag (allocation id, ~id for a recomputed copy,
    # negative for RNG stashes) only serves debugging
    points: list[tuple[tuple[int, float], int, int]] = []
    sizes = trace.sizes
    for a, e in alloc_event.items():
        size = sizes[a]
        w_alloc = window_of_event[e]
        points.append((at(w_alloc, e), size, a))
        f = free_event.get(a)
        eager_free = at(window_of_event[f], f) if f is not None else None
        win = windows[w_alloc]
        free = eager_free
        kept_for_backward = f is None or windows[window_of_event[f]].phase == BACKWARD
        if win.phase == FORWARD and segment_touched and not kept_for_backward and free is not None:
            held = _segment_input_hold(
                a, win.node, segment_of, readers, savers, end_of, last_backward_of_segment
            )
            free = max(free, held) if held is not None else free
        elif win.phase == FORWARD and segment_touched:
            free = _rescheduled_free(
                a,
                win.node,
                eager_free,
                f,
                trace,
                segment_of,
                savers,
                readers,
                graph_outputs,
                windows,
                window_of_event,
                forward_window,
                end_of,
                end_of_last_backward,
                last_backward_of_segment,
            )
        if free is not None:
            points.append((free, -size, a))
        if win.phase == FORWARD and win.node >= 0 and segment_of[win.node] >= 0:
            k = segment_of[win.node]
            if k in recompute_slot:
                points.extend(
                    _recomputed(
                        a,
                        e,
                        f,
                        win.node,
                        k,
                        segments[k],
                        recompute_slot[k],
                        trace,
                        savers,
                        readers,
                        windows,
                        window_of_event,
                        backward_windows,
                        at,
                        end_of,
                        last_event_of_window,
                        forward_window,
                    )
                )

    rng_bytes = trace.rng_state_bytes
    for k, (first, _) in enumerate(segments):
        if not (preserve_rng and preserve_rng[k] and rng_bytes):
            continue
        start = (slot_of_window[forward_window[first]], -1.0)
        stop = end_of(last_backward_of_segment[k]) if k in last_backward_of_segment else None
        points.append((start, rng_bytes, -1 - 2 * k))
        if stop is not None:
            points.append((stop, -rng_bytes, -1 - 2 * k))
        if k in recompute_slot:
            points.append(((recompute_slot[k], -1.0), rng_bytes, -2 - 2 * k))
            points.append(((recompute_slot[k], float("inf")), -rng_bytes, -2 - 2 * k))
    points.sort(key=lambda p: p[0])
    if _debug is not None:
        _debug.extend(points)
    current = peak = 0
    forward_peak = backward_peak = 0
    peak_slot = 0
    for (s, _), delta, _ in points:
        current += delta
        phase = slot_phase.get(s, (FORWARD, 0))[0]
        if phase in (FORWARD, LOSS):
            forward_peak = max(forward_peak, current)
        else:
            backward_peak = max(backward_peak, current)
        if current > peak:
            peak, peak_slot = current, s
    phase, node = slot_phase.get(peak_slot, (FORWARD, 0))
    static = trace.static_bytes
    return PlanSimulation(
        peak_bytes=static + peak,
        peak_phase=phase,
        peak_node=node,
        forward_peak_bytes=static + forward_peak,
        backward_peak_bytes=static + backward_peak,
    )


def _rescheduled_free(
    a: int,
    producer: int,
    eager_free: tuple[int, float] | None,
    f: int | None,
    trace: MemoryTrace,
    segment_of: list[int],
    savers: dict[int, list[int]],
    readers: dict[int, list[int]],
    graph_outputs: set[int],
    windows: tuple[Window, ...],
    window_of_event: list[int],
    forward_window: dict[int, int],
    end_of: Any,
    end_of_last_backward: Any,
    last_backward_of_segment: dict[int, int],
) -> tuple[int, float] | None:
    """When a forward allocation that eager kept for backward is freed under the plan."""
    saving = savers.get(a, [])
    if a in graph_outputs or not saving:
        return eager_free  # held by something the graph does not name (the loss, the caller)
    reasons: list[tuple[int, float]] = []
    eager_window = windows[window_of_event[f]] if f is not None else None
    for j in saving:
        if segment_of[j] >= 0:
            continue  # a checkpointed saver keeps nothing; its recompute makes its own copy
        if eager_window is not None and eager_window.phase == BACKWARD and eager_window.node == j:
            reasons.append(eager_free)
        else:
            end = end_of_last_backward(j)
            if end is not None:
                reasons.append(end)
    held = _segment_input_hold(
        a, producer, segment_of, readers, savers, end_of, last_backward_of_segment
    )
    if held is not None:
        reasons.append(held)
    last_reader = max([producer, *(j for j in readers.get(a, []) if j >= producer)])
    reasons.append(end_of(forward_window[last_reader]))
    return max(reasons)


def _segment_input_hold(
    a: int,
    producer: int,
    segment_of: list[int],
    readers: dict[int, list[int]],
    savers: dict[int, list[int]],
    end_of: Any,
    last_backward_of_segment: dict[int, int],
) -> tuple[int, float] | None:
    """A checkpoint keeps its segment's inputs for the recompute: an allocation made outside
    a segment and read inside it lives until that segment's backward is over."""
    entered = {
        segment_of[j]
        for j in readers.get(a, []) + savers.get(a, [])
        if segment_of[j] >= 0 and segment_of[j] != segment_of[producer]
    }
    ends = [end_of(last_backward_of_segment[k]) for k in entered if k in last_backward_of_segment]
    return max(ends) if ends else None


def _recomputed(
    a: int,
    e: int,
    f: int | None,
    producer: int,
    k: int,
    segment: tuple[int, int],
    slot: int,
    trace: MemoryTrace,
    savers: dict[int, list[int]],
    readers: dict[int, list[int]],
    windows: tuple[Window, ...],
    window_of_event: list[int],
    backward_windows: dict[int, list[int]],
    at: Any,
    end_of: Any,
    last_event_of_window: dict[int, int],
    forward_window: dict[int, int],
) -> list[tuple[tuple[int, float], int, int]]:
    """The recompute's copy of forward allocation ``a`` (made by a node of segment ``k``)."""
    first, stop = segment
    size = trace.sizes[a]
    inside_savers = [j for j in savers.get(a, []) if first <= j < stop]
    if inside_savers:
        eager_window = windows[window_of_event[f]] if f is not None else None
        if (
            eager_window is not None
            and eager_window.phase == BACKWARD
            and eager_window.node in inside_savers
        ):
            free = at(window_of_event[f], f)
        else:
            ends = [end_of(backward_windows[j][-1]) for j in inside_savers if j in backward_windows]
            free = max(ends) if ends else (slot, e + 0.5)
    elif (
        f is not None
        and windows[window_of_event[f]].phase == FORWARD
        and (first <= windows[window_of_event[f]].node < stop)
    ):
        free = (slot, f)
    else:
        inside_readers = [j for j in readers.get(a, []) if producer <= j < stop]
        last = max([producer, *inside_readers])
        free = (slot, last_event_of_window.get(forward_window[last], e) + 0.5)
    return [((slot, e), size, ~a), (free, -size, ~a)]


# ---------------------------------------------------------------------------------------------
# Recording
# ---------------------------------------------------------------------------------------------


def record_trace(
    model: nn.Module,
    capture: Capture,
    inputs: Inputs,
    *,
    loss_fn: LossFn | None = None,
) -> MemoryTrace:
    """Record one eager step of ``capture``'s graph as attributed allocation events.

    Real devices: the PyTorch profiler's allocator events (the same truth ``measure`` uses),
    after one warm-up step so that lazily created state is not counted as the step's.
    Meta device: a storage tracker (no allocator exists; see the module docstring). The
    model's training state is restored afterwards.
    """
    from autockpt.measure import static_bytes
    from autockpt.profile import placeholder_values

    loss_fn = loss_fn or default_loss
    device = device_of(model, inputs)
    nodes = capture.compute_nodes()
    index_of = {node: i for i, node in enumerate(nodes)}
    static = (
        static_bytes(model, inputs) if device.type != "meta" else _meta_static_bytes(model, inputs)
    )
    with preserved_training_state(model):
        if device.type != "meta":
            warm = _NodeRunner(model, capture, index_of, None)
            loss = loss_fn(
                capture.graph._codegen.process_outputs(
                    warm.run(*placeholder_values(capture, model, inputs))
                )
            )
            loss.backward()
            del loss, warm
            clear_grads(model)
            return _record_with_profiler(model, capture, inputs, index_of, loss_fn, device, static)
        return _record_with_storages(model, capture, inputs, index_of, loss_fn, static)


def _meta_static_bytes(model: nn.Module, inputs: Inputs) -> int:
    seen: set[int] = set()
    total = 0
    for t in list(model.parameters()) + list(model.buffers()) + inputs.tensors():
        storage = t.untyped_storage()
        if id(storage) not in seen:
            seen.add(id(storage))
            total += storage.nbytes()
    return total


class _NodeRunner(fx.Interpreter):
    """Runs the captured graph like its generated code (values die after their last use),
    marks each compute node, and notes per node the storages it reads, returns and saves."""

    def __init__(
        self, model: nn.Module, capture: Capture, index_of: dict[fx.Node, int], key: Any
    ) -> None:
        super().__init__(model, garbage_collect_values=True, graph=capture.graph)
        self.index_of = index_of
        self.key = key  # storage -> hashable key, or None for a plain run
        n = len(index_of)
        self.reads: list[list[Any]] = [[] for _ in range(n)]
        self.outputs: list[list[Any]] = [[] for _ in range(n)]
        self.saved: list[list[Any]] = [[] for _ in range(n)]
        self.graph_outputs: list[Any] = []
        self.on_node: Any = None

    def run_node(self, n: fx.Node) -> Any:
        i = self.index_of.get(n)
        if self.key is None:
            return super().run_node(n)
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
            return t

        args = fx.node.map_arg((n.args, n.kwargs), lambda a: self.env.get(a))
        self.reads[i] = [self.key(t) for t in tensors_in(args)]
        with torch.profiler.record_function(f"{_NODE_MARK}{i}"):
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


def _record_with_profiler(
    model: nn.Module,
    capture: Capture,
    inputs: Inputs,
    index_of: dict[fx.Node, int],
    loss_fn: LossFn,
    device: torch.device,
    static: int,
) -> MemoryTrace:
    from torch.profiler import ProfilerActivity, profile, record_function

    from autockpt.measure import _quiet_native_stderr
    from autockpt.profile import placeholder_values

    def key(t: torch.Tensor) -> int:
        return t.untyped_storage().data_ptr()

    runner = _NodeRunner(model, capture, index_of, key)
    # Allocator events of every device come through the CPU activity (the allocators report
    # them from the host); no CUDA tracing is needed.
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _quiet_native_stderr():
        prof.start()
    try:
        output = capture.graph._codegen.process_outputs(
            runner.run(*placeholder_values(capture, model, inputs))
        )
        runner.env.clear()  # the interpreter would hold the graph's outputs through backward
        with record_function(_LOSS_MARK):
            loss = loss_fn(output)
        del output
        loss.backward()
        del loss
    finally:
        with _quiet_native_stderr():
            prof.stop()
    tree = prof.profiler.kineto_results.experimental_event_tree()
    flat: list[tuple[int, int, str, Any]] = []  # (time, order, kind, payload)
    order = 0
    stack = list(reversed(tree))
    while stack:
        event = stack.pop()
        fields = event.extra_fields
        name = event.name
        if hasattr(fields, "alloc_size"):
            if fields.device.type == device.type:
                flat.append((event.start_time_ns, order, "memory", (fields.ptr, fields.alloc_size)))
        elif name.startswith(_NODE_MARK):
            flat.append((event.start_time_ns, order, "node", int(name[len(_NODE_MARK) :])))
        elif name == _LOSS_MARK:
            flat.append((event.start_time_ns, order, "loss", None))
        elif name.startswith("autograd::engine::evaluate_function"):
            flat.append(
                (event.start_time_ns, order, "backward", getattr(fields, "sequence_number", -1))
            )
        elif getattr(fields, "sequence_number", -1) >= 0:
            flat.append((event.start_time_ns, order, "op", fields.sequence_number))
        order += 1
        stack.extend(reversed(event.children))
    flat.sort(key=lambda item: (item[0], item[1]))

    # Pass 1: which node (or the loss) created each autograd sequence number.
    seq_owner: dict[int, int] = {}
    owner = None
    for _, _, kind, payload in flat:
        if kind == "node":
            owner = payload
        elif kind == "loss":
            owner = -1
        elif kind == "backward":
            break
        elif kind == "op" and owner is not None:
            seq_owner.setdefault(payload, owner)

    # Pass 2: windows and allocation events; pointers resolved to allocation ids.
    windows: list[Window] = []
    events: list[tuple[int, int]] = []
    sizes: list[int] = []
    live_at: dict[int, int] = {}  # ptr -> current allocation id
    history: dict[int, list[tuple[int, int]]] = {}  # ptr -> [(event index, allocation id)]
    current = -1
    in_backward = False
    for _, _, kind, payload in flat:
        new: Window | None = None
        if kind == "node":
            new = Window(FORWARD, payload)
        elif kind == "loss":
            new = Window(LOSS, -1)
        elif kind == "backward":
            in_backward = True
            node = seq_owner.get(payload)
            if node is not None and (current < 0 or windows[current] != Window(BACKWARD, node)):
                new = Window(BACKWARD, node)
        elif kind == "memory":
            ptr, nbytes = payload
            if current < 0:
                windows.append(Window(PROLOGUE, -1))
                current = 0
            if nbytes > 0:
                a = len(sizes)
                sizes.append(nbytes)
                live_at[ptr] = a
                history.setdefault(ptr, []).append((len(events), a))
                events.append((a, current))
            elif ptr in live_at:
                events.append((live_at.pop(ptr), current))
            continue
        if new is not None:
            if in_backward and new.phase != BACKWARD and windows:
                continue
            windows.append(new)
            current = len(windows) - 1
    # Forward windows without events still need a place in the timeline.
    known_nodes = {win.node for win in windows if win.phase == FORWARD}
    windows, events = _ensure_forward_windows(windows, events, len(index_of), known_nodes)
    forward_end = _forward_ends(windows, events)

    def resolve(ptrs: list[int], node: int) -> tuple[int, ...]:
        limit = forward_end.get(node, len(events) - 1)
        out: set[int] = set()
        for ptr in ptrs:
            entries = history.get(ptr)
            if not entries:
                continue
            pos = bisect.bisect_right(entries, (limit, 1 << 62)) - 1
            if pos >= 0:
                out.add(entries[pos][1])
        return tuple(sorted(out))

    n = len(index_of)
    last_forward = max(range(n), key=lambda i: forward_end.get(i, -1)) if n else 0
    return MemoryTrace(
        num_nodes=n,
        windows=tuple(windows),
        events=tuple(events),
        sizes=tuple(sizes),
        reads=tuple(resolve(runner.reads[i], i) for i in range(n)),
        outputs=tuple(resolve(runner.outputs[i], i) for i in range(n)),
        saved=tuple(resolve(runner.saved[i], i) for i in range(n)),
        output_allocations=resolve(runner.graph_outputs, last_forward),
        static_bytes=static,
        source="allocator",
        # torch.get_rng_state() is a CPU tensor: it counts where the allocator counted is CPU's
        rng_state_bytes=torch.get_rng_state().nbytes if device.type == "cpu" else 0,
    )


def _ensure_forward_windows(
    windows: list[Window], events: list[tuple[int, int]], n: int, known: set[int]
) -> tuple[list[Window], list[tuple[int, int]]]:
    """Give every compute node a forward window (a node that allocates nothing and whose
    marker the profiler dropped still needs one) by appending empty windows at the end of
    the forward; their position only matters for nodes that hold nothing."""
    missing = [i for i in range(n) if i not in known]
    if not missing:
        return windows, events
    first_non_forward = next(
        (w for w, win in enumerate(windows) if win.phase != FORWARD), len(windows)
    )
    added = [Window(FORWARD, i) for i in missing]
    remap = {w: (w if w < first_non_forward else w + len(added)) for w in range(len(windows))}
    new_windows = windows[:first_non_forward] + added + windows[first_non_forward:]
    new_events = [(a, remap[w]) for a, w in events]
    return new_windows, new_events


def _forward_ends(windows: list[Window], events: list[tuple[int, int]]) -> dict[int, int]:
    """For each node, the index of the last event up to the end of its forward window."""
    last: dict[int, int] = {}
    for e, (_, w) in enumerate(events):
        last[w] = e
    out: dict[int, int] = {}
    running = -1
    for w, win in enumerate(windows):
        running = max(running, last.get(w, running))
        if win.phase == FORWARD:
            out[win.node] = running
    return out


# ---------------------------------------------------------------------------------------------
# Meta device: a storage tracker instead of an allocator
# ---------------------------------------------------------------------------------------------


class _StorageTracker(TorchDispatchMode):
    """Sees every storage an operator returns (an allocation) and, through a weak reference,
    when it dies (a free). Backward operators are attributed to the autograd node running."""

    def __init__(self, static_ids: set[int]) -> None:
        super().__init__()
        self.static_ids = static_ids
        self.ids: dict[int, int] = {}  # id(storage) -> allocation id
        self.sizes: list[int] = []
        self.events: list[tuple[int, int]] = []
        self.window = 0
        self.backward_window_of: Any = None  # sequence number -> window index

    def key(self, t: torch.Tensor) -> int | None:
        return self.ids.get(id(t.untyped_storage()))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.backward_window_of is not None:
            node = torch._C._current_autograd_node()
            if node is not None:
                w = self.backward_window_of(node._sequence_nr())
                if w is not None:
                    self.window = w
        out = func(*args, **(kwargs or {}))
        for t in tensors_in(out):
            storage = t.untyped_storage()
            sid = id(storage)
            if sid in self.ids or sid in self.static_ids or storage.nbytes() == 0:
                continue
            a = len(self.sizes)
            self.ids[sid] = a
            self.sizes.append(storage.nbytes())
            self.events.append((a, self.window))
            weakref.finalize(storage, self._free, sid, a)
        return out

    def _free(self, sid: int, a: int) -> None:
        if self.ids.get(sid) == a:
            del self.ids[sid]
        self.events.append((a, self.window))


def _record_with_storages(
    model: nn.Module,
    capture: Capture,
    inputs: Inputs,
    index_of: dict[fx.Node, int],
    loss_fn: LossFn,
    static: int,
) -> MemoryTrace:
    from autockpt.profile import placeholder_values

    statics = list(model.parameters()) + list(model.buffers()) + inputs.tensors()
    static_storages = [t.untyped_storage() for t in statics]  # kept alive: ids stay unique
    tracker = _StorageTracker({id(s) for s in static_storages})
    n = len(index_of)
    windows: list[Window] = []
    seq_owner: dict[int, int] = {}
    created: set[int] = set()

    def key(t: torch.Tensor) -> int | None:
        return tracker.key(t)

    runner = _NodeRunner(model, capture, index_of, key)

    def on_node(i: int) -> None:
        windows.append(Window(FORWARD, i))
        tracker.window = len(windows) - 1

    runner.on_node = on_node
    backward_windows: dict[int, int] = {}

    def backward_window_of(seq: int) -> int | None:
        node = seq_owner.get(seq)
        if node is None:
            return None
        if windows[-1] != Window(BACKWARD, node):
            windows.append(Window(BACKWARD, node))
        backward_windows[node] = len(windows) - 1
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
            runner.run(*placeholder_values(capture, model, inputs))
        )
        runner.env.clear()  # the interpreter would hold the graph's outputs through backward
        windows.append(Window(LOSS, -1))
        tracker.window = len(windows) - 1
        loss = loss_fn(output)
        del output
        tracker.backward_window_of = backward_window_of
        loss.backward()
        del loss
    del static_storages
    events = list(tracker.events)

    def ids(keys: list[Any]) -> tuple[int, ...]:
        return tuple(sorted({k for k in keys if k is not None}))

    return MemoryTrace(
        num_nodes=n,
        windows=tuple(windows),
        events=tuple(events),
        sizes=tuple(tracker.sizes),
        reads=tuple(ids(runner.reads[i]) for i in range(n)),
        outputs=tuple(ids(runner.outputs[i]) for i in range(n)),
        saved=tuple(ids(runner.saved[i]) for i in range(n)),
        output_allocations=ids(runner.graph_outputs),
        static_bytes=static,
        source="storages",
        # The device the plan will run on is unknown here; counting the CPU RNG stash is the
        # conservative choice (it is CPU memory, outside a GPU's count).
        rng_state_bytes=torch.get_rng_state().nbytes,
    )
