"""What a size not planned in full would need: estimates from the sizes that were.

NOTE [fit: one probe, scaled] (autockpt/fit/__init__.py) says why: one size is probed, and
every other is planned from shapes alone, its kernel workspaces carried over from the sizes
planned in full, scaled with the size, so that an estimate lies above the plan before
anything runs at it (tests/test_fit_contract.py: every size planned in full fits).
"""

from __future__ import annotations

import math

from autockpt.api import Planner
from autockpt.costs.record import ACCUMULATED_GRADIENTS
from solvers import replay

__all__ = ["growth_per_size", "model_gap", "per_node", "scaled", "with_workspaces"]


def scaled(known: dict[int, int], size: int, fixed: int) -> int:
    """A value at ``size`` from the values ``known`` at other sizes (NOTE [fit: one probe,
    scaled]): between two known sizes, the line between them; above the largest, ``fixed``
    plus the rest of its value in proportion to the size; below the smallest, its value.
    Nothing known: 0."""
    if not known:
        return 0
    if size in known:
        return known[size]
    below = max((n for n in known if n < size), default=None)
    above = min((n for n in known if n > size), default=None)
    if below is None:
        assert above is not None
        return known[above]
    if above is None:
        return fixed + math.ceil((known[below] - fixed) * size / below)
    rise = (known[above] - known[below]) * (size - below) / (above - below)
    return known[below] + math.ceil(rise)


def with_workspaces(
    shapes: Planner,
    size: int,
    measured: dict[int, tuple[Planner, Planner]],
    gaps: dict[int, int],
) -> int:
    """An estimate of the leanest peak at ``size`` (``shapes``: planned there from shapes
    alone) from the sizes planned in full, ``measured`` (size: its planner in full and its
    planner from shapes alone), NOTE [fit: one probe, scaled]: a plan replayed on the
    shapes' step as a curve, each point raised by the workspace of the kernel that runs
    there, scaled to ``size`` (:func:`_raised_peak`, :func:`per_node`), plus every byte
    kernels save beyond their operators' results, plus what that model missed where sizes
    were planned in full (:func:`model_gap`), scaled; ``gaps`` keeps them by size between
    calls (each is a replay). Of two plans, the lower: the shapes' leanest, blind to
    workspaces, and the nearest size's leanest, which steers around them.

    Why the gap and not what a size planned in full added to its leanest peak over its
    shapes, scaled (the floor this took before): that sum is mostly workspace that does not
    grow (a 3x3 convolution's backward buffer, the same 4.5 MiB from a batch of 2 up on the
    VGG-like stack of ``benchmarks.fit``), so scaling it in proportion judged every size a
    few steps above the last one planned in full over the budget, and the search climbed
    one full plan at a time (sizes 1, 4, 5, 8, 10 there; from 2 and 3 planned in full, the
    floor put 10 at 17.4 MB, the model at 13.7, the plan is 13.5). The model's own gap at
    the sizes it was measured at is what it cannot see (allocations fake kernels miss, the
    loss's measured windows): 0 there."""
    graphs = {n: p.profile.nodes for n, (p, _) in measured.items() if p.nested is None}
    if (
        shapes.nested is not None
        or len(graphs) != len(measured)
        or {len(v) for v in graphs.values()} != {len(shapes.profile.nodes)}
    ):
        added = scaled(
            {
                n: max(0, p.minimum_peak_bytes - s.minimum_peak_bytes)
                for n, (p, s) in measured.items()
            },
            size,
            0,
        )
        largest = max(
            (max(x.forward_workspace, x.backward_workspace) for v in graphs.values() for x in v),
            default=0,
        )
        top = max(measured)
        return shapes.minimum_peak_bytes + max(added, math.ceil(largest * max(1.0, size / top)))
    modelled = _modelled_peak(shapes, size, measured)
    for n, (full, shapes_n) in measured.items():
        if n not in gaps:
            gaps[n] = model_gap(full, shapes_n, n)
    found = {n: gaps[n] for n in measured}
    return max(modelled, shapes.minimum_peak_bytes) + scaled(found, size, 0)


def _modelled_peak(shapes: Planner, size: int, measured: dict[int, tuple[Planner, Planner]]) -> int:
    """:func:`with_workspaces`'s model at ``size``: the lower of the two plans' raised
    peaks, plus the bytes kernels save beyond their operators' results."""
    graphs = {n: p.profile.nodes for n, (p, _) in measured.items()}
    forward = per_node({n: [x.forward_workspace for x in v] for n, v in graphs.items()}, size)
    backward = per_node({n: [x.backward_workspace for x in v] for n, v in graphs.items()}, size)
    hidden = per_node({n: [x.hidden_saved for x in v] for n, v in graphs.items()}, size)
    nearest = min(graphs, key=lambda n: (abs(n - size), -n))
    raised = min(
        _raised_peak(shapes, plan_of, forward, backward)
        for plan_of in (shapes, measured[nearest][0])
    )
    return raised + sum(hidden)


def model_gap(full: Planner, shapes: Planner, size: int) -> int:
    """How far the leanest peak of a size planned in full (``full``; ``shapes``: the same
    size from shapes alone) lies above what :func:`_modelled_peak` makes of it from its own
    workspaces (never below 0)."""
    return max(0, full.minimum_peak_bytes - _modelled_peak(shapes, size, {size: (full, shapes)}))


def per_node(known: dict[int, list[int]], size: int) -> list[int]:
    """Each node's workspace at ``size`` from its workspaces at the sizes ``known``. From one
    size alone, in proportion to the size above it (all of it taken as growing: an upper
    bound). Else the line through two known sizes (a workspace is a part that grows with the
    size and a part that does not): between the two that bracket ``size``; above them all,
    through the two largest above the smallest known size, never below the larger value
    (with one size above the smallest, in proportion to it); below them all, the smallest
    size's value (an upper bound where workspaces grow with the size).

    Why not through the smallest size above them all: the smallest size planned is often a
    batch of 1, where kernels take other paths (a CPU convolution's workspace at 1 was
    larger than at 6 on tests/test_fit_contract.py's stack, and 1/250 of its size at 2 on
    benchmarks.fit's VGG-like one), and a line through it and one other size fell 7% below
    the plan it predicted."""
    sizes = sorted(known)
    if size in known:
        return list(known[size])
    if len(sizes) == 1:
        return [math.ceil(v * max(1.0, size / sizes[0])) for v in known[sizes[0]]]
    if size < sizes[0]:
        return list(known[sizes[0]])
    above = [n for n in sizes if n > size]
    if not above and len(sizes) == 2:  # one size above the smallest: in proportion to it
        return per_node({sizes[-1]: known[sizes[-1]]}, size)
    a, b = (max(n for n in sizes if n < size), above[0]) if above else sizes[-2:]
    values = []
    for va, vb in zip(known[a], known[b], strict=True):
        line = math.ceil(va + (vb - va) * (size - a) / (b - a))
        values.append(line if above else max(line, va, vb))
    return values


def _raised_peak(shapes: Planner, plan_of: Planner, forward: list[int], backward: list[int]) -> int:
    """The peak of ``plan_of``'s leanest plan replayed on ``shapes``'s step, each moment
    raised by the workspace of the kernel that runs there (a recompute: its segment's
    largest), as the recorded step holds one over its whole window (NOTE [record:
    workspaces])."""
    lean = plan_of.search.leanest()
    ranges, stash = plan_of.predictor.node_ranges(lean.segments)
    curve = replay.timeline(shapes.trace, ranges, stash, lean.kept or None)
    recompute = {start: max(forward[start:end], default=0) for start, end in ranges}
    at = {replay.FORWARD: forward, replay.BACKWARD: backward}
    raised = 0
    for phase, node, peak in curve:
        if phase == "recompute":
            workspace = recompute.get(node, 0)
        else:
            workspace = at[phase][node] if phase in at and node < len(forward) else 0
        raised = max(raised, peak + workspace)
    return raised


def growth_per_size(planner: Planner, size: int) -> float:
    """How much the leanest plan's peak grows per unit of size, judged from one size: its
    forward and backward peak (the optimizer's step, which does not grow, left out) above
    what does not grow with the size (parameters, buffers, their gradients, the optimizer's
    state), spread over the size. It errs high (the activations of a small size are no
    smaller than linear), so the first guess lands below the answer, where a planner is not
    wasted: the secant through it and the first size is then close."""
    if (
        planner.nested is not None
    ):  # planned as units (a root not captured whole): the line through the origin
        return planner.minimum_peak_bytes / size
    prof = planner.profile
    lean = planner.search.leanest()
    node_ranges, stash = planner.predictor.node_ranges(lean.segments)
    curve = replay.timeline(planner.trace, node_ranges, stash, lean.kept or None)
    working = max(b for phase, _, b in curve if phase != replay.OPTIMIZER)
    resident = dict(planner.trace.resident)
    gradients = resident.pop(ACCUMULATED_GRADIENTS, prof.param_grad_bytes)
    fixed = prof.param_bytes + prof.buffer_bytes + gradients + sum(resident.values())
    return max(working - fixed, prof.input_bytes, 1) / size
