"""Stage 3 — problem: linearise the profiled graph into a chain of stages for the solvers.

A *cut* between two consecutive compute nodes is where a checkpoint segment may begin or
end. Everything produced before the cut and used after it crosses the cut; a segment that
begins there keeps exactly those bytes (its inputs) instead of what its nodes save. Cuts
are chosen where few bytes cross (several tensors may cross), and a cut is never placed
across a tensor that a later node mutates in place, because a recompute would then read the
mutated value.

The result, :class:`Chain`, pairs node ranges with a :class:`solvers.ChainProblem` of plain
numbers: the solvers never see torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch.fx as fx

from autockpt.capture.captured import Capture
from autockpt.costs.profile import Profile
from solvers import ChainProblem

DEFAULT_MAX_STAGES = 160


class NodeRange(NamedTuple):
    """Compute-node indices ``[first, stop)``: what the rewrite checkpoints and the plan
    simulator replays. A tuple, so ``first, stop = r`` keeps working."""

    first: int
    stop: int


class StageRange(NamedTuple):
    """Stage indices ``[start, end)`` of a :class:`Chain`: what the solvers return as a
    segment. Distinct from :class:`NodeRange` so the two are never mixed up silently in
    signatures; :meth:`Chain.node_range` converts."""

    start: int
    end: int


@dataclass(frozen=True)
class Chain:
    """Stages as half-open ranges of compute-node indices, and the numbers the solver uses.

    ``problem.budget_bytes`` is a placeholder (the no-checkpoint need) until
    :meth:`ChainProblem.with_budget` sets the real one.
    """

    stages: tuple[NodeRange, ...]
    node_names: tuple[str, ...]
    problem: ChainProblem

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def node_range(self, start_stage: int, end_stage: int) -> NodeRange:
        """Compute-node index range covered by stages ``[start_stage, end_stage)``."""
        return NodeRange(self.stages[start_stage].first, self.stages[end_stage - 1].stop)

    def stage_ranges_for(
        self, node_ranges: Sequence[tuple[int, int]]
    ) -> tuple[StageRange, ...] | None:
        """The stage ranges covering exactly ``node_ranges`` (one each, same order), or
        ``None`` when a range boundary is not a stage boundary (not a cut of this chain).
        This is how a plan given by node ranges (checkpoint each block) enters the
        solvers' stage space."""
        start_of = {stage.first: k for k, stage in enumerate(self.stages)}
        end_of = {stage.stop: k + 1 for k, stage in enumerate(self.stages)}
        found = []
        for first, stop in node_ranges:
            start, end = start_of.get(first), end_of.get(stop)
            if start is None or end is None or start >= end:
                return None
            found.append(StageRange(start, end))
        return tuple(found)


def build_chain(
    capture: Capture,
    profile: Profile,
    *,
    max_stages: int = DEFAULT_MAX_STAGES,
    static_bytes: int | None = None,
    segment_overhead_seconds: float = 0.0,
    required_cuts: Sequence[int] = (),
) -> Chain:
    """Choose cuts and fold per-node costs into per-stage numbers.

    ``static_bytes`` overrides the static part (e.g. 0 for ``scope="activations"``).
    ``required_cuts`` (positions ``p`` between compute nodes ``p-1`` and ``p``, e.g.
    :func:`autockpt.costs.blocks.block_cut_positions`) are kept whenever they are valid, even
    past ``max_stages``; the remaining stage budget goes to the cheapest other cuts. A
    required cut that the in-place rule forbids is left out; :meth:`Chain.stage_ranges_for`
    then reports the node ranges it bounds as not expressible.
    """
    nodes = capture.compute_nodes()
    n = len(nodes)
    if n == 0:
        raise ValueError("the captured graph has no compute nodes; nothing to checkpoint")
    if len(profile.nodes) != n:
        raise ValueError("profile and capture disagree on the number of nodes")
    index_of = {node: i for i, node in enumerate(nodes)}
    last_use = _last_uses(nodes, index_of, n)
    crossing = _crossing_storages(profile, last_use, n)
    valid = _valid_cuts(profile, n)
    cuts = _choose_cuts(valid, crossing, profile.storage_bytes, max_stages, required_cuts)
    bounds = [0, *cuts, n]
    stages = tuple(NodeRange(bounds[k], bounds[k + 1]) for k in range(len(bounds) - 1))
    size = profile.storage_bytes

    def nbytes(storages: set[int] | frozenset[int]) -> int:
        return sum(size[s] for s in storages)

    boundary = tuple(
        frozenset(crossing[start]) if start > 0 else frozenset() for start, _ in stages
    )
    owned, shared = _attribute_saved(profile, stages)
    saved, inputs, fwd, bwd, grads, transient = [], [], [], [], [], []
    for k, (start, end) in enumerate(stages):
        stage_saved = {s for i in range(start, end) for s in profile.nodes[i].saved}
        out_boundary = crossing[end] if end < n else set()
        saved.append(nbytes(owned[k]))
        inputs.append(nbytes(boundary[k]))
        # the cost model (deterministic), not measured seconds: NOTE [profile: cost model]
        fwd.append(sum(profile.nodes[i].cost_seconds for i in range(start, end)))
        bwd.append(sum(profile.nodes[i].backward_seconds for i in range(start, end)))
        grads.append(sum(profile.nodes[i].param_grad_bytes for i in range(start, end)))
        transient.append(
            nbytes(shared[k])
            + _stage_transient(
                profile, last_use, start, end, stage_saved, boundary[k] | out_boundary
            )
        )
    # The model's output and its gradient live from the end of forward into backward.
    tail = 2 * profile.output_bytes
    static = profile.static_bytes if static_bytes is None else static_bytes
    problem = ChainProblem(
        saved_bytes=saved,
        input_bytes=inputs,
        forward_seconds=fwd,
        budget_bytes=static + tail + sum(saved) + sum(grads) + max(transient) + max(inputs),
        backward_seconds=bwd,
        static_bytes=static + tail,
        param_grad_bytes=grads,
        transient_bytes=transient,
        segment_overhead_seconds=segment_overhead_seconds,
    )
    return Chain(stages, tuple(node.name for node in nodes), problem)


def _attribute_saved(
    profile: Profile, stages: tuple[tuple[int, int], ...]
) -> tuple[list[set[int]], list[set[int]]]:
    """Give each saved storage to the *last* stage that saves it.

    A storage saved by several stages (a ReLU's output that the next Linear saves too) must
    count once. Owned by its last saver, it is counted exactly in the forward: if that stage
    is kept it is stored; if it is checkpointed, either the storage was made inside the same
    segment (recomputed, correctly not stored) or it entered the segment and is counted in
    the segment's input bytes. Earlier savers still hold it during their own backward, after
    the owner's backward has run, so it is added to their transient bytes (``shared``).
    """
    stage_of = [0] * len(profile.nodes)
    for k, (start, end) in enumerate(stages):
        for i in range(start, end):
            stage_of[i] = k
    savers: dict[int, set[int]] = {}
    for i, node in enumerate(profile.nodes):
        for s in node.saved:
            savers.setdefault(s, set()).add(stage_of[i])
    owned: list[set[int]] = [set() for _ in stages]
    shared: list[set[int]] = [set() for _ in stages]
    for s, ks in savers.items():
        last = max(ks)
        owned[last].add(s)
        for k in ks - {last}:
            shared[k].add(s)
    return owned, shared


def _last_uses(nodes: list[fx.Node], index_of: dict[fx.Node, int], n: int) -> list[int]:
    """Index of the last compute node using each node's value (``n`` for the graph output)."""
    last = []
    for i, node in enumerate(nodes):
        uses = [index_of.get(user, n) for user in node.users]
        last.append(max(uses, default=i))
    return last


def _crossing_storages(profile: Profile, last_use: list[int], n: int) -> list[set[int]]:
    """For every cut position p (between node p-1 and p), the storages produced before p
    and still used at or after p. Computed in one sweep: O(n + total outputs)."""
    crossing: list[set[int]] = [set() for _ in range(n + 1)]
    live: dict[int, int] = {}  # storage -> last position it is needed at
    for p in range(1, n + 1):
        i = p - 1
        for s in profile.nodes[i].outputs:
            live[s] = max(live.get(s, -1), last_use[i])
        crossing[p] = {s for s, until in live.items() if until >= p}
        live = {s: until for s, until in live.items() if until >= p}
    return crossing


def _valid_cuts(profile: Profile, n: int) -> list[int]:
    """Cut positions that no later in-place mutation crosses.

    A mutation at node ``j`` of a storage first produced at node ``i`` forbids exactly the
    cuts in ``(i, j]``. The storage is live across each of them (node ``j`` reads it), so it
    is an input of any segment that starts there and reaches ``j``; checkpoint keeps
    segment inputs as saved tensors, and one changed in place afterwards fails the backward
    (or would be recomputed from the changed value). A segment starting there and ending
    before ``j`` without reading the storage would be safe, but a chain cut admits segments
    of every length on both sides, so it cannot be offered. Cuts outside ``(i, j]`` (a
    tensor made and mutated on one side, e.g. inside one block) are unaffected.
    """
    produced_at: dict[int, int] = {}
    for i, node in enumerate(profile.nodes):
        for s in node.outputs:
            produced_at.setdefault(s, i)
    # Mark each forbidden interval by its ends and sweep: O(n + mutations).
    opened = [0] * (n + 2)
    for j, node in enumerate(profile.nodes):
        for s in node.mutates:
            i = produced_at.get(s)
            if i is not None and i < j:
                opened[i + 1] += 1
                opened[j + 1] -= 1
    valid, depth = [], 0
    for p in range(1, n):
        depth += opened[p]
        if depth == 0:
            valid.append(p)
    return valid


def _choose_cuts(
    valid: list[int],
    crossing: list[set[int]],
    size: tuple[int, ...],
    max_stages: int,
    required: Sequence[int] = (),
) -> list[int]:
    """Keep the valid ``required`` cuts, then the cheapest other valid cuts (fewest crossing
    bytes, ties towards earlier positions) up to ``max_stages - 1`` cuts in all; the solver
    decides which of them to use. Required cuts are never dropped for the cap: a plan
    space without them cannot express the plan they stand for (checkpoint each block)."""
    kept = set(required) & set(valid)
    room = max_stages - 1 - len(kept)
    others = [p for p in valid if p not in kept]
    if len(others) <= room:
        return valid
    cost = {p: sum(size[s] for s in crossing[p]) for p in others}
    ranked = sorted(others, key=lambda p: (cost[p], p))
    return sorted([*kept, *ranked[: max(room, 0)]])


def _stage_transient(
    profile: Profile,
    last_use: list[int],
    start: int,
    end: int,
    stage_saved: set[int],
    boundaries: frozenset[int] | set[int],
) -> int:
    """Bytes a stage needs beyond its saved tensors and boundaries while it runs.

    Forward: intermediates produced inside the stage that are neither saved nor boundary
    tensors but still needed (a Linear's output before the activation that consumes it).
    Backward: a node's output gradient and its input gradients exist together, roughly its
    output bytes plus its tensor-input bytes. The larger of the two is the estimate: the
    stage chain is a proxy that seeds the search; what a plan is judged by is the replay
    (``solvers.replay``), which needs no such estimate.
    """
    size = profile.storage_bytes
    excluded = set(stage_saved) | set(boundaries)
    live: dict[int, int] = {}
    peak = 0
    for i in range(start, end):
        node = profile.nodes[i]
        for s in node.outputs:
            if s not in excluded:
                live[s] = max(live.get(s, -1), last_use[i])
        live = {s: until for s, until in live.items() if until >= i}
        forward = sum(size[s] for s in live)
        out_bytes = sum(size[s] for s in node.outputs)
        peak = max(peak, forward, 2 * out_bytes)
    return peak
