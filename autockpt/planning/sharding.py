"""What DDP and FSDP2 keep on each rank: the per-rank memory model a sharded plan uses.

autockpt composes with ``torch.distributed``; it never replaces it. The user plans one
rank's batch under a per-rank budget, then wraps the result the usual way::

    model = autockpt.optimize(model, batch, budget_gb=70, world_size=8, sharding="fsdp")
    for name in model.plan.fsdp_units:
        fully_shard(model.get_submodule(name))
    fully_shard(model)

Design (and why):

* **FSDP units are leaves of the capture.** FSDP2 all-gathers a unit's parameters in a
  forward pre-hook of the unit's module and frees them in a post-hook; both fire only if the
  unit is called as a module. Capturing each unit as one ``call_module`` node keeps it a
  real module call in the rewritten graph (fx keeps it a leaf; the export path, which
  inlines calls, folds the unit's nodes back into one call: NOTE [capture: module calls],
  autockpt/capture/outline.py, and :func:`check_units_called` refuses a unit neither path
  kept, with the reason), and every checkpoint segment, being a contiguous
  range of top-level nodes, then contains whole units (one or several, plus the glue between
  them) and never splits one. Recompute calls the unit again, so its hooks gather the
  parameters again, exactly as FSDP2 expects of checkpointed blocks. A segment strictly
  inside one unit is not offered: the budget's leanest plan then keeps one unit's saved
  tensors during its backward, which the solver accounts for.
* **The per-rank memory model changes only the static and transient terms** of the chain
  (what sharding changes); saved activations per stage are the same on every rank because
  ``example_inputs`` are one rank's batch.

  - DDP: full parameters and gradients, plus the reducer's gradient buckets. The reducer
    allocates flat buckets (``bucket_cap_mb``, 25 MiB by default) covering every gradient
    when DDP is constructed, so the buckets together hold one more copy of the gradients
    for as long as the wrapper lives (``gradient_as_bucket_view=True`` removes that copy;
    the model here assumes the default). The all-reduce runs in place on the buckets and
    the averaged gradients are copied back into the existing ``.grad`` tensors, so the end
    of backward allocates nothing more. With ``broadcast_buffers`` (the default) every
    forward starts with a flat copy of the buffers broadcast from rank 0: a transient of
    the buffers' size on the first stage.
  - Both: :data:`RANK_MARGIN_BYTES` (64 KiB) for the process group's own small tensors.
  - FSDP2: each unit's parameters and gradients are sharded ``N`` ways. While a unit runs
    (forward, recompute or backward) its parameters are all-gathered to full size, and the
    next unit's may be prefetched, so two of the largest unit are counted for the whole
    step; in forward each gather also holds the previous group's output (NOTE [sharding:
    what a forward all-gather holds]). A unit's backward makes its full unsharded
    gradients, a flat reduce-scatter input of the same size kept until the next group's,
    and the sharded output (NOTE [sharding: what a reduce-scatter holds]). Parameters
    outside every unit belong to
    the root, which FSDP2 does not reshard after forward: they are full-size for the whole
    step, and their gradients are full-size until the reduce-scatter that ends backward.
    Under FSDP2's mixed precision a rank keeps float32 shards of a bfloat16 step (NOTE
    [sharding: FSDP2 mixed precision]).
* **The search judges a rank's peak** (NOTE [search: per-rank peaks], solvers/search.py):
  the rank problem built here and the single-process one travel with the replay as a
  :class:`solvers.search.RankShift`, so the search, the leanest plan (the stated minimum),
  the breakdown and every refusal are one rank's, by the same prediction the plan states.
* **Verification runs one unsharded process.** ``optimize`` measures the rewritten model in
  the planning process (no process group needed) and transfers what the graph profile
  missed (measured minus predicted) to the per-rank prediction, on the assumption that
  workspaces and autograd buffers do not depend on sharding.
  :func:`autockpt.distributed.measure_rank` is the real per-rank truth, used by the tests
  and ``benchmarks/distributed.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from autockpt.capture.captured import Capture
from autockpt.costs.blocks import find_repeated_blocks
from autockpt.errors import ShardingError
from autockpt.plan import RankMemory
from solvers import ChainProblem
from solvers.rank import RankShift, UnitGathers

SHARDINGS = (None, "ddp", "fsdp")


# Per-rank safety margin: the process group's own small tensors (gloo work and address
# objects of about a kilobyte, freed on its worker threads) that no graph profile sees.
RANK_MARGIN_BYTES = 64 * 2**10


ROOT = ""
"""The root module's name among FSDP2's modules (``model.named_modules()``'s)."""


@dataclass(frozen=True)
class Sharding:
    """How the planned model will be trained: ``world_size`` ranks, each running one
    ``example_inputs`` batch, under ``mode`` (None: one process; "ddp"; "fsdp") with FSDP
    ``units`` (qualified module names, in call order). ``kept_gathered``: the FSDP2 modules
    (units, :data:`ROOT` for the root) that keep their parameters gathered from forward to
    backward (``reshard_after_forward=False``); FSDP2's default keeps the root alone (NOTE
    [sharding: reshard after forward])."""

    world_size: int = 1
    mode: str | None = None
    units: tuple[str, ...] = ()
    kept_gathered: tuple[str, ...] = (ROOT,)

    @property
    def active(self) -> bool:
        return self.mode is not None

    def reshards(self, module: str) -> bool:
        """Whether FSDP2 module ``module`` (:data:`ROOT`: the root) reshards after forward."""
        return module not in self.kept_gathered


# NOTE [sharding: reshard after forward]. ``fully_shard(module, reshard_after_forward=...)``
# chooses, per FSDP2 module, whether its parameters are freed when its forward ends and
# gathered again for its backward (True), or kept gathered until its backward ends (False:
# no all-gather in backward, the memory of the whole unit from its forward on). Its default
# (None) is True for every unit and False for the root, whose parameters the backward needs
# first. ``optimize(..., reshard_after_forward=)`` takes what the run passes: None, FSDP2's
# defaults; a bool, every unit's value (the root keeping FSDP2's default, as ``fully_shard(
# model)`` without the argument does: torchtitan's "never" policy); a mapping from unit
# names, and ``""`` for the root, to bools (the others keep FSDP2's defaults). An int
# (resharding to a smaller mesh after forward) is refused: its memory is not modelled. The
# plan records the choice (``Plan.fsdp_kept_gathered``, ``Plan.reshards(name)``), so what
# the user passes to ``fully_shard`` is read from the plan. What each choice holds, moment
# by moment: NOTE [search: gathered units] (solvers/rank.py) and
# :func:`_fsdp_gathering` for the forward.


def resolve_sharding(
    model: nn.Module,
    world_size: int,
    sharding: str | None,
    fsdp_units: Iterable[str] | None,
    reshard_after_forward: bool | Mapping[str, bool] | None = None,
) -> Sharding:
    """Validate the distributed arguments of ``optimize``, pick the FSDP units and which of
    them reshard after forward (NOTE [sharding: reshard after forward])."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ShardingError(
            f"world_size must be an integer >= 1 (the number of ranks), got {world_size!r}"
        )
    if sharding not in SHARDINGS:
        raise ShardingError(f"sharding must be None, 'ddp' or 'fsdp', got {sharding!r}")
    if fsdp_units is not None and sharding != "fsdp":
        raise ShardingError(
            f"fsdp_units only applies with sharding='fsdp' (got sharding={sharding!r})"
        )
    if sharding is None and world_size != 1:
        raise ShardingError(
            f"world_size={world_size} needs sharding='ddp' or 'fsdp' (how the ranks share the "
            "model decides what each keeps)"
        )
    if reshard_after_forward is not None and sharding != "fsdp":
        raise ShardingError(
            "reshard_after_forward is FSDP2's choice: it only applies with sharding='fsdp' "
            f"(got sharding={sharding!r})"
        )
    if sharding != "fsdp":
        return Sharding(world_size, sharding, ())
    if isinstance(fsdp_units, str):
        raise ShardingError("fsdp_units must be a list of module names, not one string")
    units = tuple(fsdp_units) if fsdp_units is not None else detect_units(model)
    _check_units(model, units)
    return Sharding(world_size, sharding, units, _kept_gathered(units, reshard_after_forward))


def _kept_gathered(
    units: tuple[str, ...], choice: bool | Mapping[str, bool] | None
) -> tuple[str, ...]:
    """The modules that keep their parameters gathered after forward, root first, then units
    in order (NOTE [sharding: reshard after forward])."""
    if choice is None:
        return (ROOT,)
    if isinstance(choice, bool):
        return (ROOT, *(() if choice else units))
    if not isinstance(choice, Mapping):
        kind = "an int (resharding to a smaller mesh)" if isinstance(choice, int) else "a"
        raise ShardingError(
            f"reshard_after_forward must be None, a bool or a mapping from FSDP unit names "
            f"(and '' for the root) to bools; {kind} {type(choice).__name__} is not modelled: "
            f"got {choice!r}"
        )
    unknown = sorted(name for name in choice if name != ROOT and name not in units)
    if unknown:
        raise ShardingError(
            f"reshard_after_forward names modules that are not FSDP units: {unknown}; the "
            f"units are {list(units)} and '' is the root"
        )
    bad = {name: value for name, value in choice.items() if not isinstance(value, bool)}
    if bad:
        raise ShardingError(
            f"reshard_after_forward's values must be bools (an int, resharding to a smaller "
            f"mesh, is not modelled): got {bad}"
        )
    kept = [ROOT] if not choice.get(ROOT, False) else []
    return (*kept, *(unit for unit in units if not choice.get(unit, True)))


def detect_units(model: nn.Module) -> tuple[str, ...]:
    """The repeated blocks of ``model`` (:func:`autockpt.costs.blocks.find_repeated_blocks`: every
    instance of the block class, e.g. the transformer layers, in every ``ModuleList`` or
    ``Sequential`` holding them: both of T5's stacks, all four layers of a torchvision
    ResNet), the same blocks the chain keeps cuts around, in registration order. Raises
    :class:`ShardingError` when there is none."""
    blocks = find_repeated_blocks(model)
    if blocks is None:
        raise ShardingError(
            f"found no repeated blocks (a ModuleList of same-class modules) in "
            f"{type(model).__name__} to use as FSDP units; pass fsdp_units=[...] naming the "
            "modules to shard one by one (or fsdp_units=[] to shard the root only)"
        )
    return blocks.children


def _check_units(model: nn.Module, units: tuple[str, ...]) -> None:
    names = dict(model.named_modules())
    missing = [u for u in units if u not in names or u == ""]
    if missing:
        raise ShardingError(
            f"fsdp_units name modules that {type(model).__name__} does not have: {missing}. "
            "Use names from model.named_modules(), e.g. 'layers.0'."
        )
    if len(set(units)) != len(units):
        raise ShardingError(f"fsdp_units lists a module twice: {list(units)}")
    for a in units:
        for b in units:
            if a != b and b.startswith(f"{a}."):
                raise ShardingError(
                    f"fsdp_units must not contain one another: '{b}' is inside '{a}'. "
                    "Name the innermost blocks only."
                )


def check_kept_precision(sharding: Sharding, kept: str | None) -> None:
    """A precision that keeps parameters in another dtype than the step's (``fsdp-bf16``,
    :class:`~autockpt.base.precision.Precision`'s ``kept``) is FSDP2's mixed precision: it
    describes sharded ranks only, so it needs ``sharding="fsdp"``."""
    if kept is not None and sharding.mode != "fsdp":
        raise ShardingError(
            "precision='fsdp-bf16' plans FSDP2's MixedPrecisionPolicy (bfloat16 gathers of "
            f"{kept} shards), which only FSDP2 ranks have: plan it with sharding='fsdp' and "
            f"world_size (got sharding={sharding.mode!r}); for one process or DDP, plan "
            "precision='bf16-true' or 'bf16-mixed'"
        )


def check_units_called(capture: Capture, units: tuple[str, ...]) -> None:
    """Every FSDP unit must be a ``call_module`` node of the capture: its hooks gather its
    parameters. A unit that is never called as a module (a container, a module called twice,
    or an export graph's inlined call that cannot be folded back exactly: NOTE [capture:
    module calls]) cannot be sharded behind a plan."""
    called = {str(n.target) for n in capture.graph.nodes if n.op == "call_module"}
    absent = [u for u in units if u not in called]
    if absent:
        why = [note for note in capture.warnings if note.startswith(f"'{absent[0]}' could not")]
        how = (
            why[0]
            if why
            else "they are not called as modules in forward (a container, or reached only "
            "through a parent's call)"
        )
        raise ShardingError(
            f"FSDP units {absent} are not module calls in the captured graph: {how}. Pass "
            "fsdp_units naming modules that forward calls directly."
        )


@dataclass(frozen=True)
class _ParamSplit:
    """Parameter bytes of every unit and of the root (outside all units), as the step
    computes with them (``unit_bytes``, ``root_bytes``: what is gathered) and as a rank
    keeps them (``unit_kept``, ``root_kept``: shards, gradient shards, reduce-scatters).
    The two differ under FSDP2's mixed precision only (NOTE [sharding: FSDP2 mixed
    precision]); ``kept_ratio`` is kept over computed bytes, for the optimizer's state.
    ``unit_grads``, ``root_grads``: the computed bytes of the parameters with a gradient
    (what a backward makes: a frozen parameter is gathered but has none), ``unit_kept_grads``,
    ``root_kept_grads`` their kept bytes (what a reduce-scatter and the gradient shards
    hold); ``unit_last``, ``root_last``: the gradient FSDP2 still holds through a group's
    reduce-scatter (NOTE [sharding: what a reduce-scatter holds])."""

    unit_bytes: dict[str, int]
    root_bytes: int
    unit_kept: dict[str, int]
    root_kept: int
    unit_grads: dict[str, int] = dataclasses.field(default_factory=dict)
    root_grads: int = 0
    unit_kept_grads: dict[str, int] = dataclasses.field(default_factory=dict)
    root_kept_grads: int = 0
    unit_last: dict[str, int] = dataclasses.field(default_factory=dict)
    root_last: int = 0

    @property
    def kept_ratio(self) -> float:
        computed = sum(self.unit_bytes.values()) + self.root_bytes
        kept = sum(self.unit_kept.values()) + self.root_kept
        return kept / computed if computed else 1.0


def _param_split(
    model: nn.Module, units: tuple[str, ...], kept_dtype: torch.dtype | None = None
) -> _ParamSplit:
    """Bytes per unit and root; ``kept_dtype``: the dtype a rank keeps floating parameters
    in when it is not the step's (None: the step's)."""
    owner: dict[int, str] = {}
    for unit in units:
        for p in model.get_submodule(unit).parameters():
            owner.setdefault(id(p), unit)
    unit_bytes, unit_kept = dict.fromkeys(units, 0), dict.fromkeys(units, 0)
    unit_grads, unit_kept_grads = dict.fromkeys(units, 0), dict.fromkeys(units, 0)
    root = root_kept = root_grads = root_kept_grads = 0
    for p in {id(p): p for p in model.parameters()}.values():
        nbytes = p.numel() * p.element_size()
        kept = p.numel() * kept_dtype.itemsize if kept_dtype and p.is_floating_point() else nbytes
        trained = p.requires_grad
        if id(p) in owner:
            unit = owner[id(p)]
            unit_bytes[unit] += nbytes
            unit_kept[unit] += kept
            unit_grads[unit] += nbytes if trained else 0
            unit_kept_grads[unit] += kept if trained else 0
        else:
            root += nbytes
            root_kept += kept
            root_grads += nbytes if trained else 0
            root_kept_grads += kept if trained else 0
    last = {unit: _last_gradient_bytes(model.get_submodule(unit), set()) for unit in units}
    inner = {id(m) for u in units for m in model.get_submodule(u).modules()}
    return _ParamSplit(
        unit_bytes,
        root,
        unit_kept,
        root_kept,
        unit_grads=unit_grads,
        root_grads=root_grads,
        unit_kept_grads=unit_kept_grads,
        root_kept_grads=root_kept_grads,
        unit_last=last,
        root_last=_last_gradient_bytes(model, inner),
    )


def _last_gradient_bytes(group: nn.Module, skip: set[int]) -> int:
    """Bytes of the last parameter with a gradient in FSDP2's order of a group's parameters
    (its managed modules after their children, depth first, each module's own parameters
    in order, ``_get_managed_states``), skipping the modules in ``skip`` (other units).
    NOTE [sharding: what a reduce-scatter holds]."""
    order: dict[int, nn.Parameter] = {}  # first occurrence of each (a tied weight once)
    seen: set[int] = set()

    def visit(module: nn.Module) -> None:
        if id(module) in skip or id(module) in seen:
            return
        seen.add(id(module))
        for child in module.children():
            visit(child)
        for p in module.parameters(recurse=False):
            order.setdefault(id(p), p)

    visit(group)
    with_grad = [p for p in order.values() if p.requires_grad]
    return with_grad[-1].numel() * with_grad[-1].element_size() if with_grad else 0


def kept_ratio(model: nn.Module, units: tuple[str, ...], kept_dtype: str | None) -> float:
    """What an FSDP rank keeps per byte the step computes with (FSDP2's mixed precision:
    float32 shards of a bfloat16 step, 2.0; else 1.0): the factor by which the rank model
    counts the optimizer's state and accumulated gradients, and the error breakdown with
    it (one computation: :func:`_param_split`)."""
    dtype = getattr(torch, kept_dtype) if kept_dtype else None
    return _param_split(model, units, dtype).kept_ratio


def _shard(nbytes: int, world_size: int) -> int:
    return -(-nbytes // world_size)


def rank_share(nbytes: int, sharding: Sharding) -> int:
    """What one rank keeps of ``nbytes`` of iteration state (the optimizer's state,
    accumulated gradients): a shard under FSDP, the whole under DDP or on one process."""
    return _shard(nbytes, sharding.world_size) if sharding.mode == "fsdp" else nbytes


def rank_problem(
    problem: ChainProblem,
    stages: tuple[tuple[int, int], ...],
    capture: Capture,
    model: nn.Module,
    sharding: Sharding,
    *,
    parameters: int,
    gradients: int,
    buffers: int,
    inputs: int,
    optimizer_state: int = 0,
    accumulated_gradients: int = 0,
    kept_dtype: str | None = None,
    run_device_type: str = "cuda",
) -> tuple[RankShift, RankMemory]:
    """The single-process chain ``problem`` rewritten for one rank under ``sharding``.

    ``problem.static_bytes`` is the single-process static part (parameters + buffers +
    inputs + output tail); the parameter part is replaced by what one rank
    keeps, and the engines' buffers are added (see the module docstring), plus
    :data:`RANK_MARGIN_BYTES` for the process group's own small tensors. Returns the
    per-rank problem (``.rank``) with what moves each moment of one process's step to a
    rank (a :class:`solvers.search.RankShift`: NOTE [search: per-rank peaks]), and the
    breakdown recorded in the plan.

    ``optimizer_state`` and ``accumulated_gradients`` (in the static part when the budget
    covers the optimizer, or gradient accumulation) are whole on a DDP rank and a shard each
    on an FSDP rank (FSDP2 keeps sharded gradients between micro-batches, and its optimizer
    steps the shards).

    ``kept_dtype``: the dtype an FSDP rank keeps its shards, gradient shards and optimizer
    state in, when the step computes in another (a :class:`Precision`'s ``kept``: FSDP2's
    mixed precision, NOTE [sharding: FSDP2 mixed precision]).

    ``run_device_type``: the device the ranks run on, whose collectives' backend FSDP2 uses
    (NOTE [sharding: the backend's reduce-scatter]).
    """
    rest = problem.static_bytes - parameters  # buffers, inputs, output tail, resident
    if sharding.mode == "ddp":
        return _ddp_rank_problem(
            problem,
            rest,
            parameters=parameters,
            gradients=gradients,
            buffers=buffers,
            inputs=inputs,
            optimizer_state=optimizer_state,
        )
    return _fsdp_rank_problem(
        problem,
        rest,
        stages,
        capture,
        model,
        sharding,
        buffers=buffers,
        inputs=inputs,
        optimizer_state=optimizer_state,
        accumulated_gradients=accumulated_gradients,
        kept_dtype=getattr(torch, kept_dtype) if kept_dtype else None,
        input_copies=REDUCE_SCATTER_INPUT_COPIES.get(run_device_type, 0),
        gather_copies=ALL_GATHER_OUTPUT_COPIES.get(run_device_type, 0),
    )


def _ddp_rank_problem(
    problem: ChainProblem,
    rest: int,
    *,
    parameters: int,
    gradients: int,
    buffers: int,
    inputs: int,
    optimizer_state: int,
) -> tuple[RankShift, RankMemory]:
    """One DDP rank: full parameters, the reducer's buckets, the buffers' broadcast."""
    buckets = gradients
    # broadcast_buffers (DDP's default) copies every buffer into one flat tensor at the
    # start of each forward and broadcasts it from rank 0: a transient of the buffers'
    # size while the first stage runs.
    transient = list(problem.transient_bytes)
    transient[0] += buffers
    memory = RankMemory(
        parameters=parameters,
        gradients=gradients,
        buckets=buckets,
        gathered_parameters=0,
        reduce_scatter=0,
        static=parameters + buckets + buffers + inputs + optimizer_state,
        optimizer_state=optimizer_state,
    )
    rank = dataclasses.replace(
        problem,
        static_bytes=rest + parameters + buckets + RANK_MARGIN_BYTES,
        transient_bytes=tuple(transient),
    )
    return RankShift(rank, problem), memory


# NOTE [sharding: FSDP2 mixed precision]. Under ``MixedPrecisionPolicy(param_dtype=
# torch.bfloat16, reduce_dtype=torch.float32)`` (``precision="fsdp-bf16"``, NOTE [precision:
# FSDP2 mixed precision] in autockpt/base/precision.py) the planned model is the bfloat16
# step, and a rank keeps more than that model's parameters say. Per unit of ``P`` bfloat16
# bytes (``2 P`` in float32): the shard is ``2 P / N`` (float32), the gathered unit ``P``
# (bfloat16, all-gathered from bfloat16 casts of the shards), the backward window of ``P``
# of bfloat16 unsharded gradients, ``2 P`` of float32 reduce-scatter input FSDP2 casts them
# into (``foreach_reduce``) and ``2 P / N`` of float32 sharded output, which becomes the
# gradient shard (which of them are alive together: NOTE [sharding: what a reduce-scatter
# holds]); the root alike, gathered in bfloat16 for the whole step. The
# optimizer steps the float32 shards, so its state, planned on the bfloat16 model, is
# counted at the float32 size (times the ratio of kept to computed parameter bytes), and
# so are gradients a micro-batch accumulates. Buffers are not cast by FSDP2: plan a model
# whose buffers are as they will be (``autockpt.distributed.fsdp_bf16_twin``). Checked on
# two gloo ranks (tests/test_distributed.py, a GPT of 4 layers, width 64): resident 492,328
# bytes measured against 492,288 predicted, peak 1,982,024 against 2,380,296 predicted (two
# gathered units and the windows are counted for whole stages), gradients equal to FSDP2's
# alone under the same policy; a Hugging Face Llama of 124M parameters, whose peak is the
# root's reduce-scatter, within 0.011% (benchmarks/llama_ranks.py).
# NOTE [sharding: the backend's reduce-scatter]. FSDP2 reduce-scatters each unit's gradients
# with ``dist.reduce_scatter_tensor`` on the process group of the device the ranks run on.
# NCCL (CUDA) reduces into the output in place; gloo (CPU) copies the whole input first
# (measured: a reduce-scatter of a 16 MiB float32 input on two gloo ranks allocates 16 MiB
# more, with ``ReduceOp.AVG`` or ``SUM``), so on CPU ranks each reduce-scatter window holds
# its input twice. The root's, which ends backward, is the largest on a Hugging Face
# decoder (embedding and head). Keyed by the run's device type: a meta plan without a
# target is for a GPU (autockpt/planning/prepared.py), one made on CPU tensors for CPU.
# Not modelled: gloo's worker thread frees its copy after the collective has returned, and
# on a loaded machine that free can come after the next group's allocations (a unit's
# input: 199,924 bytes above the prediction, once in about ten runs of the root-heavy
# model of tests/test_rank_memory.py, with the rest of the suite running); NCCL has none.
REDUCE_SCATTER_INPUT_COPIES: dict[str, int] = {"cpu": 1}
"""Extra copies of a reduce-scatter's input the backend allocates, by run device type."""

# NOTE [sharding: what a forward all-gather holds]. FSDP2 gathers a group when its forward
# starts (``unshard``, ``wait_for_unshard``, torch 2.13 and 2.14 alike): the flat all-gather
# output is allocated (a bfloat16 cast of the shards beside it under mixed precision, the
# backend's copy of it during gloo's collective: 199,936 bytes for a 199,936-byte unit,
# measured), then the unsharded parameters are copied out of it, and in forward the output
# is kept (``comm_ctx.all_gather_state``) until the next group's collective is done, the
# root's after the step's last unit. So at a group's gather a rank holds the root, the
# previous group's output and this one's, with its copies; at the root's own, at the start
# of forward, the root twice. The static part counts the root and two units (current and
# prefetched: what backward holds); a stage's forward counts what these moments hold more
# (``RankShift.gathering``). Found on two gloo ranks: a root of an embedding and a head
# around one small unit peaked at the first unit's gather, 4.1 MB (the root's retained
# output) above what the static part counted. The copy is made and freed on gloo's worker
# thread: on a loaded machine its life can miss the main thread's peak, which then measures
# a unit under the prediction (2,102,272 B once, torch 2.13 beside the suite); never over.
ALL_GATHER_OUTPUT_COPIES: dict[str, int] = {"cpu": 1}
"""Extra copies of an all-gather's output the backend allocates, by run device type."""

# NOTE [sharding: what a reduce-scatter holds]. A unit's gradients, read from FSDP2's
# ``post_backward`` and ``foreach_reduce`` (torch 2.13 and 2.14 alike): the unit's gathered
# parameters are resharded first; the flat input is allocated (every unsharded gradient
# alive beside it: ``computed + kept``), the gradients copied in and released, except the
# group's last parameter's, which the loop over ``(param, grad)`` pairs still names until
# ``foreach_reduce`` returns; then the sharded output, and the backend's copies of the
# input (``last + kept * (1 + copies) + kept / N``). The input itself is kept after the
# call (``reduce_scatter_states``, at most ``reduce_scatter_max_input_buffers``, 1 by
# default) until the next group's ``post_backward``: through the next unit's backward, or
# the root's, until the root's own reduce-scatter. Measured on two gloo ranks, a Hugging
# Face Llama of 124M parameters: counting every root gradient alive through the root's
# reduce-scatter put the peak 49.3 MB high, the embedding's bfloat16 gradient (49.2 MB),
# released at the copy; the head's, the root's last parameter, stays.


def _fsdp_rank_problem(
    problem: ChainProblem,
    rest: int,
    stages: tuple[tuple[int, int], ...],
    capture: Capture,
    model: nn.Module,
    sharding: Sharding,
    *,
    buffers: int,
    inputs: int,
    optimizer_state: int,
    accumulated_gradients: int,
    kept_dtype: torch.dtype | None,
    input_copies: int = 0,
    gather_copies: int = 0,
) -> tuple[RankShift, RankMemory]:
    """One FSDP2 rank: sharded units and state, plus two units gathered in full."""
    n = sharding.world_size
    split = _param_split(model, sharding.units, kept_dtype)
    largest = max(split.unit_bytes.values(), default=0)
    # shards, and the gradient shards after each reduce-scatter: in the kept dtype
    local_params = sum(_shard(b, n) for b in split.unit_kept.values()) + _shard(split.root_kept, n)
    gathered = 2 * largest + split.root_bytes  # current + prefetched unit; the root stays full
    # the optimizer steps the kept shards: its state (and accumulated gradients) in their dtype
    kept_state = round(optimizer_state * split.kept_ratio)
    kept_accumulated = round(accumulated_gradients * split.kept_ratio)
    sharded_resident = rank_share(kept_state, sharding) + rank_share(kept_accumulated, sharding)
    rest -= optimizer_state + accumulated_gradients - sharded_resident
    unit_of_node = _unit_calls(capture, split)
    grads, transient, windows, held = _fsdp_stage_terms(
        problem, stages, unit_of_node, split, n, input_copies, gather_copies
    )
    root_window = _unit_window(
        split.root_grads, split.root_kept_grads, split.root_last, n, input_copies
    )
    units = _unit_gathers(stages, unit_of_node, split, sharding)
    kept_all = sum(units.kept)
    memory = RankMemory(
        parameters=local_params,
        gradients=local_params,
        buckets=0,
        gathered_parameters=split.root_bytes + max(2 * largest, kept_all + largest),
        reduce_scatter=max([*windows, root_window]),
        static=local_params + buffers + inputs + _shard(kept_state, n),
        optimizer_state=_shard(kept_state, n),
    )
    rank = dataclasses.replace(
        problem,
        static_bytes=rest + local_params + gathered + RANK_MARGIN_BYTES,
        param_grad_bytes=tuple(max(0, g) for g in grads),
        transient_bytes=tuple(transient),
    )
    # When backward ends FSDP2 has resharded every unit and the root (reshard after
    # backward), then reduce-scatters the root's gradients; the optimizer steps shards.
    root_shard = _shard(split.root_kept_grads, n)
    # A root resharded after forward is sharded while the loss runs and gathered again when
    # the backward starts: its all-gather's output beside its parameters (NOTE [sharding:
    # reshard after forward])
    root_kept = not sharding.reshards(ROOT)
    regather = max(
        split.root_bytes, _gather(split, split.root_bytes, n, gather_copies) - split.root_bytes
    )
    shift = RankShift(
        rank,
        problem,
        windows=tuple(windows),
        held=tuple(held),
        gathering=_fsdp_gathering(stages, unit_of_node, split, n, gather_copies, sharding),
        end_bytes=root_window - split.root_grads - gathered,
        optimizer_bytes=root_shard - split.root_grads - gathered,
        units=units,
        loss_bytes=max(0, kept_all - units.counted) - (0 if root_kept else split.root_bytes),
        backward_start_bytes=0 if root_kept else regather,
    )
    return shift, memory


def _unit_gathers(
    stages: tuple[tuple[int, int], ...],
    unit_of_node: dict[int, str],
    split: _ParamSplit,
    sharding: Sharding,
) -> UnitGathers:
    """Per stage, the bytes of the units it calls that reshard after forward and of those
    kept gathered (NOTE [search: gathered units]), against the two largest the static part
    counts."""
    resharded, kept = [0] * len(stages), [0] * len(stages)
    for k, (first, stop) in enumerate(stages):
        for i in range(first, stop):
            unit = unit_of_node.get(i)
            if unit is not None:
                into = resharded if sharding.reshards(unit) else kept
                into[k] += split.unit_bytes[unit]
    largest = max(split.unit_bytes.values(), default=0)
    resharding = [b for u, b in split.unit_bytes.items() if sharding.reshards(u)]
    return UnitGathers(tuple(resharded), tuple(kept), max(resharding, default=0), 2 * largest)


def _unit_window(
    computed: int,
    kept: int,
    last: int,
    n: int,
    input_copies: int = 0,
    retained: int = 0,
    gathered: int = 0,
    gather_copies: int = 0,
) -> int:
    """A group's backward window (NOTE [sharding: what a reduce-scatter holds]), counted
    with its unsharded gradients (``computed`` bytes, ``last`` of them held to the end):
    while they are made, the previous group's retained input (``retained``) beside them,
    or, when the backward starts, the backend's copies of the next group's prefetched
    all-gather; the flat input allocated beside them all; the collective
    (:func:`_reduce_scatter`) beside the last one. FSDP2 reshards the group's ``gathered``
    parameters before it allocates the flat input, so those two moments hold them no more
    (the static part counts two gathered units throughout)."""
    return max(
        retained + max(computed, gathered * gather_copies),
        computed + kept - gathered,
        last + _reduce_scatter(kept, n, input_copies) - gathered,
    )


def _reduce_scatter(kept: int, n: int, input_copies: int = 0) -> int:
    """One reduce-scatter of ``kept`` bytes (the kept dtype: FSDP2 casts the gradients into
    its flat input, allocated in its ``reduce_dtype``): the input, the backend's copies of
    it (NOTE [sharding: the backend's reduce-scatter]) and the sharded output."""
    return kept * (1 + input_copies) + _shard(kept, n)


def _gather(split: _ParamSplit, size: int, n: int, gather_copies: int) -> int:
    """One all-gather of ``size`` bytes while it runs: its output, and the backend's copies
    of it or, under mixed precision, the shards' cast (NOTE [sharding: what a forward
    all-gather holds])."""
    mixed = split.unit_bytes != split.unit_kept or split.root_bytes != split.root_kept
    return size + max(size * gather_copies, _shard(size, n) if mixed else 0)


def _fsdp_gathering(
    stages: tuple[tuple[int, int], ...],
    unit_of_node: dict[int, str],
    split: _ParamSplit,
    n: int,
    gather_copies: int = 0,
    sharding: Sharding | None = None,
) -> tuple[int, ...]:
    """Per compute node, what its forward holds beyond the root and two units the static
    part counts, at FSDP2's all-gathers (NOTE [sharding: what a forward all-gather holds]):
    the root's retained output until the first unit's gather; each unit's gather counted on
    the node before it (the moment it starts, after that node), or on the unit's own node
    when it is the first; and the units kept gathered after their forward (NOTE [sharding:
    reshard after forward]) beside everything that follows."""
    root, nodes = split.root_bytes, stages[-1][1] if stages else 0
    counted = root + 2 * max(split.unit_bytes.values(), default=0)
    extra = [0] * nodes
    retained = root  # the root's output, kept until the first unit's gather
    held = max(root + retained, _gather(split, root, n, gather_copies))  # at the start
    resident = 0  # units kept gathered after their forward, so far
    for i in range(nodes):
        unit = unit_of_node.get(i)
        if unit is not None:
            size = split.unit_bytes[unit]
            at = max(i - 1, 0)
            moment = root + resident + retained + _gather(split, size, n, gather_copies)
            extra[at] = max(extra[at], moment - counted)
            retained, held = size, 0
            # the unit runs beside its gather's retained output
            extra[i] = max(extra[i], root + resident + 2 * size - counted)
            if sharding is not None and not sharding.reshards(unit):
                resident += size
        else:
            extra[i] = max(extra[i], root + resident + retained - counted)
        extra[i] = max(extra[i], held - counted)
    return tuple(max(0, x) for x in extra)


def _unit_calls(capture: Capture, split: _ParamSplit) -> dict[int, str]:
    """The compute nodes that call a unit, by index: the unit's name."""
    return {
        i: str(node.target)
        for i, node in enumerate(capture.compute_nodes())
        if node.op == "call_module" and str(node.target) in split.unit_bytes
    }


def _fsdp_stage_terms(
    problem: ChainProblem,
    stages: tuple[tuple[int, int], ...],
    unit_of_node: dict[int, str],
    split: _ParamSplit,
    n: int,
    input_copies: int = 0,
    gather_copies: int = 0,
) -> tuple[list[int], list[int], list[int], list[int]]:
    """Each stage's gradient and transient bytes on an FSDP2 rank (unit windows, then
    shards), the windows alone (what only the stage's backward holds) and what a stage's
    backward starts with held (the retained input of the previous reduce-scatter)."""
    grads = list(problem.param_grad_bytes)
    transient = list(problem.transient_bytes)
    windows = [0] * len(stages)
    held = [0] * len(stages)
    retained = 0  # the input of the last reduce-scatter, kept until the next group's
    for k in range(len(stages) - 1, -1, -1):  # in backward's order
        start, end = stages[k]
        window = held[k] = retained
        for i in range(end - 1, start - 1, -1):
            unit = unit_of_node.get(i)
            if unit is None:
                continue
            made, kept = split.unit_grads[unit], split.unit_kept_grads[unit]
            moments = (made, kept, split.unit_last[unit], n, input_copies, retained)
            window = max(window, _unit_window(*moments, split.unit_bytes[unit], gather_copies))
            retained = kept
            # Unit gradients persist as shards; root gradients stay full until the end.
            grads[k] += _shard(kept, n) - made
        transient[k] += window
        windows[k] = window
    # Root gradients stay full until the root's reduce-scatter ends backward: a moment of
    # its own (RankShift.end_bytes), after which the root keeps their shard.
    return grads, transient, windows, held
