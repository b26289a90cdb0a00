"""Stage 2b — record: one training step of the captured graph as attributed allocation events.

The plan simulator (:mod:`solvers.replay`) replays what this module records. See that
module's docstring for why a replay of recorded allocations, and :func:`record_trace` here
for how a step is recorded.
"""

from __future__ import annotations

import bisect
import os
import weakref
from typing import Any

os.environ.setdefault("KINETO_LOG_LEVEL", "5")

import torch  # noqa: E402
import torch.fx as fx  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from autockpt.profile import CaptureInterpreter, placeholder_values  # noqa: E402
from autockpt.runtime import (  # noqa: E402
    LossFn,
    clear_grads,
    default_loss,
    device_of,
    preserved_training_state,
    tensors_in,
)
from autockpt.trace import Capture, Inputs  # noqa: E402
from solvers.replay import (  # noqa: E402
    BACKWARD,
    FORWARD,
    LOSS,
    PROLOGUE,
    MemoryTrace,
    Window,
)

__all__ = ["record_trace"]

_NODE_MARK = "autockpt::node::"
_LOSS_MARK = "autockpt::loss"
_PACK_MARK = "autockpt::pack"

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
                    warm.run(
                        *placeholder_values(capture, model, inputs), enable_io_processing=False
                    )
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


class _NodeRunner(CaptureInterpreter):
    """Runs the captured graph like its generated code (values die after their last use),
    marks each compute node, and notes per node the storages it reads, returns and saves."""

    def __init__(
        self, model: nn.Module, capture: Capture, index_of: dict[fx.Node, int], key: Any
    ) -> None:
        super().__init__(model, capture, garbage_collect_values=True)
        self.index_of = index_of
        self.key = key  # storage -> hashable key, or None for a plain run
        n = len(index_of)
        self.reads: list[list[Any]] = [[] for _ in range(n)]
        self.outputs: list[list[Any]] = [[] for _ in range(n)]
        self.saved: list[list[Any]] = [[] for _ in range(n)]
        self.graph_outputs: list[Any] = []
        self.on_node: Any = None
        self.mark_packs = False  # a profiler mark at each save (where recomputes stop)

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
            if self.mark_packs:
                with torch.profiler.record_function(f"{_PACK_MARK}{i}"):
                    pass
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

    def key(t: torch.Tensor) -> int:
        return t.untyped_storage().data_ptr()

    runner = _NodeRunner(model, capture, index_of, key)
    runner.mark_packs = True
    # Allocator events of every device come through the CPU activity (the allocators report
    # them from the host); no CUDA tracing is needed.
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _quiet_native_stderr():
        prof.start()
    try:
        output = capture.graph._codegen.process_outputs(
            runner.run(*placeholder_values(capture, model, inputs), enable_io_processing=False)
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
        elif name.startswith(_PACK_MARK):
            flat.append((event.start_time_ns, order, "pack", int(name[len(_PACK_MARK) :])))
        elif name.startswith("autograd::engine::evaluate_function"):
            flat.append(
                (event.start_time_ns, order, "backward", getattr(fields, "sequence_number", -1))
            )
        elif getattr(fields, "sequence_number", -1) >= 0:
            flat.append((event.start_time_ns, order, "op", fields.sequence_number))
        order += 1
        stack.extend(reversed(event.children))
    flat.sort(key=lambda item: (item[0], item[1]))

    # Pass 1: which node (or the loss) created each autograd sequence number. An operator
    # event carries the sequence number autograd will give the *next* node it creates, also
    # when the operator itself creates none (an op on tensors that need no gradient, such as
    # the labels an export graph shifts before its loss): that op reports the number the
    # next differentiable op will take. The creator is therefore the *last* operator in the
    # forward to report a number (after it, the counter has moved on), not the first.
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
            seq_owner[payload] = owner

    # Pass 2: windows and allocation events; pointers resolved to allocation ids.
    windows: list[Window] = []
    events: list[tuple[int, int]] = []
    sizes: list[int] = []
    live_at: dict[int, int] = {}  # ptr -> current allocation id
    history: dict[int, list[tuple[int, int]]] = {}  # ptr -> [(event index, allocation id)]
    current = -1
    in_backward = False
    last_pack = [-1] * len(index_of)
    for _, _, kind, payload in flat:
        new: Window | None = None
        if kind == "pack":
            if not in_backward:
                last_pack[payload] = len(events)
            continue
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
        last_pack=tuple(last_pack),
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
            runner.run(*placeholder_values(capture, model, inputs), enable_io_processing=False)
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
