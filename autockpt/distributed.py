"""What runs across processes: one plan for every rank, and a rank's measured truth.

The per-rank memory model a sharded plan is made with lives in
``autockpt/planning/sharding.py``; this module holds what needs a process group or a
wrapped model:

* **A model already wrapped is refused** (:func:`check_not_wrapped`): plan first, then wrap
  the result (:func:`wrap`).
* :func:`measure_rank` is the real per-rank truth, used by the tests and
  ``benchmarks/distributed.py``.
* **One rank plans; every rank applies its plan.** When every rank of a process group
  calls ``optimize`` (the ``torchrun`` pattern), :func:`plan_on_one_rank` lets rank 0 plan
  and broadcasts the plan; the others only apply it. Planning is deterministic given its
  measurements, but the measurements (step times, on other machines, under other loads)
  are not, and two ranks whose FSDP2 units are checkpointed differently issue different
  collectives and wait on each other for ever.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import importlib
import itertools
import pickle
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autockpt.base.allocations import allocator_events, quiet_native_stderr
from autockpt.base.inputs import Inputs
from autockpt.base.precision import Precision
from autockpt.base.runtime import LossFn, clear_grads, default_loss
from autockpt.errors import ShardingError
from autockpt.plan import Plan


def check_not_wrapped(model: nn.Module) -> None:
    """Refuse a model that a distributed engine already wraps: plan first, then wrap.

    Detects ``DistributedDataParallel``, FSDP2 (``fully_shard``: an ``FSDPModule`` anywhere in
    the tree) and classic ``FullyShardedDataParallel``; DTensor parameters (sharded by
    tensor parallelism or an FSDP unit) are refused too, since the profile needs plain
    tensors.
    """
    engine = _wrapping_engine(model)
    if engine is not None:
        raise ShardingError(
            f"model is already wrapped by {engine}; call autockpt.optimize on the plain "
            "module first (with world_size= and sharding=), then wrap the result with "
            "DistributedDataParallel / fully_shard"
        )


def _wrapping_engine(model: nn.Module) -> str | None:
    if not torch.distributed.is_available():
        return None
    from torch.nn.parallel import DistributedDataParallel

    # An engine can only have wrapped the model if its module was imported; checking
    # sys.modules spares every plain optimize() the import of torch.distributed.fsdp.
    fsdp = sys.modules.get("torch.distributed.fsdp")
    composable = sys.modules.get("torch.distributed._composable_state")
    dtensor = sys.modules.get("torch.distributed.tensor")
    for name, module in model.named_modules():
        where = f" (module '{name}')" if name else ""
        if isinstance(module, DistributedDataParallel):
            return f"DistributedDataParallel{where}"
        if fsdp is not None and isinstance(module, fsdp.FSDPModule):
            return f"FSDP2 fully_shard{where}"
        if fsdp is not None and isinstance(module, fsdp.FullyShardedDataParallel):
            return f"FullyShardedDataParallel{where}"
        if composable is not None and composable._get_module_state(module) is not None:
            return f"a torch.distributed composable API (fully_shard / replicate){where}"
    if dtensor is not None:
        for name, param in model.named_parameters():
            if isinstance(param, dtensor.DTensor):
                return f"a DTensor-sharding engine (parameter '{name}' is a DTensor)"
    return None


def wrap(
    model: nn.Module,
    mode: str,
    units: Iterable[str] = (),
    *,
    plan: Plan | None = None,
    **engine_kwargs: Any,
) -> nn.Module:
    """Wrap ``model`` for training under ``mode`` in the current process group, the way a
    user would: ``DistributedDataParallel(model)``, or ``fully_shard`` on each unit and then
    on the root. ``plan``: FSDP2 as the plan counts it, its units (``units`` unless given)
    each with the plan's ``reshard_after_forward`` (:meth:`Plan.reshards`), the root too.
    Returns the module to call."""
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, **engine_kwargs)
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        def shard(name: str) -> None:
            chosen = {} if plan is None else {"reshard_after_forward": plan.reshards(name)}
            fully_shard(model.get_submodule(name), **chosen, **engine_kwargs)

        for name in units or (plan.fsdp_units if plan is not None else ()):
            shard(name)
        shard("")
        return model
    raise ShardingError(f"unknown sharding mode {mode!r}; use 'ddp' or 'fsdp'")


# NOTE [distributed: garbage holding full parameters]. Capturing and rewriting a model leave
# unreachable reference cycles that hold the user's parameters: torch.export keeps a set of
# every parameter and buffer in a recursive closure (``_gather_constant_attrs``), the
# capture's graph module (export's ``ExportedProgram.module()``, a cycle with its graph)
# holds the root's own parameters, the modules outside every unit, and so does each fx
# ``GraphModule`` that generated the result's code (autockpt/rewrite/graph.py, ``_code``).
# Such garbage goes only when Python's cyclic collector makes a full collection, whenever
# that comes. While the model owns the same tensors this costs nothing; but FSDP2's
# ``fully_shard(model)`` replaces the root's parameters by their shards, and the full
# tensors stayed alive beside them, through the step. Measured on two gloo ranks (a tiny
# Hugging Face Llama, 4 layers, width 64, vocab 256, planned at 30% between its per-rank
# minimum and no checkpointing): 131,328 bytes per rank, exactly the embedding, the final
# norm and the head (resident 496,104 bytes against 364,736 predicted; the same model under
# FSDP2 alone, 364,776), which put the step 1.6% over its budget (2,713,776 bytes against
# 2,672,052). The tensors were found alive after the step under a graph module of the
# capture, and freed by the first ``gc.collect()``. Which garbage a full collection had
# already taken depended on when the collector ran: with collection disabled after planning
# the export closures still held every unit's parameters too. So a plan for FSDP collects
# once when its result is handed back (:func:`release_planning_garbage`, called by
# ``autockpt.apply`` and by :func:`plan_on_one_rank`): a full collection costs 0.6-0.8 s
# beside 20 s of capture on this 2-core machine; other plans keep their time, since only
# FSDP2 replaces the parameters the garbage holds (DDP keeps them).


def release_planning_garbage(plan: Plan | None) -> None:
    """Free the garbage that capture and rewrite left holding a model's tensors, for a plan
    whose parameters FSDP2 will replace by shards (NOTE [distributed: garbage holding full
    parameters]); nothing for other plans."""
    if plan is not None and plan.sharding == "fsdp":
        gc.collect()


def fsdp_bf16_twin(model: nn.Module) -> nn.Module:
    """What FSDP2's ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` computes with, to
    plan with ``precision="fsdp-bf16"``: a copy of ``model`` whose floating parameters are
    bfloat16 and whose buffers are as they are (FSDP2 casts the parameters it gathers, not
    the buffers: ``model.to(torch.bfloat16)`` would plan bfloat16 masks and tables that the
    run keeps in float32). Tied parameters stay tied; no float32 copy is made (the twin's
    parameters are made directly; on the meta device nothing is allocated). NOTE
    [precision: FSDP2 mixed precision] in autockpt/base/precision.py."""
    twins: dict[int, Any] = {}
    for p in model.parameters():
        if p.is_floating_point():
            twin = nn.Parameter(p.detach().to(torch.bfloat16), requires_grad=p.requires_grad)
            twins[id(p)] = twin
    return copy.deepcopy(model, twins)


def step_model(model: nn.Module, plan: Plan) -> nn.Module:
    """The model whose step ``plan``'s graph is: ``model`` itself, or, for a plan of FSDP2's
    mixed precision (``fsdp-bf16``) applied to the float32 model the run wraps, its
    bfloat16 twin (:func:`fsdp_bf16_twin`).

    Why: a ``torch.export`` graph writes dtypes into its operators (Hugging Face's RMSNorm
    casts back to its input's dtype, rotary tables to the activations'), so the float32
    model's graph is not the planned one, and run between the units FSDP2 gathers in
    bfloat16 it would compute in float32. The twin is only captured: the result calls
    ``model``'s own parameters by name, which FSDP2 gathers in bfloat16. It costs a
    bfloat16 copy of the parameters while the graph is captured (nothing on meta)."""
    planned = Precision.from_notes(plan.notes, with_kept=True)
    if planned is None or planned.kept is None:
        return model
    if Precision.now(model).parameters == planned.parameters:
        return model  # already what the policy computes with (the twin itself)
    return fsdp_bf16_twin(model)


_RECENT = 24
"""Most recent live blocks searched for a drop that two or three frees explain."""


class _AllocationLedger:
    """Live CPU allocations by address, replayed from profiler sessions in time order.

    The CPU allocator reports an allocation or free to the profiler only on threads the
    profiler watches; gloo's worker threads drop the last reference to communicated tensors
    (DDP's flat broadcast copies of parameters and buffers, FSDP2's reduce-scatter input)
    and those frees go unreported. Two witnesses recover them:

    * the allocator's running total (``total`` of each event, kept process-wide while
      :func:`_allocator_totals_on_every_thread` is active): a change between two events that
      the second event does not explain happened on another thread. An unexplained drop
      retires the most recent live block of exactly that size (or bytes first counted as
      allocated on another thread); a rise is counted as memory of another thread.
    * address reuse: an address allocated again proves the earlier block was freed; the
      ledger then frees it at the latest possible moment, just before the new allocation.

    A drop says how many bytes went, not which block: FSDP2's all-gather outputs of equal
    units are blocks of one size, two of them alive at once. When the block a drop retired
    is later freed on a watched thread, the guess was wrong (that block was alive until
    now), and another live block of its size is the one that went unseen: it is retired
    then (:meth:`_guess_corrected`). Before, the watched free found nothing to free and the
    block that did go stayed counted, one unit's gathered parameters (147,968 bytes for the
    tiny Llama of tests/test_fsdp_units.py) over the rest of the measurement.

    A drop that matches no block and a block whose free is never witnessed stay counted, so
    the figures remain upper bounds of the truth.
    """

    def __init__(self) -> None:
        self.live: dict[int, int] = {}
        self.current = 0
        self.elsewhere = 0  # bytes allocated on unwatched threads, not yet seen freed
        self._total: int | None = None
        self._guessed: dict[int, int] = {}  # blocks a drop retired, by address: their size

    def replay(self, prof: Any) -> int:
        """Apply one profiler session's allocation events; return the peak reached. (A
        change of the total between sessions counts as made on another thread.)"""
        return self.apply(_allocations(prof))

    def apply(self, events: Iterable[tuple[int, ...]]) -> int:
        """Apply ``(address, signed bytes[, allocator total after the event])`` events in
        time order; return the peak reached."""
        peak = self.current
        for ptr, nbytes, *total in events:
            after = total[0] if total else None
            if after is not None and self._total is not None:
                self._unwatched(after - nbytes - self._total)
                peak = max(peak, self.current)
            self._total = after
            if nbytes > 0:
                self._guessed.pop(ptr, None)  # the address returned: it was free indeed
                self.current += nbytes - self.live.pop(ptr, 0)
                self.live[ptr] = nbytes
                peak = max(peak, self.current)
            elif ptr in self.live:
                self.current -= self.live.pop(ptr)
            else:
                self._guess_corrected(ptr)
        return peak

    def _guess_corrected(self, ptr: int) -> None:
        """A watched free of ``ptr``, which a drop of the total had retired: that block was
        alive until now, so the drop was another live block of its size, retired here (the
        most recent one; none: the drop stays unexplained, an upper bound)."""
        size = self._guessed.pop(ptr, None)
        if size is None:
            return  # a block this ledger never saw
        for other in reversed(self.live):
            if self.live[other] == size:
                del self.live[other]
                self._guessed[other] = size
                self.current -= size
                return

    def _unwatched(self, change: int) -> None:
        """Account a change of the allocator's total made on a thread the profiler does not
        watch: a free of a block this ledger holds, or memory of that thread."""
        if change > 0:
            self.elsewhere += change
            self.current += change
        elif change < 0:
            size = -change
            freed = self._blocks_summing_to(size, counts=(1,))
            if not freed and self.elsewhere >= size:  # another thread's own bytes
                self.elsewhere -= size
                self.current -= size
                return
            freed = freed or self._blocks_summing_to(size, counts=(2, 3))
            for ptr in freed:
                self._guessed[ptr] = self.live.pop(ptr)
            if freed:
                self.current -= size

    def _blocks_summing_to(self, size: int, counts: tuple[int, ...]) -> tuple[int, ...]:
        """Addresses of ``count`` live blocks (for the first count in ``counts`` that has
        them) whose sizes sum exactly to ``size``: one block searched among all, most recent
        first (frees follow soon); two or three among the most recent :data:`_RECENT`. A
        worker thread may free several blocks between two watched events (a bucket's and its
        copy's), and one drop then covers them all: matching a single block only left such
        frees counted, by timing (an over-count of a whole bucket on a rank, seen now and
        then on a loaded machine). Empty: no exact match."""
        recent = list(reversed(self.live))
        for count in counts:
            window = recent if count == 1 else recent[:_RECENT]
            for combo in itertools.combinations(window, count):
                if sum(self.live[ptr] for ptr in combo) == size:
                    return combo
        return ()


@contextmanager
def _allocator_totals_on_every_thread() -> Iterator[bool]:
    """Make the CPU allocator keep its running total on every thread while profiling.

    The allocator updates the total it attaches to profiler events only on watched threads,
    unless the ``caffe2_report_cpu_memory_usage`` flag is set, in which case frees on gloo's
    worker threads lower it too and :class:`_AllocationLedger` can see them. Yields whether
    the flag could be set (it is a symbol of the c10 library; without it, only address reuse
    recovers unreported frees).
    """
    flag = _report_cpu_memory_flag()
    if flag is None:
        yield False
        return
    before = flag.value
    flag.value = True
    try:
        yield True
    finally:
        flag.value = before


def _report_cpu_memory_flag() -> Any:
    import ctypes
    import glob
    import os

    libdir = os.path.join(os.path.dirname(torch.__file__), "lib")
    for path in sorted(glob.glob(os.path.join(libdir, "*c10.*"))):
        try:
            return ctypes.c_bool.in_dll(ctypes.CDLL(path), "FLAGS_caffe2_report_cpu_memory_usage")
        except (OSError, ValueError):
            continue
    return None


def _allocations(prof: Any) -> list[tuple[int, int, int]]:
    """``(address, signed bytes, allocator total after it)`` of every CPU allocator event of
    a session, in time order (read by the one recording layer, ``autockpt.base.allocations``)."""
    return [(e.ptr, e.nbytes, e.total) for e in allocator_events(prof, "cpu")]


@dataclass(frozen=True)
class RankMeasurement:
    """One rank's allocator-level truth: ``resident_bytes`` alive when a step starts (local
    parameters or shards, buffers, DDP buckets, inputs) and ``peak_bytes`` during it."""

    peak_bytes: int
    resident_bytes: int
    world_size: int
    rank: int


def measure_rank(
    build: Callable[[], tuple[nn.Module, Any]],
    *,
    loss_fn: LossFn | None = None,
    optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None = None,
    warmup: int = 2,
    device: str = "cpu",
) -> tuple[nn.Module, Inputs, RankMeasurement]:
    """Build, wrap and step a model on this rank, counting every byte it allocates.

    The CPU allocator reports frees to the profiler only for allocations it saw, so the
    model must be *created* inside the measurement: ``build()`` makes the model and its
    inputs, applies the plan and wraps it (DDP / fully_shard, which frees the full
    parameters it shards). Everything it leaves alive is the rank's resident memory; the
    peak of one step after ``warmup`` steps (DDP re-allocates its buckets once after the
    first iteration) is measured on top. Frees that gloo performs on its own threads are not
    reported to the profiler; :class:`_AllocationLedger` recovers them from the allocator's
    process-wide running total (kept on every thread during the measurement) and from
    address reuse, and counts what neither witnesses, so the figures are upper bounds.
    Under a process group every rank must call it (as every rank steps): the warm-up ends in
    a barrier (:func:`_wait_for_collectives`). ``device="cuda"``: the caching allocator's
    counters.

    ``optimizer``: a factory of the training loop's optimizer over the wrapped model (its
    sharded parameters under FSDP2), called right after ``build`` inside the measurement.
    Each step is then the whole iteration a plan with an optimizer budgets: forward,
    backward and ``optimizer.step()``, gradients set to None after it; the warm-up makes the
    optimizer's state, so ``resident_bytes`` holds it (steady state, as the plan counts).
    """
    from torch.profiler import ProfilerActivity, profile

    loss_fn = loss_fn or default_loss
    stepping: list[torch.optim.Optimizer] = []

    def built() -> tuple[nn.Module, Any]:
        model, raw = build()
        if optimizer is not None:
            stepping.append(optimizer(model))
        return model, raw

    def step(model: nn.Module, inputs: Inputs) -> None:
        loss_fn(model(*inputs.args, **inputs.kwargs)).backward()
        for each in stepping:
            each.step()

    def session() -> Any:
        return profile(activities=[ProfilerActivity.CPU], profile_memory=True)

    if torch.device(device).type == "cuda":
        base = torch.cuda.memory_allocated()
        model, raw = built()
        inputs = Inputs.of(raw)
        for _ in range(warmup):
            step(model, inputs)
            clear_grads(model)
        torch.cuda.synchronize()
        resident = torch.cuda.memory_allocated() - base
        torch.cuda.reset_peak_memory_stats()
        step(model, inputs)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        clear_grads(model)
    else:
        with _allocator_totals_on_every_thread():
            peak, resident, model, inputs = _measure_cpu(built, step, session, warmup)
    rank, size = 0, 1
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        rank, size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    return model, inputs, RankMeasurement(peak, resident, size, rank)


def _measure_cpu(
    build: Callable[[], tuple[nn.Module, Any]],
    step: Callable[[nn.Module, Inputs], None],
    session: Callable[[], Any],
    warmup: int,
) -> tuple[int, int, nn.Module, Inputs]:
    setup = session()
    with quiet_native_stderr():
        setup.start()
    try:
        model, raw = build()
        inputs = Inputs.of(raw)
        for _ in range(warmup):
            step(model, inputs)
            clear_grads(model)
        _wait_for_collectives()
    finally:
        with quiet_native_stderr():
            setup.stop()
    ledger = _AllocationLedger()
    ledger.replay(setup)
    ledger.replay(_witness(session))  # after the replay's time: gloo's late frees are done
    resident = ledger.current
    measured = session()
    with quiet_native_stderr():
        measured.start()
    try:
        step(model, inputs)
    finally:
        with quiet_native_stderr():
            measured.stop()
    peak = ledger.replay(measured)
    clear_grads(model)
    return peak, resident, model, inputs


def _wait_for_collectives() -> None:
    """Wait for the collectives a step left running (every rank measures, as every rank
    steps), so that the frees gloo's threads make when they end can be witnessed
    (:func:`_witness`)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _witness(session: Callable[[], Any]) -> Any:
    """A profiler session holding one event, a tiny tensor made and dropped: its allocator
    total, read after the warm-up's events have been replayed, shows the frees that gloo's
    threads made after the warm-up's last event.

    FSDP2's reduce-scatter of the root's gradients ends backward; its flat input (131,328
    bytes for the tiny Llama of tests/test_fsdp_units.py) is freed on a gloo thread when the
    collective's work is let go, often after the session's last event: no later total
    witnessed the drop, and the rank's resident memory was over-stated by that block
    (496,104 bytes against 364,776 in 4 of 44 measurements). A barrier is no witness: it
    waits for the work to finish, not for gloo's thread to drop it (a witness made right
    after a barrier still missed the root's float32 reduce-scatter input once, 49,664
    bytes, in tests/test_distributed.py's mixed-precision run). The witness comes after the
    replay of the warm-up's thousands of events instead."""
    witnessed = session()
    with quiet_native_stderr():
        witnessed.start()
    try:
        witness = torch.empty(1)
        del witness
    finally:
        with quiet_native_stderr():
            witnessed.stop()
    return witnessed


@dataclass(frozen=True)
class PlanRequest:
    """The arguments of ``optimize`` that a rank's plan must honour. One rank's plan serves
    every rank, so every rank must ask for the same: the receivers check theirs against the
    planning rank's."""

    budget_gb: float
    world_size: int
    sharding: str | None
    scope: str


@dataclass(frozen=True)
class _Planned:
    """What the planning rank broadcasts on success: the plan as JSON (the plan's own
    validated exchange format, parsed like a saved plan file) and what it was asked for."""

    plan_json: str
    request: PlanRequest


@dataclass(frozen=True)
class _Failure:
    """An exception raised on one rank, in a form every other rank can raise again: its class
    (by import path), ``args`` and attributes (``InfeasibleBudgetError`` keeps its minimum and
    breakdown there). Exceptions are not sent as pickles because a class whose ``__init__``
    takes other arguments than its message, like ``InfeasibleBudgetError``, cannot be
    unpickled."""

    rank: int
    doing: str
    module: str
    qualname: str
    args: tuple[Any, ...]
    attributes: dict[str, Any]
    message: str

    @classmethod
    def of(cls, error: BaseException, rank: int, doing: str) -> _Failure:
        kind = type(error)
        args = error.args if _picklable(error.args) else (str(error),)
        attributes = {k: v for k, v in vars(error).items() if _picklable(v)}
        return cls(rank, doing, kind.__module__, kind.__qualname__, args, attributes, str(error))

    def rebuild(self) -> BaseException:
        """The same exception (class, message, attributes), without running its
        ``__init__``; a class this process cannot import becomes a ``RuntimeError``."""
        error: BaseException | None = None
        kind = _exception_class(self.module, self.qualname)
        if kind is not None:
            try:
                error = kind.__new__(kind, *self.args)
                error.args = self.args
                error.__dict__.update(self.attributes)
            except Exception:
                error = None
        if error is None:
            error = RuntimeError(f"{self.module}.{self.qualname}: {self.message}")
        note = (
            f"raised on rank {self.rank} while {self.doing}; every rank raises it, so that "
            "none waits for the others in a collective"
        )
        if hasattr(error, "add_note"):  # Python >= 3.11
            error.add_note(note)
        return error


BUDGET_TOLERANCE = 0.01
"""Ranks whose budgets lie within this share of the smallest get one plan for the smallest
(NOTE [distributed: nearly equal budgets])."""


def plan_on_one_rank(
    plan_here: Callable[[float], nn.Module],
    apply_plan: Callable[[Plan], nn.Module],
    request: PlanRequest,
    *,
    plan_rank: int | None = 0,
) -> nn.Module:
    """Plan on one rank of the default process group and apply that plan on every rank.

    ``plan_here(budget_gb)`` profiles, solves and returns the rewritten model (with
    ``.plan``); ``apply_plan(plan)`` re-applies a plan without profiling or solving. Outside
    ``torch.distributed`` (not initialised, or one rank) this is
    ``plan_here(request.budget_gb)``.

    In a group of several ranks, the ranks first exchange what they ask for
    (:class:`PlanRequest`): anything but the budget differing, or budgets further apart than
    :data:`BUDGET_TOLERANCE`, is a :class:`ShardingError` on every rank, before any
    planning. Then rank ``plan_rank`` calls ``plan_here`` with the smallest budget asked for
    (NOTE [distributed: nearly equal budgets]) and broadcasts the plan's JSON, and every
    other rank calls ``apply_plan``. Why: planning is
    deterministic given its measurements, but step times are measured, and they differ from
    rank to rank (noise, other machines, other loads); two ranks that checkpoint different
    FSDP2 units issue different collectives and wait on each other for ever (one
    all-gathers for a recompute while the other reduce-scatters). One plan makes the ranks
    agree by construction.

    No rank is left waiting on a failure: an exception while planning is broadcast instead
    of the plan, and one while applying (a rank whose model or batch shapes differ) is
    gathered from every rank; then every rank raises it (same class, message and
    attributes; the others' copy notes the rank it came from).

    ``world_size`` (with a ``sharding``) must not exceed the group's size and must divide
    it: a smaller one is a sub-mesh (HSDP's shard group, FSDP beside tensor parallelism) and
    is conservative for FSDP over the whole group; a larger one would under-count each
    rank's shard, so it is a :class:`ShardingError`. ``plan_rank=None`` lets every rank plan
    on its own (ranks that train separate models); plans may then differ.

    Every rank must pass the same ``plan_rank``. The others wait in a collective while the
    planning rank works, so the process group's timeout must exceed the planning time.
    The planning rank collects planning's garbage before it returns (NOTE [distributed:
    garbage holding full parameters]); ``apply_plan`` does on the others.
    """
    plan_here = _releasing(plan_here)
    size = _group_size()
    if size <= 1:
        return plan_here(request.budget_gb)
    if plan_rank is None:
        _check_world_size(request, size)
        return plan_here(request.budget_gb)
    _check_plan_rank(plan_rank, size)
    dist = torch.distributed
    rank = dist.get_rank()
    asked: list[PlanRequest | None] = [None] * size
    dist.all_gather_object(asked, request)
    # Every rank holds every request, so every rank reaches the same verdict (and the same
    # message) without waiting on another.
    budget_gb, note = _agreed_budget([r for r in asked if r is not None], plan_rank)
    result: nn.Module | None = None
    own_error: Exception | None = None
    if rank == plan_rank:
        result = _plan_and_send(plan_here, request, size, budget_gb, note, plan_rank)
    else:
        result, own_error = _receive_and_apply(apply_plan, plan_rank)
    _share_apply_failures(own_error, rank, plan_rank, size)
    assert result is not None
    return result


def _releasing(plan_here: Callable[[float], nn.Module]) -> Callable[[float], nn.Module]:
    """``plan_here`` followed by :func:`release_planning_garbage` for the plan it made (the
    planner and its capture are garbage once it returns)."""

    def plan_and_release(budget_gb: float) -> nn.Module:
        result = plan_here(budget_gb)
        release_planning_garbage(getattr(getattr(result, "_orig_mod", result), "plan", None))
        return result

    return plan_and_release


def _check_plan_rank(plan_rank: int, size: int) -> None:
    """Refuse a ``plan_rank`` that names no rank of the group, before any collective."""
    if isinstance(plan_rank, bool) or not isinstance(plan_rank, int) or not 0 <= plan_rank < size:
        raise ShardingError(
            f"plan_rank must be a rank of the process group (0 to {size - 1}) or None, got "
            f"{plan_rank!r}"
        )


def _plan_and_send(
    plan_here: Callable[[float], nn.Module],
    request: PlanRequest,
    size: int,
    budget_gb: float,
    note: str | None,
    plan_rank: int,
) -> nn.Module:
    """On the planning rank: plan, then broadcast the plan or its failure, so no rank waits."""
    try:
        _check_world_size(request, size)
        result = plan_here(budget_gb)
        if note is not None and result.plan is not None:
            plan = result.plan
            result.plan = dataclasses.replace(plan, notes=(*plan.notes, note))
        payload: _Planned | _Failure = _Planned(result.plan.to_json(), request)
    except Exception as error:
        _broadcast(_Failure.of(error, plan_rank, "planning"), plan_rank)
        raise
    _broadcast(payload, plan_rank)
    return result


def _receive_and_apply(
    apply_plan: Callable[[Plan], nn.Module], plan_rank: int
) -> tuple[nn.Module | None, Exception | None]:
    """On another rank: apply the plan received, keeping a failure for the next collective."""
    payload = _broadcast(None, plan_rank)
    if isinstance(payload, _Failure):
        raise payload.rebuild()
    try:
        return apply_plan(Plan.from_json(payload.plan_json)), None
    except Exception as error:
        return None, error


def _share_apply_failures(
    own_error: Exception | None, rank: int, plan_rank: int, size: int
) -> None:
    """Raise any rank's failure to apply the plan on every rank, so none goes on alone."""
    outcome = None
    if own_error is not None:
        outcome = _Failure.of(own_error, rank, f"applying the plan of rank {plan_rank}")
    outcomes: list[_Failure | None] = [None] * size
    torch.distributed.all_gather_object(outcomes, outcome)
    if own_error is not None:
        raise own_error
    failures = [failure for failure in outcomes if failure is not None]
    if failures:
        raise failures[0].rebuild()


def _group_size() -> int:
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size()


def _broadcast(payload: Any, src: int) -> Any:
    box = [payload]
    torch.distributed.broadcast_object_list(box, src=src)
    return box[0]


def _check_world_size(request: PlanRequest, size: int) -> None:
    world_size = request.world_size
    if request.sharding is None or isinstance(world_size, bool) or not isinstance(world_size, int):
        return  # one process's plan, or a bad argument that resolve_sharding reports
    if world_size >= 1 and (world_size > size or size % world_size):
        raise ShardingError(
            f"world_size={world_size} does not fit the process group of {size} ranks: it is "
            f"the number of ranks that share the model under sharding={request.sharding!r}. "
            f"Pass world_size={size}, or a divisor of it for a sub-mesh (HSDP's shard group)."
        )


# NOTE [distributed: nearly equal budgets]
# Ranks that derive their budget from what they measure (free memory, a rank's own peak)
# pass budgets a few bytes apart (seen: 0.027815666794776917 and 0.02781566195189953 GiB on
# two ranks of one job). One plan serves every rank, and a plan within the smallest budget is
# within each of them, so such ranks get one plan for the smallest, and its notes say so.
# Budgets further apart than BUDGET_TOLERANCE of the smallest stay an error: that is no
# rounding, it is ranks disagreeing about the job (a plan for the smallest would cost the
# others recompute they did not ask for, silently).


def _agreed_budget(asked: list[PlanRequest], plan_rank: int) -> tuple[float, str | None]:
    """The budget to plan for, given every rank's request (index = rank), and a note for
    the plan when the ranks' budgets differ; :class:`ShardingError` when the requests
    differ otherwise or their budgets lie too far apart (the first such rank's message)."""
    planned = asked[plan_rank]
    budgets = [r.budget_gb for r in asked]
    smallest, largest = min(budgets), max(budgets)
    close = largest <= smallest * (1 + BUDGET_TOLERANCE)
    for rank, mine in enumerate(asked):
        if close:
            mine = dataclasses.replace(mine, budget_gb=planned.budget_gb)
        _check_same_request(mine, planned, rank, plan_rank)
    if smallest == largest:
        return smallest, None
    return smallest, (
        f"ranks asked for budgets from {smallest!r} to {largest!r} GiB (within "
        f"{BUDGET_TOLERANCE:.0%} of each other): one plan for the smallest serves every rank "
        "(NOTE [distributed: nearly equal budgets] in autockpt/distributed.py)"
    )


def _check_same_request(mine: PlanRequest, planned: PlanRequest, rank: int, src: int) -> None:
    differ = [
        f"{f.name}={getattr(mine, f.name)!r} here, {getattr(planned, f.name)!r} on rank {src}"
        for f in dataclasses.fields(PlanRequest)
        if getattr(mine, f.name) != getattr(planned, f.name)
    ]
    if differ:
        raise ShardingError(
            f"rank {rank} asked optimize for another plan than rank {src}, which plans for "
            f"every rank: {'; '.join(differ)}. Pass the same arguments on every rank (or "
            "plan_rank=None to plan on each rank separately)."
        )


def _picklable(value: Any) -> bool:
    try:
        pickle.dumps(value)
    except Exception:
        return False
    return True


def _exception_class(module: str, qualname: str) -> type[BaseException] | None:
    try:
        found: Any = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError):
        return None
    if isinstance(found, type) and issubclass(found, BaseException):
        return found
    return None
