"""The replay search (``solvers.search``) and the fast replay under it.

* The fast replay (``solvers.replay.Replayer``) against a verbatim copy of the replay's
  original, slow implementation, kept here only: every number of ``simulate`` and
  ``timeline`` equal, on recorded steps of real models and on random synthetic steps.
* The replay's prefix lower bound never exceeds the peak of any completion.
* ``least_recompute`` and ``leanest`` against brute force over every plan of small chains,
  on real recorded steps and on synthetic ones, also with the local search switched off
  (the branch and bound alone must prove the optimum).
* The local search is never worse than its seeds; answers are deterministic.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Iterator, Sequence
from functools import cache

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import solvers
from solvers import InfeasibleError
from solvers.chain import ChainProblem
from solvers.chain import simulate as proxy_simulate
from solvers.rank import UnitGathers
from solvers.replay import (
    BACKWARD,
    FORWARD,
    LOSS,
    PROLOGUE,
    MemoryTrace,
    PlanSimulation,
    Replayer,
    Window,
    replayer,
    simulate,
    timeline,
)
from solvers.search import (
    EXHAUSTIVE_STAGES,
    RankShift,
    ReplayChain,
    count_plans,
    leanest,
    least_recompute,
    recompute_seconds,
    replay_peak,
)

# ---------------------------------------------------------------------------------------------
# The reference: the replay as first written (one Python tuple per point, one sort per plan)
# ---------------------------------------------------------------------------------------------

Position = tuple[int, float]


def reference_simulate(
    trace: MemoryTrace,
    segments: Sequence[tuple[int, int]],
    preserve_rng: Sequence[bool] | None = None,
) -> PlanSimulation:
    replay = _ReferenceReplay(trace, segments)
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


def reference_timeline(
    trace: MemoryTrace,
    segments: Sequence[tuple[int, int]],
    preserve_rng: Sequence[bool] | None = None,
) -> list[tuple[str, int, int]]:
    replay = _ReferenceReplay(trace, segments)
    peaks: dict[int, int] = {}
    ends: dict[int, int] = {}
    current = 0
    for (slot, _), delta, _ in replay.points(preserve_rng):
        peaks.setdefault(slot, current)
        current += delta
        peaks[slot] = max(peaks[slot], current)
        ends[slot] = current
    curve: list[tuple[str, int, int]] = []
    live = 0
    for slot in sorted(replay.slot_phase):
        phase, node = replay.slot_phase[slot]
        curve.append((phase, node, trace.static_bytes + peaks.get(slot, live)))
        live = ends.get(slot, live)
    return curve


class _ReferenceReplay:
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
        # Only nodes that save hold a checkpoint's frame and trigger its recompute (unknown
        # saves: every node may save).
        packs = trace.last_pack
        saves = [
            not packs or (i < len(packs) and packs[i] >= 0) or bool(trace.saved[i])
            for i in range(n)
        ]
        for node, ws in self.backward_windows.items():
            k = self.segment_of[node]
            if k >= 0 and saves[node]:
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
        # Where the last backward formula using a saved allocation let go of it.
        self.unpack_end: dict[int, Position] = {}
        for a, w, e in trace.unpacked:
            inside = 0 <= e < len(trace.events) and self.window_of_event[e] == w
            self.unpack_end[a] = (self.slot_of_window[w], e - 0.5) if inside else self.end_of(w)
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
        if a in self.graph_outputs or not saving or f is None:
            # held by something the graph does not name (the loss, the caller, the model)
            return eager_free
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
                # the copy dies as the formula lets go of it, not when the node releases it
                free = min(self.at(f), self.unpack_end.get(a, self.at(f)))
            else:
                ends = [
                    self.end_of(self.backward_windows[j][-1])
                    for j in inside_savers
                    if j in self.backward_windows
                ]
                free = max(ends) if ends else (slot, e + 0.5)
        elif freed_in is not None and freed_in.phase == FORWARD and first <= freed_in.node < stop:
            free = (slot, f)
        elif a in self.graph_outputs or any(j >= stop for j in self.readers.get(a, [])):
            # an output of the segment: its code holds it until the recompute stops or ends
            last = max(
                self.last_event_of_window.get(self.forward_window[j], -1)
                for j in range(first, stop)
            )
            free = (slot, last + 0.5)
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
        for k, (first, stop) in enumerate(self.segments):
            if not preserve_rng[k]:
                continue
            tag = -(1 << 40) - k
            out.append(((self.slot_of_window[self.forward_window[first]], -1.0), size, tag))
            if k in self.last_backward_of_segment:
                out.append((self.end_of(self.last_backward_of_segment[k]), -size, tag))
            else:  # no node saves: the checkpoint's frame dies as its forward returns
                last = max(self.forward_window[j] for j in range(first, stop))
                out.append((self.end_of(last), -size, tag))
            if k in self.recompute_slot:
                slot = self.recompute_slot[k]
                out.append(((slot, -1.0), size, tag))
                out.append(((slot, float("inf")), -size, tag))
        return out


# ---------------------------------------------------------------------------------------------
# Steps to replay: recorded from zoo models, and synthetic
# ---------------------------------------------------------------------------------------------


@cache
def recorded(name: str, max_stages: int) -> ReplayChain:
    """One recorded step of a zoo model as a chain (the same pipeline as the planner's)."""
    import warnings

    from autockpt.capture import Inputs, capture
    from autockpt.costs.problem import build_chain
    from autockpt.costs.profile import profile
    from autockpt.costs.record import record_trace
    from autockpt_zoo.toy import ZOO

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, example = ZOO[name]()
        inputs = Inputs.of(example)
        cap = capture(model, inputs)
        prof = profile(model, cap, inputs)
        chain = build_chain(cap, prof, max_stages=max_stages)
        nodes = prof.nodes
        trace = record_trace(model, cap, inputs, profile=prof)
    stages = tuple((first, stop) for first, stop in chain.stages)
    return ReplayChain(
        trace=trace,
        stages=stages,
        stage_seconds=chain.problem.forward_seconds,
        random=tuple(any(nodes[i].random for i in range(a, b)) for a, b in stages),
        segment_overhead_seconds=1e-5,
        offset_bytes=4096,
        problem=chain.problem,
    )


REAL = [("gpt", 10), ("resnet", 8)]


@st.composite
def synthetic_traces(draw: st.DrawFn, min_nodes: int = 1, max_nodes: int = 6) -> MemoryTrace:
    """A step with every structure the rules distinguish: allocations made and freed in
    any window (or never freed), windows without events, nodes with no, one or two
    backward windows, backward windows of the loss, shared saves, graph outputs, early
    stops, RNG state."""
    n = draw(st.integers(min_nodes, max_nodes))
    windows = [Window(PROLOGUE, -1)] if draw(st.booleans()) else []
    windows += [Window(FORWARD, i) for i in range(n)]
    windows.append(Window(LOSS, -1))
    for i in reversed(range(n)):
        windows += [Window(BACKWARD, i)] * draw(st.integers(0, 2))
        if draw(st.integers(0, 3)) == 0:
            windows.append(Window(BACKWARD, -1))
    count = len(windows)
    allocations = draw(st.integers(0, 4 * n))
    keyed = []
    for a in range(allocations):
        made = draw(st.integers(0, count - 1))
        order = draw(st.integers(0, 1000))
        keyed.append(((made, order, 0), a, made))
        if draw(st.integers(0, 5)):
            freed = draw(st.integers(made, count - 1))
            later = draw(st.integers(order + 1 if freed == made else 0, 1001))
            keyed.append(((freed, later, 1), a, freed))
    events = tuple((a, w) for _, a, w in sorted(keyed))
    ids = st.integers(0, max(allocations - 1, 0))

    def subsets() -> tuple[int, ...]:
        if not allocations:
            return ()
        return tuple(sorted(set(draw(st.lists(ids, max_size=4)))))

    packs = draw(
        st.one_of(st.just(()), st.lists(st.integers(-1, len(events)), min_size=n, max_size=n))
    )
    # Where a backward let go of an allocation it frees: in its window, up to right after
    # the free (then: the window's end, or the next window's first event).
    unpacked = []
    made: dict[int, int] = {}
    for e, (a, w) in enumerate(events):
        if a not in made:
            made[a] = e
        elif windows[w].phase == BACKWARD and draw(st.booleans()):
            first = min(x for x, (_, v) in enumerate(events) if v == w)
            unpacked.append((a, w, draw(st.integers(max(first, made[a] + 1), e + 1))))
    return MemoryTrace(
        num_nodes=n,
        windows=tuple(windows),
        events=events,
        sizes=tuple(draw(st.integers(0, 100)) for _ in range(allocations)),
        reads=tuple(subsets() for _ in range(n)),
        outputs=tuple(subsets() for _ in range(n)),
        saved=tuple(subsets() for _ in range(n)),
        output_allocations=subsets(),
        static_bytes=draw(st.integers(0, 50)),
        source="storages",
        rng_state_bytes=draw(st.sampled_from([0, 7])),
        last_pack=tuple(packs),
        unpacked=tuple(unpacked),
    )


@st.composite
def chain_like_traces(draw: st.DrawFn, min_nodes: int = 4, max_nodes: int = 8) -> MemoryTrace:
    """A step shaped like a recorded one: each node reads the previous output (sometimes
    also the one before), makes an output and a temporary and saves some of them until its
    backward; backward makes and drops gradients in reverse order. Sizes are random, so
    where to checkpoint matters and plans differ."""
    n = draw(st.integers(min_nodes, max_nodes))
    skip = [False, False, *(draw(st.booleans()) for _ in range(2, n))]
    byte = st.integers(1, 64)
    sizes: list[int] = []
    events: list[tuple[int, int]] = []
    windows: list[Window] = []
    reads: list[tuple[int, ...]] = []
    saved: list[tuple[int, ...]] = []
    packs: list[int] = []
    outputs: list[int] = []
    last_saver: dict[int, int] = {}

    def new(size: int, window: int) -> int:
        sizes.append(size)
        events.append((len(sizes) - 1, window))
        return len(sizes) - 1

    for i in range(n):
        windows.append(Window(FORWARD, i))
        w = len(windows) - 1
        inputs = outputs[-1:] + (outputs[-2:-1] if skip[i] else [])
        out, temp = new(draw(byte), w), new(draw(byte), w)
        keep = draw(st.sets(st.sampled_from([*inputs, out, temp])))
        for a in keep:
            last_saver[a] = i
        packs.append(len(events) if keep else -1)
        if temp not in keep:
            events.append((temp, w))
        reads.append(tuple(sorted(inputs)))
        saved.append(tuple(sorted(keep)))
        outputs.append(out)
        for j in (i - 1, i - 2):  # outputs whose last reader this node is
            last = j + 2 if j + 2 < n and skip[j + 2] else j + 1
            if j >= 0 and last == i and outputs[j] not in last_saver:
                events.append((outputs[j], w))
    windows.append(Window(LOSS, -1))
    loss = new(8, len(windows) - 1)
    grad = new(draw(byte), len(windows) - 1)
    unpacked: list[tuple[int, int, int]] = []
    for i in reversed(range(n)):
        windows.append(Window(BACKWARD, i))
        w = len(windows) - 1
        following = new(draw(byte), w)
        # the formula lets go of what it saved before the engine frees the incoming gradient
        unpacked += [
            (a, w, len(events))
            for a, saver in last_saver.items()
            if saver == i and draw(st.booleans())
        ]
        events.append((grad, w))
        grad = following
        events += [(a, w) for a, saver in last_saver.items() if saver == i]
    w = len(windows) - 1
    events += [(grad, w), (loss, w)]
    if outputs[-1] not in last_saver:
        events.append((outputs[-1], w))
    return MemoryTrace(
        num_nodes=n,
        windows=tuple(windows),
        events=tuple(events),
        sizes=tuple(sizes),
        reads=tuple(reads),
        outputs=tuple((o,) for o in outputs),
        saved=tuple(saved),
        output_allocations=(outputs[-1],),
        static_bytes=draw(st.integers(0, 50)),
        source="storages",
        rng_state_bytes=draw(st.sampled_from([0, 7])),
        last_pack=tuple(packs) if draw(st.booleans()) else (),
        unpacked=tuple(sorted(unpacked)),
    )


@st.composite
def node_segments(draw: st.DrawFn, num_nodes: int) -> list[tuple[int, int]]:
    """Disjoint node ranges in any order."""
    cuts = sorted(set(draw(st.lists(st.integers(0, num_nodes), max_size=8))))
    ranges = [(cuts[i], cuts[i + 1]) for i in range(0, len(cuts) - 1, 2)]
    return draw(st.permutations(ranges)) if ranges else []


def synthetic_chain(trace: MemoryTrace, data: st.DataObject) -> ReplayChain:
    """``trace`` cut into stages (several nodes per stage sometimes)."""
    n = trace.num_nodes
    stages = data.draw(st.integers(min(3, n), n))
    inner = st.sampled_from(list(range(1, n))) if n > 1 else st.nothing()
    cuts = sorted(data.draw(st.sets(inner, min_size=stages - 1, max_size=stages - 1)))
    bounds = [0, *cuts, n]
    stages = tuple(zip(bounds, bounds[1:], strict=False))
    return ReplayChain(
        trace=trace,
        stages=stages,
        stage_seconds=tuple(data.draw(st.sampled_from([0.0, 1.0, 2.0, 3.5])) for _ in stages),
        random=tuple(data.draw(st.booleans()) for _ in stages),
        segment_overhead_seconds=data.draw(st.sampled_from([0.0, 0.25])),
        offset_bytes=data.draw(st.integers(0, 9)),
    )


# ---------------------------------------------------------------------------------------------
# The fast replay is the replay
# ---------------------------------------------------------------------------------------------


def assert_same_replay(
    trace: MemoryTrace, segments: list[tuple[int, int]], rng: list[bool] | None
) -> None:
    expected = reference_simulate(trace, segments, rng)
    assert simulate(trace, segments, rng) == expected
    assert timeline(trace, segments, rng) == reference_timeline(trace, segments, rng)
    assert replayer(trace).peak_bytes(segments, rng) == expected.peak_bytes


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fast_replay_is_the_reference_on_recorded_steps(data: st.DataObject) -> None:
    chain = recorded(*data.draw(st.sampled_from(REAL)))
    trace = chain.trace
    segments = data.draw(node_segments(trace.num_nodes))
    rng = data.draw(
        st.one_of(
            st.none(), st.lists(st.booleans(), min_size=len(segments), max_size=len(segments))
        )
    )
    assert_same_replay(trace, segments, rng)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=st.one_of(chain_like_traces(), synthetic_traces()), data=st.data())
def test_fast_replay_is_the_reference_on_synthetic_steps(
    trace: MemoryTrace, data: st.DataObject
) -> None:
    segments = data.draw(node_segments(trace.num_nodes))
    rng = data.draw(
        st.one_of(
            st.none(), st.lists(st.booleans(), min_size=len(segments), max_size=len(segments))
        )
    )
    assert_same_replay(trace, segments, rng)


def test_stage_plans_replay_like_the_reference() -> None:
    """Every plan the search can propose on a real chain, for a sample of plans."""
    chain = recorded("gpt", 10)
    plans = list(all_plans(chain.num_stages))
    for plan in random.Random(0).sample(plans, 40) + [[], [(0, chain.num_stages)]]:
        ranges, rng = chain.node_ranges(plan), chain.preserve_rng(plan)
        expected = reference_simulate(chain.trace, ranges, rng).peak_bytes
        assert replay_peak(chain, plan) == expected + chain.offset_bytes


def test_bad_segments_raise_like_the_reference() -> None:
    trace = recorded("gpt", 10).trace
    n = trace.num_nodes
    for segments in ([(0, n + 1)], [(3, 3)], [(0, 4), (2, 6)], [(5, 9), (0, 2), (1, 3)]):
        with pytest.raises(ValueError) as expected:
            reference_simulate(trace, segments)
        with pytest.raises(ValueError) as got:
            simulate(trace, segments)
        assert str(got.value) == str(expected.value)


def test_a_step_without_windows_replays_like_the_reference() -> None:
    trace = MemoryTrace(
        num_nodes=2,
        windows=(),
        events=(),
        sizes=(),
        reads=((), ()),
        outputs=((), ()),
        saved=((), ()),
        output_allocations=(),
        static_bytes=5,
        source="storages",
    )
    for segments in ([], [(0, 2)], [(1, 2), (0, 1)]):
        assert_same_replay(trace, segments, None)
    assert replayer(trace).lower_bound_bytes([], 1) == 5


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=st.one_of(chain_like_traces(), synthetic_traces()), data=st.data())
def test_prefix_bound_never_exceeds_a_completion(trace: MemoryTrace, data: st.DataObject) -> None:
    """The branch and bound's pruning rule: for a plan with a segment, cut anywhere no
    segment straddles, the bound from the part before the cut is at most its peak."""
    _check_prefix_bound(trace, data)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_prefix_bound_never_exceeds_a_completion_on_recorded_steps(data: st.DataObject) -> None:
    _check_prefix_bound(recorded(*data.draw(st.sampled_from(REAL))).trace, data)


def _check_prefix_bound(trace: MemoryTrace, data: st.DataObject) -> None:
    segments = sorted(data.draw(node_segments(trace.num_nodes)))
    if not segments:
        return
    rng = [data.draw(st.booleans()) for _ in segments]
    peak = reference_simulate(trace, segments, rng).peak_bytes
    cuts = [c for c in range(trace.num_nodes + 1) if not any(a < c < b for a, b in segments)]
    replay = replayer(trace)
    for cut in cuts:
        before = [k for k, (_, stop) in enumerate(segments) if stop <= cut]
        bound = replay.lower_bound_bytes(
            [segments[k] for k in before], cut, [rng[k] for k in before]
        )
        assert bound <= peak, (cut, bound, peak)
    assert replay.lower_bound_bytes(segments, trace.num_nodes, rng) == peak


# ---------------------------------------------------------------------------------------------
# The search against brute force
# ---------------------------------------------------------------------------------------------


def all_plans(num_stages: int, start: int = 0) -> Iterator[list[tuple[int, int]]]:
    """Every plan: each stage kept, or in one segment of any length."""
    if start == num_stages:
        yield []
        return
    yield from all_plans(num_stages, start + 1)
    for end in range(start + 1, num_stages + 1):
        for rest in all_plans(num_stages, end):
            yield [(start, end), *rest]


@cache
def exhaustive(chain: ReplayChain) -> list[tuple[int, float, tuple[tuple[int, int], ...]]]:
    """(peak, recompute, plan) of every plan."""
    return [
        (replay_peak(chain, plan), recompute_seconds(chain, plan), tuple(plan))
        for plan in all_plans(chain.num_stages)
    ]


def cheapest(rows, budget: int):
    fitting = [(cost, peak, len(plan), plan) for peak, cost, plan in rows if peak <= budget]
    return min(fitting) if fitting else None


def lowest(rows):
    return min((peak, cost, len(plan), plan) for peak, cost, plan in rows)


def budgets_between(low: int, high: int) -> list[int]:
    return sorted({low, *(low + (high - low) * k // 8 for k in (1, 4, 6)), high})


@pytest.mark.parametrize("name,max_stages", REAL)
def test_search_is_exact_on_recorded_steps(name: str, max_stages: int) -> None:
    chain = recorded(name, max_stages)
    assert chain.num_stages <= EXHAUSTIVE_STAGES
    rows = exhaustive(chain)
    assert len(rows) == count_plans(chain.num_stages)
    minimum = lowest(rows)
    lean = leanest(chain)
    assert (lean.peak_bytes, lean.recompute_seconds, tuple(lean.segments)) == (
        minimum[0],
        minimum[1],
        minimum[3],
    )
    assert lean.status == "optimal" and lean.method == "replay-exact" and lean.gap == 0.0
    eager = replay_peak(chain, [])
    assert minimum[0] < eager  # checkpointing matters on these chains
    for budget in budgets_between(minimum[0], eager):
        best = cheapest(rows, budget)
        got = least_recompute(chain, budget)
        assert (got.recompute_seconds, got.peak_bytes, tuple(got.segments)) == (
            best[0],
            best[1],
            best[3],
        ), budget
        assert got.status == "optimal" and got.peak_bytes <= budget
    with pytest.raises(InfeasibleError):
        least_recompute(chain, minimum[0] - 1)


def test_branch_and_bound_alone_is_exact() -> None:
    """No local search: the incumbent comes from the seeds only (or nothing), so the
    pruning does the work; the answers are still the brute-force ones."""
    for name, max_stages in REAL:
        chain = recorded(name, max_stages)
        rows = exhaustive(chain)
        minimum = lowest(rows)
        eager = replay_peak(chain, [])
        budgets = budgets_between(minimum[0], eager)[1:4]
        if name == "resnet":
            lean = leanest(chain, max_evaluations=0)
            assert tuple(lean.segments) == minimum[3]
        else:
            budgets = budgets[1:2]  # the slowest to prove; one is enough
        for budget in budgets:
            got = least_recompute(chain, budget, max_evaluations=0)
            assert tuple(got.segments) == cheapest(rows, budget)[3]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=st.one_of(chain_like_traces(), synthetic_traces(3, 7)), data=st.data())
def test_search_is_exact_on_synthetic_steps(trace: MemoryTrace, data: st.DataObject) -> None:
    chain = synthetic_chain(trace, data)
    rows = [
        (
            reference_simulate(trace, chain.node_ranges(p), chain.preserve_rng(p)).peak_bytes
            + chain.offset_bytes,
            recompute_seconds(chain, p),
            tuple(p),
        )
        for p in all_plans(chain.num_stages)
    ]
    minimum = lowest(rows)
    lean = leanest(chain)
    assert (lean.peak_bytes, tuple(lean.segments)) == (minimum[0], minimum[3])
    assert lean.status == "optimal"
    budget = data.draw(st.integers(minimum[0] - 2, max(peak for peak, _, _ in rows) + 2))
    best = cheapest(rows, budget)
    if best is None:
        with pytest.raises(InfeasibleError):
            least_recompute(chain, budget, max_evaluations=data.draw(st.sampled_from([0, 50])))
        return
    got = least_recompute(chain, budget, max_evaluations=data.draw(st.sampled_from([0, 50])))
    assert (got.recompute_seconds, got.peak_bytes, tuple(got.segments)) == (
        best[0],
        best[1],
        best[3],
    )
    assert got.status == "optimal"


# ---------------------------------------------------------------------------------------------
# One rank of a sharded run: the replay plus the plan's rank shift (NOTE [search: per-rank peaks])
# ---------------------------------------------------------------------------------------------


@st.composite
def rank_shifts(
    draw: st.DrawFn, num_stages: int, scale: int = 30, extras: bool = False
) -> RankShift:
    """A single-process stage problem and a rank's: the same activations, other static,
    gradient and transient terms (larger or smaller, as FSDP's windows and shards are).
    ``extras``: maybe with backward-only windows (part of each transient), bytes held into
    a stage's backward and its recomputes, and end and optimizer moments of their own."""
    n = num_stages

    def terms(top: int) -> list[int]:
        return [draw(st.integers(0, top)) for _ in range(n)]

    single = ChainProblem(
        saved_bytes=terms(scale),
        input_bytes=terms(scale),
        forward_seconds=[1.0] * n,
        budget_bytes=0,
        static_bytes=draw(st.integers(0, 3 * scale)),
        param_grad_bytes=terms(scale),
        transient_bytes=terms(scale),
    )
    rank = dataclasses.replace(
        single,
        static_bytes=draw(st.integers(0, 3 * scale)),
        param_grad_bytes=terms(scale),
        transient_bytes=terms(2 * scale),
    )
    if not (extras and draw(st.booleans())):
        return RankShift(rank, single)
    windows = tuple(draw(st.integers(0, t)) for t in rank.transient_bytes)
    units = None
    if draw(st.booleans()):  # FSDP2's units gathered by plan (NOTE [search: gathered units])
        units = UnitGathers(
            tuple(terms(scale)), tuple(terms(scale)), draw(st.integers(0, scale)), scale
        )
    return RankShift(
        rank,
        single,
        windows=windows,
        held=tuple(draw(st.integers(0, w)) for w in windows),
        end_bytes=draw(st.integers(-scale, scale)),
        optimizer_bytes=draw(st.integers(-scale, scale)),
        units=units,
        loss_bytes=draw(st.integers(-scale, scale)),
        backward_start_bytes=draw(st.integers(0, scale)),
    )


def rank_peak(chain: ReplayChain, plan) -> int:
    """A rank's peak written out: every slot of the plan's replayed curve moved by its
    event's difference (NOTE [search: per-rank peaks])."""
    ranges, rng = chain.node_ranges(plan), chain.preserve_rng(plan)
    curve = replayer(chain.trace).timeline(ranges, rng)
    return max(chain.rank_shift.moments(curve, plan, chain.stages)) + chain.offset_bytes


def segment_end(plan, stage: int) -> int:
    return next(end for start, end in plan if start <= stage < end)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_a_rank_differs_from_one_process_by_the_stage_models_difference_at_each_event(
    data: st.DataObject,
) -> None:
    """Each event of the stage model (forward, recompute, backward) of every plan differs
    between the rank's problem and the single one by :meth:`RankShift.difference`, which
    depends on the event only; ``least_bytes`` bounds every difference, the optimizer
    step's included."""
    n = data.draw(st.integers(1, 6))
    shift = data.draw(rank_shifts(n))
    for plan in all_plans(n):
        rank = proxy_simulate(shift.rank, plan).timeline
        single = proxy_simulate(shift.single, plan).timeline
        for (phase, stage, r), (_, _, s) in zip(rank, single, strict=True):
            end = segment_end(plan, stage) if phase == "recompute" else -1
            assert r - s == shift.difference(phase, stage, end)
            assert shift.least_bytes <= r - s
    assert shift.least_bytes <= shift.difference("optimizer", 0)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=st.one_of(chain_like_traces(), synthetic_traces(3, 7)), data=st.data())
def test_search_is_exact_per_rank_on_synthetic_steps(
    trace: MemoryTrace, data: st.DataObject
) -> None:
    """For one rank the search's peaks are the replay's moments each moved by its event's
    difference, and its answers are brute force's under them (the branch and bound's
    bound, the replay's plus ``least_bytes``, stays one)."""
    chain = synthetic_chain(trace, data)
    shift = data.draw(rank_shifts(chain.num_stages, 60, extras=True))
    if shift.windows:  # and a forward's all-gathers, per node
        nodes = trace.num_nodes
        gathering = data.draw(st.lists(st.integers(0, 60), min_size=nodes, max_size=nodes))
        shift = dataclasses.replace(shift, gathering=tuple(gathering))
    chain = dataclasses.replace(chain, rank_shift=shift)
    rows = [
        (rank_peak(chain, p), recompute_seconds(chain, p), tuple(p))
        for p in all_plans(chain.num_stages)
    ]
    assert [replay_peak(chain, p) for _, _, p in rows] == [peak for peak, _, _ in rows]
    for peak, _, p in rows:
        single = reference_simulate(trace, chain.node_ranges(p), chain.preserve_rng(p))
        assert peak >= single.peak_bytes + chain.offset_bytes + chain.rank_shift.least_bytes
    minimum = lowest(rows)
    lean = leanest(chain)
    assert (lean.peak_bytes, tuple(lean.segments)) == (minimum[0], minimum[3])
    assert lean.status == "optimal"
    budget = data.draw(st.integers(minimum[0] - 2, max(peak for peak, _, _ in rows) + 2))
    best = cheapest(rows, budget)
    evaluations = data.draw(st.sampled_from([0, 50]))
    if best is None:
        with pytest.raises(InfeasibleError):
            least_recompute(chain, budget, max_evaluations=evaluations)
        return
    got = least_recompute(chain, budget, max_evaluations=evaluations)
    assert (got.recompute_seconds, got.peak_bytes, tuple(got.segments)) == (
        best[0],
        best[1],
        best[3],
    )
    assert got.status == "optimal"


def fsdp_like(chain: ReplayChain, world_size: int = 8) -> ReplayChain:
    """``chain`` for one rank of a run sharding its parameters ``world_size`` ways, the way
    autockpt/planning/sharding.py changes the stage model: the static part mostly sharded,
    each stage's gradients a shard, a gathered unit's window on every other stage."""
    single = chain.problem
    unit = max(1, single.static_bytes // (8 * single.num_stages))
    rank = dataclasses.replace(
        single,
        static_bytes=single.static_bytes // world_size + 2 * unit,
        param_grad_bytes=tuple(-(-g // world_size) for g in single.param_grad_bytes),
        transient_bytes=tuple(
            t + (2 * unit + unit // world_size) * (k % 2)
            for k, t in enumerate(single.transient_bytes)
        ),
    )
    return dataclasses.replace(chain, rank_shift=RankShift(rank, single))


def test_search_is_exact_per_rank_on_a_recorded_step() -> None:
    """The per-rank leanest plan and least-recompute plans are brute force's under the
    replay plus the shift; a budget at the rank's no-checkpoint peak checkpoints nothing,
    and one below the single process's leanest peak is planned."""
    chain = fsdp_like(recorded("gpt", 8))
    single = dataclasses.replace(chain, rank_shift=None)
    rows = exhaustive(chain)
    minimum = lowest(rows)
    lean = leanest(chain, time_limit_s=None)  # proved, however busy the machine
    assert (lean.peak_bytes, tuple(lean.segments)) == (minimum[0], minimum[3])
    assert lean.status == "optimal"
    eager = replay_peak(chain, [])
    assert eager < leanest(single, time_limit_s=None).peak_bytes  # sharding saves more
    assert least_recompute(chain, eager).segments == []
    for budget in budgets_between(minimum[0], eager):
        best = cheapest(rows, budget)
        got = least_recompute(chain, budget, time_limit_s=None)
        assert (got.recompute_seconds, got.peak_bytes, tuple(got.segments)) == (
            best[0],
            best[1],
            best[3],
        )
        assert got.status == "optimal"


def test_a_recompute_holds_what_its_segments_last_backward_starts_with() -> None:
    """NOTE [sharding: what a reduce-scatter holds]: a segment's recompute runs when the
    backward reaches its last stage, beside what that stage's backward starts with held
    (FSDP2's retained reduce-scatter input of the unit reduced before), and without the
    recomputed stage's own window; a forward, and only a forward, holds its gathering."""
    single = ChainProblem((1, 1, 1), (1, 1, 1), (1.0, 1.0, 1.0), 0)
    rank = dataclasses.replace(single, transient_bytes=(10, 20, 30))
    shift = RankShift(rank, single, windows=(4, 8, 12), held=(1, 2, 3), gathering=(5, 6, 7))
    assert shift.difference("recompute", 0, end=2) == 10 - 4 + 2
    assert shift.difference("recompute", 1, end=3) == 20 - 8 + 3
    assert shift.difference("backward", 1) == 20
    assert shift.difference("forward", 1) == 20 - 8
    assert shift.least_bytes <= min(10 - 4, 20 - 8, 30 - 12)
    # a node's forward holds the all-gathers counted on it (NOTE [sharding: what a forward
    # all-gather holds]); its backward and a recompute do not
    stages = [(0, 1), (1, 2), (2, 3)]
    slots = [("forward", 1, 100), ("backward", 1, 100), ("recompute", 1, 100)]
    moments = shift.moments(slots, [(1, 2)], stages)
    assert moments[0] == 100 + shift.difference("forward", 1) + 6
    assert moments[2] == 100 + shift.difference("recompute", 1, end=2)
    with pytest.raises(ValueError, match="gathering"):
        RankShift(rank, single, gathering=(1,)).moments(slots, [], stages)
    with pytest.raises(ValueError, match="held"):
        RankShift(rank, single, held=(1,))


def test_a_rank_shift_must_keep_the_activations_and_the_stages() -> None:
    chain = recorded("gpt", 10)
    single = chain.problem
    with pytest.raises(ValueError, match="saved and input"):
        RankShift(dataclasses.replace(single, saved_bytes=(0,) * single.num_stages), single)
    shorter = ChainProblem((1,), (0,), (1.0,), 0)
    with pytest.raises(ValueError, match="same stages"):
        RankShift(shorter, single)
    with pytest.raises(ValueError, match="rank_shift"):
        dataclasses.replace(
            chain,
            stages=((0, chain.trace.num_nodes),),
            stage_seconds=(0.0,),
            random=(False,),
            problem=None,
            rank_shift=RankShift(single, single),
        )


# ---------------------------------------------------------------------------------------------
# Large chains: the local search
# ---------------------------------------------------------------------------------------------


def _key_lean(chain: ReplayChain, plan) -> tuple:
    plan = tuple(plan)
    return (replay_peak(chain, plan), recompute_seconds(chain, plan), len(plan), plan)


def test_never_worse_than_its_seeds_on_a_long_chain() -> None:
    """160 stages (far beyond brute force): whatever the seeds, the answer is at least as
    good as each seed that fits, and it is what the replay says."""
    chain = recorded("gpt", 160)
    n = chain.num_stages
    rng = random.Random(1)
    seeds = [
        [(m, m + 1) for m in range(0, n, 2)],  # every other stage
        [(s, min(s + 5, n)) for s in range(0, n, 7)],
        sorted({(s, s + 1) for s in rng.sample(range(n), 30)}),
    ]
    lean = leanest(chain, seeds=seeds, max_evaluations=300, max_nodes=200)
    assert lean.peak_bytes == replay_peak(chain, lean.segments)
    assert lean.recompute_seconds == recompute_seconds(chain, lean.segments)
    got = _key_lean(chain, lean.segments)
    for seed in seeds:
        assert got <= _key_lean(chain, seed)
    assert lean.status in ("optimal", "feasible")
    eager = replay_peak(chain, [])
    budget = (lean.peak_bytes + eager) // 2
    fitting = [s for s in seeds if replay_peak(chain, s) <= budget] + [lean.segments]
    cheap = least_recompute(
        chain, budget, seeds=seeds + [lean.segments], max_evaluations=300, max_nodes=200
    )
    assert cheap.peak_bytes == replay_peak(chain, cheap.segments) <= budget
    for seed in fitting:
        assert cheap.recompute_seconds <= recompute_seconds(chain, seed)


@pytest.mark.parametrize("name,max_stages", [("gpt", 160), ("resnet", 40)])
def test_the_rungs_it_skips_would_not_change_the_answer(name: str, max_stages: int) -> None:
    """NOTE [search: the rungs a search needs]: with every rung of dp's ladder given as a
    seed, the leanest plan and the least-recompute plans at budgets between it and no
    checkpointing are the ones found from the rungs the search climbs or bisects to, and
    the search solved fewer rungs than the ladder holds."""
    from solvers import search

    chain = recorded(name, max_stages)
    kwargs = dict(max_evaluations=300, max_nodes=200)
    search._ladder.cache_clear()
    lean = leanest(chain, **kwargs)
    ladder = search._ladder(chain.problem)
    solved = len(ladder.plans)
    assert solved < len(ladder.rungs())
    every = [ladder.plan(rung) for rung in ladder.rungs()]
    assert leanest(chain, seeds=every, **kwargs).segments == lean.segments
    eager = replay_peak(chain, [])
    for k in (1, 3, 6):
        budget = lean.peak_bytes + (eager - lean.peak_bytes) * k // 8
        search._ladder.cache_clear()
        found = least_recompute(chain, budget, seeds=[lean.segments], **kwargs)
        assert len(search._ladder(chain.problem).plans) < len(ladder.rungs())
        seeded = least_recompute(chain, budget, seeds=[lean.segments, *every], **kwargs)
        assert found.segments == seeded.segments


def test_deterministic() -> None:
    """Same inputs, same plan: twice, with the seeds in another order, on a new chain
    object (a fresh replayer)."""
    chain = recorded("gpt", 160)
    n = chain.num_stages
    seeds = [[(m, m + 1) for m in range(0, n, 3)], [(0, n // 2)], [(n // 2, n)]]
    kwargs = dict(max_evaluations=150, max_nodes=100)
    first = leanest(chain, seeds=seeds, **kwargs)
    again = leanest(chain, seeds=list(reversed(seeds)), **kwargs)
    copy = ReplayChain(
        trace=MemoryTrace(**{f: getattr(chain.trace, f) for f in chain.trace.__dataclass_fields__}),
        stages=chain.stages,
        stage_seconds=chain.stage_seconds,
        random=chain.random,
        segment_overhead_seconds=chain.segment_overhead_seconds,
        offset_bytes=chain.offset_bytes,
        problem=chain.problem,
    )
    fresh = leanest(copy, seeds=[seeds[1], seeds[2], seeds[0]], **kwargs)
    assert first.segments == again.segments == fresh.segments
    budget = (first.peak_bytes + replay_peak(chain, [])) // 2
    plans = {
        tuple(least_recompute(c, budget, seeds=s, **kwargs).segments)
        for c, s in ((chain, seeds), (chain, seeds[::-1]), (copy, seeds[1:] + seeds[:1]))
    }
    assert len(plans) == 1


# ---------------------------------------------------------------------------------------------
# Contract details
# ---------------------------------------------------------------------------------------------


def test_chain_validation() -> None:
    chain = recorded("gpt", 10)
    with pytest.raises(ValueError, match="contiguous"):
        ReplayChain(chain.trace, ((0, 3), (4, chain.trace.num_nodes)), (0.0, 0.0), (False,) * 2)
    with pytest.raises(ValueError, match="cover"):
        ReplayChain(chain.trace, ((0, 3),), (0.0,), (False,))
    with pytest.raises(ValueError, match="one entry per stage"):
        ReplayChain(chain.trace, chain.stages, chain.stage_seconds[:-1], chain.random)
    with pytest.raises(ValueError, match="sorted and disjoint"):
        replay_peak(chain, [(2, 4), (0, 1)])


def test_count_plans_counts_the_plans() -> None:
    assert [count_plans(n) for n in range(7)] == [sum(1 for _ in all_plans(n)) for n in range(7)]


def test_solution_numbers_are_the_replays() -> None:
    chain = recorded("resnet", 8)
    lean = solvers.leanest(chain)
    assert isinstance(lean, solvers.Solution)
    assert lean.peak_bytes == solvers.replay_peak(chain, lean.segments)
    assert (
        lean.peak_bytes
        == simulate(
            chain.trace, chain.node_ranges(lean.segments), chain.preserve_rng(lean.segments)
        ).peak_bytes
        + chain.offset_bytes
    )
    assert math.isclose(
        lean.recompute_seconds,
        sum(chain.stage_seconds[m] for a, b in lean.segments for m in range(a, b))
        + chain.segment_overhead_seconds * len(lean.segments),
    )
    assert isinstance(replayer(chain.trace), Replayer)
