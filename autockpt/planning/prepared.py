"""What every budget's plan is made from, prepared once: capture → profile → chain →
recorded step → per-rank terms, frozen in a :class:`Prepared`.

Why one frozen record: a planner answers many budgets (a frontier, a benchmark sweep, the
verification rounds of one budget) from one capture and one profile, and every part that
answers them (:class:`~autockpt.planning.predict.Predictor`,
:class:`~autockpt.planning.search.BudgetSearch`, :func:`~autockpt.planning.make_plan.make_plan`)
reads the same values. Nothing here changes after :func:`prepare` returns, so no part can see
another's half-finished state.

The order of the phases, and why:

1. *capture* (``autockpt.capture``) is done by the caller: a root whose own forward cannot be
   captured has its submodule calls planned as units (``autockpt/planning/nested.py``), and
   only the caller knows whether that is allowed.
2. *profile*: sizes from a step on fake tensors, kernel workspaces and times from a probe
   that runs one node at a time on the device (NOTE [profile: fake structure], NOTE
   [profile: probe]); the un-checkpointed step never runs for real.
3. *record*: one step's allocation events for the replay (``autockpt/costs/record.py``).
4. *chain*: the stage chain the proxy solvers and the plan records speak in; every repeated
   block's boundaries are cuts, so the per-block hand plan is always in the plan space.
5. *rank terms*: under sharding, what a rank keeps (``autockpt/planning/sharding.py``).

With the training loop's optimizer (and gradient accumulation) the recorded step is one
training iteration from steady state, and the stage chain's static part holds what it keeps
resident: one memory model for the whole iteration.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from autockpt.base.allocations import StorageSet
from autockpt.base.inputs import Inputs
from autockpt.base.optimizer import state_bytes
from autockpt.base.precision import Precision, requested_precision
from autockpt.base.runtime import (
    device_of,
    heard_written,
    is_unusual,
    parameters_written,
    release_freed_heap,
)
from autockpt.base.target import Target, resolve_target
from autockpt.capture.captured import Capture
from autockpt.costs.blocks import (
    PerBlockPlan,
    RepeatedBlocks,
    block_cut_positions,
    find_block_classes,
    per_block_plan,
    share_plans,
)
from autockpt.costs.problem import Chain, StageRange, build_chain
from autockpt.costs.profile import Profile, profile, trained_parameters
from autockpt.costs.record import ACCUMULATED_GRADIENTS, OPTIMIZER_STATE, record_trace
from autockpt.costs.timing import TIMING_PASSES
from autockpt.errors import UnusualStateError
from autockpt.plan import RankMemory
from autockpt.planning.request import Phases, Request, logger
from autockpt.planning.sharding import check_kept_precision, check_units_called, rank_problem
from solvers import ChainProblem
from solvers.replay import MemoryTrace
from solvers.search import RankShift


@dataclass(frozen=True, eq=False)
class Prepared:
    """One capture, profile, chain and recorded step of a model, for any number of budgets."""

    model: nn.Module
    inputs: Inputs
    request: Request
    precision: Precision
    """The precision the step was planned in (autocast around the call, parameter dtypes)."""
    capture: Capture
    profile: Profile
    chain: Chain
    """The stage chain in the budget's scope, per rank when sharded (scope "total")."""
    rank_shift: RankShift | None
    """What moves each moment of one process's step to a rank (sharded, scope "total");
    None: one process (NOTE [search: per-rank peaks])."""
    trace: MemoryTrace
    """One step's allocation events: what the replay (the one memory model) replays (with
    an optimizer, one training iteration's)."""
    rank_memory: RankMemory | None
    blocks: RepeatedBlocks | None
    per_block: PerBlockPlan | None
    """Checkpointing each repeated block, on this chain (the one derivation of the
    baseline: the search's seed, the frontier's per-block point)."""
    block_plans: tuple[PerBlockPlan, ...]
    """Checkpointing each instance of every repeated class (``per_block``'s class first):
    the one-line plans the search seeds itself with (NOTE [blocks: every class])."""
    planning_peak_bytes: int | None

    @property
    def single_problem(self) -> ChainProblem:
        """The stage problem of one unsharded process (``chain.problem`` unless sharded)."""
        return self.rank_shift.single if self.rank_shift is not None else self.chain.problem

    @property
    def per_block_segments(self) -> tuple[StageRange, ...] | None:
        """The per-block hand plan as stage ranges, when each block is one segment of the
        chain (None without repeated blocks)."""
        per = self.per_block
        return per.segments if per is not None and per.exact and per.segments else None

    @property
    def seeds(self) -> tuple[tuple[StageRange, ...], ...]:
        """Plans the search must never do worse than: every exact one-line per-block plan
        (NOTE [blocks: every class]) and the shares of each (NOTE [blocks: shares]), in
        that order, without repeats."""
        found: dict[tuple[StageRange, ...], None] = {}
        for plan in self.block_plans:
            if plan.exact and plan.segments:
                found[plan.segments] = None
        for plan in self.block_plans:
            if plan.exact and plan.segments:
                found.update(dict.fromkeys(share_plans(plan)))
        return tuple(found)

    @property
    def meta(self) -> bool:
        """On the meta device tensors have shapes and no data: plans come from the graph
        alone (cost-model times, no workspaces), and nothing is measured or verified."""
        return self.profile.device == "meta"


class PlanningPeak:
    """What planning itself allocates at most (reported in the plan's notes): on CUDA the
    device allocator's own peak over planning; elsewhere the allocator's peak while the
    profile's probe ran (the only real tensors planning makes; the rest runs on fake
    tensors)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device if device.type == "cuda" else None
        if self.cuda is not None:
            torch.cuda.synchronize(self.cuda)
            torch.cuda.reset_peak_memory_stats(self.cuda)

    def peak(self, prof: Profile) -> int | None:
        if self.cuda is not None:
            torch.cuda.synchronize(self.cuda)
            return torch.cuda.max_memory_allocated(self.cuda)
        return prof.probe_peak_bytes


def scope_chain(chain: Chain, scope: str, static_bytes: int) -> Chain:
    """The stage chain as a budget of ``scope`` counts it (``autockpt.plan.scoped_bytes``
    is the rule): for "activations", without the static part (parameters, buffers, inputs)
    and without parameter gradients."""
    if scope == "total":
        return chain
    problem = chain.problem
    zeros = tuple(0 for _ in problem.param_grad_bytes)
    return dataclasses.replace(
        chain,
        problem=dataclasses.replace(
            problem,
            static_bytes=problem.static_bytes - static_bytes,
            budget_bytes=problem.budget_bytes - static_bytes,
            param_grad_bytes=zeros,
        ),
    )


def resident_floor(
    model: nn.Module,
    inputs: Inputs,
    captured: Capture | None,
    optimizer: torch.optim.Optimizer | None = None,
) -> dict[str, int]:
    """What one step keeps whatever is checkpointed, read from the model, the inputs and the
    graph alone (no step runs): parameters, the gradients of the parameters the graph uses
    and trains, buffers, inputs and, with an optimizer, its state (a stand-in stepped once
    on fake tensors). All of it is alive when the backward ends, so every plan's peak in
    scope "total" on one process is at least the sum: a budget below it is refused before
    profiling. Named as the refusal's breakdown names them. Without a graph (``captured``
    None: before capture), parameters, buffers and inputs alone: which parameters train is
    the graph's to say."""
    static = StorageSet()  # parameters first, then buffers and inputs not shared with them
    parameters = static.add(model.parameters())
    buffers = static.add(model.buffers())
    input_bytes = static.add(inputs.tensors())
    if captured is None:
        return {"parameters": parameters, "buffers": buffers, "inputs": input_bytes}
    index_of = {node: i for i, node in enumerate(captured.compute_nodes())}
    trained = trained_parameters(model, captured, index_of)
    parts = {
        "parameters": parameters,
        "gradients": sum(p.numel() * p.element_size() for p, _ in trained.values()),
        "buffers": buffers,
        "inputs": input_bytes,
    }
    if optimizer is not None:
        parts[OPTIMIZER_STATE] = state_bytes(optimizer, trained.keys())
    return parts


def prepare(
    model: nn.Module,
    inputs: Inputs,
    captured: Capture,
    request: Request,
    precision: Precision,
    planning: PlanningPeak,
    phases: Phases,
    reused: tuple[Profile, MemoryTrace] | None = None,
) -> Prepared:
    """Profile, chain, record and the per-rank terms of a captured model (phases 2-5 of the
    module docstring), in training mode, leaving everything as found (the caller's
    ``as_found`` block). ``reused``: the profile and recorded step of an earlier call with
    the same key (autockpt/planning/cache.py), taken instead of phases 2 and 3.

    Why this is long: phases 2-5 in a straight line, each a few calls whose results the
    next reads; split, the frozen record's fields would travel through four signatures."""
    sharding = request.sharding
    check_units_called(captured, sharding.units)
    check_kept_precision(sharding, precision.kept)  # fsdp-bf16 needs FSDP ranks
    refuse_unusual_reads(model, captured)
    if reused is not None:
        phases.stop()
        prof, trace = reused
        logger.info("profile and record: reused from an earlier call (autockpt.clear_cache())")
        if prof.timing is not None and prof.timing.factors is None:
            # another process (or an earlier planner) may have timed a step since
            prof = prof.with_timing(prof.timing.with_stored_factors())
    else:
        phases.start("profile", "profiling (fake tensors, then node by node on the device)")
        with parameters_written() as written:
            prof = profile(
                model,
                captured,
                inputs,
                loss_fn=request.loss_fn,
                optimizer=request.optimizer,
                estimate_times=None if request.probe else True,
                repeat=TIMING_PASSES,
                target=request.target,
            )
        prof = with_written_parameters(prof, written)
        if prof.probe_peak_bytes is not None:  # a probe ran real tensors, now gone: so are
            release_freed_heap()  # their pages (a full collection costs 0.2 s: not after fakes)
        # The plan simulator: one step's allocations (fake tensors plus measured
        # workspaces), replayed under each plan; with an optimizer, one training iteration's.
        phases.start("record", "recording one step on fake tensors for the plan simulator")
        trace = record_trace(
            model,
            captured,
            inputs,
            loss_fn=request.loss_fn,
            profile=prof,
            optimizer=request.optimizer,
            accumulation_steps=request.accumulation_steps,
        )
    say_written_parameters(model, captured, prof)
    block_classes = find_block_classes(model)
    blocks = block_classes[0] if block_classes else None
    resident = dict(trace.resident)
    chain = build_chain(
        captured,
        prof,
        max_stages=request.max_stages,
        # what the stage proxy's static part holds besides parameters, buffers and inputs:
        # the optimizer's state, the gradients a micro-batch accumulates into
        static_bytes=prof.static_bytes + sum(resident.values()),
        segment_overhead_seconds=prof.segment_overhead_seconds,
        # every repeated block's boundaries, of every class, are cuts: each per-block
        # hand plan is always in the plan space (NOTE [blocks: every class])
        required_cuts=block_cut_positions(captured, block_classes),
    )
    chain = scope_chain(chain, request.scope, prof.static_bytes)
    # Sharding changes what a rank keeps (parameters, gradients, engine buffers), not the
    # activations: the stage model gets the per-rank terms, and each moment of the
    # simulated single-process step is moved to a rank by its event's difference.
    rank_memory: RankMemory | None = None
    rank_shift: RankShift | None = None
    if sharding.active:
        shift, rank_memory = rank_problem(
            chain.problem,
            chain.stages,
            captured,
            model,
            sharding,
            parameters=prof.param_bytes,
            gradients=prof.param_grad_bytes,
            buffers=prof.buffer_bytes,
            inputs=prof.input_bytes,
            optimizer_state=resident.get(OPTIMIZER_STATE, 0),
            accumulated_gradients=resident.get(ACCUMULATED_GRADIENTS, 0),
            kept_dtype=precision.kept,  # FSDP2's mixed precision keeps float32 shards
            run_device_type=run_device_type(request.target, prof.device),
        )
        if request.scope == "total":  # sharding changes only what "activations" leaves out
            chain = dataclasses.replace(chain, problem=shift.rank)
            rank_shift = shift
    return Prepared(
        model=model,
        inputs=inputs,
        request=request,
        precision=precision,
        capture=captured,
        profile=prof,
        chain=chain,
        rank_shift=rank_shift,
        trace=trace,
        rank_memory=rank_memory,
        blocks=blocks,
        per_block=per_block_plan(chain, captured, blocks),
        block_plans=tuple(
            plan
            for each in block_classes
            if (plan := per_block_plan(chain, captured, each)) is not None
        ),
        planning_peak_bytes=planning.peak(prof),
    )


def with_written_parameters(prof: Profile, written: set[str]) -> Profile:
    """``prof`` with the parameters its fake step saw the forward write in place among its
    mutated state (NOTE [runtime: parameters the forward writes]): a segment touching one
    restores it around its recompute, as it does a mutated buffer, and the predictor counts
    its snapshot. Unchanged (the same object) when the forward writes none."""
    if not written:
        return prof
    mutated = tuple(sorted({*prof.mutated_buffers, *written}))
    return dataclasses.replace(prof, mutated_buffers=mutated)


def say_written_parameters(model: nn.Module, captured: Capture, prof: Profile) -> None:
    """Tell the running ``as_found`` blocks which parameters the forward writes in place (a
    reused profile has run no fake step in this call), so planning's real steps leave them
    as found, and add a note saying so to the capture's, which become the plan's (NOTE
    [runtime: parameters the forward writes])."""
    parameters = dict(model.named_parameters(remove_duplicate=False))
    written = {name: parameters[name] for name in prof.mutated_buffers if name in parameters}
    if not written:
        return
    heard_written(written)
    note = (
        f"the forward updates {_listed(sorted(written))} in place (e.g. a forced weight "
        "normalisation under torch.no_grad()): a segment that recomputes such an update "
        "restores the parameter's value before and after its recompute, as it does a mutated "
        "buffer (restore_buffers), so the update happens once per step and the recompute "
        "sees the value the forward saw"
    )
    if note not in captured.warnings:
        captured.warnings.append(note)


def _listed(names: list[str], at_most: int = 4) -> str:
    shown = ", ".join(names[:at_most])
    more = len(names) - at_most
    word = "parameter" if len(names) == 1 else "parameters"
    return f"{word} {shown}" + (f" and {more} more" if more > 0 else "")


def refuse_unusual_reads(model: nn.Module, captured: Capture) -> None:
    """Raise :class:`~autockpt.errors.UnusualStateError` when the captured graph reads
    a parameter or buffer without dense values (sparse, quantized, a wrapper subclass): by
    an attribute node, or inside a module it calls whole. Those it does not read are planned
    around (NOTE [runtime: unusual state])."""
    read: set[str] = set()
    called: list[str] = []
    for node in captured.graph.nodes:
        if node.op == "get_attr":
            read.add(str(node.target))
        elif node.op == "call_module":
            called.append(f"{node.target}.")
    tensors = [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]
    for name, t in tensors:
        if not is_unusual(t):
            continue
        if name in read or any(name.startswith(prefix) for prefix in called):
            kind = "quantized" if t.is_quantized else str(t.layout).replace("torch.", "")
            if t.layout == torch.strided and not t.is_quantized:
                kind = type(t).__name__
            raise UnusualStateError(
                f"the forward reads '{name}', a {kind} tensor ({type(t).__name__}, shape "
                f"{list(t.shape)}): autockpt sizes a step on fake tensors and times it node by "
                "node, and cannot do either with a tensor that is not one dense strided "
                "tensor. Register a dense copy for the forward to read instead "
                "(tensor.to_dense(), tensor.dequantize(), a DTensor's full_tensor()), or keep "
                "it out of the forward: tensors the forward does not read may stay as they are"
            )


def start(
    model: nn.Module,
    inputs: Inputs,
    precision: Precision | str | None = None,
    target: Target | str | None = None,
) -> tuple[torch.device, Precision, PlanningPeak, Target | None]:
    """What is read before capture: the device, the precision asked for or else the one in
    effect (an autocast context around the call is the one training runs in:
    autockpt/base/precision.py), the start of planning's own peak, and the target checked
    against the device (NOTE [target: planning for another device]). A named mixed
    precision is autocast on the device the run uses: the target's, else the model's (a
    GPU's for a model on the meta device)."""
    device = device_of(model, inputs)
    target = resolve_target(target, device)
    asked = requested_precision(precision, model, run_device_type(target, device.type))
    return device, asked or Precision.now(model), PlanningPeak(device), target


def run_device_type(target: Target | None, planned_on: str) -> str:
    """The device type the run uses: the target's, else the one planned on, where a model
    on the meta device stands for a GPU's run (its autocast, its collectives: NOTE
    [sharding: the backend's reduce-scatter])."""
    if target is not None:
        return target.device_type
    kind = torch.device(planned_on).type
    return "cuda" if kind == "meta" else kind
