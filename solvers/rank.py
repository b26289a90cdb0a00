"""One rank of a sharded run: what its peak differs from one process's, moment by moment.

:class:`RankShift` carries the stage model's terms for one rank against one process's (NOTE
[search: per-rank peaks]); :class:`UnitGathers` the FSDP2 units gathered beyond what the
static part counts, which depend on the plan (NOTE [search: gathered units]). The search
(:mod:`solvers.search`) judges every plan of a sharded run by :meth:`RankShift.peak`.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .chain import ChainProblem

__all__ = ["RankShift", "UnitGathers"]


@dataclass(frozen=True)
class UnitGathers:
    """FSDP2's gathered units beyond the ``counted`` bytes the static part holds at every
    moment (two of the largest unit: the one running and the one prefetched), per stage.

    NOTE [search: gathered units]. FSDP2 gathers a unit's parameters when its forward starts
    and, with ``reshard_after_forward=True`` (the default for every unit), frees them when
    its forward ends, gathering them again for its backward (the next unit's prefetched
    beside it) and freeing them when its backward ends (``post_backward``). Two moments hold
    more than the two units the static part counts: (1) a unit kept gathered after its
    forward (``reshard_after_forward=False``: ``kept``) stays so until its own backward, so
    from its forward to its backward it is held beside every other; (2) a checkpointed
    segment's recompute runs the forward of every unit in it inside the backward, where
    FSDP2's ``post_forward`` does not reshard (``if not is_bw()``): each recomputed unit
    stays gathered until its own backward ends, so the segment's backward holds the units
    recomputed and not yet reduced. Measured on two gloo ranks (six units of 8.4 MB, one
    segment over all six): 120.8 MB, where counting two units predicted 104.0. So a
    backward of stage ``m`` holds the kept units of stages up to ``m``, and either the
    running and the prefetched unit (outside a segment) or the resharded units of its
    segment from its first stage to ``m`` plus one prefetched; a recompute of stage ``m`` holds the kept units up to the
    segment's end and the segment's resharded units up to ``m`` plus one more (the last
    all-gather's output, kept until the next collective). Outside a segment the unit
    running counts there only if it reshards (a kept one is among the kept), and so does
    the prefetched one, from the stages before. A unit's forward is counted per
    node by :attr:`RankShift.gathering`."""

    resharded: tuple[int, ...]
    """Per stage, bytes of the units it calls that reshard after forward."""
    kept: tuple[int, ...]
    """Per stage, bytes of the units it calls that stay gathered from forward to backward."""
    largest: int
    """The largest unit that reshards after forward (0: none)."""
    counted: int
    """Gathered unit bytes the static part counts at every moment."""

    def __post_init__(self) -> None:
        if len(self.resharded) != len(self.kept):
            raise ValueError("resharded and kept need one entry per stage")
        if min((*self.resharded, *self.kept, self.largest, self.counted), default=0) < 0:
            raise ValueError("gathered bytes cannot be negative")

    @functools.cached_property
    def _through(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Prefix sums of (resharded, kept): entry ``k`` sums stages ``[0, k)``."""
        resharded, kept = [0], [0]
        for r, k in zip(self.resharded, self.kept, strict=True):
            resharded.append(resharded[-1] + r)
            kept.append(kept[-1] + k)
        return tuple(resharded), tuple(kept)

    def backward(self, stage: int, start: int | None = None) -> int:
        """What the backward of ``stage`` holds beyond ``counted``; ``start``: the first
        stage of the checkpointed segment holding it (None: it is kept)."""
        resharded, kept = self._through
        if start is None:  # the one running and the one prefetched, if they reshard
            running = self.largest if self.resharded[stage] else 0
            gathered = running + (self.largest if resharded[stage] else 0)
        else:
            before = self.largest if resharded[start] else 0  # prefetched for what follows
            gathered = resharded[stage + 1] - resharded[start] + before
        return max(0, kept[stage + 1] + gathered - self.counted)

    def recompute(self, stage: int, start: int, end: int) -> int:
        """What the recompute of ``stage`` in the segment ``[start, end)`` holds beyond
        ``counted``."""
        resharded, kept = self._through
        last_output = self.largest if resharded[end] - resharded[start] else 0
        gathered = resharded[stage + 1] - resharded[start] + last_output
        return max(0, kept[end] + gathered - self.counted)


@dataclass(frozen=True)
class RankShift:
    """What one rank's peak differs from one process's, event by event: the stage model's
    (:mod:`solvers.chain`) terms for one rank (``rank``) against those for one unsharded
    process (``single``).

    NOTE [search: per-rank peaks]. A sharded engine changes what a rank keeps besides the
    activations (parameters, gradients and optimizer state sharded ``N`` ways, gathered
    units, gradient buckets, reduce-scatter windows): only the static, gradient and
    transient terms of the stage model, never its saved or input bytes (one rank runs one
    batch). So every moment of a step differs between a rank and one process by an amount
    that depends only on which event of the step it is (:meth:`difference`): the static
    part, the transient of the stage running, and in the backward the gradients made so
    far. The replay records one unsharded step; a rank's peak is the highest moment of the
    replay with its event's difference added (:meth:`peak`), which is what the search
    judges every plan by and what the plan states. Why not one shift per plan (the rank
    model's peak minus the single one's, added to the replay's peak), as before: the two
    peaks may be other events than the replay's (a rank peaks at the root's reduce-scatter
    at the end of backward, one process at the loss), and the search then found plans that
    lowered the shift without lowering the rank's peak (a Hugging Face Llama on two gloo
    ranks, predicted 37.8 MiB, measured 43.0). Why the lower bound :attr:`least_bytes` is
    one: every difference is at least it."""

    rank: ChainProblem
    single: ChainProblem
    windows: tuple[int, ...] = ()
    """Per stage, the part of the rank's transient that only its backward holds (FSDP2's
    reduce-scatter of a unit's gradients); the stage model counts it in both phases, a
    forward or recompute of the stage here does not. Empty: none."""
    held: tuple[int, ...] = ()
    """Per stage, what a rank holds when the stage's backward begins, from an earlier
    moment of the backward, and through a recompute there (FSDP2's retained reduce-scatter
    input of the group reduced before: NOTE [sharding: what a reduce-scatter holds] in
    autockpt/planning/sharding.py); the windows count it for the backward itself. Empty:
    none."""
    gathering: tuple[int, ...] = ()
    """Per compute node, what a rank holds more in that node's forward only (FSDP2's
    all-gathers, which keep the previous group's output until the next collective: NOTE
    [sharding: what a forward all-gather holds] in autockpt/planning/sharding.py; a group
    gathered when a node ends is counted on that node). Empty: none."""
    end_bytes: int = 0
    """What a rank holds more than its gradients and static part say when its backward
    ends (FSDP2's root reduce-scatter, after every gathered parameter is resharded): a
    moment of its own (:meth:`difference` ``"end"``)."""
    optimizer_bytes: int = 0
    """What a rank holds more at the optimizer's step than its gradients and static part
    say (the root's gradient shards instead of its full gradients, nothing gathered)."""
    units: UnitGathers | None = None
    """FSDP2's units gathered beyond what the static part counts, which depend on the plan
    (NOTE [search: gathered units]); None: none."""
    loss_bytes: int = 0
    """What a rank holds more (or less) while the loss runs, after the model's forward and
    before its backward: the units kept gathered beyond the static part's, less the root's
    parameters when the root reshards after its forward."""
    backward_start_bytes: int = 0
    """What a rank holds more in the first moment of its backward: the root gathered again
    (its all-gather's output beside its parameters) when it reshards after forward."""

    def __post_init__(self) -> None:
        if self.rank.num_stages != self.single.num_stages:
            raise ValueError("rank and single problems need the same stages")
        if self.windows and len(self.windows) != self.rank.num_stages:
            raise ValueError("windows needs one entry per stage (or none)")
        if self.held and len(self.held) != self.rank.num_stages:
            raise ValueError("held needs one entry per stage (or none)")
        if self.units is not None and len(self.units.kept) != self.rank.num_stages:
            raise ValueError("units needs one entry per stage")
        if self.backward_start_bytes < 0:
            raise ValueError("backward_start_bytes cannot be negative")
        if (
            self.rank.saved_bytes != self.single.saved_bytes
            or self.rank.input_bytes != self.single.input_bytes
        ):
            raise ValueError("a rank keeps the activations of one process: saved and input bytes")

    @functools.cached_property
    def _terms(self) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
        """(static difference, per-stage transient difference, per-stage difference of the
        gradients made from that stage to the end: ``G(k) = sum_{m >= k} g_m``, ``G(L) = 0``)."""
        rank, single = self.rank, self.single
        n = rank.num_stages
        gradients = [0] * (n + 1)
        for k in range(n - 1, -1, -1):
            gradients[k] = gradients[k + 1] + rank.param_grad_bytes[k] - single.param_grad_bytes[k]
        transient = tuple(
            r - s for r, s in zip(rank.transient_bytes, single.transient_bytes, strict=True)
        )
        return rank.static_bytes - single.static_bytes, transient, tuple(gradients)

    def difference(self, phase: str, stage: int, end: int = -1) -> int:
        """A rank's bytes minus one process's at one event of the step: the forward of
        ``stage`` (also the prologue, the loss and the loss's own backward, before any
        gradient: the last stage's), its ``backward``, its ``recompute`` inside a segment
        ending at stage ``end`` (whose gradients wait), the ``end`` of backward (every
        gradient made, :attr:`end_bytes`) or the ``optimizer`` step."""
        static, transient, gradients = self._terms
        window = self.windows[stage] if self.windows else 0
        if phase == "optimizer":
            return static + gradients[0] + self.optimizer_bytes
        if phase == "end":
            return static + gradients[0] + self.end_bytes
        if phase == "backward":
            return static + transient[stage] + gradients[stage]
        if phase == "recompute":
            held = self.held[end - 1] if self.held else 0
            return static + transient[stage] - window + gradients[end] + held
        return static + transient[stage] - window

    def peak(
        self,
        slots: Iterable[tuple[str, int, int]],
        segments: Sequence[tuple[int, int]],
        stages: Sequence[tuple[int, int]],
    ) -> int:
        """One rank's peak of a plan (stage ranges ``segments``) from its replay's slots
        (:meth:`solvers.replay.Replayer.timeline`: phase, node, highest bytes): the highest
        slot with its event's :meth:`difference` added. A recompute slot covers its whole
        segment, so it takes the segment's largest difference."""
        return max(self.moments(slots, segments, stages), default=0)

    def moments(
        self,
        slots: Iterable[tuple[str, int, int]],
        segments: Sequence[tuple[int, int]],
        stages: Sequence[tuple[int, int]],
    ) -> list[int]:
        """Each slot's bytes on one rank (:meth:`peak`'s terms, in the slots' order)."""
        slots = list(slots)
        stage_of = _stage_of_node(tuple(stages))
        if self.gathering and len(self.gathering) != len(stage_of):
            raise ValueError("gathering needs one entry per compute node (or none)")
        last = len(stages) - 1
        by_first = {stages[start][0]: (start, end) for start, end in segments}
        # A stage whose backward has no slot of its own (an embedding's, whose gradient
        # autograd accumulates in the next slot's window; the root's reduce-scatter, which
        # ends backward after every node's) is counted in the backward slot that follows
        # it in time: each backward slot covers the stages down to the next one's.
        backward = [
            i for i, (phase, node, _) in enumerate(slots) if phase == "backward" and node >= 0
        ]
        covers: dict[int, range] = {}
        upper = last
        for j, i in enumerate(backward):
            lower = stage_of[slots[backward[j + 1]][1]] + 1 if j + 1 < len(backward) else 0
            covers[i] = range(
                min(lower, stage_of[slots[i][1]]), max(upper, stage_of[slots[i][1]]) + 1
            )
            upper = lower - 1
        segment_of = {k: (start, end) for start, end in segments for k in range(start, end)}
        units = self.units
        first_backward = backward[0] if backward else -1
        found = []
        for i, (phase, node, value) in enumerate(slots):
            if phase == "recompute":
                start, end = by_first[node]
                extra = max(
                    self.difference(phase, m, end)
                    + (units.recompute(m, start, end) if units else 0)
                    for m in range(start, end)
                )
            elif phase == "optimizer":
                extra = self.difference(phase, 0)
            elif i in covers:
                extra = max(
                    self.difference(phase, m)
                    + (units.backward(m, segment_of.get(m, (None,))[0]) if units else 0)
                    for m in covers[i]
                )
                if covers[i].start == 0:  # the last backward slot: the backward ends in it
                    extra = max(extra, self.difference("end", 0))
                if i == first_backward:
                    extra += self.backward_start_bytes
            elif node >= 0 and phase in ("prologue", "forward"):
                extra = self.difference("forward", stage_of[node])
                extra += self.gathering[node] if self.gathering else 0
            else:  # the loss and its own backward: after the forward, before any gradient
                extra = self.difference("forward", last) + self.loss_bytes
            found.append(value + extra)
        return found

    @functools.cached_property
    def least_bytes(self) -> int:
        """A lower bound of every moment's difference: a forward without its stage's window,
        the loss's (:attr:`loss_bytes` below zero), the end and the optimizer step as they
        are, a backward or recompute no lower than
        the least gradient difference from its stage on (``G(j)`` for ``j >= m``, ``G(L) =
        0`` included)."""
        static, transient, gradients = self._terms
        n = len(transient)
        windows = self.windows or (0,) * n
        least_after = [0] * (n + 1)  # min over k >= m of G(k), G(n) = 0 included
        for k in range(n - 1, -1, -1):
            least_after[k] = min(least_after[k + 1], gradients[k])
        return static + min(
            gradients[0] + min(self.optimizer_bytes, self.end_bytes),
            transient[n - 1] - max(0, windows[n - 1]) + min(0, self.loss_bytes),
            *(transient[m] - max(0, windows[m]) + least_after[m] for m in range(n)),
        )


@functools.lru_cache(maxsize=8)
def _stage_of_node(stages: tuple[tuple[int, int], ...]) -> tuple[int, ...]:
    """Per compute node, the stage holding it."""
    return tuple(k for k, (first, stop) in enumerate(stages) for _ in range(first, stop))
