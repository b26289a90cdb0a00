"""The front doors: ``optimize``, ``apply`` and :class:`Planner`. They only compose.

``optimize(model, inputs, budget_gb)`` runs, in a straight line::

    unwrap (autockpt/rewrite/apply.py)        the eager module to plan, and how to hand it back
    Request (autockpt/planning/request.py)    every input of planning, checked, frozen
    capture (autockpt/capture/)               one graph of the whole step, or a refusal
    a route (autockpt/planning/routes/)       chosen once: the captured graph, the units of
                                              a root that cannot be captured, or a compiled
                                              model's; it states the range and plans budgets
    route.optimize                            search -> plan -> rewrite -> measure, tightened
                                              by what the measurement exceeded the prediction

A plan is returned only when both its prediction and its measured step fit the budget
(``verify=True``, the default). :class:`Planner` is the facade over the chosen route
(docs/design.md, "The front door and its routes").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from autockpt.base.inputs import Inputs
from autockpt.base.optimizer import check_optimizer
from autockpt.base.precision import Precision
from autockpt.base.runtime import LossFn, as_found, training_mode, unit_loss, warn_if_eval
from autockpt.base.target import Target
from autockpt.costs.problem import DEFAULT_MAX_STAGES
from autockpt.distributed import PlanRequest, plan_on_one_rank
from autockpt.errors import PlanMismatchError
from autockpt.plan import SCOPES, Plan
from autockpt.planning.cache import clear_cache
from autockpt.planning.prepared import start
from autockpt.planning.request import (
    Phases,
    ProgressFn,
    Request,
    budget_in_bytes,
    budget_or_default,
    check_budget_gb,
    check_iteration,
)
from autockpt.planning.routes import choose_route
from autockpt.planning.routes.base import Route, Solve
from autockpt.planning.routes.captured import CapturedRoute
from autockpt.planning.routes.compiled import CompiledRoute, check_compile_budgets
from autockpt.planning.routes.units import UnitsRoute
from autockpt.planning.sharding import resolve_sharding
from autockpt.rewrite.apply import apply_plan, unwrap
from autockpt.rewrite.result import check_setting, set_precision_change, watch_units_precision
from solvers import Solution

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
    budget_gb: float | None = None,
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
    reshard_after_forward: bool | Mapping[str, bool] | None = None,
    plan_rank: int | None = 0,
    selective: bool = True,
    optimizer: torch.optim.Optimizer | None = None,
    accumulation_steps: int = 1,
    progress: ProgressFn | None = None,
    cache: bool = True,
    on_precision_change: str = "replan",
    compile_budgets: Sequence[float] | None = None,
    target: Target | str | None = None,
    precision: Precision | str | None = None,
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
    :class:`InfeasibleBudgetError` when no plan fits: its ``minimum_gb`` does fit, or, for a
    budget refused before profiling, ``floor_gb`` states what every plan keeps at least
    (``minimum_gb`` is then None).

    Distributed training (see ``docs/distributed.md``): with ``world_size=N`` and
    ``sharding="ddp"`` or ``"fsdp"``, ``example_inputs`` are one rank's batch and the budget
    is per rank; the memory model counts what that engine keeps on a rank. Wrap the result
    afterwards: ``DDP(result)``, or ``fully_shard`` on each of ``result.plan.fsdp_units``
    (default: the repeated blocks, e.g. transformer layers; they stay module calls and
    checkpoint segments hold whole units) and then on ``result``, each with
    ``reshard_after_forward=result.plan.reshards(name)`` (``""``: the root).
    ``reshard_after_forward``: what the run passes to ``fully_shard``: None, FSDP2's
    defaults (units reshard, the root does not); a bool for every unit; or a mapping from
    unit names (``""``: the root) to bools (NOTE [sharding: reshard after forward]).

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

    Planning before launch (docs/large-runs.md): a model built on the meta device is planned
    for ``target``, a device it will run on (``"h100"``, ``"h200"``, ``"a100"``, ``"l4"``,
    ``"mi300x"`` or an :class:`autockpt.Target`): its fused attention and autocast, its
    roofline times, and its memory less a reserve as the default budget (NOTE [target:
    planning for another device]). ``precision``: ``"bf16-mixed"`` / ``"16-mixed"`` plan
    autocast on the device the run uses (the target's) whatever context is around the call;
    ``"bf16-true"`` checks the parameters are bfloat16; None: the autocast context around
    the call. ``budget_gb`` may be left out only with a target.

    Why this is long: this docstring is the reference of every argument of the front door;
    the body is a straight line (check, plan on one rank, settle the result).
    """
    # every argument but the model and its inputs and precision: what planning again
    # repeats (a call in another precision is planned in that one)
    request = {
        k: v for k, v in locals().items() if k not in ("model", "example_inputs", "precision")
    }
    budget_gb = check_budget_gb(budget_or_default(budget_gb, target))
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
            reshard_after_forward=reshard_after_forward,
            optimizer=optimizer,
            accumulation_steps=accumulation_steps,
            progress=progress,
            budget_gb=budget_gb,
            cache=cache,
            target=target,
            precision=precision,
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


class _Routed:
    """A public name of the chosen route, read through :class:`Planner` (the range:
    ``minimum_peak_bytes``, ``no_checkpoint_peak_bytes``, ``breakdown``, ...; their
    meaning is :class:`~autockpt.planning.routes.base.Route`'s). Why descriptors: the
    facade holds no copy of a route's state, so a route that changes (step factors
    adopted) is read as it is now."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, planner: Planner | None, owner: type | None = None) -> Any:
        return self if planner is None else getattr(self.route_of(planner), self.name)

    def route_of(self, planner: Planner) -> Any:
        return planner.route


class _OfTheGraph(_Routed):
    """A public name of the captured graph's route (``capture``, ``profile``, ``chain``,
    ``predict``, ``rewrite``, ...: :class:`~autockpt.planning.routes.captured.CapturedRoute`
    documents each). A planner of units has no graph of the root: the name then raises an
    :class:`AttributeError` saying what that planner offers instead."""

    def route_of(self, planner: Planner) -> Any:
        return planner.graph_route(self.name)


_AGAIN = (
    *("scope", "loss_fn", "leaf_modules", "max_stages", "world_size", "sharding"),
    *("fsdp_units", "reshard_after_forward", "optimizer", "accumulation_steps", "cache"),
    "target",
)
"""The planner's arguments a plan for another precision repeats (not the precision)."""


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
    right after capture, before profiling: it states that sum as ``floor_gb`` (and
    ``lower_bound``), not a minimum, which needs the profile. ``cache``: reuse the
    profile, recorded step and leanest plan of an earlier planner of the same model, inputs
    and options, and keep this one's for later ones (autockpt/planning/cache.py; planning
    from shapes alone, ``probe=False``, is neither read nor kept). ``progress`` is called
    with a short description as each phase begins; every phase is also logged on the
    ``"autockpt"`` logger at INFO, with its seconds.

    The planner is a facade (docs/design.md, "The front door and its routes"): it checks the
    request (:attr:`request`), captures, and chooses one route (:attr:`route`): the captured
    graph's (``autockpt/planning/routes/captured.py``), compiled over it for a model that came
    under ``torch.compile`` (``routes/compiled.py``), or, for a root whose own forward cannot
    be captured, its submodule calls planned as units (``routes/units.py``; :attr:`nested`).
    The graph's values and questions are the planner's too (``capture``, ``profile``,
    ``chain``, ``trace``, ``prepared``, ``predictor``, ``search``, ``predict``, ...).
    """

    # the route's range (NOTE [routes: protocol]), read through
    minimum_peak_bytes = _Routed()
    no_checkpoint_peak_bytes = _Routed()
    breakdown = _Routed()
    meta = _Routed()
    planning_peak_bytes = _Routed()
    # the captured graph's values and questions (NOTE [routes: captured graph])
    prepared = _OfTheGraph()
    capture = _OfTheGraph()
    profile = _OfTheGraph()
    blocks = _OfTheGraph()
    chain = _OfTheGraph()
    trace = _OfTheGraph()
    single_problem = _OfTheGraph()
    rank_memory = _OfTheGraph()
    per_block_segments = _OfTheGraph()
    predictor = _OfTheGraph()
    search = _OfTheGraph()
    predict = _OfTheGraph()
    timeline = _OfTheGraph()
    recompute_seconds = _OfTheGraph()
    simulate = _OfTheGraph()
    budgeted_bytes = _OfTheGraph()
    rewrite = _OfTheGraph()

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
        reshard_after_forward: bool | Mapping[str, bool] | None = None,
        progress: ProgressFn | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        accumulation_steps: int = 1,
        probe: bool = True,
        budget_gb: float | None = None,
        cache: bool = True,
        target: Target | str | None = None,
        precision: Precision | str | None = None,
    ) -> None:
        budget_bytes = None if budget_gb is None else budget_in_bytes(check_budget_gb(budget_gb))
        leaf_modules = tuple(leaf_modules)
        fsdp_units = None if fsdp_units is None else tuple(fsdp_units)
        # what planning again for another precision repeats (NOTE [rewrite: precision change])
        self._options: dict[str, Any] = {k: v for k, v in locals().items() if k in _AGAIN}
        model, hand_back = unwrap(model)
        self.progress: ProgressFn = progress or (lambda stage: None)
        if scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
        self.optimizer = check_iteration(model, scope, optimizer, accumulation_steps)
        self.sharding = resolve_sharding(
            model, world_size, sharding, fsdp_units, reshard_after_forward
        )
        self.model, self.accumulation_steps = model, accumulation_steps
        self.inputs = Inputs.of(example_inputs).as_called(model)
        self.scope, self.loss_fn = scope, loss_fn
        warn_if_eval(model)
        # through the attribute: a caller may set planner.progress between phases (the CLI)
        phases = Phases(lambda what: self.progress(what))
        self.phase_seconds: dict[str, float] = phases.seconds
        """Wall seconds per planning phase (capture, profile, record, search, verify)."""
        with as_found(model, self.inputs), training_mode(model):
            device, self.precision, planning_peak, target = start(
                model, self.inputs, precision, target
            )
            self.request = Request(
                scope, loss_fn, leaf_modules, max_stages, self.sharding, self.optimizer,
                accumulation_steps, probe, self.precision, device, cache, target,
            )  # fmt: skip
            """Every input of planning, checked and frozen (NOTE [planning: one request])."""
            with self.precision.entered(device):  # the one asked for, or the caller's
                self.route: Route = choose_route(
                    model,
                    self.inputs,
                    self.request,
                    phases=phases,
                    planning_peak=planning_peak,
                    hand_back=hand_back,
                    budget_bytes=budget_bytes,
                    progress=self.progress,
                    plan_unit=self._plan_unit,
                )
            """The way this model is planned (NOTE [routes: protocol])."""
        self.nested = self.route if isinstance(self.route, UnitsRoute) else None
        """The units route, when the step cannot be captured whole (the root's own forward,
        or a leaf hiding repeated blocks: its submodule calls are planned as units,
        autockpt/planning/routes/units.py)."""

    def _plan_unit(self, module: nn.Module, inputs: Inputs, leaves: tuple[str, ...]) -> Planner:
        """The planner of one unit of a root planned as units (NOTE [nested: units])."""
        return Planner(
            module,
            inputs,
            scope="total",
            loss_fn=unit_loss,
            leaf_modules=leaves,
            max_stages=self.request.max_stages,
            progress=self.progress,
            cache=self.request.cache,
        )

    def graph_route(self, name: str) -> CapturedRoute:
        """The captured graph's route, or an :class:`AttributeError` naming ``name`` for a
        planner of units (whose root has no graph, profile or search)."""
        route = self.route
        if isinstance(route, CompiledRoute):
            route = route.graph
        if not isinstance(route, CapturedRoute):
            raise AttributeError(
                f"Planner.{name} is not available: {self.nested.eager}, so this planner "
                f"plans submodule calls as units ({self.nested.path}); use "
                "optimize(), minimum_peak_bytes and no_checkpoint_peak_bytes, or "
                "planner.nested.planners for each unit's own planner"
            )
        return route

    @property
    def as_written_peak_bytes(self) -> int:
        """Predicted peak of one step of the model as written, without checkpointing (in the
        planner's scope, per rank when sharded): the baseline "without checkpointing" means
        to a user, and what the halfway default budget and every ratio against no
        checkpointing use. It is :attr:`no_checkpoint_peak_bytes` (the captured graph's)
        moved by how much higher the model's own step peaks than the graph's, both run on
        fake tensors under the same tracker (autockpt/costs/as_written.py). Never run for
        real (planning must fit where the plan fits); computed on first use. Where the model
        as written does not run on fake tensors, the graph's prediction. With an optimizer
        the difference is the forward and backward's, added to the whole iteration's peak
        (an upper bound)."""
        found = self.route.as_written_or_none()
        return self.no_checkpoint_peak_bytes if found is None else found

    @property
    def step_seconds(self) -> float:
        """Step time of the unmodified model as the probe measured it node by node (the
        cost model's on the meta device)."""
        return self.graph_route("step_seconds").profile.step_seconds

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
        how = Solve(solver=solver, time_limit_s=time_limit_s, selective=selective)
        return self.route.solve(int(budget_bytes), how)

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
        how = Solve(solver, time_limit_s, verify, selective, compile_budgets)

        def replan(module: nn.Module, args: tuple, kwargs: dict) -> nn.Module:
            # this planner's request, from the call in the new precision (NOTE [rewrite:
            # precision change]); the result is planned from its plain model (unwrap)
            again = Planner(module, Inputs(tuple(args), dict(kwargs)), **self._options)
            return again.optimize(**dataclasses.asdict(how), budget_gb=budget_gb)

        def finish(result: nn.Module) -> None:
            inner = getattr(result, "_orig_mod", result)
            if settle is not None:  # the caller's rule replaces this planner's
                settle(inner)
            else:
                set_precision_change(inner, "replan", replan)

        # planning leaves the model, its inputs and the global generators as found
        with as_found(self.model, self.inputs):
            return self.route.optimize(budget_bytes, how, finish, replan)
