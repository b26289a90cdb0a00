"""The plan simulator: replay one training step's allocations under any checkpoint plan.

Why a replay of recorded allocations rather than a formula
----------------------------------------------------------
The budget is what the allocator reports (``max_memory_allocated`` on CUDA, the profiler's
allocator events on CPU). Between the tensors a graph names there are many the graph does not
name: gradient buffers flowing between nodes, a gradient summed from two users, a kernel's
workspace, the loss's own temporaries, parameter gradients that ``AccumulateGrad`` creates in
backward order. A stage-level formula guesses them; the recording stage
(``autockpt/record.py``) captures them once, and this module reschedules exactly the
allocations a plan moves:

* **record** (``autockpt.record.record_trace``): the graph runs node by node on fake tensors
  (exact sizes, aliasing and lifetimes, no data) under a storage tracker, and the kernel
  workspaces and hidden saved bytes a probe measured on the device node by node are added to
  each node's windows. Every event belongs to a *window*: the forward of node ``i``, the
  loss, or the backward of node ``i`` (backward functions are mapped to the node that created
  them through autograd sequence numbers). Per node the recorder also notes which
  allocations it reads, returns and hands to autograd (``saved_tensors_hooks``), and where
  its last save happens (the recompute's early stop).
* **replay** (:func:`simulate`): under non-reentrant ``torch.utils.checkpoint`` semantics a
  plan changes these things, and only these are rescheduled:

  1. A tensor made in the forward that eager keeps for backward is now freed at the latest of
     its remaining reasons to live: its last forward use, the backward of a *kept* node that
     saves it, the backward of a segment it enters (the checkpoint keeps a segment's inputs
     for the recompute), or its eager free when something the graph does not name holds it
     (a model output the loss holds, a tensor the model keeps past the step, such as a
     buffer it built) or no node saves it. Saves by nodes inside a segment no longer hold it.
  2. Before the first backward window of a segment, the segment's forward allocations are
     replayed (the recompute) up to the segment's last save for backward, where the
     checkpoint stops recomputing (early stop) and the recompute's temporaries die. A
     recomputed tensor that a segment node saves lives until the backward formula that used
     it last lets go of it (``MemoryTrace.unpacked``; without it, where eager freed the
     original); an output of the segment (read after it, or the graph's) is held by the
     segment's code until the recompute stops or ends; the others die after their last use
     inside the recompute.
  3. Only nodes that save hold a checkpoint: its frame (its inputs, its stashes) lives
     while a tensor one of them saved does, to the end of their backward, and it recomputes
     at the first of their backward windows. A segment whose nodes save nothing (an
     addition, a block run without gradients) keeps nothing past its forward and never
     recomputes.
  4. Everything else (gradients, loss, parameter gradients, workspaces) happens as in eager.
  5. Selective recompute: a node *kept* inside its segment (``saved``; its one allocating
     operator returns ``MUST_SAVE`` to the checkpoint's selective policy) is not run by the
     recompute. What its operator made (and what the node hands to autograd) is the
     forward's own tensor, alive from the forward until the recomputed copy would have died
     (or, if the recompute stops before it, until the checkpoint's frame dies); its other
     forward allocations (workspaces) are not made again.

  The peak is the static part (parameters, buffers, inputs) plus the highest running sum.

The replay is exact for what it moves and keeps everything else as recorded, so its error is
limited to effects it ignores: the checkpoint's own bookkeeping (a few bytes per segment)
and allocator behaviour that depends on the order of frees (caching on CUDA). A segment's
stashes (its RNG state, snapshots of the buffers it restores) are counted
(``preserve_rng``). docs/memory.md lists the measured accuracy. On the meta device no
probe runs: kernel workspaces are unknown, so meta-device plans are memory-exact only for
the tensors operators return.

Speed
-----
A plan search replays one trace hundreds of times, so what no plan changes is computed once
per trace (:class:`Replayer`, cached per trace by :func:`replayer`): every timeline position
as one integer, the points of allocations no plan moves, per allocation its readers and
savers as flat arrays. A plan then costs a few dozen numpy passes over the allocations the
forward makes: about 0.15 ms on a 600-event step and 0.8 ms on a 16,000-event one for the
peak alone (:meth:`Replayer.peak_bytes`), against 1.2 ms and 49 ms for the tuple-and-sort
replay this replaced; :func:`simulate` and :func:`timeline` return the same numbers as that
replay, byte for byte (``tests/test_search.py`` keeps it as the reference).
:meth:`Replayer.lower_bound_bytes` bounds the peak of every plan that begins with a given
prefix, which lets :mod:`solvers.search` prove plans optimal.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "MemoryTrace",
    "OpCall",
    "PlanSimulation",
    "Replayer",
    "Window",
    "replayer",
    "simulate",
    "timeline",
]

PROLOGUE, FORWARD, LOSS, BACKWARD = "prologue", "forward", "loss", "backward"
OPTIMIZER = "optimizer"
"""The optimizer's step after the last backward (node -1): no plan moves what it makes, and
the gradients it reads are alive; a training iteration's peak may fall there."""


@dataclass(frozen=True)
class Window:
    """A stretch of the eager step: ``phase`` is prologue, forward, loss, backward or
    optimizer; ``node`` is the compute node's index (-1 for the loss, for backward functions
    of the loss and for the optimizer's step)."""

    phase: str
    node: int


@dataclass(frozen=True)
class OpCall:
    """One operator a node's forward called (that returned a tensor), as recorded:
    ``name`` (``"aten.mm.default"``), the allocations it made, whether it draws random
    numbers (``seeded``), and the allocations it wrote to (in place, ``out=``). Selective
    recompute keeps an operator's output by naming its ``(name, ordinal)`` within a segment
    (:mod:`solvers.selective`), and must know which outputs are safe to keep."""

    name: str
    allocations: tuple[int, ...] = ()
    seeded: bool = False
    writes: tuple[int, ...] = ()


@dataclass(frozen=True)
class MemoryTrace:
    """One eager training step as allocation events, attributed to the graph's nodes.

    ``events`` holds ``(allocation, window)`` pairs in time order: the first occurrence of an
    allocation id is its allocation, the second its free. ``sizes[a]`` is the bytes of
    allocation ``a``. Per compute node: the allocations it reads (``reads``), returns
    (``outputs``) and saves for backward (``saved``). ``output_allocations`` are those of the
    graph's output. ``static_bytes`` is what is alive before the step starts (parameters,
    buffers, inputs, and what ``resident`` names). ``source`` is ``"allocator"`` (profiler
    events) or ``"storages"`` (meta-device storage tracker: no kernel workspaces).
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
    unpacked: tuple[tuple[int, int, int], ...] = ()
    """``(allocation, window, event)``: where the last backward formula that used the saved
    allocation was done with it, in ``window`` right before ``event`` (the number of events
    before it). A checkpoint's recomputed copy dies there; eager keeps the original until
    its autograd node releases what it saved, after the engine has reduced the gradients
    the formula returned (a bias gradient summed over the batch)."""
    buffer_bytes: tuple[tuple[str, int], ...] = ()
    """``(name, bytes)`` of every buffer as the step leaves it. A forward may replace a
    buffer (a table built on the first call), and a checkpoint snapshots the buffers it
    restores as it finds them: the caller sizes those stashes (``preserve_rng`` as bytes)
    from this, not from the buffer before the step. Not replayed itself."""
    forward_ops: tuple[tuple[OpCall, ...], ...] = ()
    """Per compute node, the operators its forward called, in order (empty: not recorded;
    then no node can be kept inside a segment)."""
    resident: tuple[tuple[str, int], ...] = ()
    """``(what, bytes)`` the static part holds besides parameters, buffers and inputs: the
    optimizer's state of a training iteration from steady state, the gradients micro-batches
    after the first accumulate into. Already in ``static_bytes``; named for reports."""

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


def simulate(
    trace: MemoryTrace,
    segments: Sequence[tuple[int, int]],
    preserve_rng: Sequence[bool] | None = None,
    saved: Sequence[Sequence[int]] | None = None,
) -> PlanSimulation:
    """Replay ``trace`` with the given checkpointed node ranges ``[first, stop)`` (disjoint,
    within the graph's compute nodes) and return the predicted peak.

    ``preserve_rng[k]`` says that segment ``k`` stashes the RNG state (it has random ops):
    the checkpoint then holds one state tensor from its forward to the end of its backward
    and another while it recomputes (``trace.rng_state_bytes`` each). An int instead of a
    bool is the bytes segment ``k`` stashes that way (its RNG state and the snapshots of
    the buffers it restores).

    ``saved[k]`` lists nodes of segment ``k`` whose operator outputs the checkpoint keeps
    from the forward instead of recomputing them (selective recompute, rule 5)."""
    return replayer(trace).simulate(segments, preserve_rng, saved)


def timeline(
    trace: MemoryTrace,
    segments: Sequence[tuple[int, int]],
    preserve_rng: Sequence[bool] | None = None,
    saved: Sequence[Sequence[int]] | None = None,
) -> list[tuple[str, int, int]]:
    """The same replay as :func:`simulate`, as a curve: ``(phase, node, peak bytes)`` for
    every slot of the plan's step in time order, where ``phase`` is ``prologue``,
    ``forward``, ``loss``, ``recompute`` (``node`` = the segment's first node) or
    ``backward``, and bytes include the static part. Its maximum is ``simulate``'s peak."""
    return replayer(trace).timeline(segments, preserve_rng, saved)


def held_after_forward(
    trace: MemoryTrace,
    segments: Sequence[tuple[int, int]],
    preserve_rng: Sequence[bool] | None = None,
    saved: Sequence[Sequence[int]] | None = None,
) -> int:
    """:meth:`Replayer.held_after_forward` of ``trace``'s replayer."""
    return replayer(trace).held_after_forward(segments, preserve_rng, saved)


_REPLAYERS: dict[int, Replayer] = {}


def replayer(trace: MemoryTrace) -> Replayer:
    """The :class:`Replayer` of ``trace``: built on first use, kept while the trace lives
    (a search replays one trace hundreds of times; the plan-independent part is paid once)."""
    found = _REPLAYERS.get(id(trace))
    if found is None:
        found = Replayer(trace)
        _REPLAYERS[id(trace)] = found
        weakref.finalize(trace, _REPLAYERS.pop, id(trace), None)
    return found


_I64 = np.int64
_NO_WINDOW = np.iinfo(np.int64).max // 4  # "no backward window" in a minimum


def _group(owners: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(starts, owners)`` of the runs of equal values in sorted ``owners`` (for reduceat)."""
    if len(owners) == 0:
        return np.zeros(0, _I64), np.zeros(0, _I64)
    starts = np.flatnonzero(np.r_[True, owners[1:] != owners[:-1]])
    return starts, owners[starts]


def _group_max(values: np.ndarray, group: tuple[np.ndarray, np.ndarray], size: int) -> np.ndarray:
    """Per owner the largest of its values, ``-1`` for owners without any."""
    out = np.full(size, -1, _I64)
    starts, owners = group
    if len(starts):
        out[owners] = np.maximum.reduceat(values, starts)
    return out


@dataclass(frozen=True)
class _Layout:
    """Where a plan puts things: eager positions shifted by the recompute slots inserted
    before them (``shift`` per eager window), and each recompute slot's block of positions."""

    total: int
    shift: np.ndarray  # per eager window: positions of recompute blocks at or before it
    blocks: np.ndarray  # segments with a recompute slot, in time order
    block_window: np.ndarray  # the eager window each of those blocks precedes
    block_size: np.ndarray


class Replayer:
    """The replay of one trace, with everything no plan changes computed once.

    The rules are those of the module docstring. A timeline position ``(slot, order)`` is
    mapped to one integer: eager window ``w`` owns the positions ``-1`` (before anything),
    its events in order, and "after its last event"; a recompute slot owns a block with
    ``-1``, every event and every half step between the first and last event of its
    segment's forward windows, and ``+inf``. A plan shifts the eager positions by the
    blocks inserted before them, which keeps the order of ``(slot, order)`` pairs. Every
    allocation is then a ``+size`` and a ``-size`` at two integers; the running sum is one
    cumulative sum.

    :meth:`peak_bytes` sums on a dense axis (allocation positions are unique, so the
    highest prefix sum is the peak); :meth:`simulate` and :meth:`timeline` sort the points
    by position and then by the order the rules list them, exactly as the replay is
    defined, so that their every number, not only the peak, is the replay's."""

    def __init__(self, trace: MemoryTrace) -> None:
        n = self.num_nodes = trace.num_nodes
        windows = self.windows = trace.windows
        nw = len(windows)
        self.static_bytes = trace.static_bytes
        self.rng_state_bytes = trace.rng_state_bytes
        events = trace.events
        ne = len(events)
        ev_w = np.fromiter((w for _, w in events), dtype=_I64, count=ne)
        phases = [win.phase for win in windows]
        w_node = np.fromiter((win.node for win in windows), dtype=_I64, count=nw)
        w_fwd = np.array([p == FORWARD for p in phases], dtype=bool)
        w_bwd = np.array([p == BACKWARD for p in phases], dtype=bool)
        self._w_fclass = np.array([p in (PROLOGUE, FORWARD, LOSS) for p in phases], dtype=bool)
        if ne and (ev_w.min() < 0 or ev_w.max() >= nw):
            raise ValueError("an event names a window the trace does not have")
        if np.any(w_fwd & ((w_node < 0) | (w_node >= n))):
            raise ValueError("a forward window names a node outside the compute nodes")
        if np.any(w_bwd & (w_node >= n)):
            raise ValueError("a backward window names a node outside the compute nodes")

        # Eager positions: per window "-1", its events in order, "after the last event".
        count = np.bincount(ev_w, minlength=nw).astype(_I64)
        width = count + 2
        woff = np.zeros(nw, _I64)
        if nw:
            woff[1:] = np.cumsum(width)[:-1]
        first_of = np.zeros(nw, _I64)
        if nw:
            first_of[1:] = np.cumsum(count)[:-1]
        order = np.argsort(ev_w, kind="stable")
        at = np.empty(ne, _I64)
        at[order] = woff[ev_w[order]] + 1 + np.arange(ne, dtype=_I64) - first_of[ev_w[order]]
        end = woff + 1 + count  # end_of(w): right after the window's last event
        self._woff, self._end, self._dense = woff, end, int(width.sum())
        self._win_of_dense = np.repeat(np.arange(nw, dtype=_I64), width)
        last_event = np.full(nw, -1, _I64)
        np.maximum.at(last_event, ev_w, np.arange(ne, dtype=_I64))

        # Per node: its forward window, first/last backward window, forward event range.
        fwd_window = np.full(n + 1, -1, _I64)
        bwd_first = np.full(n + 1, _NO_WINDOW, _I64)
        bwd_last = np.full(n + 1, -1, _I64)
        for w in range(nw):
            node = int(w_node[w])
            if w_fwd[w]:
                fwd_window[node] = w
            elif w_bwd[w] and node >= 0:
                bwd_first[node] = min(int(bwd_first[node]), w)
                bwd_last[node] = max(int(bwd_last[node]), w)
        fwd_lo = np.full(n + 1, _NO_WINDOW, _I64)
        fwd_hi = np.full(n + 1, -1, _I64)
        fwd_events = np.flatnonzero(w_fwd[ev_w]) if ne else np.zeros(0, _I64)
        np.minimum.at(fwd_lo, w_node[ev_w[fwd_events]], fwd_events)
        np.maximum.at(fwd_hi, w_node[ev_w[fwd_events]], fwd_events)
        last_pack = np.full(n + 1, -1, _I64)
        packs = np.asarray(trace.last_pack[:n], dtype=_I64)
        last_pack[: len(packs)] = packs
        self._fwd_window, self._bwd_first, self._bwd_last = fwd_window, bwd_first, bwd_last
        self._fwd_lo, self._fwd_hi, self._last_pack = fwd_lo, fwd_hi, last_pack
        # A checkpoint's frame (its inputs, its stashes) lives while a tensor one of its
        # nodes saved does, and it recomputes at the first unpack: only the backward
        # windows of nodes that save count for a segment (rule 3). Unknown saves: all may.
        saves = np.ones(n + 1, bool)
        if trace.last_pack:
            saves[:n] = [
                (i < len(packs) and packs[i] >= 0) or bool(trace.saved[i]) for i in range(n)
            ]
        self._save_bwd_first = np.where(saves, bwd_first, _NO_WINDOW)
        self._save_bwd_last = np.where(saves, bwd_last, -1)
        end_last_bwd = np.where(bwd_last >= 0, end[np.maximum(bwd_last, 0)], -1) if nw else bwd_last

        # Allocations in the order the rules list them (first occurrence).
        alloc_event: dict[int, int] = {}
        free_event: dict[int, int] = {}
        for e, (a, _) in enumerate(events):
            if a in alloc_event:
                free_event[a] = e
            else:
                alloc_event[a] = e
        ids = list(alloc_event)
        na = self._num_allocations = len(ids)
        a_e = np.fromiter(alloc_event.values(), dtype=_I64, count=na)
        a_f = np.fromiter((free_event.get(a, -1) for a in ids), dtype=_I64, count=na)
        sizes = trace.sizes
        a_size = np.fromiter((sizes[a] for a in ids), dtype=_I64, count=na)
        a_wm = ev_w[a_e]
        a_wf = np.where(a_f >= 0, ev_w[np.maximum(a_f, 0)], -1) if na else a_f
        made_fwd = w_fwd[a_wm] if na else np.zeros(0, bool)
        freed = a_f >= 0
        a_at_free = np.where(freed, at[np.maximum(a_f, 0)], -1) if na else a_f

        # Plan-independent points: every allocation, and the free of what the forward did
        # not make. Ranks follow the order the rules list points (alloc, recomputed copy's
        # alloc and free, free; RNG stashes last): ties in position keep that order.
        rank = 4 * np.arange(na, dtype=_I64)
        other = np.flatnonzero(~made_fwd & freed)
        self._base_pos = np.concatenate((at[a_e], a_at_free[other]))
        self._base_delta = np.concatenate((a_size, -a_size[other]))
        self._base_rank = np.concatenate((rank, rank[other] + 3))
        self._base = np.zeros(self._dense, _I64)
        np.add.at(self._base, self._base_pos, self._base_delta)

        # Forward-made allocations: what the plan reschedules.
        fa = np.flatnonzero(made_fwd)
        nf = self._nf = len(fa)
        producer = w_node[a_wm[fa]]
        wf = a_wf[fa]
        freed_bwd = (wf >= 0) & w_bwd[np.maximum(wf, 0)]
        self._f_rank = rank[fa]
        self._f_size = a_size[fa]
        self._f_event = a_e[fa]
        self._f_producer = producer
        self._f_free = a_at_free[fa]  # eager free position, -1: never freed
        # Where the last backward formula using it let go of it (rule 2): a recomputed copy
        # dies there, no later than eager freed the original.
        unpack_end: dict[int, int] = {}
        for a, w, e in trace.unpacked:
            if not 0 <= w < nw:
                raise ValueError("an unpack names a window the trace does not have")
            inside = 0 <= e < ne and ev_w[e] == w
            unpack_end[a] = int(at[e]) if inside else int(end[w])
        ends = np.fromiter((unpack_end.get(ids[i], -1) for i in fa.tolist()), _I64, count=len(fa))
        self._f_copy_free = np.where(
            (ends >= 0) & (self._f_free >= 0), np.minimum(ends, self._f_free), self._f_free
        )
        self._f_in_forward_free = (wf >= 0) & ~freed_bwd  # freed before backward
        freed_fwd = (wf >= 0) & w_fwd[np.maximum(wf, 0)]
        self._f_freed_node = np.where(freed_fwd, w_node[np.maximum(wf, 0)], n)  # n: sentinel
        self._f_free_event = a_f[fa]
        self._f_free_window_start = np.where(wf >= 0, woff[np.maximum(wf, 0)], -1)
        # Rule 5: what a kept operator made (or its node hands to autograd) stays from the
        # forward; the rest of that node's forward allocations (workspaces) is not made again.
        made_by_ops: list[set[int]] = [set() for _ in range(n + 1)]
        for i, ops in enumerate(trace.forward_ops[:n]):
            for op in ops:
                made_by_ops[i].update(op.allocations)
            made_by_ops[i].update(trace.saved[i])
        self._f_op_made = np.fromiter(
            (ids[i] in made_by_ops[p] for i, p in zip(fa.tolist(), producer.tolist(), strict=True)),
            dtype=bool,
            count=len(fa),
        )

        savers: dict[int, list[int]] = {}
        for i, allocations in enumerate(trace.saved):
            for a in allocations:
                savers.setdefault(a, []).append(i)
        readers: dict[int, list[int]] = {}
        for i, allocations in enumerate(trace.reads):
            for a in allocations:
                readers.setdefault(a, []).append(i)
        outputs = set(trace.output_allocations)
        keep_eager = np.zeros(nf, bool)  # a graph output, nothing saves it, or it outlives the step
        last_reader_end = np.full(nf, -1, _I64)
        last_reader = np.full(nf, -1, _I64)  # its last reader, a graph output: n
        held_owner: list[int] = []
        held_node: list[int] = []
        saver_owner: list[int] = []
        saver_node: list[int] = []
        reader_owner: list[int] = []
        reader_node: list[int] = []
        for x, i in enumerate(fa.tolist()):
            a, p = ids[i], int(producer[x])
            reading, saving = readers.get(a, []), savers.get(a, [])
            keep_eager[x] = a in outputs or not saving or a not in free_event
            later = [j for j in reading if j >= p]
            last = max([p, *later])
            last_reader[x] = n if a in outputs else last
            w = int(fwd_window[last])
            last_reader_end[x] = end[w] if w >= 0 else -2
            both = reading + saving
            held_owner += [x] * len(both)
            held_node += both
            saver_owner += [x] * len(saving)
            saver_node += saving
            reader_owner += [x] * len(later)
            reader_node += later
        self._f_keep_eager = keep_eager
        self._f_last_reader_end = last_reader_end
        self._f_last_reader = last_reader
        self._held_owner = np.asarray(held_owner, _I64)
        self._held_node = np.asarray(held_node, _I64)
        self._held_group = _group(self._held_owner)
        s_owner = self._saver_owner = np.asarray(saver_owner, _I64)
        s_node = self._saver_node = np.asarray(saver_node, _I64)
        self._saver_group = _group(s_owner)
        # The saver whose backward freed it in eager: that free; another kept saver: the end
        # of its backward (if it has one).
        freer = (
            (wf[s_owner] >= 0) & freed_bwd[s_owner] & (w_node[np.maximum(wf[s_owner], 0)] == s_node)
        )
        self._saver_freer = freer
        # The freeing saver's copy surely exists when checkpointed with its producer: its
        # last save comes after the allocation (or no recompute ever stops early).
        copied = (last_pack[s_node] > a_e[fa][s_owner]) | bool(np.all(last_pack < 0))
        self._saver_holds_late = freer & copied
        self._saver_end = end_last_bwd[s_node]
        self._saver_kept_reason = np.where(freer, self._f_free[s_owner], end_last_bwd[s_node])
        self._reader_owner = np.asarray(reader_owner, _I64)
        self._reader_node = np.asarray(reader_node, _I64)
        self._reader_group = _group(self._reader_owner)
        fw_last = (
            np.where(fwd_window >= 0, last_event[np.maximum(fwd_window, 0)], -1)
            if nw
            else np.full(len(fwd_window), -1, _I64)
        )
        self._last_event_of_forward = fw_last if nw else fwd_window
        self._window_phase = [(win.phase, win.node) for win in windows]
        self._f_freed = np.flatnonzero(self._f_free >= 0)
        empty = np.zeros(0, _I64)
        self._no_blocks = _Layout(self._dense, np.zeros(nw, _I64), empty, empty, empty)
        self._segment_facts: dict[tuple[int, int], tuple[int, ...]] = {}

    # -- public -----------------------------------------------------------------------------

    def peak_bytes(
        self,
        segments: Sequence[tuple[int, int]],
        preserve_rng: Sequence[bool] | None = None,
        saved: Sequence[Sequence[int]] | None = None,
    ) -> int:
        """``simulate(trace, segments, preserve_rng, saved).peak_bytes``, faster (no sort)."""
        return self._dense_peak(self._points(segments, preserve_rng, self.num_nodes, False, saved))

    def lower_bound_bytes(
        self,
        segments: Sequence[tuple[int, int]],
        decided: int,
        preserve_rng: Sequence[bool] | None = None,
    ) -> int:
        """A lower bound on the peak of every plan that checkpoints at least one range and,
        on the nodes ``[0, decided)``, exactly ``segments`` (which lie there), whatever it
        does with the nodes from ``decided`` on.

        Why it is one: such a plan holds every allocation this replay holds (a subset of
        its points: the undecided part's recomputes are left out) at the same positions,
        and frees each no earlier, because every reason to keep an allocation that this
        replay counts is one the plan has too: kept savers and entered segments among the
        decided nodes, the last forward reader. With nothing undecided it is the peak."""
        if not 0 <= decided <= self.num_nodes:
            raise ValueError(f"decided must be within 0..{self.num_nodes}, got {decided}")
        for first, stop in segments:
            if stop > decided:
                raise ValueError(f"segment [{first}, {stop}) reaches past node {decided}")
        return self._dense_peak(self._points(segments, preserve_rng, decided, False))

    def simulate(
        self,
        segments: Sequence[tuple[int, int]],
        preserve_rng: Sequence[bool] | None = None,
        saved: Sequence[Sequence[int]] | None = None,
    ) -> PlanSimulation:
        """:func:`simulate` on this trace."""
        points = self._points(segments, preserve_rng, self.num_nodes, True, saved)
        _, cur, slot_of, slot_phase, slot_fclass = self._sorted(points)
        fclass = slot_fclass[slot_of]
        static = self.static_bytes
        peak, peak_slot = 0, 0
        if len(cur):
            top = int(cur.max())
            if top > 0:
                peak, peak_slot = top, int(slot_of[int(np.argmax(cur))])
        forward = int(cur[fclass].max()) if fclass.any() else 0
        backward = int(cur[~fclass].max()) if (~fclass).any() else 0
        phase, node = slot_phase[peak_slot] if peak_slot < len(slot_phase) else (FORWARD, 0)
        return PlanSimulation(
            peak_bytes=static + peak,
            peak_phase=phase,
            peak_node=node,
            forward_peak_bytes=static + max(0, forward),
            backward_peak_bytes=static + max(0, backward),
        )

    def timeline(
        self,
        segments: Sequence[tuple[int, int]],
        preserve_rng: Sequence[bool] | None = None,
        saved: Sequence[Sequence[int]] | None = None,
    ) -> list[tuple[str, int, int]]:
        """:func:`timeline` on this trace."""
        points = self._points(segments, preserve_rng, self.num_nodes, True, saved)
        _, cur, slot_of, slot_phase, _ = self._sorted(points)
        slots = len(slot_phase)
        top = np.full(slots, np.iinfo(_I64).min, _I64)
        np.maximum.at(top, slot_of, cur)
        last = np.searchsorted(slot_of, np.arange(slots), side="right") - 1
        live_end = np.where(last >= 0, cur[np.maximum(last, 0)] if len(cur) else 0, 0)
        entry = np.r_[0, live_end[:-1]] if slots else live_end
        peaks = np.maximum(entry, top) + self.static_bytes
        return [
            (phase, node, int(b))
            for (phase, node), b in zip(slot_phase, peaks.tolist(), strict=True)
        ]

    def held_after_forward(
        self,
        segments: Sequence[tuple[int, int]],
        preserve_rng: Sequence[bool] | None = None,
        saved: Sequence[Sequence[int]] | None = None,
    ) -> int:
        """Bytes above the static part still live when the forward's last window ends
        (before the loss): what the step keeps for its backward, its output included.
        A unit of a larger step holds this while later units run
        (:mod:`solvers.units`)."""
        points = self._points(segments, preserve_rng, self.num_nodes, True, saved)
        _, cur, slot_of, slot_phase, _ = self._sorted(points)
        forward = [k for k, (phase, _) in enumerate(slot_phase) if phase in ("prologue", "forward")]
        if not forward or len(cur) == 0:
            return 0
        last = int(np.searchsorted(slot_of, forward[-1], side="right")) - 1
        return int(cur[last]) if last >= 0 else 0

    def recomputed_nodes(self, first: int, stop: int) -> np.ndarray:
        """Per node of the segment ``[first, stop)``, does its recompute run the node's
        forward again (the segment recomputes at all, and the node's first event comes
        before the early stop)? Only those are worth keeping (rule 5)."""
        _, _, early, _, size, _, _ = self._facts(first, stop)
        lo = self._fwd_lo[first:stop]
        if size == 0:
            return np.zeros(stop - first, bool)
        return (lo < _NO_WINDOW) & ((early < 0) | (lo < early))

    # -- the rules, vectorised ----------------------------------------------------------------

    def _validate(self, segments: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        n = self.num_nodes
        segs = [(int(first), int(stop)) for first, stop in segments]
        previous = 0
        for first, stop in segs:
            if not previous <= first < stop <= n:
                break
            previous = stop
        else:
            return segs  # sorted, disjoint, inside: the common case
        segment_of = [-1] * n  # the first fault in the order a loop would meet it
        for k, (first, stop) in enumerate(segs):
            if not 0 <= first < stop <= n:
                raise ValueError(f"segment [{first}, {stop}) is outside the {n} compute nodes")
            for i in range(first, stop):
                if segment_of[i] != -1:
                    raise ValueError(f"segments overlap at node {i}")
                segment_of[i] = k
        return segs

    def _facts(self, first: int, stop: int) -> tuple[int, ...]:
        """What the rules need of segment ``[first, stop)``: the first backward window and
        the end of the backward of its saving nodes (-1: none; rule 3), where its recompute
        stops (-1: never early), the first event of its forward, its recompute block's size
        (0: no recompute), the last event of its forward and the end of its forward."""
        found = self._segment_facts.get((first, stop))
        if found is None:
            last_bwd = int(self._save_bwd_last[first:stop].max())
            hi = int(self._fwd_hi[first:stop].max())
            lo = int(self._fwd_lo[first:stop].min()) if hi >= 0 else 0
            last_fwd = int(self._fwd_window[first:stop].max())
            found = (
                int(self._save_bwd_first[first:stop].min()) if last_bwd >= 0 else -1,
                int(self._end[last_bwd]) if last_bwd >= 0 else -1,
                int(self._last_pack[first:stop].max()),
                lo,
                2 * (hi - lo) + 4 if last_bwd >= 0 else 0,
                hi,
                int(self._end[last_fwd]) if last_fwd >= 0 else -1,
            )
            self._segment_facts[(first, stop)] = found
        return found

    def _saved_nodes(
        self, saved: Sequence[Sequence[int]] | None, segs: Sequence[tuple[int, int]]
    ) -> np.ndarray | None:
        """Per node (and a sentinel), is it kept inside its segment (rule 5)? None: none is."""
        if not saved or not any(len(nodes) for nodes in saved):
            return None
        if len(saved) != len(segs):
            raise ValueError(f"saved has {len(saved)} entries for {len(segs)} segments")
        kept = np.zeros(self.num_nodes + 1, bool)
        for (first, stop), nodes in zip(segs, saved, strict=True):
            for node in nodes:
                if not first <= int(node) < stop:
                    raise ValueError(f"kept node {node} is outside its segment [{first}, {stop})")
                kept[int(node)] = True
        return kept

    def _points(
        self,
        segments: Sequence[tuple[int, int]],
        preserve_rng: Sequence[bool] | None,
        decided: int,
        ranks: bool,
        saved: Sequence[Sequence[int]] | None = None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, _Layout, tuple[tuple[int, int], ...]]:
        """The plan's points besides the plan-independent ones: (combined position, bytes,
        rank or None), the layout, and the segments as ints."""
        segs = self._validate(segments)
        n, count = self.num_nodes, len(segs)
        nf = self._nf
        woff = self._woff
        kept_node = self._saved_nodes(saved, segs)
        if kept_node is not None and decided < n:
            raise ValueError("kept nodes need a decided plan (no lower bounds with them)")
        if not count and decided == n:  # eager: every free where it was
            keep = self._f_freed
            rank = self._f_rank[keep] + 3 if ranks else None
            return self._f_free[keep], -self._f_size[keep], rank, self._no_blocks, segs

        # Segment of every node (-1: kept or undecided), and per segment what the rules use.
        firsts = np.fromiter((f for f, _ in segs), dtype=_I64, count=count)
        stops = np.fromiter((s for _, s in segs), dtype=_I64, count=count)
        mark = np.zeros(n + 1, _I64)
        tags = np.arange(1, count + 1, dtype=_I64)
        np.add.at(mark, firsts, tags)
        np.add.at(mark, stops, -tags)
        segment_of = np.cumsum(mark)[:n] - 1
        facts = np.array([self._facts(f, s) for f, s in segs], dtype=_I64).reshape(count, 7)
        # Per segment, index -1 (no segment) is a sentinel row.
        seg_first_bwd, seg_end, seg_stop, seg_lo, seg_size, seg_hi, seg_fwd_end = np.vstack(
            (facts, (-1, -1, -1, 0, 0, -1, -1))
        ).T
        has_bwd = seg_end[:count] >= 0
        # Recompute blocks, in time order (the first backward windows are distinct).
        blocks = np.flatnonzero(has_bwd)
        blocks = blocks[np.argsort(seg_first_bwd[blocks], kind="stable")]
        block_window = seg_first_bwd[blocks]
        block_size = seg_size[blocks]
        shift = np.zeros(len(self.windows), _I64)
        shift[block_window] = block_size
        shift = np.cumsum(shift)
        layout = _Layout(
            self._dense + int(block_size.sum()), shift, blocks, block_window, block_size
        )
        block_start = np.full(count + 1, -1, _I64)
        block_start[blocks] = woff[block_window] + shift[block_window] - block_size

        def combined(pos: np.ndarray) -> np.ndarray:
            return pos + shift[self._win_of_dense[pos]]

        own = segment_of[self._f_producer]
        # A checkpoint keeps its inputs: read or saved inside another segment -> held
        # until that segment's backward is over.
        hn = segment_of[self._held_node]
        held_at = np.where((hn >= 0) & (hn != own[self._held_owner]), seg_end[hn], -1)
        held = _group_max(held_at, self._held_group, nf)
        free = np.maximum(self._f_free, held)  # freed in the forward: the eager free or held
        kept_for_backward = ~self._f_in_forward_free
        eager_kept = kept_for_backward & self._f_keep_eager
        free[eager_kept] = self._f_free[eager_kept]
        # Kept for backward and saved: the latest of kept savers' backward, held, last use.
        sn = self._saver_node
        kept_saver = (segment_of[sn] < 0) & (sn < decided)
        reasons = _group_max(
            np.where(kept_saver, self._saver_kept_reason, -1), self._saver_group, nf
        )
        rest = kept_for_backward & ~self._f_keep_eager
        free[rest] = np.maximum(np.maximum(reasons, held), self._f_last_reader_end)[rest]
        if np.any(self._f_last_reader_end[rest] == -2):
            raise KeyError("a reader of a forward allocation has no forward window")
        # Combined positions of the originals' frees (-1: never freed); appended last, once
        # rule 5 has moved the kept operators' outputs.
        free_at = np.where(free >= 0, combined(np.maximum(free, 0)), -1)
        pos: list[np.ndarray] = []
        delta: list[np.ndarray] = []
        rank: list[np.ndarray] = []
        if decided < n:
            # Saved by an undecided node whose backward freed it: kept, that node holds it
            # until then; checkpointed with its producer, the recompute's copy lives from
            # before that backward until then; checkpointed apart from its producer, the
            # segment holds it as an input. Alive over that backward window in every case.
            # (A copy exists because the saver's last save comes after the allocation.)
            late = np.unique(self._saver_owner[self._saver_holds_late & (sn >= decided)])
            # Until the formula lets go of it: where a copy dies, and the original is older.
            late = late[free[late] < self._f_free[late]]
            since = np.maximum(self._f_free_window_start[late], free[late])
            until = self._f_copy_free[late]
            late, since, until = late[since < until], since[since < until], until[since < until]
            if len(late):
                pos += [combined(since), combined(until)]
                delta += [self._f_size[late], -self._f_size[late]]

        # Recomputed copies of what segment nodes made.
        copy = (own >= 0) & (block_start[own] >= 0)
        copy &= ~((seg_stop[own] >= 0) & (self._f_event >= seg_stop[own]))
        c = np.flatnonzero(copy)
        if len(c):
            copy_pair = copy[self._saver_owner]
            sel = np.flatnonzero(copy_pair & (segment_of[sn] == own[self._saver_owner]))
            owner = self._saver_owner[sel]
            has_inside = np.zeros(nf, bool)
            has_inside[owner] = True
            freer_inside = np.zeros(nf, bool)
            freer_inside[owner[self._saver_freer[sel]]] = True
            inside_end = np.full(nf, -1, _I64)
            np.maximum.at(inside_end, owner, self._saver_end[sel])
            rn, ro = self._reader_node, self._reader_owner
            sel = np.flatnonzero(copy[ro] & (segment_of[rn] == own[ro]))
            last = self._f_producer.copy()
            np.maximum.at(last, ro[sel], rn[sel])
            # From here on, only the copies.
            e, last = self._f_event[c], last[c]
            has_inside, freer_inside, inside_end = has_inside[c], freer_inside[c], inside_end[c]
            k = own[c]
            after_last = self._last_event_of_forward[last]
            after_last = np.where(after_last >= 0, after_last, e)
            freed_node = self._f_freed_node[c]
            freed_inside = (freed_node < n) & (segment_of[np.minimum(freed_node, n - 1)] == k)
            # Free as an eager position (-1: inside the recompute) ...
            eager_free = np.where(
                has_inside, np.where(freer_inside, self._f_copy_free[c], inside_end), -1
            )
            # ... or in half steps of the recompute (2x: event x, 2x+1: right after it). An
            # output of the segment (read after it, or the graph's) is held by the
            # segment's code until the recompute stops or ends.
            output = self._f_last_reader[c] >= stops[k]
            half = np.where(
                has_inside,
                2 * e + 1,
                np.where(
                    freed_inside,
                    2 * self._f_free_event[c],
                    np.where(output, 2 * seg_hi[k] + 1, 2 * after_last + 1),
                ),
            )
            early = seg_stop[k]
            half = np.where((early >= 0) & (half > 2 * early - 1), 2 * early - 1, half)
            start, base = block_start[k], 2 * seg_lo[k]
            made_at = start + 1 + 2 * e - base
            dies_at = np.where(
                eager_free < 0, start + 1 + half - base, combined(np.maximum(eager_free, 0))
            )
            if kept_node is not None:
                # Rule 5: a kept operator is not run again; the recompute uses the tensor the
                # forward made, which lives on until the recomputed copy would have died.
                kept = kept_node[self._f_producer[c]]
                held = kept & self._f_op_made[c]
                held_c = c[held]
                free_at[held_c] = np.where(
                    free_at[held_c] >= 0, np.maximum(free_at[held_c], dies_at[held]), -1
                )
                c, made_at, dies_at = c[~kept], made_at[~kept], dies_at[~kept]
            pos += [made_at, dies_at]
            size = self._f_size[c]
            delta += [size, -size]
            if ranks:
                rank += [self._f_rank[c] + 1, self._f_rank[c] + 2]
        if kept_node is not None:
            # A kept output the recompute never reaches (it stops early before it) stays
            # with the checkpoint's frame until its backward is over.
            unreached = kept_node[self._f_producer] & self._f_op_made & ~copy & (own >= 0)
            unreached &= seg_end[own] >= 0
            u = np.flatnonzero(unreached)
            if len(u):
                frame_end = combined(seg_end[own[u]])
                free_at[u] = np.where(free_at[u] >= 0, np.maximum(free_at[u], frame_end), -1)
        keep = np.flatnonzero(free_at >= 0)
        pos.append(free_at[keep])
        delta.append(-self._f_size[keep])
        if ranks:
            rank.append(self._f_rank[keep] + 3)

        # Stashes: the RNG state of a random segment, and the buffer snapshots of a segment
        # that restores buffers (autockpt/rewrite.py): one copy from the segment's forward to
        # the end of its backward, one while it recomputes.
        sizes = _stash_sizes(preserve_rng, count, self.rng_state_bytes)
        if sizes is not None:
            stash = [k for k in range(count) if sizes[k] > 0]
            if stash:
                ks = np.asarray(stash, _I64)
                each = np.asarray(sizes, _I64)[ks]
                window = self._fwd_window[firsts[ks]]
                if np.any(window < 0):
                    raise KeyError(int(firsts[ks][np.argmax(window < 0)]))
                rbase = 4 * self._num_allocations + 4 * ks
                pos.append(combined(woff[window]))
                delta.append(each)
                # freed with the checkpoint's frame: after the backward of its saving
                # nodes, or as its forward returns when none saves (rule 3)
                pos.append(combined(np.where(has_bwd[ks], seg_end[ks], seg_fwd_end[ks])))
                delta.append(-each)
                with_recompute = block_start[ks] >= 0
                r = ks[with_recompute]
                pos += [block_start[r], block_start[r] + seg_size[r] - 1]
                delta += [each[with_recompute], -each[with_recompute]]
                if ranks:
                    rank += [
                        rbase,
                        rbase + 1,
                        4 * self._num_allocations + 4 * r + 2,
                        4 * self._num_allocations + 4 * r + 3,
                    ]
        return (
            np.concatenate(pos),
            np.concatenate(delta),
            np.concatenate(rank) if ranks else None,
            layout,
            segs,
        )

    def _dense_peak(self, points: tuple) -> int:
        pos, delta, _, layout, _ = points
        out = np.zeros(layout.total, _I64)
        if len(layout.blocks):
            out[np.arange(self._dense) + layout.shift[self._win_of_dense]] = self._base
        else:
            out[: self._dense] = self._base
        np.add.at(out, pos, delta)
        top = int(np.cumsum(out).max()) if layout.total else 0
        return self.static_bytes + max(0, top)

    def _sorted(self, points: tuple):
        """Every point in replay order: positions, running sums, slots, the slots' phases."""
        pos, delta, rank, layout, segs = points
        shift = layout.shift
        base_pos = self._base_pos + shift[self._win_of_dense[self._base_pos]]
        all_pos = np.concatenate((base_pos, pos))
        all_rank = np.concatenate((self._base_rank, rank))
        all_delta = np.concatenate((self._base_delta, delta))
        scale = 4 * self._num_allocations + 4 * len(segs) + 4
        key = np.sort(all_pos * scale + all_rank)
        by_rank = np.zeros(scale, _I64)
        by_rank[all_rank] = all_delta
        cur = np.cumsum(by_rank[key % scale])
        position = key // scale
        # Slots: eager windows, a recompute slot before each block's window.
        nw = len(self.windows)
        before = np.zeros(nw, _I64)
        before[layout.block_window] = 1
        window_slot = np.arange(nw, dtype=_I64) + np.cumsum(before)
        slot_of_pos = np.empty(layout.total, _I64)
        eager = np.arange(self._dense) + shift[self._win_of_dense]
        slot_of_pos[eager] = window_slot[self._win_of_dense]
        is_block = np.ones(layout.total, bool)
        is_block[eager] = False
        slot_of_pos[is_block] = np.repeat(window_slot[layout.block_window] - 1, layout.block_size)
        slot_phase: list[tuple[str, int]] = []
        done = 0
        for w, k in zip(layout.block_window.tolist(), layout.blocks.tolist(), strict=True):
            slot_phase += self._window_phase[done:w]
            slot_phase.append(("recompute", segs[k][0]))
            done = w
        slot_phase += self._window_phase[done:]
        fclass = np.insert(self._w_fclass, layout.block_window, False)
        return position, cur, slot_of_pos[position], slot_phase, fclass


def _stash_sizes(
    preserve_rng: Sequence[bool | int] | None, count: int, rng_state_bytes: int
) -> list[int] | None:
    """Bytes each segment stashes: ``True`` is the RNG state (``rng_state_bytes``), an int
    is a byte count (the RNG state and buffer snapshots together), ``False`` nothing."""
    if not preserve_rng:
        return None
    if len(preserve_rng) != count:
        raise ValueError(f"preserve_rng has {len(preserve_rng)} entries for {count} segments")
    sizes = [
        (rng_state_bytes if value else 0) if isinstance(value, (bool, np.bool_)) else int(value)
        for value in preserve_rng
    ]
    return sizes if any(sizes) else None
