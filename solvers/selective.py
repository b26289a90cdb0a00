"""Selective recompute: which operator outputs a checkpointed segment keeps.

Why
---
A checkpointed segment saves its inputs and recomputes everything inside it. Recomputing
a matrix multiply costs as much as running it; recomputing a pointwise op, a norm or a
dropout mask costs little but frees as much memory. Megatron's selective recomputation,
torchtitan's "save matmul outputs, except every other one" policy and ``torch.compile``'s
activation memory budget all keep the expensive outputs and recompute the cheap ones, each
by a fixed rule. Here the same replay that judges every segment plan (:mod:`solvers.replay`,
one memory model) decides, node by node, under the user's budget.

Formulation
-----------
A selective plan is a segment plan (stage ranges, :mod:`solvers.search`) plus, per segment,
the *kept* nodes: nodes inside it whose operator output the checkpoint keeps from the
forward (``torch.utils.checkpoint.create_selective_checkpoint_contexts`` returning
``MUST_SAVE`` for that operator call; ``autockpt/rewrite.py``). The recompute does not run
a kept node again, which saves its seconds; its output lives from the forward until the
recompute's copy would have died (replay rule 5). A node can be kept (:func:`keepable_nodes`)
when its forward calls exactly one operator that makes an allocation, no operator of it draws
random numbers (the recompute would then replay the generator from another state) or writes
in place, and no operator writes to what it made (a kept tensor written later would be
stale at recompute; torch refuses it). A node is only worth keeping if the recompute reaches
it (it runs before the segment's last save: early stop).

Cost: the plan's recompute seconds (:func:`solvers.search.recompute_seconds`) minus the
kept nodes' seconds (``ReplayChain.node_seconds``).

How
---
:func:`keep_greedily` starts from one segment plan and keeps nodes one at a time, most
seconds first (ties: lower node), each only if the replayed peak still fits; a second pass
orders by seconds per byte kept, and the cheaper result wins (total order ``(cost, peak,
kept)``). The planner starts it from the segment-only answer at the budget
(``autockpt/solve.py`` says why only that one). It is a heuristic over the kept sets (the
answer's status is ``feasible``), never dearer than the plan it starts from.
Deterministic: fixed orders and counts, no clocks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .chain import normalize_segments
from .replay import MemoryTrace, replayer

__all__ = ["SelectivePlan", "keep_greedily", "keepable_nodes", "plan_cost"]

Plan = tuple[tuple[int, int], ...]
Kept = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class SelectivePlan:
    """Stage ranges, and per range the nodes kept inside it; its replayed peak (with the
    chain's offset, a rank's shift included) and its cost."""

    segments: Plan
    kept: Kept
    peak_bytes: int
    cost_seconds: float

    def key(self) -> tuple:
        return (self.cost_seconds, self.peak_bytes, len(self.segments), self.segments, self.kept)


def keepable_nodes(trace: MemoryTrace) -> frozenset[int]:
    """Nodes whose one allocating operator a segment may keep (see the module docstring)."""
    if not trace.forward_ops:
        return frozenset()
    written = {a for ops in trace.forward_ops for op in ops for a in op.writes}
    found = set()
    for i, ops in enumerate(trace.forward_ops):
        making = [op for op in ops if op.allocations]
        if len(making) != 1 or any(op.seeded or op.writes for op in ops):
            continue
        if written.isdisjoint(making[0].allocations):
            found.add(i)
    return frozenset(found)


def plan_cost(chain, segments: Plan, kept: Kept) -> float:
    """Recompute seconds of a selective plan: the segments' stages, the overhead per segment,
    minus what the kept nodes save (``ReplayChain.node_seconds``, net of what keeping
    costs; ``math.fsum``: exact and order-independent)."""
    seconds = chain.stage_seconds
    parts = [seconds[m] for start, end in segments for m in range(start, end)]
    parts += [chain.segment_overhead_seconds] * len(segments)
    parts += [-chain.node_seconds[i] for nodes in kept for i in nodes]
    return math.fsum(parts)


def _peak(chain, segments: Plan, kept: Kept) -> int:
    # kept nodes change the activations only; a rank's moments move as the plan's do
    return chain.peak(segments, kept)


def _candidates(chain, segments: Plan) -> list[tuple[int, int]]:
    """``(segment index, node)`` pairs that may be kept: keepable and reached by the
    recompute."""
    keepable = _keepable(chain)
    replay = replayer(chain.trace)
    found = []
    for k, (first, stop) in enumerate(chain.node_ranges(segments)):
        reached = replay.recomputed_nodes(first, stop)
        found += [(k, i) for i in range(first, stop) if i in keepable and reached[i - first]]
    return found


def _keepable(chain) -> frozenset[int]:
    """:func:`keepable_nodes`, computed once per trace (kept with its replayer)."""
    replay = replayer(chain.trace)
    found = replay.__dict__.get("keepable")
    if found is None:
        found = replay.__dict__["keepable"] = keepable_nodes(chain.trace)
    return found


def keep_greedily(chain, segments: Iterable[Sequence[int]], budget_bytes: int) -> SelectivePlan:
    """The cheapest of two greedy passes keeping nodes inside ``segments`` while the replayed
    peak fits ``budget_bytes`` (most seconds first; most seconds per kept byte first). When
    the segment plan itself does not fit, it is returned with nothing kept."""
    plan: Plan = tuple(normalize_segments(segments, chain.num_stages))
    nothing: Kept = tuple(() for _ in plan)
    base = SelectivePlan(
        plan, nothing, _peak(chain, plan, nothing), plan_cost(chain, plan, nothing)
    )
    candidates = _candidates(chain, plan)
    if base.peak_bytes > budget_bytes or not candidates:
        return base
    sizes = _kept_bytes(chain.trace)
    seconds = chain.node_seconds
    orders = (
        sorted(candidates, key=lambda c: (-seconds[c[1]], c[1])),
        sorted(candidates, key=lambda c: (-seconds[c[1]] / max(1, sizes[c[1]]), c[1])),
    )
    best = base
    for order in orders:
        kept: list[list[int]] = [[] for _ in plan]
        peak = base.peak_bytes
        for k, node in order:
            if seconds[node] <= 0:
                continue
            kept[k].append(node)
            trial = tuple(tuple(sorted(nodes)) for nodes in kept)
            found = _peak(chain, plan, trial)
            if found <= budget_bytes:
                peak = found
            else:
                kept[k].pop()
        final = tuple(tuple(sorted(nodes)) for nodes in kept)
        candidate = SelectivePlan(plan, final, peak, plan_cost(chain, plan, final))
        if candidate.key() < best.key():
            best = candidate
    return best


def _kept_bytes(trace: MemoryTrace) -> list[int]:
    """Per node, the bytes its allocating operators made (what keeping it holds)."""
    sizes = trace.sizes
    return [sum(sizes[a] for op in ops for a in op.allocations) for ops in trace.forward_ops]
