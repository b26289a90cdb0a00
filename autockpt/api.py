"""The front doors: ``optimize``, ``apply`` and :class:`Planner`. They only compose.

``optimize(model, inputs, budget_gb)`` runs, in a straight line::

    unwrap (autockpt/rewrite/apply.py)      the eager module to plan
    capture (autockpt/capture/)             one fx graph
    prepare (autockpt/planning/prepared.py) profile -> chain -> recorded step -> rank terms
    Predictor, BudgetSearch (planning/)     the one memory model; the leanest plan
    fit_by_measuring (planning/verify.py)   search -> plan -> rewrite -> measure, tightened
                                            by what the measurement exceeded the prediction

A root whose own forward cannot be captured runs eagerly and its submodule calls are
planned as units (``autockpt/planning/nested.py``). A plan is returned only when both its prediction and
its measured step fit the budget (``verify=True``, the default).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import numbers
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from autockpt.base.inputs import Inputs
from autockpt.base.optimizer import check_optimizer
from autockpt.base.rng import worst_case_draws
from autockpt.base.runtime import (
    LossFn,
    as_found,
    loss_name,
    release_freed_heap,
    training_mode,
    unit_loss,
    warn_if_eval,
)
from autockpt.capture.captured import Capture
from autockpt.capture.front import capture
from autockpt.costs.as_written import as_written_shift
from autockpt.costs.problem import DEFAULT_MAX_STAGES, StageRange
from autockpt.costs.timing import STEP_ROUNDS, STEP_TIMING_SECONDS, settle_factors, step_factors
from autockpt.distributed import PlanRequest, plan_on_one_rank
from autockpt.errors import (
    GIB,
    AutockptError,
    BudgetError,
    BudgetTypeError,
    InfeasibleBudgetError,
    OptimizerError,
    PlanMismatchError,
    TraceError,
)
from autockpt.measure import Measurement, measure, time_steps
from autockpt.plan import SCOPES, MemoryTimeline, Plan
from autockpt.planning.cache import (
    Reused,
    cache_key,
    cached,
    clear_cache,
    keep,
    remember_as_written,
    remember_profile,
)
from autockpt.planning.compiled import (
    COMPILE_BUDGETS,
    Candidate,
    Run,
    candidate_key,
    check_compile_budgets,
    compiled_notes,
    fastest_within,
)
from autockpt.planning.make_plan import breakdown, make_plan, rank_breakdown, with_measurement
from autockpt.planning.nested import UnitsPlanner, find_units, unit_key
from autockpt.planning.predict import Predictor
from autockpt.planning.prepared import (
    Phases,
    Prepared,
    ProgressFn,
    Request,
    prepare,
    resident_floor,
    start,
)
from autockpt.planning.search import SEARCH_METHODS, BudgetSearch
from autockpt.planning.sharding import resolve_sharding
from autockpt.planning.specs import segment_specs
from autockpt.planning.verify import Attempt, fit_by_measuring
from autockpt.rewrite.apply import (
    CompiledHandBack,
    apply_plan,
    rewrite_for_training,
    same,
    unwrap,
)
from autockpt.rewrite.apply import segment_specs_from_plan as specs_from_plan
from autockpt.rewrite.result import (
    check_setting,
    mark_verified_compiled,
    set_precision_change,
    watch_units_precision,
)
from solvers import METHODS, InfeasibleError, Simulation, Solution
from solvers.selective import keepable_nodes

__all__ = [
    "SCOPES",
    "Planner",
    "ProgressFn",
    "apply",
    "budget_in_bytes",
    "check_budget_gb",
    "clear_cache",
    "optimize",
]


def optimize(
    model: nn.Module,
    example_inputs: Any,
    *,
    budget_gb: float,
    solver: str = "auto",
    scope: str = "total",
    loss_fn: LossFn | None = None,
    time_limit_s: float = 30.0,
    leaf_modules: Iterable[str] = (),
    verify: bool = True,
    max_stages: int = DEFAULT_MAX_STAGES,
    world_size: int = 1,
    sharding: str | None = None,
    fsdp_units: Iterable[str] | None = None,
    plan_rank: int | None = 0,
    selective: bool = True,
    optimizer: torch.optim.Optimizer | None = None,
    accumulation_steps: int = 1,
    progress: ProgressFn | None = None,
    cache: bool = True,
    on_precision_change: str = "replan",
    compile_budgets: Sequence[float] | None = None,
) -> nn.Module:
    """Return ``model`` rewritten to checkpoint activations so that one training step's
    peak memory fits ``budget_gb`` GiB at the least predicted recompute time.

    ``optimizer`` (the one the training loop steps): the budget covers the whole training
    iteration from steady state, its state resident and its step after the backward (found
    by stepping a stand-in of it on fake tensors; the optimizer itself is never stepped).
    ``accumulation_steps=k``: the loop accumulates gradients over ``k`` micro-batches of
    ``example_inputs``' size before each step; from the second on the gradients are
    resident, and the budget covers that.

    ``example_inputs`` is a Tensor, a tuple of positional arguments or a dict of keyword
    arguments, shaped like a real batch. ``scope="total"`` budgets everything the step
    allocates (parameters, buffers, inputs, gradients, activations, workspaces);
    ``scope="activations"`` budgets only what lies above parameters, buffers, inputs and
    gradients. ``loss_fn`` maps the output to the scalar that is differentiated while
    profiling (default: the output's ``loss``, else the sum of its floating tensors).

    The result shares the original's parameters and buffers, has the same ``state_dict()``
    keys and trains like it; ``result.plan`` is the :class:`Plan`. Raises
    :class:`InfeasibleBudgetError` when no plan fits (its ``minimum_gb`` does fit).

    Distributed training (see ``docs/distributed.md``): with ``world_size=N`` and
    ``sharding="ddp"`` or ``"fsdp"``, ``example_inputs`` are one rank's batch and the budget
    is per rank; the memory model counts what that engine keeps on a rank. Wrap the result
    afterwards: ``DDP(result)``, or ``fully_shard`` on each of ``result.plan.fsdp_units``
    (default: the repeated blocks, e.g. transformer layers; they stay module calls and
    checkpoint segments hold whole units) and then on ``result``.

    Under ``torch.distributed`` (initialised, several ranks) every rank may call
    ``optimize`` (the ``torchrun`` pattern): rank ``plan_rank`` alone profiles and solves,
    and every rank applies its plan, so all ranks checkpoint the same segments (ranks that
    planned apart, from their own measured times, could checkpoint different FSDP units and
    hang). Every rank must pass the same arguments; a failure on any rank is raised on all.
    ``plan_rank=None`` plans on each rank separately. See
    :func:`autockpt.distributed.plan_on_one_rank`.

    ``selective=True`` lets a checkpointed segment keep chosen operator outputs (a matrix
    multiply's) from the forward instead of recomputing them, where the plan simulator shows
    that is cheaper within the budget (``torch.utils.checkpoint``'s selective checkpoint
    policies; docs/design.md, "Selective recompute"). ``False``: segments recompute all.

    A budget below what the step keeps whatever is checkpointed (parameters, their
    gradients, buffers, inputs, the optimizer's state) is refused right after capture,
    before anything is profiled. Called again on the same model and inputs (another budget),
    ``optimize`` reuses the first call's profile, recorded step and leanest plan
    (``cache=True``; autockpt/planning/cache.py lists the key; ``autockpt.clear_cache()``
    forgets them). Each phase is logged on the ``"autockpt"`` logger at INFO, with its
    seconds; ``progress`` is called with a short description as each begins.

    ``on_precision_change``: what a training call in another precision than planned does
    (under ``torch.autocast``, after ``model.to(torch.bfloat16)``; Hugging Face's
    ``Trainer(bf16=True)``): ``"replan"`` (default) plans again once for that precision,
    within the same budget, from that call's arguments, warns, and keeps the new plan
    (``result.plan``); ``"warn"`` runs the old plan (an fx graph; an export graph raises);
    ``"raise"`` raises :class:`PlanMismatchError`. Settable later as
    ``result.on_precision_change``.

    ``model`` may come compiled (``torch.compile(model)``): the result is compiled the same
    way and its peak is measured compiled. Then ``compile_budgets`` (default 0.1, 0.3, 0.5)
    are torch.compile's own ``activation_memory_budget`` values tried beside autockpt's plan:
    each is measured compiled, and the fastest step whose measured peak fits the budget is
    handed back (NOTE [compiled: partitioner budgets]; ``()``: autockpt's plan alone).
    """
    # every argument but the model and its inputs: what planning again repeats
    request = {k: v for k, v in locals().items() if k not in ("model", "example_inputs")}
    budget_gb = check_budget_gb(budget_gb)
    check_setting("on_precision_change", on_precision_change)
    if compile_budgets is not None:
        check_compile_budgets(compile_budgets)

    def replan(module: nn.Module, args: tuple, kwargs: dict) -> nn.Module:
        # the same request, from the call in the new precision (NOTE [rewrite: precision
        # change]); the result is planned from its plain model (unwrap)
        return optimize(module, Inputs(tuple(args), dict(kwargs)), **request)

    def settle(inner: nn.Module) -> None:
        set_precision_change(inner, on_precision_change, replan)

    def plan_here(budget_gb: float = budget_gb) -> nn.Module:
        planner = Planner(
            model,
            example_inputs,
            scope=scope,
            loss_fn=loss_fn,
            leaf_modules=leaf_modules,
            max_stages=max_stages,
            world_size=world_size,
            sharding=sharding,
            fsdp_units=fsdp_units,
            optimizer=optimizer,
            accumulation_steps=accumulation_steps,
            progress=progress,
            budget_gb=budget_gb,
            cache=cache,
        )
        return planner.optimize(
            budget_gb=budget_gb,
            solver=solver,
            time_limit_s=time_limit_s,
            verify=verify,
            selective=selective,
            compile_budgets=compile_budgets,
            settle=settle,
        )

    result = plan_on_one_rank(
        plan_here,
        lambda plan: apply(model, plan, example_inputs, optimizer=optimizer),
        PlanRequest(budget_gb, world_size, sharding, scope),
        plan_rank=plan_rank,
    )

    inner = getattr(result, "_orig_mod", result)
    settle(inner)
    if getattr(inner, "plan", None) is not None and inner.plan.units:  # a result of units
        watch_units_precision(
            inner,
            lambda args, kwargs: optimize(model, Inputs(tuple(args), dict(kwargs)), **request),
            on_precision_change,
        )
    return result


def apply(
    model: nn.Module,
    plan: Plan,
    example_inputs: Any = None,
    *,
    optimizer: torch.optim.Optimizer | None = None,
) -> nn.Module:
    """Re-apply a saved plan to ``model`` without profiling or solving.

    The model is captured again and its structural fingerprint must equal the plan's; when
    ``example_inputs`` are given their shapes must match too. Plans captured with
    ``torch.export`` need ``example_inputs`` (export traces with real shapes). An
    ``optimizer`` given must be the kind the plan's budget covers (``plan.optimizer``):
    another one would not be covered, and is refused.
    """
    if optimizer is not None:
        check_optimizer(optimizer, unwrap(model)[0])
        covered = plan.optimizer.name if plan.optimizer is not None else None
        if covered != type(optimizer).__name__:
            raise PlanMismatchError(
                f"the plan's budget covers {f'a {covered}' if covered else 'no optimizer'}, "
                f"not this {type(optimizer).__name__}: plan again with "
                "optimize(..., optimizer=your_optimizer)"
            )
    return apply_plan(model, plan, example_inputs)


def check_budget_gb(budget_gb: Any) -> float:
    """``budget_gb`` as a float, or :class:`BudgetError` (:class:`BudgetTypeError` for what is
    not a real number). Every front door calls this first: a bad budget is refused before
    seconds of capture and profiling, not after them."""
    if isinstance(budget_gb, bool) or not isinstance(budget_gb, numbers.Real):
        hint = f": pass float({budget_gb!r})" if isinstance(budget_gb, str) else ""
        raise BudgetTypeError(
            f"budget_gb must be a number of GiB (2**30 bytes), e.g. budget_gb=8.0; got "
            f"{type(budget_gb).__name__} {budget_gb!r}{hint}"
        )
    value = float(budget_gb)
    if not (math.isfinite(value) and value > 0 and math.isfinite(value * GIB)):
        raise BudgetError(
            f"budget_gb must be a positive, finite number of GiB (2**30 bytes); got "
            f"{budget_gb!r}. Sensible budgets lie between the leanest plan's peak and the peak "
            "without checkpointing: Planner(model, inputs).minimum_peak_bytes and "
            ".as_written_peak_bytes, or `autockpt frontier`, show both."
        )
    return value


def budget_in_bytes(budget_gb: float) -> int:
    """A checked budget in whole bytes. A byte count stated as GiB (``minimum_peak_bytes /
    2**30``) comes back as that count, where the float product may land a hair below it
    (``int`` would then refuse the stated minimum by one byte); a fraction of a byte left
    over is not budget."""
    return math.floor(budget_gb * GIB + 1e-3)


def _check_iteration(
    model: nn.Module, scope: str, optimizer: Any, accumulation_steps: Any
) -> torch.optim.Optimizer | None:
    """The training iteration's arguments, checked before any work: an optimizer of the
    model's parameters (``autockpt.base.optimizer.check_optimizer``), only with scope
    "total" (scope "activations" leaves out everything resident, the optimizer's state
    too), and a whole number of micro-batches."""
    if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int):
        raise TypeError(f"accumulation_steps must be an int, got {accumulation_steps!r}")
    if accumulation_steps < 1:
        raise ValueError(f"accumulation_steps must be at least 1, got {accumulation_steps}")
    if optimizer is None:
        return None
    if scope != "total":
        raise OptimizerError(
            f'scope="{scope}" budgets what lies above the resident part of a step, and an '
            'optimizer\'s state is resident: pass scope="total" with an optimizer (the budget '
            "is then the whole iteration's), or leave the optimizer out"
        )
    return check_optimizer(optimizer, model)


def _refuse_below_floor(
    model: nn.Module, inputs: Inputs, captured: Capture, request: Request, budget_bytes: int
) -> None:
    """:class:`InfeasibleBudgetError` (``lower_bound``), before profiling, for a budget below
    what the step keeps whatever is checkpointed (:func:`resident_floor`). Scope "total" on
    one process only: "activations" leaves that part out, and a rank keeps a share of it."""
    if request.scope != "total" or request.sharding.active:
        return
    parts = resident_floor(model, inputs, captured, request.optimizer)
    floor = sum(parts.values())
    if floor > budget_bytes:
        raise InfeasibleBudgetError(
            budget_bytes,
            floor,
            parts,
            request.scope,
            "Raise the budget well above this sum (Planner(model, inputs).minimum_peak_bytes "
            "states the least that fits), or shrink what checkpointing cannot touch: smaller "
            "or lower-precision parameters, a smaller batch, an optimizer with less state, or "
            "sharding parameters and gradients across devices (FSDP).",
            lower_bound=True,
        )


def _leaves_as_found(method: Callable[..., Any]) -> Callable[..., Any]:
    """A :class:`Planner` method that leaves the model, its example inputs and the global
    random generators as found (:func:`autockpt.base.runtime.as_found`)."""

    @functools.wraps(method)
    def wrapper(self: Planner, *args: Any, **kwargs: Any) -> Any:
        with as_found(self.model, self.inputs):
            return method(self, *args, **kwargs)

    return wrapper


class Planner:
    """Capture and profile a model once; then plan it for any number of budgets.

    ``optimize`` is ``Planner(...).optimize(budget_gb=...)``; keep a planner to sweep
    budgets (a frontier, a benchmark) without profiling again. The predicted range is
    ``minimum_peak_bytes`` (the leanest plan) to ``no_checkpoint_peak_bytes`` (the captured
    graph run without checkpoints: what the solver and every plan's prediction build on);
    the baseline a user compares with, "without checkpointing", is
    :attr:`as_written_peak_bytes` (the model as written, which may keep more than its graph).

    ``probe=False`` plans from shapes alone: no node runs on the device, so kernel
    workspaces are unknown (every prediction is then a lower bound of the real peak) and
    times are the cost model's. ``fit_batch`` judges sizes far from its answer this way.

    ``budget_gb``, when the budget to be asked for is known (``optimize`` passes its own):
    a budget below what the step keeps whatever is checkpointed (parameters, their
    gradients, buffers, inputs, the optimizer's state) raises :class:`InfeasibleBudgetError`
    right after capture, before profiling (``lower_bound`` set). ``cache``: reuse the
    profile, recorded step and leanest plan of an earlier planner of the same model, inputs
    and options, and keep this one's for later ones (autockpt/planning/cache.py; planning
    from shapes alone, ``probe=False``, is neither read nor kept). ``progress`` is called
    with a short description as each phase begins; every phase is also logged on the
    ``"autockpt"`` logger at INFO, with its seconds.

    The planner composes three parts (``autockpt/planning/``): a frozen :class:`Prepared`
    (capture, profile, chain, recorded step, rank terms; :attr:`prepared`), the
    :class:`Predictor` (the one memory model and scope rule; :attr:`predictor`) and the
    :class:`BudgetSearch` (:attr:`search`). The prepared values are also attributes of the
    planner (``capture``, ``profile``, ``chain``, ``trace``, ...).
    """

    def __init__(
        self,
        model: nn.Module,
        example_inputs: Any,
        *,
        scope: str = "total",
        loss_fn: LossFn | None = None,
        leaf_modules: Iterable[str] = (),
        max_stages: int = DEFAULT_MAX_STAGES,
        world_size: int = 1,
        sharding: str | None = None,
        fsdp_units: Iterable[str] | None = None,
        progress: ProgressFn | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        accumulation_steps: int = 1,
        probe: bool = True,
        budget_gb: float | None = None,
        cache: bool = True,
    ) -> None:
        budget_bytes = None if budget_gb is None else budget_in_bytes(check_budget_gb(budget_gb))
        # what planning again for another precision repeats (NOTE [rewrite: precision change])
        self._options: dict[str, Any] = dict(
            scope=scope,
            loss_fn=loss_fn,
            leaf_modules=tuple(leaf_modules),
            max_stages=max_stages,
            world_size=world_size,
            sharding=sharding,
            fsdp_units=None if fsdp_units is None else tuple(fsdp_units),
            optimizer=optimizer,
            accumulation_steps=accumulation_steps,
            cache=cache,
        )
        model, self._hand_back = unwrap(model)
        self.progress: ProgressFn = progress or (lambda stage: None)
        if scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
        self.optimizer = _check_iteration(model, scope, optimizer, accumulation_steps)
        self.accumulation_steps = accumulation_steps
        self.sharding = resolve_sharding(model, world_size, sharding, fsdp_units)
        self.model = model
        self.inputs = Inputs.of(example_inputs).as_called(model)
        self.scope = scope
        self.loss_fn = loss_fn
        warn_if_eval(model)
        request = Request(
            scope,
            loss_fn,
            tuple(leaf_modules),
            max_stages,
            self.sharding,
            self.optimizer,
            accumulation_steps,
            probe,
        )
        self._cache = cache
        self._cache_key: Hashable | None = None  # this preparation's entry, when cached
        # through the attribute: a caller may set planner.progress between phases (the CLI)
        self._phases = Phases(lambda what: self.progress(what))
        self.phase_seconds: dict[str, float] = self._phases.seconds
        """Wall seconds per planning phase (capture, profile, record, search, verify)."""
        self.nested: UnitsPlanner | None = None
        """Set when the root's own forward cannot be captured: its submodule calls are then
        planned as units (autockpt/planning/nested.py), and :meth:`optimize` and the
        predicted range are what this planner offers."""
        with as_found(model, self.inputs), training_mode(model):
            device, self.precision, planning_peak = start(model, self.inputs)
            self._phases.start("capture", "capturing the graph")
            try:
                captured = capture(model, self.inputs, leaf_modules=request.leaves)
            except TraceError as error:
                # Before any profiling of the root: data-dependent code in the root itself
                # (an input check) runs eagerly around a submodule that is planned instead.
                if not error.in_root_code or self.sharding.active or device.type == "meta":
                    raise
                self._plan_units(error, request)
                return
            if budget_bytes is not None:
                _refuse_below_floor(model, self.inputs, captured, request, budget_bytes)
            # probe=False (shapes alone: fit_batch's many sizes) is cheap: neither read nor kept
            key = (
                cache_key(model, self.inputs, captured, request, self.precision)
                if cache and probe
                else None
            )
            reused = cached(model, key)
            self._cache_key = key
            if reused is not None and reused.as_written_known:
                self._as_written_shift = reused.as_written_shift
            prepared = prepare(
                model,
                self.inputs,
                captured,
                request,
                self.precision,
                planning_peak,
                self._phases,
                reused=(reused.profile, reused.trace) if reused is not None else None,
            )
            self._adopt(prepared, leanest=reused.leanest if reused is not None else None)
            self._phases.start("search", "searching the leanest plan")
            self.no_checkpoint_peak_bytes = self.predict([])
            """Predicted peak of the captured graph run without checkpoints (the replay of
            the recorded step under no plan): the solver's upper end and what plans are
            compared with inside autockpt. The user's model as written may peak higher (its
            own code keeps tensors the graph frees): :attr:`as_written_peak_bytes`."""
            leanest = self.search.leanest()
            self.minimum_peak_bytes = leanest.peak_bytes
            if reused is None:
                keep(model, key, Reused(self.profile, self.trace, leanest))
            self.breakdown = breakdown(
                self.profile, self.chain, scope, self.minimum_peak_bytes, self.trace
            )
            if self.rank_memory is not None and scope == "total":
                self.breakdown = rank_breakdown(self.breakdown, self.rank_memory, self.sharding)
            self._phases.stop()

    def _adopt(self, prepared: Prepared, leanest: Solution | None = None) -> None:
        """Make the prepared values the planner's attributes (their public names), and
        build the predictor and the search over them (``leanest``: the search's answer from
        the cache)."""
        self.prepared = prepared
        self.capture = prepared.capture
        self.profile = prepared.profile
        self.meta = prepared.meta
        self.blocks = prepared.blocks
        self.chain = prepared.chain
        self.trace = prepared.trace
        self.single_problem = prepared.single_problem
        self.rank_memory = prepared.rank_memory
        self.per_block_segments: tuple[StageRange, ...] | None = prepared.per_block_segments
        """The per-block hand plan as stage ranges (None without repeated blocks)."""
        self.planning_peak_bytes = prepared.planning_peak_bytes
        self.predictor = Predictor(prepared)
        self.search = BudgetSearch(
            self.chain, self.predictor, seeds=prepared.seeds, leanest=leanest
        )

    def _plan_units(self, error: TraceError, request: Request) -> None:
        """Plan the submodule calls of a root whose own code cannot be captured as units
        (autockpt/planning/nested.py, NOTE [nested: units])."""
        self._phases.stop()  # the failed capture; the units' planners time their own phases
        if not request.probe:
            # finding units runs the root's forward: no plan from shapes alone (fit_batch)
            raise AutockptError(
                f"this model's forward cannot be captured ({error.location}: "
                f"`{error.source_line}`), so it is planned as units found by running its "
                "forward, which a plan from shapes alone (probe=False, fit_batch's sizes) "
                "must not do: plan a given batch with autockpt.optimize instead"
            ) from error
        self.progress("finding the submodule calls to plan (the root's forward cannot be captured)")
        started = time.perf_counter()
        leaves = request.leaf_modules
        found = find_units(self.model, self.inputs, leaves, error)
        choose_seconds = time.perf_counter() - started
        planners: list[Planner] = []
        by_key: dict[tuple, Planner] = {}
        for unit in found.units:
            module = self.model.get_submodule(unit.path)
            key = unit_key(module, unit.inputs)
            if key not in by_key:
                prefix = f"{unit.path}."
                by_key[key] = Planner(
                    module,
                    unit.inputs,
                    scope="total",
                    loss_fn=unit_loss,
                    leaf_modules=[n.removeprefix(prefix) for n in leaves if n.startswith(prefix)],
                    max_stages=request.max_stages,
                    progress=self.progress,
                    cache=self._cache,
                )
            planners.append(by_key[key])
        self.nested = UnitsPlanner(
            self.model,
            self.inputs,
            error,
            found,
            planners,
            scope=self.scope,
            leaf_modules=tuple(leaves),
            loss=loss_name(self.loss_fn),
            precision_note=self.precision.note(),
            choose_seconds=choose_seconds,
            progress=self.progress,
            measure_step=self._measure,
        )
        for phases in (*(p.phase_seconds for p in by_key.values()), self.nested.phase_seconds):
            for phase, seconds in phases.items():
                self._phases.add(phase, seconds)
        self.meta = False
        self.minimum_peak_bytes = self.nested.minimum_peak_bytes
        self.no_checkpoint_peak_bytes = self.nested.no_checkpoint_peak_bytes
        self.breakdown = self.nested.breakdown
        self.planning_peak_bytes = max(p.planning_peak_bytes or 0 for p in by_key.values()) or None

    def __getattr__(self, name: str) -> Any:
        # Reached only for attributes never set: a planner that plans units of a root
        # has no graph, profile or search of the root.
        nested = self.__dict__.get("nested")
        if nested is None or name.startswith("__"):
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
        raise AttributeError(
            f"Planner.{name} is not available: the root's forward cannot be captured, so "
            f"this planner plans its submodule calls as units ({nested.path}); use "
            "optimize(), minimum_peak_bytes and no_checkpoint_peak_bytes, or "
            "planner.nested.planners for each unit's own planner"
        )

    # -- predictions (the Predictor's) ----------------------------------------------------

    def predict(self, segments: Sequence[StageRange], kept: Sequence[Sequence[int]] = ()) -> int:
        """Predicted peak (in the planner's scope, per rank when sharded) of a plan given as
        stage ranges (and, per range, the compute nodes kept inside it: selective
        recompute): the plan simulator's replay of the recorded step."""
        return self.predictor.predict(segments, kept)

    def timeline(
        self, segments: Sequence[StageRange], kept: Sequence[Sequence[int]] = ()
    ) -> MemoryTimeline:
        """The predicted memory curve of one step with and without the plan
        (:meth:`autockpt.planning.predict.Predictor.timeline`)."""
        return self.predictor.timeline(segments, kept)

    def recompute_seconds(
        self, segments: Sequence[StageRange], kept: Sequence[Sequence[int]] = ()
    ) -> float:
        """Seconds a plan adds to a step, from the probe's measured node times
        (:meth:`autockpt.planning.predict.Predictor.recompute_seconds`)."""
        return self.predictor.recompute_seconds(segments, kept)

    def simulate(self, segments: Sequence[StageRange]) -> Simulation:
        """The prediction for checkpointing the given stage ranges: peak from the plan
        simulator (:meth:`predict`), recompute seconds from :meth:`recompute_seconds`."""
        return self.predictor.simulate(segments)

    @property
    def as_written_peak_bytes(self) -> int:
        """Predicted peak of one step of the model as written, without checkpointing (in the
        planner's scope, per rank when sharded): the baseline "without checkpointing" means
        to a user, and what the halfway default budget and every ratio against no
        checkpointing use. It is :attr:`no_checkpoint_peak_bytes` (the captured graph's)
        moved by how much higher the model's own step peaks than the graph's, both run on
        fake tensors under the same tracker (autockpt/costs/as_written.py): the model's code
        may keep tensors alive that the graph frees. Never run for real (planning must fit
        where the plan fits); computed on first use. Where the model as written does not
        run on fake tensors, the graph's prediction. With an optimizer the difference is
        the forward and backward's, added to the whole iteration's peak (an upper bound)."""
        found = self._as_written_or_none()
        return self.no_checkpoint_peak_bytes if found is None else found

    def _as_written_or_none(self) -> int | None:
        """:attr:`as_written_peak_bytes`, or None where the model as written does not run on
        fake tensors (what a plan records)."""
        if self.nested is not None:
            return None  # the root's own code runs eagerly: its step is measured, not modelled
        if "_as_written_shift" not in self.__dict__:
            with (
                as_found(self.model, self.inputs),
                training_mode(self.model),
                self.precision.entered(),
            ):
                self._as_written_shift = as_written_shift(
                    self.model, self.capture, self.inputs, self.loss_fn
                )
            # kept with the cached preparation: a later call does not run the two steps again
            remember_as_written(self.model, self._cache_key, self._as_written_shift)
        shift = self._as_written_shift
        return None if shift is None else self.no_checkpoint_peak_bytes + shift

    @property
    def step_seconds(self) -> float:
        """Step time of the unmodified model as the probe measured it node by node (the
        cost model's on the meta device)."""
        return self.profile.step_seconds

    def budgeted_bytes(self, measurement: Measurement) -> int:
        """The part of a measured peak that the budget covers (all of it for scope
        ``total``; what lies above parameters, buffers, inputs and gradients otherwise)."""
        return self.predictor.in_scope(measurement.peak_bytes)

    # -- plans ----------------------------------------------------------------------------

    def solve(
        self,
        budget_bytes: int,
        *,
        solver: str = "auto",
        time_limit_s: float = 30.0,
        selective: bool = True,
    ) -> Solution:
        """The least-recompute plan whose simulated peak fits ``budget_bytes``, without
        rewriting or measuring (cheap: the profile and the recorded step are reused).
        Raises :class:`InfeasibleBudgetError` below the minimum."""
        return self._search(int(budget_bytes), solver, time_limit_s, selective)

    def _search(
        self, budget_bytes: int, solver: str, time_limit_s: float, selective: bool = True
    ) -> Solution:
        """The least-recompute plan whose predicted peak fits ``budget_bytes``: the search
        under the replay (``auto``), or a stage-chain solver judged by it
        (autockpt/planning/search.py). Raises :class:`InfeasibleBudgetError` below the
        minimum."""
        if solver not in METHODS and solver not in SEARCH_METHODS:
            raise ValueError(
                f"unknown solver {solver!r}; choose one of {', '.join((*SEARCH_METHODS, *METHODS[1:]))}"
            )
        if self.minimum_peak_bytes > budget_bytes:
            raise InfeasibleBudgetError(
                budget_bytes, self.minimum_peak_bytes, self.breakdown, self.scope
            )
        try:
            if solver in SEARCH_METHODS:
                return self.search.least_recompute(
                    budget_bytes, time_limit_s=time_limit_s, selective=selective
                )
            return self.search.chain_solver(budget_bytes, solver, time_limit_s=time_limit_s)
        except InfeasibleError as error:
            hint = (
                f"The '{solver}' solver optimises the stage-chain proxy and found no plan that "
                "fits, but one exists: use solver='auto'."
            )
            raise InfeasibleBudgetError(
                budget_bytes, self.minimum_peak_bytes, self.breakdown, self.scope, hint
            ) from error

    @_leaves_as_found
    def optimize(
        self,
        *,
        budget_gb: float,
        solver: str = "auto",
        time_limit_s: float = 30.0,
        verify: bool = True,
        selective: bool = True,
        compile_budgets: Sequence[float] | None = None,
        settle: Callable[[nn.Module], None] | None = None,
    ) -> nn.Module:
        """Solve for ``budget_gb``, rewrite, and (``verify``) check one measured step.

        ``selective``: segments may keep chosen operator outputs (a matrix multiply's)
        instead of recomputing them, where the replay shows that is cheaper within the
        budget (docs/design.md, "Selective recompute"); False: every segment recomputes
        everything inside it. ``compile_budgets``: for a model that came compiled, the
        ``activation_memory_budget`` values of torch.compile measured beside the plan (NOTE
        [compiled: partitioner budgets]; default 0.1, 0.3, 0.5; ``()``: none).
        ``settle(result)``: what the caller sets on the result (its precision-change
        rule), done before a compiled result's last measured step, since dynamo guards
        on it (else the user's first step compiles again)."""
        budget_bytes = budget_in_bytes(check_budget_gb(budget_gb))

        def replan(module: nn.Module, args: tuple, kwargs: dict) -> nn.Module:
            # this planner's request, from the call in the new precision (NOTE [rewrite:
            # precision change]); the result is planned from its plain model (unwrap)
            again = Planner(module, Inputs(tuple(args), dict(kwargs)), **self._options)
            return again.optimize(
                budget_gb=budget_gb,
                solver=solver,
                time_limit_s=time_limit_s,
                verify=verify,
                selective=selective,
                compile_budgets=compile_budgets,
            )

        def finish(result: nn.Module) -> None:
            inner = getattr(result, "_orig_mod", result)
            if settle is not None:  # the caller's rule replaces this planner's
                settle(inner)
            else:
                set_precision_change(inner, "replan", replan)

        if self.nested is not None:
            units = self.nested.optimize(
                budget_bytes,
                solver=solver,
                time_limit_s=time_limit_s,
                verify=verify,
                selective=selective,
            )
            # a result of units plans the whole step again from the user's model
            watch_units_precision(
                units, lambda args, kwargs: replan(self.model, args, kwargs), "replan"
            )
            return self._hand_back(units)

        def attempt(underestimate: int, last_round: bool) -> Attempt[tuple[Solution, Plan]]:
            self._phases.start("search", "solving")
            try:
                solution = self._search(
                    budget_bytes - underestimate, solver, time_limit_s, selective
                )
            except InfeasibleBudgetError as error:
                if not underestimate:
                    raise
                raise self._measured_infeasible(budget_bytes, underestimate) from error
            plan = self._plan_of(solution, budget_bytes)
            # One road from a plan to a module, for optimize and apply alike.
            result = self._rewrite(specs_from_plan(self.capture, plan))
            return Attempt(result, (solution, plan), solution.peak_bytes)

        def measure_attempt(found: Attempt[tuple[Solution, Plan]]) -> tuple[int, Measurement]:
            # The plan's own step fits by construction: measuring it is the only real step
            # planning runs (the probe already warmed every kernel up). Memory only: one
            # step's time is no result (benchmarks interleave rounds).
            self._phases.start("verify", "measuring the plan")
            checked = self._measure(found.result, timed=self._times_step)
            solution = found.found[0]
            return self.budgeted_bytes(checked) + self.predictor.rank_shift(
                solution.segments
            ), checked

        fractions = self._compile_budgets(compile_budgets, verify)
        try:
            fitted = fit_by_measuring(
                budget_bytes,
                attempt,
                measure_attempt if verify and not self.meta else None,
                lambda underestimate, used: self._measured_infeasible(budget_bytes, underestimate),
            )
        except InfeasibleBudgetError as error:
            if not fractions:
                raise
            # compile's own partitions may still fit (NOTE [compiled: partitioner budgets])
            result = self._fastest_compiled(None, budget_bytes, fractions, error, finish)
        else:
            result = fitted.attempt.result
            solution, plan = fitted.attempt.found
            if fitted.measurement is not None and fitted.measurement.repeat > 0:
                self._adopt_step_factors(solution, fitted.measurement)
                plan = self._plan_of(solution, budget_bytes)  # its seconds at the factors
            result.plan = with_measurement(
                plan, self.prepared, self.predictor, solution, fitted.measurement
            )
            if fractions:
                result = self._fastest_compiled(result, budget_bytes, fractions, None, finish)
        finally:
            self._phases.stop()

        finish(result)
        return result

    def rewrite(
        self, segments: Sequence[StageRange], kept: Sequence[Sequence[int]] = ()
    ) -> nn.Module:
        """The model rewritten to checkpoint the given stage ranges, keeping the outputs of
        the compute nodes ``kept[k]`` inside segment ``k`` (no solving, no check; a kept
        node must be one :func:`solvers.selective.keepable_nodes` allows)."""
        keepable = keepable_nodes(self.trace) if any(kept) else frozenset()
        for nodes in kept:
            for i in nodes:
                if i not in keepable:
                    raise ValueError(
                        f"node {i} ({self.chain.node_names[i]}) cannot be kept: it does not "
                        "call exactly one allocating, deterministic, non-mutating operator"
                    )
        given = Solution(
            segments=[tuple(seg) for seg in segments],
            recompute_seconds=0.0,
            peak_bytes=0,
            status="feasible",
            method="given",
            solve_seconds=0.0,
            gap=None,
            kept=tuple(tuple(nodes) for nodes in kept),
        )
        return self._rewrite(
            segment_specs(self.chain, self.profile, self.capture, given, self.trace)
        )

    def _rewrite(self, specs: list[Any]) -> nn.Module:
        """The model rewritten with ``specs``, handed back as it came (compiled or not)."""
        return self._hand_back(rewrite_for_training(self.model, self.capture, specs, self.inputs))

    def _compile_budgets(self, given: Sequence[float] | None, verify: bool) -> tuple[float, ...]:
        """The partitioner budgets to measure beside the plan (NOTE [compiled: partitioner
        budgets]): only for a model that came compiled, verified on a real device."""
        if self._hand_back is same or not verify or self.meta:
            return ()
        return COMPILE_BUDGETS if given is None else check_compile_budgets(given)

    def _fastest_compiled(
        self,
        planned: nn.Module | None,
        budget_bytes: int,
        fractions: tuple[float, ...],
        infeasible: InfeasibleBudgetError | None,
        finish: Callable[[nn.Module], None],
    ) -> nn.Module:
        """The fastest of the verified plan (``planned``; None: no plan fits) and the model
        compiled at each partitioner budget, by measured peak and time (NOTE [compiled:
        partitioner budgets]). ``finish`` sets the result's precision-change rule before its
        last measured step: dynamo guards on it, and set afterwards it made the user's first
        step compile again, which kept 16-64 bytes more than the step planning measured (over
        the budget at compile's own 0.5 point on GPT-2)."""
        hand_back = self._hand_back
        assert isinstance(hand_back, CompiledHandBack)
        self._phases.start("verify", "measuring torch.compile's own partitions")
        backend = hand_back.backend_name + repr(getattr(hand_back.context, "_dynamic", None))
        plain = rewrite_for_training(self.model, self.capture, [], self.inputs)
        candidates = [
            Candidate(
                hand_back.at_budget(plain, fraction),
                fraction,
                candidate_key(backend, fraction, None),
            )
            for fraction in fractions
        ]
        if planned is not None:
            plan = planned.plan
            segments = [(s.first_node, s.last_node, s.kept_ops) for s in plan.segments]
            key = candidate_key(backend, None, segments)
            candidates.insert(0, Candidate(planned, None, key))

        def measure_peak(module: nn.Module) -> tuple[int, int]:
            checked = self._measure(module)
            return self.budgeted_bytes(checked), checked.peak_bytes

        def side_by_side(modules: list[nn.Module]) -> list[float]:
            with self.precision.entered():
                return time_steps(modules, self.inputs, loss_fn=self.loss_fn)

        while True:
            best, runs = fastest_within(
                candidates, budget_bytes, self.profile.timing, measure_peak, side_by_side
            )
            if best is None:
                if infeasible is not None:
                    raise infeasible
                raise self._measured_infeasible(budget_bytes, 0)
            result = self._handed_back(candidates, runs, best, budget_bytes)
            finish(result)
            # The module as handed back, its final plan and re-plan in place (dynamo guards
            # on both, so this step compiles it once more): its own step is the promise, and
            # the user's first step compiles nothing.
            final = self._measure(result)
            if self.budgeted_bytes(final) <= budget_bytes:
                # recorded in place: a new plan object would fail dynamo's guard on it and
                # compile the module once more, which is not the step just measured
                object.__setattr__(result.plan, "measured_peak_bytes", final.peak_bytes)
                return result
            candidates = [c for k, c in enumerate(candidates) if k != best]

    def _handed_back(
        self, candidates: list[Candidate], runs: list[Run], best: int, budget_bytes: int
    ) -> nn.Module:
        """The chosen compiled candidate with its plan (NOTE [compiled: partitioner
        budgets])."""
        notes = compiled_notes(candidates, runs, best, budget_bytes)
        chosen, run = candidates[best], runs[best]
        result = chosen.module
        if chosen.fraction is None:
            result.plan = dataclasses.replace(
                result.plan,
                measured_step_seconds=run.seconds,
                notes=(*result.plan.notes, *notes),
            )
            return result
        # no segments: the partitioner recomputes; peak and step measured compiled
        empty = Solution([], 0.0, 0, "feasible", "compile", 0.0, None)
        plan = self._plan_of(empty, budget_bytes)
        mark_verified_compiled(result._orig_mod)
        result.plan = dataclasses.replace(
            plan,
            compile_memory_budget=chosen.fraction,
            predicted_peak_bytes=run.peak_bytes,
            predicted_recompute_seconds=0.0,
            predicted_step_seconds=run.seconds,
            recompute_fraction=0.0,
            measured_peak_bytes=run.peak_bytes,
            measured_step_seconds=run.seconds,
            notes=(*plan.notes, *notes),
        )
        return result

    def _plan_of(self, solution: Solution, budget_bytes: int) -> Plan:
        """The plan of ``solution``, with this planner's predictions."""
        specs = segment_specs(self.chain, self.profile, self.capture, solution, self.trace)
        return make_plan(
            self.prepared,
            self.predictor,
            solution,
            specs,
            budget_bytes,
            minimum_peak_bytes=self.minimum_peak_bytes,
            no_checkpoint_peak_bytes=self.no_checkpoint_peak_bytes,
            as_written_peak_bytes=self._as_written_or_none(),
        )

    @property
    def _times_step(self) -> bool:
        """Whether the verifying measurement also times the plan's step, for the step
        factors no plan of this model has stored yet (NOTE [timing: step factors]): an
        eager, unsharded forward and backward with measured node seconds that rank."""
        timing = self.profile.timing
        return (
            timing is not None
            and timing.ranks
            and timing.factors is None
            and self._hand_back is same
            and self.optimizer is None
            and self.accumulation_steps == 1
            and not self.sharding.active
        )

    def _adopt_step_factors(self, solution: Solution, timed: Measurement) -> None:
        """Store the step factors from the verified plan's timed steps (or take those another
        process stored first) and predict by them from now on (NOTE [timing: step
        factors])."""
        timing = self.profile.timing
        assert timing is not None
        ranked = self.predictor.recompute_seconds(solution.segments, solution.kept)
        factors = step_factors(timing, ranked, timed.forward_seconds, timed.step_seconds)
        profile = self.profile.with_timing(settle_factors(timing, factors))
        leanest = self.search.leanest()
        self._adopt(dataclasses.replace(self.prepared, profile=profile), leanest=leanest)
        remember_profile(self.model, self._cache_key, profile)

    def _measure(self, result: nn.Module, timed: bool = False) -> Measurement:
        """One real step of the plan, in the training mode it was planned in (``timed``:
        then up to :data:`autockpt.costs.timing.STEP_ROUNDS` timed steps, fewer once they
        took :data:`~autockpt.costs.timing.STEP_TIMING_SECONDS`). A result under
        ``torch.compile`` (the model came compiled) is measured compiled, after one warm-up
        step that compiles it: the budget holds for the module handed back."""
        compiled = self._hand_back is not same
        inner = getattr(result, "_orig_mod", None)
        if compiled and inner is not None:  # measured as handed back, under its torch.compile
            mark_verified_compiled(inner)  # so tracing it raises no CompileWarning
        # Scalar draws at their worst case (every LayerDrop layer runs), as the profile and
        # the recorded step planned for (autockpt/base/rng.py): predicted and measured agree.
        # None when the root's code runs eagerly around units: its draws (a LayerDrop loop's)
        # are at their worst case too, as the units were found (planning/nested.py)
        planned = self.__dict__.get("profile")
        draws = (planned is None or planned.worst_case_draws > 0) and not compiled
        worst_case = worst_case_draws() if draws else contextlib.nullcontext()
        with self.precision.entered(), training_mode(result), worst_case:
            measured = measure(
                result,
                self.inputs,
                loss_fn=self.loss_fn,
                repeat=STEP_ROUNDS if timed else 0,
                max_seconds=STEP_TIMING_SECONDS,
                warmup=1 if compiled else 0,
                optimizer=self.optimizer,
                accumulation_steps=self.accumulation_steps,
            )
        release_freed_heap()  # the measured step is gone: so are its pages
        return measured

    def _measured_infeasible(self, budget_bytes: int, underestimate: int) -> InfeasibleBudgetError:
        return InfeasibleBudgetError(
            budget_bytes,
            max(self.minimum_peak_bytes + underestimate, budget_bytes + 1),
            self.breakdown,
            self.scope,
            f"Measured peaks ran up to {underestimate} bytes above the model's prediction, so "
            "the leanest plan needs the minimum stated."
            + (
                " (Measured under the model's torch.compile, which keeps other tensors than "
                "the eager step the prediction models.)"
                if self._hand_back is not same
                else ""
            ),
        )
