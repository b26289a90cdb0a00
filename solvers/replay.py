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
     replayed (the recompute) up to the segment's last save for backward, where the
     checkpoint stops recomputing (early stop) and the recompute's temporaries die. A
     recomputed tensor that a segment node saves lives until that node's backward frees
     it, exactly where eager freed the original; the others die after their last use
     inside the recompute.
  3. Everything else (gradients, loss, parameter gradients, workspaces) happens as in eager.

  The peak is the static part (parameters, buffers, inputs) plus the highest running sum.

The replay is exact for what it moves and keeps everything else as measured, so its error is
limited to effects it ignores: the checkpoint's own bookkeeping (a few hundred bytes per
segment) and allocator behaviour that depends on the order of frees (caching on CUDA).
docs/memory.md lists them. (The meta-device recorder below does not mark saves, so its
replays recompute whole segments.)

On the meta device there is no allocator; a dispatch mode sees every storage an operator
returns and a weak-reference callback sees it die. Kernel workspaces are invisible there, so
meta-device plans are memory-exact only for named tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["MemoryTrace", "PlanSimulation", "Window", "simulate", "timeline"]

PROLOGUE, FORWARD, LOSS, BACKWARD = "prologue", "forward", "loss", "backward"


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
    last_pack: tuple[int, ...] = ()
    """Per compute node, how many events precede its last save for backward (-1 when it
    saves nothing or it is unknown): a checkpoint's recompute stops there (early stop)."""

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


Position = tuple[int, float]
"""A point of the plan's timeline: (slot, order within the slot). Slots are the eager windows
in order with one recompute slot inserted per segment; the order within a slot is the eager
event index (``+ 0.5`` is "right after that event", ``-1`` "before anything")."""


def simulate(
    trace: MemoryTrace,
    segments: Sequence[tuple[int, int]],
    preserve_rng: Sequence[bool] | None = None,
) -> PlanSimulation:
    """Replay ``trace`` with the given checkpointed node ranges ``[first, stop)`` (sorted,
    disjoint, within the graph's compute nodes) and return the predicted peak.

    ``preserve_rng[k]`` says that segment ``k`` stashes the RNG state (it has random ops):
    the checkpoint then holds one state tensor from its forward to the end of its backward
    and another while it recomputes (``trace.rng_state_bytes`` each)."""
    replay = _Replay(trace, segments)
    points = replay.points(preserve_rng)
    current = peak = 0
    forward_peak = backward_peak = 0
    peak_slot = 0
    for (slot, _), delta, _ in points:
        current += delta
        phase = replay.slot_phase[slot][0]
        if phase in (PROLOGUE, FORWARD, LOSS):
            forward_peak = max(forward_peak, current)
        else:
            backward_peak = max(backward_peak, current)
        if current > peak:
            peak, peak_slot = current, slot
    phase, node = replay.slot_phase.get(peak_slot, (FORWARD, 0))
    static = trace.static_bytes
    return PlanSimulation(
        peak_bytes=static + peak,
        peak_phase=phase,
        peak_node=node,
        forward_peak_bytes=static + forward_peak,
        backward_peak_bytes=static + backward_peak,
    )


def timeline(
    trace: MemoryTrace,
    segments: Sequence[tuple[int, int]],
    preserve_rng: Sequence[bool] | None = None,
) -> list[tuple[str, int, int]]:
    """The same replay as :func:`simulate`, as a curve: ``(phase, node, peak bytes)`` for
    every slot of the plan's step in time order, where ``phase`` is ``prologue``,
    ``forward``, ``loss``, ``recompute`` (``node`` = the segment's first node) or
    ``backward``, and bytes include the static part. Its maximum is ``simulate``'s peak."""
    replay = _Replay(trace, segments)
    peaks: dict[int, int] = {}
    ends: dict[int, int] = {}
    current = 0
    for (slot, _), delta, _ in replay.points(preserve_rng):
        peaks.setdefault(slot, current)  # live on entry, before the slot's first event
        current += delta
        peaks[slot] = max(peaks[slot], current)
        ends[slot] = current
    curve: list[tuple[str, int, int]] = []
    live = 0  # live bytes at the end of the previous slot
    for slot in sorted(replay.slot_phase):
        phase, node = replay.slot_phase[slot]
        curve.append((phase, node, trace.static_bytes + peaks.get(slot, live)))
        live = ends.get(slot, live)
    return curve


class _Replay:
    """The plan's timeline for one trace and one set of segments (see the module docstring
    for the rules); :meth:`points` lists every allocation and free as a timeline point."""

    def __init__(self, trace: MemoryTrace, segments: Sequence[tuple[int, int]]) -> None:
        n = trace.num_nodes
        self.trace = trace
        self.segments = [(int(first), int(stop)) for first, stop in segments]
        self.segment_of = [-1] * n
        for k, (first, stop) in enumerate(self.segments):
            if not 0 <= first < stop <= n:
                raise ValueError(f"segment [{first}, {stop}) is outside the {n} compute nodes")
            for i in range(first, stop):
                if self.segment_of[i] != -1:
                    raise ValueError(f"segments overlap at node {i}")
                self.segment_of[i] = k
        windows = self.windows = trace.windows
        # Each allocation's allocation and free event (eager order).
        self.alloc_event: dict[int, int] = {}
        self.free_event: dict[int, int] = {}
        for e, (a, _) in enumerate(trace.events):
            if a in self.alloc_event:
                self.free_event[a] = e
            else:
                self.alloc_event[a] = e
        self.window_of_event = [w for _, w in trace.events]
        self.last_event_of_window: dict[int, int] = {}
        for e, w in enumerate(self.window_of_event):
            self.last_event_of_window[w] = e
        # Forward window and backward windows (in time order) of every node.
        self.backward_windows: dict[int, list[int]] = {}
        self.forward_window: dict[int, int] = {}
        for w, win in enumerate(windows):
            if win.phase == BACKWARD and win.node >= 0:
                self.backward_windows.setdefault(win.node, []).append(w)
            elif win.phase == FORWARD:
                self.forward_window[win.node] = w
        first_backward: dict[int, int] = {}
        self.last_backward_of_segment: dict[int, int] = {}
        for node, ws in self.backward_windows.items():
            k = self.segment_of[node]
            if k >= 0:
                first_backward[k] = min(first_backward.get(k, ws[0]), ws[0])
                last = self.last_backward_of_segment.get(k, ws[-1])
                self.last_backward_of_segment[k] = max(last, ws[-1])
        # Slots: eager windows in order, each segment's recompute right before the first
        # backward window of any of its nodes (where its first saved tensor is unpacked).
        recompute_before = {w: k for k, w in first_backward.items()}
        self.slot_of_window = [0] * len(windows)
        self.recompute_slot: dict[int, int] = {}
        self.slot_phase: dict[int, tuple[str, int]] = {}
        slot = 0
        for w, win in enumerate(windows):
            if w in recompute_before:
                k = recompute_before[w]
                self.recompute_slot[k] = slot
                self.slot_phase[slot] = ("recompute", self.segments[k][0])
                slot += 1
            self.slot_of_window[w] = slot
            self.slot_phase[slot] = (win.phase, win.node)
            slot += 1
        self.savers: dict[int, list[int]] = {}
        for i, allocations in enumerate(trace.saved):
            for a in allocations:
                self.savers.setdefault(a, []).append(i)
        self.readers: dict[int, list[int]] = {}
        for i, allocations in enumerate(trace.reads):
            for a in allocations:
                self.readers.setdefault(a, []).append(i)
        self.graph_outputs = set(trace.output_allocations)
        # Early stop: a recompute ends at the segment's last save for backward (the
        # checkpoint stops once every saved tensor is back); what the rest of the segment
        # would allocate never is, and the recompute's temporaries die there.
        self.recompute_stop: dict[int, int] = {}
        for k, (first, stop) in enumerate(self.segments):
            packs = [trace.last_pack[i] for i in range(first, stop) if i < len(trace.last_pack)]
            if packs and max(packs) >= 0:
                self.recompute_stop[k] = max(packs)

    # -- positions ------------------------------------------------------------------------

    def at(self, e: int) -> Position:
        """Where eager event ``e`` happens."""
        return (self.slot_of_window[self.window_of_event[e]], e)

    def end_of(self, w: int) -> Position:
        """Right after the last event of eager window ``w``."""
        return (self.slot_of_window[w], self.last_event_of_window.get(w, -1) + 0.5)

    def window_of(self, e: int | None) -> Window | None:
        return self.windows[self.window_of_event[e]] if e is not None else None

    # -- the rules --------------------------------------------------------------------------

    def points(self, preserve_rng: Sequence[bool] | None) -> list[tuple[Position, int, int]]:
        """Every allocation (+bytes) and free (-bytes) of the plan's step, sorted by position.
        The third field tags the allocation (its id; ``~id`` for a recomputed copy; other
        negative numbers for RNG stashes) for diagnostics."""
        points: list[tuple[Position, int, int]] = []
        checkpointed = bool(self.segments)
        for a, e in self.alloc_event.items():
            size = self.trace.sizes[a]
            points.append((self.at(e), size, a))
            f = self.free_event.get(a)
            made_in = self.window_of(e)
            free = self.at(f) if f is not None else None
            if checkpointed and made_in is not None and made_in.phase == FORWARD:
                freed_in = self.window_of(f)
                if freed_in is not None and freed_in.phase != BACKWARD:
                    held = self.segment_input_hold(a, made_in.node)
                    free = max(free, held) if held is not None and free is not None else free
                else:
                    free = self.kept_for_backward_free(a, made_in.node, f)
                k = self.segment_of[made_in.node]
                if k >= 0 and k in self.recompute_slot:
                    points.extend(self.recomputed(a, e, f, made_in.node, k))
            if free is not None:
                points.append((free, -size, a))
        points.extend(self.rng_stashes(preserve_rng))
        points.sort(key=lambda point: point[0])
        return points

    def kept_for_backward_free(self, a: int, producer: int, f: int | None) -> Position | None:
        """When a forward allocation that eager kept for backward is freed under the plan:
        the latest of its last forward use, the backward of each *kept* node that saves it,
        and the end of the backward of each segment it enters."""
        eager_free = self.at(f) if f is not None else None
        saving = self.savers.get(a, [])
        if a in self.graph_outputs or not saving:
            return eager_free  # held by something the graph does not name (the loss, the caller)
        reasons: list[Position] = []
        freed_in = self.window_of(f)
        for j in saving:
            if self.segment_of[j] >= 0:
                continue  # a checkpointed saver keeps nothing; its recompute makes its own copy
            if freed_in is not None and freed_in.phase == BACKWARD and freed_in.node == j:
                reasons.append(eager_free)  # the very backward that freed it in eager
            elif j in self.backward_windows:
                reasons.append(self.end_of(self.backward_windows[j][-1]))
        held = self.segment_input_hold(a, producer)
        if held is not None:
            reasons.append(held)
        last_reader = max([producer, *(j for j in self.readers.get(a, []) if j >= producer)])
        reasons.append(self.end_of(self.forward_window[last_reader]))
        return max(reasons)

    def segment_input_hold(self, a: int, producer: int) -> Position | None:
        """A checkpoint keeps its segment's inputs for the recompute: an allocation made
        outside a segment and read inside it lives until that segment's backward is over."""
        segment_of = self.segment_of
        entered = {
            segment_of[j]
            for j in self.readers.get(a, []) + self.savers.get(a, [])
            if segment_of[j] >= 0 and segment_of[j] != segment_of[producer]
        }
        ends = [
            self.end_of(self.last_backward_of_segment[k])
            for k in entered
            if k in self.last_backward_of_segment
        ]
        return max(ends) if ends else None

    def recomputed(
        self, a: int, e: int, f: int | None, producer: int, k: int
    ) -> list[tuple[Position, int, int]]:
        """The recompute's copy of forward allocation ``a`` (made by a node of segment ``k``):
        made at the same point of the recompute slot; freed where eager freed the original
        when a node of the segment saves it, else after its last use inside the recompute."""
        first, stop = self.segments[k]
        slot = self.recompute_slot[k]
        size = self.trace.sizes[a]
        end = self.recompute_stop.get(k)
        if end is not None and e >= end:
            return []  # after the segment's last save: the recompute stopped before it
        freed_in = self.window_of(f)
        inside_savers = [j for j in self.savers.get(a, []) if first <= j < stop]
        if inside_savers:
            if (
                freed_in is not None
                and freed_in.phase == BACKWARD
                and freed_in.node in inside_savers
            ):
                free = self.at(f)
            else:
                ends = [
                    self.end_of(self.backward_windows[j][-1])
                    for j in inside_savers
                    if j in self.backward_windows
                ]
                free = max(ends) if ends else (slot, e + 0.5)
        elif freed_in is not None and freed_in.phase == FORWARD and first <= freed_in.node < stop:
            free = (slot, f)
        else:
            inside_readers = [j for j in self.readers.get(a, []) if producer <= j < stop]
            last = self.forward_window[max([producer, *inside_readers])]
            free = (slot, self.last_event_of_window.get(last, e) + 0.5)
        if end is not None and free[0] == slot and free[1] > end - 0.5:
            free = (slot, end - 0.5)  # a temporary the stopped recompute drops
        return [((slot, e), size, ~a), (free, -size, ~a)]

    def rng_stashes(self, preserve_rng: Sequence[bool] | None) -> list[tuple[Position, int, int]]:
        """RNG states a random segment's checkpoint keeps: one from its forward to the end of
        its backward, one while it recomputes."""
        out: list[tuple[Position, int, int]] = []
        size = self.trace.rng_state_bytes
        if not preserve_rng or not size:
            return out
        for k, (first, _) in enumerate(self.segments):
            if not preserve_rng[k]:
                continue
            tag = -(1 << 40) - k
            out.append(((self.slot_of_window[self.forward_window[first]], -1.0), size, tag))
            if k in self.last_backward_of_segment:
                out.append((self.end_of(self.last_backward_of_segment[k]), -size, tag))
            if k in self.recompute_slot:
                slot = self.recompute_slot[k]
                out.append(((slot, -1.0), size, tag))
                out.append(((slot, float("inf")), -size, tag))
        return out
