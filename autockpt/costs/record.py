"""Stage 2b — record: one training step of the captured graph as attributed allocation events.

The plan simulator (:mod:`solvers.replay`) replays what this module records; see its
docstring for why a replay of recorded allocations. How a step is recorded, and why
(named notes the code points back to):

* NOTE [record: fake sizes] **Sizes come from fake tensors.** Planning must fit where the plan
  fits, so the step the plan avoids is never run with real tensors. The graph runs on fake
  tensors (:func:`autockpt.base.runtime.fake_step`): every operator returns tensors with the
  real shapes, dtypes, strides, devices and storage aliasing, and no data. A dispatch mode
  (:class:`autockpt.base.allocations.StorageTracker`) sees every storage an operator returns (an
  allocation) and, through a weak reference, when it dies (a free); the graph runs like its
  generated code (values die after their last use) and backward runs through the real autograd
  engine, so gradient buffers, gradient sums and parameter gradients appear in the engine's own
  order. Backward operators belong to the compute node that created their autograd node
  (sequence numbers). On the meta device the same tracker runs on the meta tensors.
* NOTE [record: workspaces] **Workspaces come from real kernels, one node at a time.** What no
  operator returns (a convolution's im2col buffer, a kernel's scratch space) is invisible to a
  dispatch mode. :func:`autockpt.costs.profile.profile` measures it per node on real tensors
  while only a lean working set is alive (``NodeProfile.forward_workspace``,
  ``backward_workspace``; NOTE [profile: probe]), and :func:`record_trace` adds it to the node's
  windows: one allocation of that many bytes over each window (:func:`_with_workspaces`). The
  window's peak then equals what the allocator reaches there; elsewhere the extra bytes can only
  over-count, never under-count.
* NOTE [record: loss windows] **The loss, forward and backward.** The loss runs between the
  graph's output and the graph's backward, outside the graph, and the probe measures it like a
  node (NOTE [profile: probe]): its forward in one window, its own backward (down to the
  gradient of the model's output) in the next. One window for both once spread the forward's
  workspace (a CPU ``logsumexp`` allocates a temporary of its input's size and frees it before
  returning) over the backward, whose gradients of that size peak later: every plan of a GPT
  with a ``logsumexp`` loss was predicted one logits tensor above the allocator.
* NOTE [record: early stop] **Early stop.** A checkpoint's recompute stops at the segment's last
  save for backward; the recorder notes, per node, how many events precede its last save
  (``last_pack``).
* NOTE [record: autocast cache] **Autocast's weight cache.** Recorded under ``torch.autocast``,
  a node's forward casts the weights it uses; the casts of float32 leaves that require grad stay
  in autocast's cache from their first use to the end of the step
  (``autockpt/base/precision.py``), and a recompute finds them there. They are no node's to free
  or recompute: each is moved into a prologue window of its own just before the forward that
  made it (:func:`_hold_cached_casts`), where no plan moves it. Without that, a checkpointed
  node's cast (the matmul saves it) would be freed and made again by the replay, while the cache
  holds it all along (measured peaks 3-20% above the prediction on small models). The backward
  of every autocast cast (``ToCopyBackward``: the gradient back to float32) gets a backward
  window of its own without workspace: the probe measures each node's kernels without these
  conversions (:class:`autockpt.base.precision.AutocastCasts`), which in the step may run after
  the node's saved tensors are freed, or not.
* NOTE [record: buffers as left] **Buffers as the step leaves them.** A forward may replace a
  registered buffer (a table built on the first call, as timm's ConViT does); a checkpoint
  restoring it snapshots it as it finds it. The trace keeps every buffer's bytes at the end of
  the step (``MemoryTrace.buffer_bytes``), which sizes those snapshots, not the placeholder the
  model held before (measured 4092 bytes low on a 32x32 table).
* NOTE [record: saved tensor release] **Where a backward lets go of a saved tensor.** Eager
  keeps a saved tensor until its autograd node releases what it saved, after the engine has
  reduced the gradients the formula returned (a bias gradient summed over the batch); a
  checkpoint's recomputed copy dies as the formula returns. In backward, each saved activation
  is handed to its formula as a stand-in of the same sizes and strides with a storage of its own
  (fake: no memory); where the last stand-in of an allocation dies is kept
  (``MemoryTrace.unpacked``) and the stand-ins leave no event. Where a probe workspace spans the
  window, the allocator's peak within it is unknown, and the copy keeps the original's free (a
  rescheduled free could fall before the true peak).
* NOTE [record: optimizer step] **A training iteration from steady state.** Given the user's
  optimizer, a stand-in of it steps the fake parameters after the fake backward
  (:func:`_with_optimizer_step`): its state joins the static part and its step's own
  allocations are a window after the backward. The optimizer's kernels are elementwise and
  run on the gradients' memory; no probe measures them (verification measures the iteration).
* NOTE [record: accumulated gradients] **Micro-batches after the first.** With gradient
  accumulation the gradients are resident from the start of such a micro-batch and each new
  gradient is freed as soon as it is added in (:func:`_accumulating`).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from autockpt.base.allocations import (
    StorageSet,
    StorageTracker,
    peak_above_start,
    returned_short,
    static_bytes,
)
from autockpt.base.inputs import Inputs
from autockpt.base.optimizer import stand_in, state_tensors
from autockpt.base.optimizer import step as optimizer_step
from autockpt.base.precision import (
    autocast_dtypes,
    cached_cast_dtypes,
    fresh_autocast_cache,
    held_by_cache,
    is_autocast_cast,
)
from autockpt.base.rng import worst_case_draws
from autockpt.base.runtime import (
    LossFn,
    default_loss,
    fake_step,
    loss_on_fake,
    preserved_training_state,
    tensors_in,
)
from autockpt.capture.captured import Capture
from autockpt.costs.interpret import CaptureInterpreter, placeholder_values
from autockpt.costs.profile import Profile
from autockpt.plan import OptimizerRecord
from solvers.replay import BACKWARD, FORWARD, LOSS, OPTIMIZER, PROLOGUE, MemoryTrace, Window

__all__ = ["record_trace"]


def record_trace(
    model: nn.Module,
    capture: Capture,
    inputs: Inputs,
    *,
    loss_fn: LossFn | None = None,
    profile: Profile | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    accumulation_steps: int = 1,
) -> MemoryTrace:
    """Record one step of ``capture``'s graph as attributed allocation events, on fake
    tensors (NOTE [record: fake sizes]): nothing the size of an activation is allocated.

    ``profile`` (:func:`autockpt.costs.profile.profile` of the same capture) brings what the
    probe measured on real kernels (NOTE [record: workspaces]): per node the bytes its
    kernels allocate beyond the tensors its operators return, in forward and backward, the
    loss's, what a forward leaves allocated until its backward, and the operators' returned
    bytes that fake kernels miss. Without it the trace holds the fake step's events only.

    With ``optimizer`` the trace is one training iteration from steady state (NOTE [record:
    optimizer step]): its state is resident, and its step follows the backward in a window
    of its own. With ``accumulation_steps`` above 1 it is a micro-batch after the first (NOTE
    [record: accumulated gradients]). The model, its gradients, buffers, the RNG and the
    optimizer are as they were afterwards.
    """
    loss_fn = loss_fn or default_loss
    nodes = capture.compute_nodes()
    index_of = {node: i for i, node in enumerate(nodes)}
    static = static_bytes(model, inputs)
    # Under autocast the step starts with an empty weight cache (NOTE [record: autocast cache]),
    # and the fake casts it made are not left in the caller's. Scalar draws take their worst
    # case, as in the profile (a random-depth model runs every layer: autockpt/base/rng.py).
    twins: dict[int, torch.Tensor] = {}
    with (
        fresh_autocast_cache(),
        preserved_training_state(model),
        fake_step(model, inputs, twins) as fake_inputs,
        worst_case_draws(),
    ):
        trace, fake_ops, cached, conversions, gradients = _record(
            model, capture, fake_inputs, index_of, loss_fn, static
        )
        if optimizer is not None:
            trace = _with_optimizer_step(trace, optimizer, model, twins)
        # Buffers as the step leaves them (NOTE [record: buffers as left]): a forward may have
        # replaced one.
        trace = dataclasses.replace(
            trace,
            buffer_bytes=tuple(
                (name, b.nbytes) for name, b in model.named_buffers(remove_duplicate=False)
            ),
        )
    if profile is not None:
        trace = _with_probe(trace, profile, fake_ops, conversions)
    if cached:
        trace = _hold_cached_casts(trace, cached)
    if accumulation_steps > 1:
        trace = _accumulating(trace, gradients)
    return trace


def _with_optimizer_step(
    trace: MemoryTrace,
    optimizer: torch.optim.Optimizer,
    model: nn.Module,
    twins: Mapping[int, torch.Tensor],
) -> MemoryTrace:
    """NOTE [record: optimizer step]: a training iteration from steady state. A stand-in of
    the user's optimizer (autockpt/base/optimizer.py) steps the fake parameters twice, after
    the fake backward, while the gradients are alive: the first step makes its state (lazily,
    as ``torch.optim`` does), which in the steady state is resident before the iteration
    starts, so it joins the static part; the second step is the steady state's, and what it
    allocates (``foreach`` lists, a fused kernel's outputs) is recorded in a window of its
    own after the backward (``solvers.replay.OPTIMIZER``), which no plan moves. Whatever
    else is alive then (parameters, buffers, gradients, the state) is not the step's."""
    stepping = stand_in(optimizer, lambda p: twins.get(id(p), p))
    optimizer_step(stepping)  # the state, as the steady state holds it
    state = state_tensors(stepping)
    state_bytes = StorageSet().add(state)
    alive = [*model.parameters(), *model.buffers(), *state]
    alive += [p.grad for p in model.parameters() if p.grad is not None]
    tracker = StorageTracker({id(t.untyped_storage()) for t in alive})
    with tracker:
        optimizer_step(stepping)
    offset, window = len(trace.sizes), len(trace.windows)
    return dataclasses.replace(
        trace,
        windows=(*trace.windows, Window(OPTIMIZER, -1)),
        events=(*trace.events, *((offset + a, window) for a, _ in tracker.events)),
        sizes=(*trace.sizes, *tracker.sizes),
        static_bytes=trace.static_bytes + state_bytes,
        resident=(*trace.resident, (OPTIMIZER_STATE, state_bytes)),
    )


def _accumulating(trace: MemoryTrace, gradients: set[int]) -> MemoryTrace:
    """NOTE [record: accumulated gradients]: a micro-batch after the first of a gradient
    accumulation. Its parameter gradients are resident from the start (the first micro-batch
    made them: they join the static part), and each gradient its backward computes is
    accumulated into them in place and freed at once (``AccumulateGrad`` runs as soon as its
    input is ready), where the recorded first micro-batch kept it as the ``.grad``. Such a
    micro-batch peaks at least as high as the first, so it is what the budget must hold."""
    events: list[tuple[int, int]] = []
    inserted_before: list[int] = []  # per recorded event: frees inserted before it
    for a, w in trace.events:
        inserted_before.append(len(events) - len(inserted_before))
        events.append((a, w))
        if a in gradients:
            events.append((a, w))  # freed as soon as it is accumulated
    inserted_before.append(len(events) - len(trace.events))
    grads = sum(trace.sizes[a] for a in gradients)
    return dataclasses.replace(
        trace,
        events=tuple(events),
        last_pack=tuple(p + inserted_before[p] if p >= 0 else p for p in trace.last_pack),
        unpacked=tuple((a, w, e + inserted_before[e]) for a, w, e in trace.unpacked),
        static_bytes=trace.static_bytes + grads,
        resident=(*trace.resident, (ACCUMULATED_GRADIENTS, grads)),
    )


def optimizer_record(
    trace: MemoryTrace, optimizer: torch.optim.Optimizer | None
) -> OptimizerRecord | None:
    """What ``trace`` (recorded with ``optimizer``) says the optimizer costs: its resident
    state and the highest its step's own allocations reach."""
    if optimizer is None:
        return None
    return OptimizerRecord(
        name=type(optimizer).__name__,
        state_bytes=dict(trace.resident).get(OPTIMIZER_STATE, 0),
        step_bytes=optimizer_step_bytes(trace),
    )


def optimizer_step_bytes(trace: MemoryTrace) -> int:
    """The highest the optimizer step's own allocations reach (0 without a step)."""
    optimizer_windows = {w for w, win in enumerate(trace.windows) if win.phase == OPTIMIZER}
    seen: set[int] = set()
    deltas = []
    for a, w in trace.events:
        if w in optimizer_windows:
            deltas.append(-trace.sizes[a] if a in seen else trace.sizes[a])
        seen.add(a)
    return peak_above_start(deltas)


OPTIMIZER_STATE = "optimizer state"
ACCUMULATED_GRADIENTS = "accumulated gradients"
"""Names of what a trace's static part holds besides parameters, buffers and inputs
(``MemoryTrace.resident``)."""


def _with_probe(
    trace: MemoryTrace,
    profile: Profile,
    fake_ops: Mapping[int, list[tuple[str, int]]],
    conversions: set[int],
) -> MemoryTrace:
    """``trace`` with what the probe measured on real kernels (NOTE [record: workspaces])."""
    nodes = profile.nodes
    forward_workspace = {i: node.forward_workspace for i, node in enumerate(nodes)}
    backward_workspace = {i: node.backward_workspace for i, node in enumerate(nodes)}
    hidden_saved = {i: node.hidden_saved for i, node in enumerate(nodes)}
    if profile.device != "meta":
        device_forward_ops = {i: node.device_forward_ops for i, node in enumerate(nodes)}
        _add_what_fake_kernels_miss(trace, fake_ops, device_forward_ops, hidden_saved)
    loss = _loss_terms(trace, profile)
    if forward_workspace or backward_workspace or loss.any() or hidden_saved:
        trace = _with_workspaces(
            trace,
            forward_workspace,
            backward_workspace,
            loss,
            hidden_saved,
            conversions,
            optimizer=profile.optimizer_workspace,
        )
    return trace


@dataclass(frozen=True)
class _LossTerms:
    """What the loss's windows need besides their fake events for their peaks to be the
    allocator's (NOTE [record: loss windows]), in bytes."""

    forward: int = 0
    """A workspace over the loss's forward window."""
    backward: int = 0
    """A workspace over the loss's own backward window."""
    held: int = 0
    """Held from the loss's forward to the end of its backward."""
    kept: int = 0
    """Held from the end of the loss's backward to the end of the step (the gradients of
    the model's output a measured loss hands on)."""

    def any(self) -> bool:
        return any((self.forward, self.backward, self.held, self.kept))


def _loss_terms(trace: MemoryTrace, profile: Profile) -> _LossTerms:
    """The loss's :class:`_LossTerms`, measured against the fake events of the same
    windows; never negative (a window the fake step over-counts stays over-counted)."""
    real = profile.loss_probe
    windows = [w for w, win in enumerate(trace.windows) if win.phase == LOSS]
    if real is None or len(windows) != 2:
        return _LossTerms()
    # each window's own allocations and their frees there: the probe's loss ran on leaves
    # that outlive it, so what was allocated before (the logits) never frees in its windows
    deltas: dict[int, list[int]] = {w: [] for w in windows}
    born: dict[int, int] = {}
    for a, w in trace.events:
        if a not in born:
            born[a] = w
            if w in deltas:
                deltas[w].append(trace.sizes[a])
        elif born[a] == w and w in deltas:
            deltas[w].append(-trace.sizes[a])
    forward, backward = (deltas[w] for w in windows)
    held = max(0, real.forward_net - sum(forward))
    if profile.loss_measured:  # the stand-in saved none of the outputs the loss saves
        held += real.saved_output_bytes
    forward_workspace = max(0, real.forward_peak - held - peak_above_start(forward))
    backward_workspace = max(0, real.backward_peak - peak_above_start(backward))
    # a loss that ran as a stand-in on fake tensors (it reads a value) hands the model's
    # backward the stand-in's gradients, broadcast scalars: the real ones are held instead,
    # to the end of the step (an over-count after the model's last node has used them)
    kept = real.output_gradient_bytes if profile.loss_measured else 0
    return _LossTerms(forward_workspace, backward_workspace, held, kept)


def _hold_cached_casts(trace: MemoryTrace, cached: set[int]) -> MemoryTrace:
    """``trace`` with each allocation autocast's weight cache holds (NOTE [record: autocast
    cache]) made in a prologue window of its own, right before the forward window that made it:
    the replay keeps what no forward window made where and when it was (allocated there, never
    freed in the step) and never copies it into a recompute. Windows only advance along the
    event list, so each moved allocation stays in order with the rest of its node's forward."""
    windows = trace.windows
    moved: dict[int, list[int]] = {}  # forward window -> its events that move
    seen: set[int] = set()
    for e, (a, w) in enumerate(trace.events):
        if a not in seen:
            seen.add(a)
            if a in cached and windows[w].phase == FORWARD:
                moved.setdefault(w, []).append(e)
    if not moved:
        return trace
    new_windows: list[Window] = []
    renumbered: dict[int, int] = {}
    prologue: dict[int, int] = {}
    for w, win in enumerate(windows):
        if w in moved:
            prologue[w] = len(new_windows)
            new_windows.append(Window(PROLOGUE, win.node))
        renumbered[w] = len(new_windows)
        new_windows.append(win)
    moving = {e for events in moved.values() for e in events}
    events: list[tuple[int, int]] = []
    position = [0] * len(trace.events)  # old event index -> new one
    current = -1
    for e, (a, w) in enumerate(trace.events):
        if w != current:
            current = w
            for m in moved.get(w, []):
                position[m] = len(events)
                events.append((trace.events[m][0], prologue[w]))
        if e not in moving:
            position[e] = len(events)
            events.append((a, renumbered[w]))
    # last_pack counts the events before a save: moved events only move earlier, so the
    # events before it are those up to the latest new position of one that was before it.
    latest = [0] * (len(trace.events) + 1)
    for e in range(len(trace.events)):
        latest[e + 1] = max(latest[e], position[e] + 1)
    position.append(len(events))  # "before the end"
    return dataclasses.replace(
        trace,
        windows=tuple(new_windows),
        events=tuple(events),
        last_pack=tuple(latest[p] if p >= 0 else p for p in trace.last_pack),
        unpacked=tuple((a, renumbered[w], position[e]) for a, w, e in trace.unpacked),
    )


def _add_what_fake_kernels_miss(
    trace: MemoryTrace,
    fake_ops: Mapping[int, list[tuple[str, int]]],
    device_ops: Mapping[int, Sequence[tuple[str, int]]],
    hidden: dict[int, int],
) -> None:
    """NOTE [record: workspaces], second half: where an operator of a node's forward returned
    more on the device than on fake tensors (``aten::mkldnn_rnn_layer`` returns its reserve
    buffer on the CPU and an empty one from its fake kernel), the difference joins the node's
    hidden saved bytes (such buffers are what the backward needs). Operators are compared one by
    one, in order; a node whose two runs called different operators is left as recorded."""
    forward_window = {win.node: w for w, win in enumerate(trace.windows) if win.phase == FORWARD}
    for node, real in device_ops.items():
        fake = fake_ops.get(forward_window.get(node, -1), [])
        # No more than the two runs' totals differ by: where bytes only moved between
        # operators, nothing was missed (the probe's node found a buffer its forward had
        # replaced already, so it never built it, and a view of it looked new).
        total = sum(n for _, n in real) - sum(n for _, n in fake)
        missed = min(returned_short(list(fake), list(real)), max(0, total))
        if missed:
            hidden[node] = hidden.get(node, 0) + missed


def _with_workspaces(
    trace: MemoryTrace,
    forward: Mapping[int, int],
    backward: Mapping[int, int],
    loss: _LossTerms,
    hidden_saved: Mapping[int, int],
    conversions: set[int] = frozenset(),  # type: ignore[assignment]
    optimizer: int = 0,
) -> MemoryTrace:
    """``trace`` with what the probe saw and fake tensors cannot (NOTE [record: workspaces]):
    one workspace allocation spanning each window that has one, and each node's hidden saved
    bytes from the start of its forward to the end of its backward, saved by that node (so a
    plan that checkpoints the node drops and recomputes them like its other saved tensors).

    A node's backward may be split into several windows (several autograd nodes); each gets
    the node's backward workspace, which over-counts only if two of them peak together,
    except the windows that convert autocast casts' gradients back to float32
    (``conversions``, NOTE [record: autocast cache]): the probe measured the node without them."""
    windows = trace.windows
    spans = _Spans(list(trace.sizes))
    loss_windows = [w for w, win in enumerate(windows) if win.phase == LOSS]
    for w, win in enumerate(windows):
        size = {FORWARD: forward, BACKWARD: backward}.get(win.phase, {}).get(win.node, 0)
        if win.phase == LOSS:  # its forward, then its backward (NOTE [record: loss windows])
            size = loss.forward if w == loss_windows[0] else loss.backward
        if win.phase == OPTIMIZER:
            size = optimizer
        if w in conversions:
            size = 0
        if size > 0:
            spans.add(size, w, w, at_start=True)
    # In a window with a workspace, where the allocator peaked is unknown: a recomputed copy
    # is kept to the window's eager free (NOTE [record: saved tensor release]), never dropped
    # before that peak.
    spanned = set(spans.before)
    saved = _with_hidden_saved(spans, trace, hidden_saved)
    if loss.held > 0 and loss_windows:  # held to the end of the loss's backward
        spans.add(loss.held, loss_windows[0], loss_windows[-1], True)
    if loss.kept > 0 and loss_windows:  # the output's gradients a measured loss leaves
        spans.add(loss.kept, loss_windows[-1], len(windows) - 1, False)
    events, position = spans.interleaved(trace.events, len(windows))
    return dataclasses.replace(
        trace,
        events=tuple(events),
        sizes=tuple(spans.sizes),
        saved=tuple(tuple(sorted(ids)) for ids in saved),
        last_pack=tuple(position[p] if p >= 0 else p for p in trace.last_pack),
        unpacked=tuple((a, w, position[e]) for a, w, e in trace.unpacked if w not in spanned),
    )


class _Spans:
    """Allocations added to a trace, each spanning windows (:func:`_with_workspaces`): ids
    after the trace's own, each allocated as a window opens (or as one closes) and freed as
    a later window, or the same one, closes."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes  # the trace's sizes, then the spans'
        self.before: dict[int, list[int]] = {}  # window -> allocation ids whose event opens it
        self.after: dict[int, list[int]] = {}  # window -> allocation ids whose event closes it

    def add(self, size: int, opens: int, closes: int, at_start: bool) -> int:
        """A new allocation of ``size`` bytes: allocated as window ``opens`` starts (or, not
        ``at_start``, as it ends), freed as window ``closes`` ends. Returns its id."""
        a = len(self.sizes)
        self.sizes.append(size)
        (self.before if at_start else self.after).setdefault(opens, []).append(a)
        self.after.setdefault(closes, []).append(a)
        return a

    def interleaved(
        self, recorded: Sequence[tuple[int, int]], num_windows: int
    ) -> tuple[list[tuple[int, int]], list[int]]:
        """``recorded`` with the spans' events among them, and where each recorded event
        went (the last entry: the end). One pass in time order; windows only advance along
        the event list."""
        events: list[tuple[int, int]] = []
        position = [0] * (len(recorded) + 1)  # old event index -> new one (for last_pack)
        window = -1

        def advance_to(target: int) -> None:
            nonlocal window
            while window < target:
                if window >= 0:
                    events.extend((a, window) for a in self.after.get(window, []))
                window += 1
                if window < num_windows:
                    events.extend((a, window) for a in self.before.get(window, []))

        for e, (a, w) in enumerate(recorded):
            advance_to(w)
            position[e] = len(events)
            events.append((a, w))
        advance_to(num_windows)
        position[len(recorded)] = len(events)
        return events, position


def _with_hidden_saved(
    spans: _Spans, trace: MemoryTrace, hidden_saved: Mapping[int, int]
) -> list[list[int]]:
    """Each node's allocations saved for backward, with a span of its hidden saved bytes
    (:func:`_with_workspaces`) from the start of its forward to the end of its last backward
    window added where it has any."""
    last_backward: dict[int, int] = {}
    forward_window: dict[int, int] = {}
    for w, win in enumerate(trace.windows):
        if win.phase == BACKWARD:
            last_backward[win.node] = w
        elif win.phase == FORWARD:
            forward_window[win.node] = w
    saved = [list(ids) for ids in trace.saved]
    for node, size in sorted(hidden_saved.items()):
        if size > 0 and node in last_backward and node in forward_window:
            # allocated as the forward starts: before the node's saves, so a recompute that
            # stops after its last save (NOTE [record: early stop]) makes them again
            saved[node].append(spans.add(size, forward_window[node], last_backward[node], True))
    return saved


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
        # What the recorder is told (set by _record): a compute node begins; it saved a
        # tensor (NOTE [record: early stop]); it returned; and what a backward gets for a
        # saved tensor (NOTE [record: saved tensor release]).
        self.on_node: Callable[[int], None] | None = None
        self.on_pack: Callable[[int], None] | None = None
        self.on_result: Callable[[int, Any], None] | None = None
        self.on_unpack: Callable[[torch.Tensor], torch.Tensor] | None = None

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

        def unpack(t: torch.Tensor) -> torch.Tensor:
            return t if self.on_unpack is None else self.on_unpack(t)

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            result = super().run_node(n)
        self.saved[i] = saved
        self.outputs[i] = [self.key(t) for t in tensors_in(result)]
        if self.on_result is not None:
            self.on_result(i, result)
        return result


class _CastTracker(StorageTracker):
    """The storage tracker, also noting the casts autocast keeps in its weight cache (NOTE
    [record: autocast cache]). Which casts those are is decided by autocast's own rule (:func:`held_by_cache`),
    with the autocast state read before the step (inside its kernels autocast reports
    itself off)."""

    def __init__(self, static_ids: set[int], cast_to: dict[str, torch.dtype]) -> None:
        super().__init__(static_ids)
        self.cast_to = cast_to
        self.cached: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if (
            self.cast_to
            and func is torch.ops.aten._to_copy.default
            and isinstance(out, torch.Tensor)
            and held_by_cache(args[0], (kwargs or {}).get("dtype"), self.cast_to)
        ):
            a = self.key(out)
            if a is not None:
                self.cached.add(a)
        return out

    def held(self) -> set[int]:
        """The cached casts, checked against what happened: the cache frees none of them
        within the step."""
        freed = {a for a, count in Counter(a for a, _ in self.events).items() if count > 1}
        return self.cached - freed


def _forward_sequence_numbers(
    result: Any,
    known: set[int],
    conversions: set[int] | None = None,
    cast_to: Mapping[str, torch.dtype] | None = None,
) -> set[int]:
    """Sequence numbers of the autograd nodes reachable from ``result`` and not yet known;
    those that convert an autocast cast's gradient back to float32 are also added to
    ``conversions`` (NOTE [record: autocast cache]; ``cast_to`` from
    :func:`autockpt.base.precision.autocast_dtypes`)."""
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
        if conversions is not None and cast_to and _converts_autocast_cast(fn, cast_to):
            conversions.add(seq)
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return found


def _converts_autocast_cast(fn: Any, cast_to: Mapping[str, torch.dtype]) -> bool:
    """Whether the autograd node ``fn`` is the backward of a cast autocast made (float32 to
    the autocast dtype): it receives a gradient of the lower precision and hands one of
    float32 on."""
    if type(fn).__name__ != "ToCopyBackward0" or not fn.next_functions:
        return False
    received = fn._input_metadata[0]
    following, slot = fn.next_functions[0]
    if following is None:
        return False
    if type(following).__name__ == "AccumulateGrad":
        source = following.variable.dtype
    else:
        source = following._input_metadata[slot].dtype
    return is_autocast_cast(source, received.dtype, received.device.type, dict(cast_to))


def _record(
    model: nn.Module,
    capture: Capture,
    inputs: Inputs,
    index_of: dict[fx.Node, int],
    loss_fn: LossFn,
    static: int,
) -> tuple[MemoryTrace, dict[int, list[tuple[str, int]]], set[int], set[int], set[int]]:
    """One step of the graph under :class:`autockpt.base.allocations.StorageTracker` (NOTE
    [record: fake sizes]), on whatever tensors ``model`` and ``inputs`` hold (fake or meta);
    also the operators each window called and the bytes of new storage each returned, the
    allocations autocast's weight cache holds, the backward windows that convert autocast
    casts' gradients (NOTE [record: autocast cache]) and the allocations of the parameter
    gradients (NOTE [record: accumulated gradients])."""
    statics = list(model.parameters()) + list(model.buffers()) + inputs.tensors()
    static_storages = [t.untyped_storage() for t in statics]  # kept alive: ids stay unique
    tracker = _CastTracker({id(s) for s in static_storages}, cached_cast_dtypes())
    tracker.op_calls = {}
    recording = _Recording(tracker, len(index_of))
    runner = _NodeRunner(model, capture, index_of, tracker.key)
    runner.on_node = recording.on_node
    runner.on_pack = recording.on_pack
    runner.on_result = recording.on_result
    gradients = _run_step(model, capture, inputs, loss_fn, runner, recording)
    del static_storages
    device = next((t.device for t in statics), torch.device("cpu"))
    return (
        _memory_trace(recording, runner, static, device),
        tracker.op_log(),
        tracker.held(),
        recording.conversion_windows,
        gradients - {None},
    )


class _Recording:
    """What :func:`_record` learns while the step runs, and the callbacks that learn it: the
    windows in the order the step opens them, the compute node that created each autograd
    node (its backward's windows are that node's), per node how many events precede its
    latest save (NOTE [record: early stop]), the stand-ins backward formulas got for saved
    tensors (NOTE [record: saved tensor release]) and the backward windows that convert
    autocast casts' gradients (NOTE [record: autocast cache])."""

    def __init__(self, tracker: _CastTracker, num_nodes: int) -> None:
        self.tracker = tracker
        self.windows: list[Window] = []
        self.seq_owner: dict[int, int] = {}
        self.created: set[int] = set()
        self.last_pack = [-1] * num_nodes
        self.cast_to = autocast_dtypes()
        self.conversions: set[int] = set()  # sequence numbers (NOTE [record: autocast cache])
        self.conversion_windows: set[int] = set()
        # allocation a backward got instead -> the saved one (NOTE [record: saved tensor release])
        self.stand_ins: dict[int, int] = {}

    def open(self, window: Window) -> None:
        """Events from now on fall in ``window``, a new one."""
        self.windows.append(window)
        self.tracker.window = len(self.windows) - 1

    def on_node(self, i: int) -> None:
        self.open(Window(FORWARD, i))

    def on_pack(self, i: int) -> None:
        # NOTE [record: early stop]: events so far precede node i's latest save
        self.last_pack[i] = len(self.tracker.events)

    def on_unpack(self, t: torch.Tensor) -> torch.Tensor:
        a = self.tracker.key(t)
        if a is None:
            return t
        # Same sizes and strides, a storage of its own (fake: no memory): it dies where a
        # checkpoint's recomputed copy would, as the backward formula lets go of it.
        stand_in = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device)
        s = self.tracker.key(stand_in)
        if s is not None:
            self.stand_ins[s] = a
        return stand_in

    def backward_window_of(self, seq: int) -> int | None:
        node = self.seq_owner.get(seq)
        if node is None:
            return None
        # a window of its own, without workspace (NOTE [record: autocast cache])
        converting = seq in self.conversions
        windows = self.windows
        last = len(windows) - 1
        if windows[-1] != Window(BACKWARD, node) or (last in self.conversion_windows) != converting:
            windows.append(Window(BACKWARD, node))
            if converting:
                self.conversion_windows.add(len(windows) - 1)
        return len(windows) - 1

    def on_result(self, i: int, result: Any) -> None:
        for seq in _forward_sequence_numbers(result, self.created, self.conversions, self.cast_to):
            self.seq_owner.setdefault(seq, i)
            self.created.add(seq)


def _run_step(
    model: nn.Module,
    capture: Capture,
    inputs: Inputs,
    loss_fn: LossFn,
    runner: _NodeRunner,
    recording: _Recording,
) -> set[int | None]:
    """The step under ``recording``'s tracker: the graph's forward (a window per compute
    node), the loss's forward and its own backward (NOTE [record: loss windows]), then the
    graph's backward (windows by autograd node). Returns the allocations of the parameters'
    gradients."""
    tracker = recording.tracker
    with tracker:
        output = capture.graph._codegen.process_outputs(
            runner.run(*placeholder_values(capture, model, inputs), enable_io_processing=False)
        )
        runner.env.clear()  # the interpreter would hold the graph's outputs through backward
        recording.open(Window(LOSS, -1))
        loss, _ = loss_on_fake(loss_fn, output)
        del output
        # the loss's own backward: a window of its own, so that the forward's workspace
        # (a logsumexp's temporary) is not counted under the backward's gradients (NOTE
        # [record: loss windows])
        recording.open(Window(LOSS, -1))
        tracker.backward_window_of = recording.backward_window_of
        runner.on_pack = None
        runner.on_unpack = recording.on_unpack
        loss.backward()
        del loss
        gradients = {tracker.key(p.grad) for p in model.parameters() if p.grad is not None}
    return gradients


def _memory_trace(
    recording: _Recording, runner: _NodeRunner, static: int, device: torch.device
) -> MemoryTrace:
    """The recorded step as the replay reads it: its events without the stand-ins (NOTE
    [record: saved tensor release]) and per node what it read, returned and saved."""
    tracker = recording.tracker
    events, unpacked = _without_stand_ins(tracker.events, recording.stand_ins)
    windows = recording.windows
    n = len(recording.last_pack)

    def ids(keys: list[Any]) -> tuple[int, ...]:
        return tuple(sorted({k for k in keys if k is not None}))

    forward_window = {win.node: w for w, win in enumerate(windows) if win.phase == FORWARD}
    return MemoryTrace(
        num_nodes=n,
        windows=tuple(windows),
        events=events,
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
        last_pack=tuple(recording.last_pack),
        unpacked=unpacked,
        forward_ops=tuple(
            tuple(tracker.op_calls.get(forward_window.get(i, -1), ())) for i in range(n)
        ),
    )


def _without_stand_ins(
    recorded: Sequence[tuple[int, int]], stand_ins: Mapping[int, int]
) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int, int], ...]]:
    """The step's events without the stand-ins backward formulas got for saved tensors
    (NOTE [record: saved tensor release]), and per saved allocation where the last of them died:
    ``(allocation, window, event)``, the stand-in died in ``window`` right before ``event`` (an
    index into the events returned)."""
    events: list[tuple[int, int]] = []
    last: dict[int, tuple[int, int]] = {}
    seen: set[int] = set()
    for a, w in recorded:
        saved = stand_ins.get(a)
        if saved is None:
            events.append((a, w))
        elif a in seen:
            last[saved] = (w, len(events))
        seen.add(a)
    return tuple(events), tuple((a, w, e) for a, (w, e) in sorted(last.items()))
