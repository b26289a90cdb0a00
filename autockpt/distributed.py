"""Distributed engines: what DDP and FSDP2 keep on each rank, and how plans compose with them.

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
  real module call in the rewritten graph, and every checkpoint segment, being a contiguous
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
    step. A unit's backward holds its full unsharded gradients plus a flat reduce-scatter
    input of the same size and the sharded output. Parameters outside every unit belong to
    the root, which FSDP2 does not reshard after forward: they are full-size for the whole
    step, and their gradients are full-size until the reduce-scatter that ends backward.
* **Verification runs one unsharded process.** ``optimize`` measures the rewritten model in
  the planning process (no process group needed) and transfers what the graph profile
  missed (measured minus predicted) to the per-rank prediction, on the assumption that
  workspaces and autograd buffers do not depend on sharding. :func:`measure_rank` is the
  real per-rank truth, used by the tests and ``benchmarks/distributed.py``.
* **One rank plans; every rank applies its plan.** When every rank of a process group
  calls ``optimize`` (the ``torchrun`` pattern), :func:`plan_on_one_rank` lets rank 0 plan
  and broadcasts the plan; the others only apply it. Planning is deterministic given its
  measurements, but the measurements (step times, on other machines, under other loads)
  are not, and two ranks whose FSDP2 units are checkpointed differently issue different
  collectives and wait on each other for ever.
"""

from __future__ import annotations

import dataclasses
import importlib
import pickle
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autockpt.allocations import allocator_events
from autockpt.blocks import find_repeated_blocks
from autockpt.errors import ShardingError
from autockpt.plan import Plan, RankMemory
from autockpt.runtime import LossFn, clear_grads, default_loss
from autockpt.trace import Capture, Inputs
from solvers import ChainProblem

SHARDINGS = (None, "ddp", "fsdp")
DDP_BUCKET_CAP_BYTES = 25 * 2**20
# Per-rank safety margin: the process group's own small tensors (gloo work and address
# objects of about a kilobyte, freed on its worker threads) that no graph profile sees.
RANK_MARGIN_BYTES = 64 * 2**10


@dataclass(frozen=True)
class Sharding:
    """How the planned model will be trained: ``world_size`` ranks, each running one
    ``example_inputs`` batch, under ``mode`` (None: one process; "ddp"; "fsdp") with FSDP
    ``units`` (qualified module names, in call order)."""

    world_size: int = 1
    mode: str | None = None
    units: tuple[str, ...] = ()

    @property
    def active(self) -> bool:
        return self.mode is not None


def resolve_sharding(
    model: nn.Module, world_size: int, sharding: str | None, fsdp_units: Iterable[str] | None
) -> Sharding:
    """Validate the distributed arguments of ``optimize`` and pick the FSDP units."""
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
    if sharding != "fsdp":
        return Sharding(world_size, sharding, ())
    if isinstance(fsdp_units, str):
        raise ShardingError("fsdp_units must be a list of module names, not one string")
    units = tuple(fsdp_units) if fsdp_units is not None else detect_units(model)
    _check_units(model, units)
    return Sharding(world_size, sharding, units)


def detect_units(model: nn.Module) -> tuple[str, ...]:
    """The repeated blocks of ``model`` (:func:`autockpt.blocks.find_repeated_blocks`: every
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


def check_units_called(capture: Capture, units: tuple[str, ...]) -> None:
    """Every FSDP unit must be a ``call_module`` node of the capture: its hooks gather its
    parameters. A unit that is never called as a module (a container, or a graph captured
    by ``torch.export``, which inlines modules) cannot be sharded behind a plan."""
    called = {str(n.target) for n in capture.graph.nodes if n.op == "call_module"}
    absent = [u for u in units if u not in called]
    if absent:
        how = (
            "the graph was captured with torch.export, which inlines module calls, because fx "
            "could not trace the root module"
            if capture.method == "export"
            else "they are not called as modules in forward (a container, or reached only "
            "through a parent's call)"
        )
        raise ShardingError(
            f"FSDP units {absent} are not module calls in the captured graph: {how}. Pass "
            "fsdp_units naming modules that forward calls directly."
        )


# ---------------------------------------------------------------------------------------------
# per-rank memory model


@dataclass(frozen=True)
class _ParamSplit:
    """Parameter bytes of every unit and of the root (outside all units)."""

    unit_bytes: dict[str, int]
    root_bytes: int


def _param_split(model: nn.Module, units: tuple[str, ...]) -> _ParamSplit:
    owner: dict[int, str] = {}
    for unit in units:
        for p in model.get_submodule(unit).parameters():
            owner.setdefault(id(p), unit)
    unit_bytes = dict.fromkeys(units, 0)
    root = 0
    for p in {id(p): p for p in model.parameters()}.values():
        nbytes = p.numel() * p.element_size()
        if id(p) in owner:
            unit_bytes[owner[id(p)]] += nbytes
        else:
            root += nbytes
    return _ParamSplit(unit_bytes, root)


def _shard(nbytes: int, world_size: int) -> int:
    return -(-nbytes // world_size)


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
) -> tuple[ChainProblem, RankMemory]:
    """The single-process chain ``problem`` rewritten for one rank under ``sharding``.

    ``problem.static_bytes`` is the single-process static part (parameters + buffers +
    inputs + calibration + output tail); the parameter part is replaced by what one rank
    keeps, and the engines' buffers are added (see the module docstring), plus
    :data:`RANK_MARGIN_BYTES` for the process group's own small tensors. Returns the
    per-rank problem and the breakdown recorded in the plan.
    """
    n = sharding.world_size
    rest = problem.static_bytes - parameters  # buffers, inputs, output tail, calibration
    if sharding.mode == "ddp":
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
            static=parameters + buckets + buffers + inputs,
        )
        problem = dataclasses.replace(
            problem,
            static_bytes=rest + parameters + buckets + RANK_MARGIN_BYTES,
            transient_bytes=tuple(transient),
        )
        return problem, memory

    split = _param_split(model, sharding.units)
    largest = max(split.unit_bytes.values(), default=0)
    local_params = sum(_shard(b, n) for b in split.unit_bytes.values()) + _shard(
        split.root_bytes, n
    )
    gathered = 2 * largest + split.root_bytes  # current + prefetched unit; the root stays full
    nodes = capture.compute_nodes()
    unit_of_node = {
        i: str(node.target)
        for i, node in enumerate(nodes)
        if node.op == "call_module" and str(node.target) in split.unit_bytes
    }
    grads = list(problem.param_grad_bytes)
    transient = list(problem.transient_bytes)
    for k, (start, end) in enumerate(stages):
        unit_grads = 0
        window = 0
        for i in range(start, end):
            unit = unit_of_node.get(i)
            if unit is not None:
                size = split.unit_bytes[unit]
                unit_grads += size
                window = max(window, 2 * size + _shard(size, n))
        # Unit gradients persist as shards; root gradients stay full until the end.
        grads[k] = (
            grads[k]
            - unit_grads
            + sum(
                _shard(split.unit_bytes[unit_of_node[i]], n)
                for i in range(start, end)
                if i in unit_of_node
            )
        )
        transient[k] += window
    # The root's reduce-scatter ends backward: a flat copy of its gradients plus the shard.
    transient[0] += split.root_bytes + _shard(split.root_bytes, n)
    grads[0] += _shard(split.root_bytes, n)
    memory = RankMemory(
        parameters=local_params,
        gradients=sum(_shard(b, n) for b in split.unit_bytes.values())
        + _shard(split.root_bytes, n),
        buckets=0,
        gathered_parameters=gathered,
        reduce_scatter=max(
            [2 * b + _shard(b, n) for b in split.unit_bytes.values()]
            + [split.root_bytes + _shard(split.root_bytes, n)]
        ),
        static=local_params + buffers + inputs,
    )
    problem = dataclasses.replace(
        problem,
        static_bytes=rest + local_params + gathered + RANK_MARGIN_BYTES,
        param_grad_bytes=tuple(max(0, g) for g in grads),
        transient_bytes=tuple(transient),
    )
    return problem, memory


# ---------------------------------------------------------------------------------------------
# wrapping and per-rank measurement


def wrap(model: nn.Module, mode: str, units: Iterable[str] = (), **engine_kwargs: Any) -> nn.Module:
    """Wrap ``model`` for training under ``mode`` in the current process group, the way a
    user would: ``DistributedDataParallel(model)``, or ``fully_shard`` on each unit and then
    on the root. Returns the module to call."""
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, **engine_kwargs)
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for name in units:
            fully_shard(model.get_submodule(name), **engine_kwargs)
        fully_shard(model, **engine_kwargs)
        return model
    raise ShardingError(f"unknown sharding mode {mode!r}; use 'ddp' or 'fsdp'")


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

    A drop that matches no block and a block whose free is never witnessed stay counted, so
    the figures remain upper bounds of the truth.
    """

    def __init__(self) -> None:
        self.live: dict[int, int] = {}
        self.current = 0
        self.elsewhere = 0  # bytes allocated on unwatched threads, not yet seen freed
        self._total: int | None = None

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
                self.current += nbytes - self.live.pop(ptr, 0)
                self.live[ptr] = nbytes
                peak = max(peak, self.current)
            else:
                self.current -= self.live.pop(ptr, 0)
        return peak

    def _unwatched(self, change: int) -> None:
        """Account a change of the allocator's total made on a thread the profiler does not
        watch: a free of a block this ledger holds, or memory of that thread."""
        if change > 0:
            self.elsewhere += change
            self.current += change
        elif change < 0:
            size = -change
            for ptr in reversed(self.live):  # most recent first: frees follow soon
                if self.live[ptr] == size:
                    del self.live[ptr]
                    self.current -= size
                    return
            if self.elsewhere >= size:
                self.elsewhere -= size
                self.current -= size


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
    a session, in time order (read by the one recording layer, ``autockpt.allocations``)."""
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
    ``device="cuda"``: the caching allocator's counters.
    """
    from torch.profiler import ProfilerActivity, profile

    loss_fn = loss_fn or default_loss

    def step(model: nn.Module, inputs: Inputs) -> None:
        loss_fn(model(*inputs.args, **inputs.kwargs)).backward()

    def session() -> Any:
        return profile(activities=[ProfilerActivity.CPU], profile_memory=True)

    if torch.device(device).type == "cuda":
        base = torch.cuda.memory_allocated()
        model, raw = build()
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
            peak, resident, model, inputs = _measure_cpu(build, step, session, warmup)
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
    from autockpt.allocations import quiet_native_stderr

    setup = session()
    with quiet_native_stderr():
        setup.start()
    try:
        model, raw = build()
        inputs = Inputs.of(raw)
        for _ in range(warmup):
            step(model, inputs)
            clear_grads(model)
    finally:
        with quiet_native_stderr():
            setup.stop()
    ledger = _AllocationLedger()
    ledger.replay(setup)
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


# ---------------------------------------------------------------------------------------------
# one plan for every rank


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


def plan_on_one_rank(
    plan_here: Callable[[], nn.Module],
    apply_plan: Callable[[Plan], nn.Module],
    request: PlanRequest,
    *,
    plan_rank: int | None = 0,
) -> nn.Module:
    """Plan on one rank of the default process group and apply that plan on every rank.

    ``plan_here()`` profiles, solves and returns the rewritten model (with ``.plan``);
    ``apply_plan(plan)`` re-applies a plan without profiling or solving. Outside
    ``torch.distributed`` (not initialised, or one rank) this is ``plan_here()``.

    In a group of several ranks, rank ``plan_rank`` calls ``plan_here()`` and broadcasts the
    plan's JSON; every other rank checks that it asked for the same (:class:`PlanRequest`;
    :class:`ShardingError` otherwise) and calls ``apply_plan``. Why: planning is
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
    """
    size = _group_size()
    if size <= 1:
        return plan_here()
    if plan_rank is None:
        _check_world_size(request, size)
        return plan_here()
    if isinstance(plan_rank, bool) or not isinstance(plan_rank, int) or not 0 <= plan_rank < size:
        raise ShardingError(
            f"plan_rank must be a rank of the process group (0 to {size - 1}) or None, got "
            f"{plan_rank!r}"
        )
    dist = torch.distributed
    rank = dist.get_rank()
    result: nn.Module | None = None
    own_error: Exception | None = None
    if rank == plan_rank:
        try:
            _check_world_size(request, size)
            result = plan_here()
            payload: _Planned | _Failure = _Planned(result.plan.to_json(), request)
        except Exception as error:
            _broadcast(_Failure.of(error, rank, "planning"), plan_rank)
            raise
        _broadcast(payload, plan_rank)
    else:
        payload = _broadcast(None, plan_rank)
        if isinstance(payload, _Failure):
            raise payload.rebuild()
        try:
            _check_same_request(request, payload.request, rank, plan_rank)
            result = apply_plan(Plan.from_json(payload.plan_json))
        except Exception as error:
            own_error = error
    outcome = None
    if own_error is not None:
        outcome = _Failure.of(own_error, rank, f"applying the plan of rank {plan_rank}")
    outcomes: list[_Failure | None] = [None] * size
    dist.all_gather_object(outcomes, outcome)
    if own_error is not None:
        raise own_error
    failures = [failure for failure in outcomes if failure is not None]
    if failures:
        raise failures[0].rebuild()
    assert result is not None
    return result


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
