"""The front door: ``optimize`` (capture, profile, solve, rewrite, verify) and ``apply``.

Data flows one way through one module per stage::

    trace -> profile -> problem -> solve -> plan -> rewrite -> measure

``optimize`` verifies its own answer: after rewriting it measures one real step (the same
allocator-level truth the tests use) and, should the measured peak exceed the budget, it
tightens the solver's budget by the overshoot and solves again. A plan is returned only
when both the prediction and the measurement fit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import numbers
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from autockpt.blocks import block_cut_positions, block_node_ranges, find_repeated_blocks
from autockpt.distributed import (
    RANK_MARGIN_BYTES,
    Sharding,
    check_not_wrapped,
    check_units_called,
    rank_problem,
    resolve_sharding,
)
from autockpt.errors import (
    GIB,
    AutockptError,
    BudgetError,
    BudgetTypeError,
    CompileError,
    InfeasibleBudgetError,
    PlanMismatchError,
    TraceError,
)
from autockpt.measure import Measurement, measure
from autockpt.plan import KeptOp, MemoryBreakdown, MemoryTimeline, Plan, RankMemory, Segment
from autockpt.precision import Precision
from autockpt.problem import DEFAULT_MAX_STAGES, Chain, StageRange, build_chain
from autockpt.profile import KEEP_OVERHEAD_SECONDS, NodeProfile, Profile, profile
from autockpt.record import record_trace
from autockpt.rewrite import (
    SegmentSpec,
    is_checkpointed,
    mark_verified_compiled,
    plain_module,
    planned_inputs,
    rewrite,
)
from autockpt.rng import worst_case_draws
from autockpt.runtime import LossFn, as_found, device_of
from autockpt.solve import SEARCH_METHODS, BudgetSearch
from autockpt.trace import Capture, Inputs, capture, given_input_names
from solvers import METHODS, InfeasibleError, Simulation, Solution, simulate
from solvers.replay import MemoryTrace
from solvers.replay import simulate as simulate_plan
from solvers.replay import timeline as simulate_timeline
from solvers.selective import keepable_nodes

if TYPE_CHECKING:
    from autockpt.nested import SubmodulePlanner

ProgressFn = Callable[[str], None]
"""Called with a short description (``"profiling"``) as each planning stage begins."""

SCOPES = ("total", "activations")
_VERIFY_ROUNDS = 4


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
) -> nn.Module:
    """Return ``model`` rewritten to checkpoint activations so that one training step's
    peak memory fits ``budget_gb`` GiB at the least predicted recompute time.

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
    """
    from autockpt.distributed import PlanRequest, plan_on_one_rank

    budget_gb = check_budget_gb(budget_gb)

    def plan_here() -> nn.Module:
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
        )
        return planner.optimize(
            budget_gb=budget_gb, solver=solver, time_limit_s=time_limit_s, verify=verify,
            selective=selective,
        )

    return plan_on_one_rank(
        plan_here,
        lambda plan: apply(model, plan, example_inputs),
        PlanRequest(budget_gb, world_size, sharding, scope),
        plan_rank=plan_rank,
    )


def _leaves_as_found(method: Callable[..., Any]) -> Callable[..., Any]:
    """A :class:`Planner` method that leaves the model, its example inputs and the global
    random generators as found (:func:`autockpt.runtime.as_found`)."""

    @functools.wraps(method)
    def wrapper(self: Planner, *args: Any, **kwargs: Any) -> Any:
        with as_found(self.model, self.inputs):
            return method(self, *args, **kwargs)

    return wrapper


class Planner:
    """Capture, profile and calibrate a model once; then plan it for any number of budgets.

    ``optimize`` is ``Planner(...).optimize(budget_gb=...)``; keep a planner to sweep
    budgets (a frontier, a benchmark) without profiling again. The predicted range is
    ``minimum_peak_bytes`` (the leanest plan) to ``no_checkpoint_peak_bytes``.
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
    ) -> None:
        model, self._hand_back = _plain_module(model)
        self.progress: ProgressFn = progress or (lambda stage: None)
        if scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
        self.sharding: Sharding = resolve_sharding(model, world_size, sharding, fsdp_units)
        self.model = model
        self.inputs = Inputs.of(example_inputs).as_called(model)
        self.scope = scope
        self.loss_fn = loss_fn
        _warn_if_eval(model)
        with as_found(model, self.inputs), _training_mode(model):
            self._prepare(model, scope, loss_fn, leaf_modules, max_stages)

    def _prepare(
        self, model: nn.Module, scope: str, loss_fn: LossFn | None, leaf_modules: Iterable[str],
        max_stages: int,
    ) -> None:
        """Capture, profile, record and search (``__init__``'s work, in training mode)."""
        device = device_of(model, self.inputs)
        # The step is planned in the precision in effect now: an autocast context around
        # the call is the one training runs in (autockpt/precision.py).
        self.precision = Precision.now(model)
        planning = _PlanningPeak(device)
        # FSDP units are leaves: they stay module calls, so fully_shard's hooks fire and
        # checkpoint segments hold whole units (autockpt.distributed explains why).
        given_leaves = tuple(leaf_modules)
        leaves = given_leaves + tuple(u for u in self.sharding.units if u not in given_leaves)
        self.phase_seconds: dict[str, float] = {}
        """Wall seconds per planning phase (capture, profile, record, search, verify)."""
        self.nested: SubmodulePlanner | None = None
        """Set when the root's own forward cannot be captured: the plan is then made inside
        its largest capturing submodule (autockpt/nested.py), and :meth:`optimize` and the
        predicted range are what this planner offers."""
        self._phase("capture", "capturing the graph")
        try:
            self.capture = capture(model, self.inputs, leaf_modules=leaves)
        except TraceError as error:
            # Before any profiling of the root: data-dependent code in the root itself
            # (an input check) runs eagerly around a submodule that is planned instead.
            if not error.in_root_code or self.sharding.active or device.type == "meta":
                raise
            self._plan_inside_submodule(error, given_leaves, max_stages)
            return
        check_units_called(self.capture, self.sharding.units)
        # Planning fits where the plan fits: sizes come from a step on fake tensors, kernel
        # workspaces and times from a probe that runs one node at a time on the device
        # (autockpt/profile.py notes 1-3); the un-checkpointed step never runs for real.
        self._phase("profile", "profiling (fake tensors, then node by node on the device)")
        self.profile = profile(model, self.capture, self.inputs, loss_fn=loss_fn)
        # On the meta device tensors have shapes and no data: plan from the graph alone
        # (cost-model times, no workspaces), nothing to measure or verify.
        self.meta = self.profile.device == "meta"
        self.blocks = find_repeated_blocks(model)
        chain = build_chain(
            self.capture, self.profile, max_stages=max_stages,
            static_bytes=0 if scope == "activations" else None,
            segment_overhead_seconds=self.profile.segment_overhead_seconds,
            # every repeated block's boundaries are cuts: the per-block hand plan is
            # always in the plan space (autockpt/blocks.py)
            required_cuts=block_cut_positions(self.capture, self.blocks),
        )
        if scope == "activations":
            zeros = tuple(0 for _ in chain.problem.param_grad_bytes)
            chain = dataclasses.replace(
                chain, problem=dataclasses.replace(chain.problem, param_grad_bytes=zeros)
            )
        self.chain = chain
        # The plan simulator: one step's allocations (fake tensors plus measured workspaces),
        # replayed under each plan.
        self._phase("record", "recording one step on fake tensors for the plan simulator")
        nodes = self.profile.nodes
        self.trace = record_trace(
            model, self.capture, self.inputs, loss_fn=loss_fn,
            forward_workspace={i: node.forward_workspace for i, node in enumerate(nodes)},
            backward_workspace={i: node.backward_workspace for i, node in enumerate(nodes)},
            loss_workspace=self.profile.loss_workspace,
            hidden_saved={i: node.hidden_saved for i, node in enumerate(nodes)},
            device_forward_ops={
                i: node.device_forward_ops for i, node in enumerate(nodes) if not self.meta
            },
        )
        # Sharding changes what a rank keeps (parameters, gradients, engine buffers), not
        # the activations: the stage model gets the per-rank terms, and each simulated
        # single-process peak is moved to a rank by the stage model's difference.
        self.single_problem = chain.problem
        self.rank_memory: RankMemory | None = None
        if self.sharding.active:
            sharded, self.rank_memory = rank_problem(
                chain.problem, chain.stages, self.capture, model, self.sharding,
                parameters=self.profile.param_bytes, gradients=self.profile.param_grad_bytes,
                buffers=self.profile.buffer_bytes, inputs=self.profile.input_bytes,
            )
            if scope == "total":  # sharding changes only what "activations" leaves out
                self.chain = dataclasses.replace(chain, problem=sharded)
        self._phase("search", "searching the leanest plan")
        per_block = self.chain.stage_ranges_for(block_node_ranges(self.capture, self.blocks))
        self.per_block_segments: tuple[StageRange, ...] | None = per_block or None
        """The per-block hand plan as stage ranges (None without repeated blocks)."""
        self.search = BudgetSearch(
            chain=self.chain,
            trace=self.trace,
            random=tuple(self._stage_flags(lambda node: node.random)),
            stash_bytes=tuple(self._stage_stash_bytes()),
            offset_bytes=in_scope(0, scope, self.profile),
            predict=self.predict,
            seeds=(per_block,) if per_block else (),
            # what keeping a node saves: its cost, less what keeping it costs; only nodes
            # that do arithmetic (docs/design.md, "Selective recompute")
            node_seconds=tuple(
                max(0.0, node.cost_seconds - self._keep_overhead) if node.flops > 0 else 0.0
                for node in self.profile.nodes
            ),
        )
        self.no_checkpoint_peak_bytes = self.predict([])
        self.minimum_peak_bytes = self.search.leanest().peak_bytes
        self.breakdown = _breakdown(self.profile, self.chain, scope, self.minimum_peak_bytes)
        if self.rank_memory is not None and scope == "total":
            self.breakdown = _rank_breakdown(self.breakdown, self.rank_memory, self.sharding)
        self.planning_peak_bytes = planning.peak(self.profile)
        self._phase(None, "")

    def _plan_inside_submodule(
        self, error: TraceError, leaf_modules: tuple[str, ...], max_stages: int
    ) -> None:
        from autockpt.nested import SubmodulePlanner

        self._phase(None, "")  # the failed capture; the nested planner times its own phases
        self.nested = SubmodulePlanner(
            self.model, self.inputs, error, scope=self.scope, loss_fn=self.loss_fn,
            leaf_modules=leaf_modules, max_stages=max_stages, progress=self.progress,
            measure_step=self._measure,
        )
        inner = self.nested.inner
        for phases in (inner.phase_seconds, self.nested.phase_seconds):
            for phase, seconds in phases.items():
                self.phase_seconds[phase] = self.phase_seconds.get(phase, 0.0) + seconds
        self.meta = False
        self.minimum_peak_bytes = self.nested.minimum_peak_bytes
        self.no_checkpoint_peak_bytes = self.nested.no_checkpoint_peak_bytes
        self.breakdown = self.nested.breakdown
        self.planning_peak_bytes = inner.planning_peak_bytes

    def __getattr__(self, name: str) -> Any:
        # Reached only for attributes never set: a planner that plans inside a submodule
        # has no graph, profile or search of the root.
        nested = self.__dict__.get("nested")
        if nested is None or name.startswith("__"):
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
        raise AttributeError(
            f"Planner.{name} is not available: the root's forward cannot be captured, so "
            f"this planner plans inside submodule '{nested.path}'; use optimize(), "
            "minimum_peak_bytes and no_checkpoint_peak_bytes, or planner.nested.inner for "
            "that submodule alone"
        )

    def _phase(self, name: str | None, description: str) -> None:
        """Close the running phase's clock and start ``name``'s (None: just close)."""
        now = time.perf_counter()
        running = getattr(self, "_running_phase", None)
        if running is not None:
            key, started = running
            self.phase_seconds[key] = self.phase_seconds.get(key, 0.0) + now - started
        self._running_phase = (name, now) if name is not None else None
        if name is not None:
            self.progress(description)

    def predict(
        self, segments: Sequence[tuple[int, int]], kept: Sequence[Sequence[int]] = ()
    ) -> int:
        """Predicted peak (in the planner's scope, per rank when sharded) of a plan given as
        stage ranges (and, per range, the compute nodes kept inside it: selective
        recompute): the plan simulator's replay of the recorded step."""
        node_ranges, random = self._node_ranges(segments)
        simulated = simulate_plan(self.trace, node_ranges, random, kept or None).peak_bytes
        return self._scoped(simulated, segments)

    def timeline(
        self, segments: Sequence[tuple[int, int]], kept: Sequence[Sequence[int]] = ()
    ) -> MemoryTimeline:
        """The plan simulator's curve of one step, without checkpointing and with the plan,
        folded onto the chain's events (what ``autockpt show --plot`` draws): each event's
        bytes are the highest the replay reaches while that stage runs that phase, so the
        curves' maxima are :meth:`predict`'s peaks."""
        problem = self.chain.problem
        node_ranges, random = self._node_ranges(segments)
        stage_of = {i: k for k, (first, stop) in enumerate(self.chain.stages) for i in range(first, stop)}
        segment_stages = {self.chain.node_range(start, end)[0]: range(start, end) for start, end in segments}
        last = self.chain.num_stages - 1

        def fold(curve: list[tuple[str, int, int]], plan: Sequence[tuple[int, int]]) -> dict[tuple[str, int], int]:
            peaks: dict[tuple[str, int], int] = {}
            for phase, node, nbytes in curve:
                if phase == "recompute":
                    keys = [("r", k) for k in segment_stages[node]]
                elif phase == "backward":
                    keys = [("b", stage_of.get(node, last))]
                else:  # prologue, forward, loss
                    # a prologue window of a node (a cached autocast cast) is its stage's
                    keys = [("f", stage_of.get(node, 0 if phase == "prologue" else last))]
                for key in keys:
                    peaks[key] = max(peaks.get(key, 0), self._scoped(nbytes, plan))
            return peaks

        def events(order: list[tuple[str, int]], peaks: dict[tuple[str, int], int]) -> tuple[int, ...]:
            values, carried = [], 0
            for key in order:
                carried = peaks.get(key, carried)
                values.append(carried)
            return tuple(values)

        letter = {"forward": "f", "recompute": "r", "backward": "b"}
        plan_order = [(letter[phase], k) for phase, k, _ in simulate(problem, segments).timeline]
        base_order = [("f", k) for k in range(last + 1)] + [("b", k) for k in range(last, -1, -1)]
        return MemoryTimeline(
            phases="".join(phase for phase, _ in plan_order),
            stages=tuple(k for _, k in plan_order),
            plan_bytes=events(
                plan_order,
                fold(simulate_timeline(self.trace, node_ranges, random, kept or None), segments),
            ),
            no_checkpoint_bytes=events(base_order, fold(simulate_timeline(self.trace, []), [])),
            stage_forward_seconds=tuple(round(t, 9) for t in problem.forward_seconds),
            stage_backward_seconds=tuple(round(t, 9) for t in problem.backward_seconds),
        )

    @property
    def _keep_overhead(self) -> float:
        device = self.profile.device.split(":")[0]
        return KEEP_OVERHEAD_SECONDS.get(device, KEEP_OVERHEAD_SECONDS["cuda"])

    def _node_ranges(self, segments: Sequence[tuple[int, int]]) -> tuple[list[tuple[int, int]], list[int]]:
        """Compute-node ranges of stage ranges, and the bytes each segment stashes (its RNG
        state when it holds a random op, snapshots of the buffers it restores)."""
        node_ranges = [self.chain.node_range(start, end) for start, end in segments]
        return node_ranges, self.search.replay_chain.preserve_rng(segments)

    def _scoped(self, simulated_bytes: int, segments: Sequence[tuple[int, int]]) -> int:
        """A simulated single-process byte count as the planner's scope counts it: per rank
        when sharded, or above the static part for "activations"."""
        if self.scope == "total":
            return simulated_bytes + self._rank_shift(segments)
        return in_scope(simulated_bytes, self.scope, self.profile)

    def _stage_flags(self, flag: Callable[[NodeProfile], bool]) -> list[bool]:
        nodes = self.profile.nodes
        return [any(flag(nodes[i]) for i in range(first, stop)) for first, stop in self.chain.stages]

    def _stage_stash_bytes(self) -> list[int]:
        """Per stage, the bytes of the mutated buffers its nodes touch: a segment holding
        the stage snapshots them at its forward and again while it recomputes
        (autockpt/rewrite.py, ``_BufferState``). Sizes are the buffers' as the recorded step
        leaves them: a forward may replace one (a table built on the first call)."""
        mutated = set(self.profile.mutated_buffers)
        nodes = self.capture.compute_nodes()
        after = dict(self.trace.buffer_bytes)
        return [
            sum(
                after.get(name, self.model.get_buffer(name).nbytes)
                for name in _buffers_used(nodes[first:stop], mutated)
            )
            for first, stop in self.chain.stages
        ]

    def _search(
        self, budget_bytes: int, solver: str, time_limit_s: float, selective: bool = True
    ) -> Solution:
        """The least-recompute plan whose predicted peak fits ``budget_bytes``: the search
        under the replay (``auto``), or a stage-chain solver judged by it
        (autockpt/solve.py). Raises :class:`InfeasibleBudgetError` below the minimum."""
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
    ) -> nn.Module:
        """Solve for ``budget_gb``, rewrite, and (``verify``) check one measured step.

        ``selective``: segments may keep chosen operator outputs (a matrix multiply's)
        instead of recomputing them, where the replay shows that is cheaper within the
        budget (docs/design.md, "Selective recompute"); False: every segment recomputes
        everything inside it."""
        budget_bytes = int(check_budget_gb(budget_gb) * GIB)
        if self.nested is not None:
            return self._hand_back(self.nested.optimize(
                budget_bytes, solver=solver, time_limit_s=time_limit_s, verify=verify,
                selective=selective,
            ))
        verify = verify and not self.meta
        underestimate = 0  # largest measured-minus-predicted peak seen so far
        checked: Measurement | None = None
        for _ in range(_VERIFY_ROUNDS):
            self._phase("search", "solving")
            try:
                solution = self._search(
                    budget_bytes - underestimate, solver, time_limit_s, selective
                )
            except InfeasibleBudgetError as error:
                if not underestimate:
                    raise
                raise self._measured_infeasible(budget_bytes, underestimate) from error
            specs = _segment_specs(self.chain, self.profile, self.capture, solution, self.trace)
            result = self._hand_back(
                _rewrite_for_training(self.model, self.capture, specs, self.inputs)
            )
            if not verify:
                break
            # The plan's own step fits by construction: measuring it is the only real step
            # planning runs (the probe already warmed every kernel up).
            self._phase("verify", "measuring the plan")
            # Memory only: one step's time is no result (benchmarks interleave rounds).
            checked = self._measure(result)
            used = self._used(checked) + self._rank_shift(solution.segments)
            if used <= budget_bytes:
                break
            predicted = self.predict(solution.segments, solution.kept)
            underestimate = max(underestimate + 1, used - predicted)
        else:
            self._phase(None, "")
            raise self._measured_infeasible(budget_bytes, underestimate)
        self._phase(None, "")
        result.plan = _make_plan(self, solution, specs, budget_bytes, checked)
        return result

    # -- several budgets, one profile (frontiers, reports) ----------------------------------

    @property
    def step_seconds(self) -> float:
        """Step time of the unmodified model as the probe measured it node by node (the
        cost model's on the meta device)."""
        return self.profile.step_seconds

    def solve(
        self, budget_bytes: int, *, solver: str = "auto", time_limit_s: float = 30.0,
        selective: bool = True,
    ) -> Solution:
        """The least-recompute plan whose simulated peak fits ``budget_bytes``, without
        rewriting or measuring (cheap: the profile and the recorded step are reused).
        Raises :class:`InfeasibleBudgetError` below the minimum."""
        return self._search(int(budget_bytes), solver, time_limit_s, selective)

    def simulate(self, segments: Sequence[tuple[int, int]]) -> Simulation:
        """The prediction for checkpointing the given stage ranges: peak from the plan
        simulator (:meth:`predict`), recompute seconds from :meth:`recompute_seconds`."""
        return dataclasses.replace(
            simulate(self.chain.problem, segments), peak_bytes=self.predict(segments),
            recompute_seconds=self.recompute_seconds(segments),
        )

    def recompute_seconds(
        self, segments: Sequence[tuple[int, int]], kept: Sequence[Sequence[int]] = ()
    ) -> float:
        """Seconds a plan adds to a step: the measured forward seconds of the nodes it
        recomputes (not those kept inside a segment, which cost ``KEEP_OVERHEAD_SECONDS``
        each) plus the fixed cost per segment (the cost model's where nothing was measured).
        The solvers rank plans by the cost model instead (profile.py, note 3)."""
        nodes = self.profile.nodes
        skipped = {i for nodes_kept in kept for i in nodes_kept}
        seconds = sum(
            nodes[i].forward_seconds
            for first, stop in self._node_ranges(segments)[0]
            for i in range(first, stop)
            if i not in skipped
        )
        seconds += self._keep_overhead * len(skipped)  # keeping is not free either
        return seconds + self.profile.segment_overhead_seconds * len(segments)

    def rewrite(
        self, segments: Sequence[tuple[int, int]], kept: Sequence[Sequence[int]] = ()
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
        given = Solution(segments=[tuple(seg) for seg in segments], recompute_seconds=0.0,
                         peak_bytes=0, status="feasible", method="given", solve_seconds=0.0,
                         gap=None, kept=tuple(tuple(nodes) for nodes in kept))
        specs = _segment_specs(self.chain, self.profile, self.capture, given, self.trace)
        return self._hand_back(_rewrite_for_training(self.model, self.capture, specs, self.inputs))

    def _measure(self, result: nn.Module) -> Measurement:
        """One real step of the plan, in the training mode it was planned in. A result under
        ``torch.compile`` (the model came compiled) is measured compiled, after one warm-up
        step that compiles it: the budget holds for the module handed back."""
        compiled = self._hand_back is not _same
        inner = getattr(result, "_orig_mod", None)
        if compiled and inner is not None:  # measured as handed back, under its torch.compile
            mark_verified_compiled(inner)  # so tracing it raises no CompileWarning
        # Scalar draws at their worst case (every LayerDrop layer runs), as the profile and
        # the recorded step planned for (autockpt/rng.py): predicted and measured agree.
        planned = self.__dict__.get("profile")  # None while planning inside a submodule
        draws = planned is not None and planned.worst_case_draws > 0 and not compiled
        worst_case = worst_case_draws() if draws else contextlib.nullcontext()
        with self.precision.entered(), _training_mode(result), worst_case:
            return measure(
                result, self.inputs, loss_fn=self.loss_fn, repeat=0, warmup=1 if compiled else 0
            )

    def budgeted_bytes(self, measurement: Measurement) -> int:
        """The part of a measured peak that the budget covers (all of it for scope
        ``total``; what lies above parameters, buffers, inputs and gradients otherwise)."""
        return self._used(measurement)

    def _measured_infeasible(self, budget_bytes: int, underestimate: int) -> InfeasibleBudgetError:
        return InfeasibleBudgetError(
            budget_bytes, max(self.minimum_peak_bytes + underestimate, budget_bytes + 1),
            self.breakdown, self.scope,
            f"Measured peaks ran up to {underestimate} bytes above the model's prediction, so "
            "the leanest plan needs the minimum stated."
            + (" (Measured under the model's torch.compile, which keeps other tensors than "
               "the eager step the prediction models.)" if self._hand_back is not _same else ""),
        )

    def _rank_shift(self, segments: Sequence[tuple[int, int]]) -> int:
        """Per-rank minus single-process prediction of a plan: verification measures one
        unsharded process and moves the result to a rank by this difference (what sharding
        changes is static and engine memory; what the profile missed stays the same)."""
        if self.chain.problem is self.single_problem:
            return 0
        return (simulate(self.chain.problem, segments).peak_bytes
                - simulate(self.single_problem, segments).peak_bytes)

    def _used(self, measurement: Measurement) -> int:
        return in_scope(measurement.peak_bytes, self.scope, self.profile)


def apply(model: nn.Module, plan: Plan, example_inputs: Any = None) -> nn.Module:
    """Re-apply a saved plan to ``model`` without profiling or solving.

    The model is captured again and its structural fingerprint must equal the plan's; when
    ``example_inputs`` are given their shapes must match too. Plans captured with
    ``torch.export`` need ``example_inputs`` (export traces with real shapes).
    """
    _check_model(model)
    with as_found(model, () if example_inputs is None else example_inputs):
        return _apply(model, plan, example_inputs)


def _apply(model: nn.Module, plan: Plan, example_inputs: Any) -> nn.Module:
    model, hand_back = _plain_module(model)
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be an autockpt.Plan, got {type(plan).__name__}")
    inputs = Inputs.of(example_inputs).as_called(model) if example_inputs is not None else None
    if plan.submodule is not None:  # the root runs eagerly around a planned submodule
        from autockpt.nested import apply_inside

        return hand_back(apply_inside(model, plan, inputs))
    if plan.capture_method == "export" and inputs is None:
        raise PlanMismatchError(
            "this plan's graph was captured with torch.export, which needs example inputs: "
            "call autockpt.apply(model, plan, example_inputs)"
        )
    method = "export" if plan.capture_method == "export" else "fx"
    _warn_if_eval(model)
    try:
        with _training_mode(model):
            captured = capture(
                model, inputs or Inputs((), {}), leaf_modules=plan.leaf_modules, method=method,
                input_names=plan.input_names,
            )
    except TypeError as error:
        raise PlanMismatchError(
            f"plan was made for {plan.model} called with ({', '.join(plan.input_names)}); this "
            f"{type(model).__name__} cannot be called that way: {error}"
        ) from error
    except AutockptError as error:
        raise PlanMismatchError(
            f"the plan (for {plan.model}) cannot be applied: this model's graph does not "
            f"capture the same way ({error})"
        ) from error
    fingerprint = captured.fingerprint()
    if fingerprint != plan.graph_fingerprint:
        raise PlanMismatchError(
            f"plan was made for a different graph: plan {plan.graph_fingerprint} for model "
            f"{plan.model} ({plan.num_nodes} nodes); this model {type(model).__name__} has "
            f"graph {fingerprint} ({len(captured.compute_nodes())} nodes)"
        )
    if inputs is not None and inputs.signature() != plan.input_signature:
        raise PlanMismatchError(
            f"plan was made for inputs {plan.input_signature}, got {inputs.signature()}"
        )
    index = {node.name: i for i, node in enumerate(captured.compute_nodes())}
    specs = []
    for seg in plan.segments:
        if seg.first_node not in index or seg.last_node not in index:
            raise PlanMismatchError(
                f"plan segment {seg.first_node}..{seg.last_node} names nodes this graph lacks"
            )
        specs.append(SegmentSpec(
            index[seg.first_node], index[seg.last_node] + 1, seg.preserve_rng,
            seg.restore_buffers,
            kept_ops=tuple((kept.node, kept.op, kept.index) for kept in seg.kept_ops),
        ))
    # Calls are checked against the planned inputs (their shapes are in the plan).
    planned = inputs if inputs is not None else planned_inputs(plan.input_signature)
    result = hand_back(_rewrite_for_training(model, captured, specs, planned))
    result.plan = plan
    return result


# ---------------------------------------------------------------------------------------------


def in_scope(total_bytes: int, scope: str, prof: Profile) -> int:
    """The part of a step's total bytes that a budget of ``scope`` counts: all of it for
    "total"; for "activations", what lies above parameters, buffers, inputs and parameter
    gradients. (The one place this arithmetic lives.)"""
    if scope == "total":
        return total_bytes
    return total_bytes - prof.static_bytes - prof.param_grad_bytes


class _PlanningPeak:
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


def _check_model(model: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    check_not_wrapped(model)


# -- front-door argument checks (docs/integrations.md says what each means for a user) ------


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
            ".no_checkpoint_peak_bytes, or `autockpt frontier`, show both."
        )
    return value


def _plain_module(model: Any) -> tuple[nn.Module, Callable[[nn.Module], nn.Module]]:
    """The eager module to plan, and how to hand a result back to look like ``model``.

    * ``torch.compile(m)`` (an ``OptimizedModule``): plan ``m``; the result is compiled with
      the same dynamo context (backend, mode, options: what ``torch.compile`` was given).
    * An ``optimize`` result: re-plan the user's original module (the result's graph has
      segment calls in it, and capturing it again would plan a plan).
    * ``m.compile()`` (compiled in place): :class:`CompileError`; its options cannot be
      recovered, and a rewritten module would silently run uncompiled.
    """
    _check_model(model)
    hand_back: Callable[[nn.Module], nn.Module] = _same
    dynamo = sys.modules.get("torch._dynamo.eval_frame")  # nothing is compiled without it
    if dynamo is not None and isinstance(model, dynamo.OptimizedModule):
        wrapper, context = type(model), model.dynamo_ctx
        model = model._orig_mod

        def hand_back(result: nn.Module) -> nn.Module:
            return wrapper(result, context)

    if getattr(model, "_compiled_call_impl", None) is not None:
        raise CompileError(
            f"{type(model).__name__} was compiled in place with Module.compile(), whose "
            "options autockpt cannot carry over to the rewritten module. Plan the eager "
            "module, then compile the result: fast = autockpt.optimize(model, ...); "
            "fast.compile(...) (or torch.compile(model) before optimize, which it keeps)"
        )
    if is_checkpointed(model):
        model = plain_module(model)  # the user's class, tree and mode, without the plan
    return model, hand_back


def _same(result: nn.Module) -> nn.Module:
    return result


def _warn_if_eval(model: nn.Module) -> None:
    if not model.training:
        name = type(model).__name__
        warnings.warn(
            f"{name} is in eval mode; autockpt plans a training step, so it planned {name} "
            "in training mode (as after .train()) and left it, and the result, in eval mode. "
            "Call .train() on the result before training: in eval mode it runs the original "
            "forward without checkpoints (models from from_pretrained() start in eval mode).",
            UserWarning,
            stacklevel=3,
        )


@contextlib.contextmanager
def _training_mode(model: nn.Module) -> Iterator[None]:
    """Put a model in eval mode into training mode for planning; on exit every module has
    its mode back. A model in training mode is left alone: submodules the user keeps in
    eval (frozen batch norm) are planned as they will run."""
    if model.training:
        yield
        return
    modes = [(module, module.training) for module in model.modules()]
    model.train()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def _rewrite_for_training(
    model: nn.Module, captured: Capture, specs: list[SegmentSpec], inputs: Inputs | None
) -> nn.Module:
    """``rewrite`` with the model in training mode, the mode its graph was captured in (so
    ``result.train()`` runs the checkpointed graph); the result then takes the model's mode."""
    training = model.training
    with _training_mode(model):
        result = rewrite(model, captured, specs, inputs)
    result.training = training
    return result


def _rank_breakdown(parts: dict[str, int], memory: RankMemory, sharding: Sharding) -> dict[str, int]:
    """The error breakdown for one rank: its local parameters and engine buffers."""
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
    rest = {k: v for k, v in parts.items() if k not in ("parameters", "gradients")}
    return rank | rest


def _breakdown(prof: Profile, chain: Chain, scope: str, least: int) -> dict[str, int]:
    parts = {
        "parameters": prof.param_bytes,
        "gradients": prof.param_grad_bytes,
        "buffers": prof.buffer_bytes,
        "inputs": prof.input_bytes,
        "activations without checkpointing": sum(chain.problem.saved_bytes),
        "leanest plan's peak": least,
    }
    if scope == "activations":
        parts = {k: v for k, v in parts.items() if k.startswith(("activations", "leanest"))}
    return parts


def _segment_specs(
    chain: Chain, prof: Profile, captured: Capture, solution: Solution, trace: MemoryTrace
) -> list[SegmentSpec]:
    mutated = set(prof.mutated_buffers)
    nodes = captured.compute_nodes()
    specs = []
    kept_per_segment = solution.kept or tuple(() for _ in solution.segments)
    for (start, end), kept in zip(solution.segments, kept_per_segment, strict=True):
        first, stop = chain.node_range(start, end)
        random = any(prof.nodes[i].random for i in range(first, stop))
        specs.append(SegmentSpec(
            first, stop, random, _buffers_used(nodes[first:stop], mutated),
            kept_ops=tuple(
                (nodes[i].name, op, index) for i, op, index in kept_calls(trace, first, stop, kept)
            ),
        ))
    return specs


def kept_calls(
    trace: MemoryTrace, first: int, stop: int, kept: Sequence[int]
) -> list[tuple[int, str, int]]:
    """``(node, operator, index)`` of each kept node's allocating operator call, ``index``
    counting that operator's calls in the segment's forward from 0: the key the rewritten
    segment's selective-checkpoint policy matches calls by (autockpt/rewrite.py)."""
    wanted = set(kept)
    counts: dict[str, int] = {}
    found = []
    for i in range(first, stop):
        for op in trace.forward_ops[i]:
            index = counts.get(op.name, 0)
            counts[op.name] = index + 1
            if i in wanted and op.allocations:
                found.append((i, op.name, index))
    return found


def _buffers_used(nodes: Sequence[torch.fx.Node], mutated: set[str]) -> tuple[str, ...]:
    """Mutated buffers that a segment's nodes touch (via a module call or an attribute)."""
    used: set[str] = set()
    for node in nodes:
        if node.op == "call_module":
            prefix = f"{node.target}."
            used |= {name for name in mutated if name.startswith(prefix)}
        for arg in node.all_input_nodes:
            if arg.op == "get_attr" and arg.target in mutated:
                used.add(arg.target)
    return tuple(sorted(used))


def _make_plan(
    planner: Planner, solution: Solution, specs: list[SegmentSpec], budget_bytes: int,
    checked: Measurement | None,
) -> Plan:
    """The plan's record of one solution, from what the planner already computed."""
    model, captured, inputs, prof, chain = (
        planner.model, planner.capture, planner.inputs, planner.profile, planner.chain
    )
    problem = chain.problem
    names = chain.node_names
    kept_per_segment = solution.kept or tuple(() for _ in solution.segments)
    recompute = planner.recompute_seconds(solution.segments, kept_per_segment)
    segments = []
    for (start, end), spec, kept in zip(solution.segments, specs, kept_per_segment, strict=True):
        saved = sum(problem.saved_bytes[start:end])
        segments.append(Segment(
            start_stage=start,
            end_stage=end,
            first_node=names[spec.first],
            last_node=names[spec.end - 1],
            recompute_seconds=planner.recompute_seconds([(start, end)], [kept]),
            bytes_freed=saved - problem.input_bytes[start],
            preserve_rng=spec.preserve_rng,
            restore_buffers=spec.restore_buffers,
            kept_ops=tuple(KeptOp(*call) for call in spec.kept_ops),
        ))
    in_segment = {k for start, end in solution.segments for k in range(start, end)}
    kept = sum(s for k, s in enumerate(problem.saved_bytes) if k not in in_segment)
    kept += sum(problem.input_bytes[start] for start, _ in solution.segments)
    step_with = prof.step_seconds + recompute
    notes = list(captured.warnings)
    notes.append(
        f"predicted peak: replay of one recorded step's {planner.trace.source} events under "
        "this plan (solvers.replay)"
    )
    notes.append(planner.precision.note())  # checked at each training call (precision.py)
    if prof.times_estimated:
        notes.append("times are FLOP-based estimates (planned on the meta device), not measured")
    else:
        notes.append(
            "segments chosen by a cost model of FLOPs and bytes (deterministic); seconds "
            "reported are measured node by node"
        )
    if planner.planning_peak_bytes is not None:
        notes.append(f"planning peak: {planner.planning_peak_bytes} bytes (allocator)")
    measured_peak = checked.peak_bytes if checked is not None else None
    if planner.sharding.active and checked is not None:
        # The measured step ran unsharded in this process: not a per-rank number.
        single = (planner.predict(solution.segments, solution.kept)
                  - planner._rank_shift(solution.segments))
        notes.append(
            f"verified on one unsharded process: measured peak {checked.peak_bytes} bytes "
            f"against a predicted {single}"
        )
        measured_peak = None
    if planner.sharding.active and planner.scope == "total":
        notes.append(
            f"per-rank safety margin: +{RANK_MARGIN_BYTES} bytes for the process group's own "
            "small tensors (autockpt.distributed.RANK_MARGIN_BYTES)"
        )
    return Plan(
        model=type(model).__name__,
        graph_fingerprint=captured.fingerprint(),
        input_signature=inputs.signature(),
        input_names=given_input_names(model, inputs),
        capture_method=captured.method,
        leaf_modules=captured.leaf_modules,
        num_nodes=len(names),
        stages=tuple((names[a], names[b - 1]) for a, b in chain.stages),
        budget_bytes=budget_bytes,
        scope=planner.scope,
        solver=solution.method,
        solver_status=solution.status,
        solve_seconds=solution.solve_seconds,
        solver_gap=solution.gap,
        segments=tuple(segments),
        predicted_peak_bytes=planner.predict(solution.segments, solution.kept),
        no_checkpoint_peak_bytes=planner.no_checkpoint_peak_bytes,
        minimum_peak_bytes=planner.minimum_peak_bytes,
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
        measured_peak_bytes=measured_peak,
        measured_step_seconds=(
            checked.step_seconds if checked is not None and checked.repeat > 0 else None
        ),
        device=prof.device,
        notes=tuple(notes),
        world_size=planner.sharding.world_size,
        sharding=planner.sharding.mode,
        fsdp_units=planner.sharding.units,
        rank_memory=planner.rank_memory,
        timeline=planner.timeline(solution.segments, solution.kept),
    )
