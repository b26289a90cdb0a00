"""The :class:`~autockpt.plan.Plan` of one solution: what was decided, why, and what it is
predicted to cost, from the prepared model and the predictor (nothing is computed twice).

A plan is made before its step is measured, and the rewrite reads its segments back from
it (``autockpt.rewrite.apply.segment_specs_from_plan``): the module a user gets is what the
plan says. The measurement then joins the plan (:func:`with_measurement`).
"""

from __future__ import annotations

import dataclasses

import torch

from autockpt.base.inputs import given_input_names
from autockpt.base.runtime import DEFAULT_LOSS, loss_name
from autockpt.capture.captured import node_module
from autockpt.capture.watch import leaf_note
from autockpt.costs.blocks import blocks_inside_notes
from autockpt.costs.problem import Chain
from autockpt.costs.profile import Profile
from autockpt.costs.record import (
    ACCUMULATED_GRADIENTS,
    OPTIMIZER_STATE,
    optimizer_record,
    optimizer_step_bytes,
)
from autockpt.errors import format_bytes
from autockpt.measure import Measurement
from autockpt.plan import KeptOp, MemoryBreakdown, Plan, RankMemory, Segment
from autockpt.planning.predict import Predictor
from autockpt.planning.prepared import Prepared
from autockpt.planning.sharding import RANK_MARGIN_BYTES, Sharding, rank_share
from autockpt.rewrite.segment import SegmentSpec
from solvers import Solution
from solvers.replay import MemoryTrace


def make_plan(
    prepared: Prepared,
    predictor: Predictor,
    solution: Solution,
    specs: list[SegmentSpec],
    budget_bytes: int,
    *,
    minimum_peak_bytes: int,
    no_checkpoint_peak_bytes: int,
    as_written_peak_bytes: int | None = None,
) -> Plan:
    """The plan's record of ``solution`` (its segments as ``specs`` translate them,
    ``autockpt/planning/specs.py``), not yet measured. ``as_written_peak_bytes``: the model
    as written without checkpointing (``Planner.as_written_peak_bytes``; None: unknown)."""
    model, captured, inputs, prof, chain = (
        prepared.model,
        prepared.capture,
        prepared.inputs,
        prepared.profile,
        prepared.chain,
    )
    sharding = prepared.request.sharding
    problem = chain.problem
    names = chain.node_names
    kept_per_segment = solution.kept or tuple(() for _ in solution.segments)
    recompute = predictor.recompute_seconds(solution.segments, kept_per_segment)
    segments = _segments(prepared, predictor, solution, specs, kept_per_segment)
    kept = _kept_activation_bytes(chain, solution)
    step_with = prof.step_seconds + recompute
    plan = Plan(
        model=type(model).__name__,
        graph_fingerprint=captured.fingerprint(),
        input_signature=inputs.signature(),
        input_names=given_input_names(model, inputs),
        capture_method=captured.method,
        leaf_modules=captured.leaf_modules,
        num_nodes=len(names),
        stages=tuple((names[a], names[b - 1]) for a, b in chain.stages),
        budget_bytes=budget_bytes,
        scope=prepared.request.scope,
        solver=solution.method,
        solver_status=solution.status,
        solve_seconds=solution.solve_seconds,
        solver_gap=solution.gap,
        segments=tuple(segments),
        predicted_peak_bytes=predictor.predict(solution.segments, solution.kept),
        no_checkpoint_peak_bytes=no_checkpoint_peak_bytes,
        minimum_peak_bytes=minimum_peak_bytes,
        predicted_recompute_seconds=recompute,
        predicted_step_seconds=step_with,
        recompute_fraction=recompute / step_with if step_with > 0 else 0.0,
        memory=MemoryBreakdown(
            parameters=prof.param_bytes,
            gradients=prof.param_grad_bytes,
            buffers=prof.buffer_bytes,
            inputs=prof.input_bytes,
            kept_activations=kept,
            no_checkpoint_activations=sum(problem.saved_bytes),
        ),
        calibration_bytes=0,
        times_estimated=prof.times_estimated,
        measured_peak_bytes=None,
        measured_step_seconds=None,
        device=prof.device,
        target=prepared.request.target.name if prepared.request.target else None,
        time_model=time_model(prepared),
        notes=_notes(prepared, predictor, solution, None),
        world_size=sharding.world_size,
        sharding=sharding.mode,
        fsdp_units=sharding.units,
        fsdp_kept_gathered=sharding.kept_gathered if sharding.mode == "fsdp" else None,
        rank_memory=prepared.rank_memory,
        timeline=predictor.timeline(solution.segments, solution.kept),
        optimizer=optimizer_record(prepared.trace, prepared.request.optimizer),
        accumulation_steps=prepared.request.accumulation_steps,
        loss=loss_name(prepared.request.loss_fn),
        as_written_peak_bytes=as_written_peak_bytes,
    )
    return dataclasses.replace(plan, notes=(*plan.notes, *as_written_notes(plan)))


def _segments(
    prepared: Prepared,
    predictor: Predictor,
    solution: Solution,
    specs: list[SegmentSpec],
    kept_per_segment: tuple[tuple[int, ...], ...],
) -> list[Segment]:
    """Each segment as the plan records it: where it lies, what it costs and frees, what runs it."""
    problem, names = prepared.chain.problem, prepared.chain.node_names
    nodes = prepared.capture.compute_nodes()  # the chain's nodes, in its order (``names``)
    segments = []
    for (start, end), spec, kept in zip(solution.segments, specs, kept_per_segment, strict=True):
        saved = sum(problem.saved_bytes[start:end])
        segments.append(
            Segment(
                start_stage=start,
                end_stage=end,
                first_node=names[spec.first],
                last_node=names[spec.end - 1],
                recompute_seconds=predictor.recompute_seconds([(start, end)], [kept]),
                bytes_freed=saved - problem.input_bytes[start],
                preserve_rng=spec.preserve_rng,
                restore_buffers=spec.restore_buffers,
                kept_ops=tuple(KeptOp(*call) for call in spec.kept_ops),
                first_module=node_module(nodes[spec.first]),
                last_module=node_module(nodes[spec.end - 1]),
            )
        )
    return segments


def _kept_activation_bytes(chain: Chain, solution: Solution) -> int:
    """Activation bytes the plan keeps (outside segments, and segment inputs): a breakdown row."""
    problem = chain.problem
    in_segment = {k for start, end in solution.segments for k in range(start, end)}
    kept = sum(s for k, s in enumerate(problem.saved_bytes) if k not in in_segment)
    kept += sum(problem.input_bytes[start] for start, _ in solution.segments)
    return kept


def as_written_notes(plan: Plan) -> tuple[str, ...]:
    """What a plan says when its captured graph without checkpointing peaks apart from the
    model as written (by more than 0.1%): by how much, and why. Plans run the graph, so
    where it is leaner part of a plan's saving against the model as written is the graph's."""
    written, graph = plan.as_written_peak_bytes, plan.no_checkpoint_peak_bytes
    if written is None or abs(written - graph) * 1000 <= written:
        return ()
    gap = written - graph
    share = f"{100 * abs(gap) / written:.1f}%"
    head = (
        f"the captured graph without checkpointing peaks at {format_bytes(graph)}, "
        f"{abs(gap)} bytes ({share}) {'below' if gap > 0 else 'above'} the model as written "
        f"({format_bytes(written)}, predicted on fake tensors; the baseline 'without "
        "checkpointing')"
    )
    if gap < 0:
        return (
            f"{head}: the graph runs other operators than the model's code (e.g. out of "
            "place where the model writes in place)",
        )
    dropped = (
        " and drops what the model computes but never uses (torch.export)"
        if plan.capture_method == "export"
        else ""
    )
    return (
        f"{head}: the graph frees each value after its last use{dropped}, where the model's "
        "own code keeps tensors alive (in its variables, in structures it builds or returns) "
        "until its forward returns; the rewritten model runs the graph, so that much of the "
        "saving against the model as written is the graph's, not checkpointing's",
    )


def with_measurement(
    plan: Plan,
    prepared: Prepared,
    predictor: Predictor,
    solution: Solution,
    checked: Measurement | None,
) -> Plan:
    """``plan`` with its verifying measurement: the measured peak (``None`` when sharded:
    one unsharded process is not a rank, its notes say what was measured) and step time
    (``None`` unless the measurement timed steps)."""
    if checked is None:
        return plan
    return dataclasses.replace(
        plan,
        measured_peak_bytes=None if prepared.request.sharding.active else checked.peak_bytes,
        measured_step_seconds=checked.step_seconds if checked.repeat > 0 else None,
        notes=(*_notes(prepared, predictor, solution, checked), *as_written_notes(plan)),
    )


def time_model(prepared: Prepared) -> str:
    """The plan's ``time_model``: measured seconds, or whose roofline."""
    if not prepared.profile.times_estimated:
        return "measured"
    target = prepared.request.target
    return f"roofline:{target.name if target else 'nominal'}"


def _notes(
    prepared: Prepared, predictor: Predictor, solution: Solution, checked: Measurement | None
) -> tuple[str, ...]:
    prof, sharding = prepared.profile, prepared.request.sharding
    notes = list(prepared.capture.warnings)
    notes += _requested_leaf_notes(prepared)
    notes.append(
        f"predicted peak: replay of one recorded step's {prepared.trace.source} events under "
        "this plan (solvers.replay)"
    )
    notes.append(prepared.precision.note())  # checked at each training call (precision.py)
    notes.append(_loss_note(loss_name(prepared.request.loss_fn)))
    if prof.loss_measured:
        notes.append(
            "the loss reads a value (.item() or a data-dependent shape) and cannot run on fake "
            "tensors: its memory is what the allocator measured of it on real tensors (its "
            "forward and backward peaks, the outputs it saves, the gradients it hands back)"
        )
    target = prepared.request.target
    if prof.device == "meta":
        notes.append(
            f"planned on the meta device for {target.describe() if target else 'a GPU'}: the "
            "step ran on fake CPU tensors, so attention is the fused kernel's (output and "
            "log-sum-exp saved, no seq x seq scores) and autocast casts as the GPU's does "
            "(NOTE [runtime: meta runs as a device])"
        )
    if prof.times_estimated:
        rates = f"{target.name}'s datasheet rates" if target else "nominal rates (no target)"
        notes.append(
            f"times are a roofline of each node's FLOPs and bytes at {rates}, not measured"
        )
    else:
        timing = prof.timing
        if timing is not None and timing.ranks:
            notes.append(
                "segments ranked by the seconds this plan reports: each node's measured "
                "forward time and a measured fixed cost per segment, "
                f"{'measured by an earlier process and ' if timing.reused else ''}stored in "
                f"{timing.stored} (reruns on this machine rank by the same seconds)"
            )
            factors = timing.factors
            if factors is not None:
                notes.append(
                    f"predicted seconds at the step factors forward {factors.forward:.3f}, "
                    f"backward {factors.backward:.3f}: a plan's step timed at "
                    f"{factors.measured_step * 1e3:.2f} ms against its nodes timed alone "
                    "(NOTE [timing: step factors]); the ranking is unchanged by them"
                )
            else:
                notes.append(
                    "predicted seconds are the nodes' timed alone: no plan of this model has "
                    "timed its step on this machine yet (NOTE [timing: step factors])"
                )
        else:
            notes.append(
                "segments ranked by a cost model of FLOPs and bytes (nothing stored: "
                "AUTOCKPT_CACHE_DIR is empty); seconds reported are measured node by node"
            )
    if prepared.planning_peak_bytes is not None:
        notes.append(f"planning peak: {prepared.planning_peak_bytes} bytes (allocator)")
    request = prepared.request
    if request.optimizer is not None or request.accumulation_steps > 1:
        notes.append(_iteration_note(request.optimizer, request.accumulation_steps))
    if sharding.active and checked is not None:
        # The measured step ran unsharded in this process: not a per-rank number.
        single = predictor.predict_single(solution.segments, solution.kept)
        notes.append(
            f"verified on one unsharded process: measured peak {checked.peak_bytes} bytes "
            f"against a predicted {single}"
        )
    if sharding.active and prepared.request.scope == "total":
        notes.append(
            f"per-rank safety margin: +{RANK_MARGIN_BYTES} bytes for the process group's own "
            "small tensors (autockpt.planning.sharding.RANK_MARGIN_BYTES)"
        )
    return tuple(notes)


def _loss_note(name: str) -> str:
    if name == DEFAULT_LOSS:
        return (
            "loss: default (the output's `loss` when it has one, else the sum of its floating "
            "tensors): the budget holds for that loss; plan with loss_fn= (command line: "
            "--loss) for the loss you train with"
        )
    return f"loss: {name}"


def _requested_leaf_notes(prepared: Prepared) -> list[str]:
    """Why the leaves the request named are kept whole (the capture's own leaves say why in
    its warnings, and here which repeated blocks they hide), or that they are not: an
    export graph inlines every module call."""
    request, captured = prepared.request, prepared.capture
    kept = set(captured.leaf_modules)
    asked = [m for m in request.leaf_modules if m in kept]
    units = [u for u in request.sharding.units if u in kept and u not in request.leaf_modules]
    notes = []
    if asked:
        notes.append(leaf_note(asked, "named in leaf_modules"))
    if units:
        notes.append(
            leaf_note(
                units,
                f"FSDP unit{'s' if len(units) > 1 else ''}: fully_shard's hooks gather the "
                "parameters when the module is called, so segments hold whole units",
            )
        )
    # the capture's own leaves: the repeated blocks each hides (autockpt/costs/blocks.py)
    auto = [m for m in kept if m not in {*request.leaf_modules, *request.sharding.units}]
    notes += blocks_inside_notes(prepared.model, sorted(auto))
    lost = [m for m in request.leaf_modules if m not in kept]
    if lost and captured.method == "export":
        notes.append(
            f"leaf_modules {', '.join(lost)} not kept whole: the graph was captured with "
            "torch.export, which inlines every module call, so segments may begin or end "
            "inside them"
        )
    return notes


def _iteration_note(optimizer: torch.optim.Optimizer | None, accumulation_steps: int) -> str:
    what = []
    if optimizer is not None:
        what.append(
            f"its {type(optimizer).__name__} state resident and the step after the backward "
            "(a stand-in of the optimizer stepped on fake tensors; the optimizer itself never)"
        )
    if accumulation_steps > 1:
        what.append(
            f"{accumulation_steps} micro-batches per step, the gradients resident through "
            "the second and later ones"
        )
    return "budget and predictions cover one training iteration from steady state: " + "; ".join(
        what
    )


def breakdown(
    prof: Profile, chain: Chain, scope: str, least: int, trace: MemoryTrace | None = None
) -> dict[str, int]:
    """Where the leanest plan's bytes go, for the error that refuses a budget below it (in
    scope "activations", only what that scope counts): the static part, what else the
    iteration keeps resident (the optimizer's state, accumulated gradients), the optimizer
    step's own peak, the activations."""
    parts = {
        "parameters": prof.param_bytes,
        "gradients": prof.param_grad_bytes,
        "buffers": prof.buffer_bytes,
        "inputs": prof.input_bytes,
    }
    if trace is not None:
        parts |= dict(trace.resident)
        if optimizer_step_bytes(trace):
            parts["optimizer step"] = optimizer_step_bytes(trace)
    parts |= {
        "activations without checkpointing": sum(chain.problem.saved_bytes),
        "leanest plan's peak": least,
    }
    if scope == "activations":
        parts = {k: v for k, v in parts.items() if k.startswith(("activations", "leanest"))}
    return parts


def rank_breakdown(
    parts: dict[str, int], memory: RankMemory, sharding: Sharding, kept: float = 1.0
) -> dict[str, int]:
    """The error breakdown for one rank: its local parameters and engine buffers, and what it
    keeps of the iteration's resident state: the optimizer's state as the plan's
    ``rank_memory`` counts it, accumulated gradients as the rank's stage model does (a
    shard each under FSDP, whole under DDP; ``kept``: in the dtype the rank keeps them,
    :func:`autockpt.planning.sharding.kept_ratio`). Its "leanest plan's peak" is already a
    rank's (NOTE [search: per-rank peaks])."""
    label = f"per rank of {sharding.world_size} ({sharding.mode})"
    rank = {
        f"parameters {label}": memory.parameters,
        "gradients per rank": memory.gradients,
    }
    if memory.buckets:
        rank["DDP gradient buckets"] = memory.buckets
    if memory.gathered_parameters:
        rank["FSDP all-gathered parameters"] = memory.gathered_parameters
        rank["FSDP reduce-scatter window"] = memory.reduce_scatter
    rest: dict[str, int] = {}
    for name, nbytes in parts.items():
        if name in ("parameters", "gradients"):
            continue
        if name == OPTIMIZER_STATE:
            rest[f"{name} per rank"] = memory.optimizer_state
        elif name == ACCUMULATED_GRADIENTS:
            rest[f"{name} per rank"] = rank_share(round(nbytes * kept), sharding)
        else:
            rest[name] = nbytes
    return rank | rest
