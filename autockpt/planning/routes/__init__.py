"""The routes of planning: one module per way a model is planned, behind one protocol.

==========================  ============================================================
``routes/base.py``          the protocol every route answers (NOTE [routes: protocol]),
                            the options of a solve, the one real step a route measures
``routes/captured.py``      a model whose forward is captured whole (fx or torch.export):
                            one graph, the replay, the search (NOTE [routes: captured graph])
``routes/compiled.py``      a model under ``torch.compile``: the captured graph's route, and
                            compile's own partitions measured beside its plan (NOTE
                            [compiled: partitioner budgets])
``routes/units.py``         a root whose own forward cannot be captured, or an fx leaf
                            that hides repeated blocks where export fails too: submodule
                            calls planned as units under one budget (NOTE [nested: units])
==========================  ============================================================

The routes import nothing from each other (tests/test_house.py checks it): the compiled
route holds the captured graph's route as a value it is given. :func:`choose_route` is the
one place the choice is made, once per model, from the capture's outcome; a new way of
planning is a new module here and one more branch of that choice, never a branch inside
another route.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from autockpt.base.inputs import Inputs
from autockpt.capture.captured import Capture
from autockpt.capture.front import capture
from autockpt.capture.watch import leaf_notes
from autockpt.costs.blocks import blocks_inside_notes
from autockpt.errors import TraceError
from autockpt.planning.cache import capture_key, captured_before, keep_capture
from autockpt.planning.prepared import PlanningPeak
from autockpt.planning.request import Phases, ProgressFn, Request
from autockpt.planning.routes.base import Route
from autockpt.planning.routes.captured import CapturedRoute, refuse_below_floor
from autockpt.planning.routes.compiled import CompiledRoute
from autockpt.planning.routes.units import PlanUnit, plan_units
from autockpt.rewrite.apply import same

__all__ = ["Route", "choose_route"]


def choose_route(
    model: nn.Module,
    inputs: Inputs,
    request: Request,
    *,
    phases: Phases,
    planning_peak: PlanningPeak,
    hand_back: Callable[[nn.Module], nn.Module],
    budget_bytes: int | None,
    progress: ProgressFn,
    plan_unit: PlanUnit,
) -> Route:
    """Capture ``model`` and choose how it is planned. A graph of the whole step: the
    captured graph's route (compiled over it when the model came compiled). A capture that
    fails in the root's own code (an input check, a LayerDrop loop; not when sharded or on
    the meta device, where units cannot be found by running the forward), or an fx capture
    whose leaves hide repeated blocks torch.export cannot reach either (NOTE [routes: leaves
    that hide blocks]): the units route.
    An export capture made before of the same model and inputs is reused (NOTE [cache:
    captured graph]). Called inside the caller's ``as_found`` and ``training_mode`` blocks."""
    if budget_bytes is not None:  # below the parameters alone: refused before capture
        refuse_below_floor(model, inputs, None, request, budget_bytes)
    key = capture_key(model, inputs, request)
    captured = captured_before(model, key, inputs)  # NOTE [cache: captured graph]
    if captured is not None:
        phases.start("capture", "reusing the captured graph (autockpt.clear_cache())")
    else:
        phases.start("capture", "capturing the graph")
        try:
            captured = capture(
                model,
                inputs,
                leaf_modules=request.leaves,
                module_calls=request.sharding.units,
                prefer_export=lambda model, fx: _hidden_blocks(model, fx, request),
            )
        except TraceError as error:
            # Before any profiling of the root: data-dependent code in the root itself
            # (an input check) runs eagerly around a submodule that is planned instead.
            device = request.device
            if not error.in_root_code or request.sharding.active or device.type == "meta":
                raise
            return plan_units(model, inputs, request, error, phases, progress, plan_unit, hand_back)
        keep_capture(model, key, captured)  # kept before a refusal: the next budget reuses it
    hidden = _leaf_hiding_blocks(model, captured, request)
    graph: CapturedRoute | None = None
    try:
        graph = CapturedRoute(
            model, inputs, request, captured, phases, planning_peak, hand_back, budget_bytes
        )
    except TraceError as error:
        if hidden is None:
            raise
        unsized = error  # the fake step cannot size the leaf (a branch on values)
    if hidden is not None:  # NOTE [routes: leaves that hide blocks], the second step
        try:
            units = plan_units(
                model, inputs, request, hidden, phases, progress, plan_unit, hand_back
            )
        except TraceError:
            if graph is None:
                raise unsized from None
            units = None  # no submodule inside the leaves captures either: they stay whole
        if graph is None or (
            units is not None and units.minimum_peak_bytes < graph.minimum_peak_bytes
        ):
            return units
    return graph if hand_back is same else CompiledRoute(graph)


def _leaf_hiding_blocks(model: nn.Module, captured: Capture, request: Request) -> TraceError | None:
    """NOTE [routes: leaves that hide blocks], the second step. Where torch.export refused
    the model too (a branch on values, LayerDrop's draw inside the leaf), the fx capture's
    leaves still hide repeated blocks: the step is also planned as units (the units route
    runs the root's forward eagerly and plans the submodules it and each leaf call,
    descending through the leaf's own code), and the route with the lower minimum plans
    it. Why both: neither is leaner everywhere. A leaf whose own activations make the peak
    gains nothing from being checkpointed whole (its recompute holds them all again: on
    ``python -m benchmarks.leaves`` the graph's minimum is the no-checkpoint peak, the
    units' the hand plan's), while a leaf the units cannot reach inside (Hugging Face
    Whisper's decoder, whose layers are given a cache object) is best checkpointed whole,
    which only the graph can (52.88 MiB there, against 53.39 MiB as units). The cost is
    the planning of both. The error returned names the leaves and why fx keeps them whole
    (their capture notes). None where the fx capture is planned alone: no hidden blocks,
    leaves the user named, or where units cannot be found by running the forward (sharded,
    on the meta device, a plan from shapes alone): there the plan's notes name the blocks
    each leaf hides."""
    if captured.method != "fx+leaves" or _hidden_blocks(model, captured, request) is None:
        return None
    if request.sharding.active or request.device.type == "meta" or not request.probe:
        return None
    leaves = captured.leaf_modules  # all automatic: none named, none an FSDP unit
    reason = "; ".join(leaf_notes(captured.warnings, leaves)) or f"{', '.join(leaves)} kept whole"
    return TraceError(", ".join(leaves), "", "", reason)


def _hidden_blocks(model: nn.Module, captured: Capture, request: Request) -> str | None:
    """NOTE [routes: leaves that hide blocks]. Why an fx capture is to be captured again by
    torch.export, or None: its automatic leaves hold repeated blocks
    (:func:`~autockpt.costs.blocks.blocks_inside_notes`, the one block finder), so each
    leaf would run as one call, its blocks could only be checkpointed together, and the
    stated minimum may lie above checkpointing each block by hand (the budget contract's "a
    leaf never raises the minimum above per-block"). Why export reaches them: a submodule
    is a leaf when its code branches on something fx cannot trace, and export, tracing with
    real sizes, takes a branch on a shape (openai/whisper's attention compares a sequence
    length outside an assertion) as the example's path, guarded for other sizes. A branch
    on values or a draw (LayerDrop) is refused by export too: capture keeps the fx graph,
    and :func:`_leaf_hiding_blocks` plans the step as units instead, or, where it cannot,
    the plan says which blocks each leaf hides. Not when the user named leaf modules
    (export would inline them)."""
    if request.leaf_modules:
        return None
    auto = [m for m in captured.leaf_modules if m not in request.sharding.units]
    if not blocks_inside_notes(model, auto):
        return None
    return (
        f"fx would run {', '.join(auto)} as one call each, hiding the repeated blocks inside "
        "(NOTE [routes: leaves that hide blocks])"
    )
