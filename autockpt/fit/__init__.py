"""The batch that fits: the largest (or fastest) batch size whose training iteration fits the
budget, answered from predictions, without an out-of-memory trial.

Why not the usual way: batch finders (Lightning's ``scale_batch_size``, accelerate's
``find_executable_batch_size``) run real steps until one fails, which costs out-of-memory
errors and knows nothing of checkpointing. autockpt predicts the peak of any plan of a step
it never runs, so a size *fits* when its leanest plan's predicted peak
(``Planner.minimum_peak_bytes``, kernel workspaces included) is within the budget, and a size
is judged without running a step at it. Only the answer's plan runs, once, to verify it (as
``optimize`` verifies its plan).

NOTE [fit: one probe, scaled]. A size is planned two ways. *From shapes alone*
(``Planner(..., probe=False)``: the fake step and the search, nothing run on the device) its
leanest peak leaves out the kernels' workspaces: a lower bound. *In full* the probe runs each
node on the device (autockpt/costs/probe.py): workspaces and times, the prediction a plan is
made and verified by. The budget contract is that nothing runs for real above the budget,
planning included, so a size is planned in full only when its full prediction fits, and a
size not planned in full is judged by its shapes plus the workspaces of the sizes that were,
scaled with the size: what the probe adds over the shapes (on a CPU, the backward of a
convolution allocates one feature map per image that no operator returns) grows with the
batch like the activations. A size is judged by an estimate built to lie above its plan
(:func:`autockpt.fit.estimates.with_workspaces`): a plan replayed on its shapes-alone step
as a curve (the shapes' leanest, and the leanest of the nearest size planned in full, which
steers around workspaces; the lower of the two), each moment raised by the workspace of the
kernel that runs there, as measured where sizes were planned in full and carried to this
size node by node (:func:`~autockpt.fit.estimates.per_node`: in proportion to the size from
one measured size, an upper bound where a workspace grows with the size; along the line
through two once two lie above the smallest size planned, since a workspace has a part that
grows and a part that does not, and the smallest, often a batch of 1, may run other
kernels), plus what that model missed at the sizes planned in full, scaled (its gap there:
allocations fake kernels miss, the loss's measured windows; 0 on a VGG-like stack). What a
size planned in full added to its leanest peak is not enough alone (20 bytes at a batch of
1 on a VGG-like stack with AdamW, whose peak is then the optimizer's step: 37 looked 1.2 MB
lighter than it was, and was probed 0.3 MB over the budget), nor a floor to scale (mostly
workspace that does not grow: the search then climbed one size planned in full at a time).
One size above one planned in full, what that one added, scaled (it errs high: part of what
was added does not grow). The probe's allocator peak is reported per size (``probe_peak_bytes``, a
note if over the budget); its working set is below the leanest plan's (NOTE [profile:
probe's working set]; CPU 3x3 convolutions: 1.29 times the budget before, 0.95 after). Why:
on VGG19 (224 x 224, SGD, 2 GiB) the shapes alone put the largest size at 19 where 15 is the
answer, and planning 19 in full peaked 6.9% above the budget; why not plan every size in
full: the probe runs the step's kernels, repeatedly for their times, so it is what costs
(profile once at the smallest size, scale, and plan in full about once more, at the answer,
which ``optimize`` then reuses).

The search (:class:`_Sizes`):

1. The smallest size (``multiple_of``) from shapes alone: over the budget, an
   :class:`InfeasibleBudgetError` states that lower bound (``floor_bytes``), nothing run.
   Else it is planned in full: the one probe run on shapes alone (its working set is lean:
   no parameter gradients, no optimizer state, values freed after their last use). Over
   the budget in full, the error states its minimum.
2. The bracket, from shapes alone, each size judged by its corrected prediction: the first
   guess extrapolates from the smallest size through the part that does not grow (the
   parameters, buffers, gradients, the optimizer's state), later ones interpolate (the
   secant) between the largest size predicted to fit and the smallest predicted not to,
   falling back to halving, until the two are one ``multiple_of`` apart.
3. The bracket settled, the size above the largest predicted to fit is planned in full
   first where only an estimate says it does not fit (NOTE [fit: the neighbour in full]):
   if it fits, so does every size below it, and the bracket runs again above it. Then the
   largest size predicted to fit is planned in full. Its prediction is then exact: if it
   does not fit, the bracket runs again with the workspaces corrected. The answer is a size
   planned in full that fits, the size above it planned in full and over the budget, or
   over it from shapes alone (a lower bound), or, where its probe was predicted over the
   budget, judged by its estimate, with a note.

NOTE [fit: the neighbour in full]. An estimate is built to lie above a size's plan, so that
nothing runs at a size that does not fit; an estimate that lies above is also one that can
call a size that fits over the budget, and then the answer is too small. On
``benchmarks.fit``'s VGG-like stack (widths / 4, 32 x 32, SGD, the budget what a batch of 4
needs without checkpointing), a batch of 1 ran other CPU convolutions (its workspaces 533,568
bytes over its shapes, 170,304 at 2), 2 estimated from it looked 209 KB over the budget, and
the answer was 1 where 4 fits. So the answer's neighbour is never settled by an estimate: it
is planned in full, which runs its probe, not its step. Its guard is the probe's own peak,
predicted from the probes of the sizes planned in full (what does not grow plus the rest in
proportion, :meth:`_Sizes._probe_estimate`), which lies well below the leanest plan's (0.51-0.59
of the budget on that stack); only where that prediction is over the budget is the neighbour
judged by its estimate, and the answer says so. Why not a tighter estimate instead: no
estimate of a kernel nobody ran is exact, and a search whose answer is one size short
breaks the promise that ``n + multiple_of`` does not fit. What it costs: one size more
planned in full (1, 2, 4, 5 there; the neighbour is planned before the size below it, so
that when it fits, the size below need not be).

The search assumes the peak grows with the size (a model that pads to buckets may break
that); ``max_batch_size`` bounds it.

Sizes the model refuses (NOTE [fit: refused sizes]). ``make_inputs(n)`` may scale a
sequence past what the model takes (a position table of 4096 rows, a ``max_len`` check), and
the first guess, a straight line from the smallest size, may land far beyond it. A size at
which planning raises the model's own error (a ``ValueError``, ``IndexError``,
``RuntimeError`` or ``AssertionError`` in the fake step or the probe, or a capture that fails
at this size where a smaller size captured) does not fit: the search goes on below it
(halving towards it, on a log scale while the bracket spans more than a factor of 4), and
the answer lists it (``BatchFit.refused_sizes``, the error's first line) with a note. A size
refused by the probe alone (an index past an embedding table: fake tensors check no index)
is one shapes alone took, so the model's limit is then bisected planning in full
(:meth:`_Sizes._limit`), and every size from it up taken as refused. A device out of memory
in the probe is a ``RuntimeError`` too: that size does not fit either way. Why
not raise: the size is the search's guess, not the user's, and the sizes below it are an
answer; why not a size limit asked of the model: no model states one. Only when even
``multiple_of`` is refused, :class:`BatchSizeError` names the model's error. Errors of
autockpt itself (a bad budget, an unsupported optimizer) are not refusals.

The loss per size. A loss that holds targets (``cross_entropy(logits, y)``) has the size in
it: ``make_loss(n)`` builds the loss of size ``n``, planned with ``make_inputs(n)``'s inputs
(``autockpt fit``: each size's loss is the third item of ``factory(n)``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import numbers
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from autockpt.api import Planner, budget_in_bytes, check_budget_gb
from autockpt.base.inputs import Inputs
from autockpt.base.precision import Precision
from autockpt.base.runtime import LossFn
from autockpt.base.target import Target
from autockpt.costs.problem import DEFAULT_MAX_STAGES
from autockpt.errors import AutockptError, BatchSizeError, InfeasibleBudgetError, TraceError
from autockpt.fit.estimates import growth_per_size, scaled, with_workspaces
from autockpt.plan import Plan
from autockpt.planning.request import ProgressFn, budget_or_default

__all__ = ["OBJECTIVES", "BatchCandidate", "BatchFit", "fit_batch"]

OBJECTIVES = ("largest", "throughput")
_MAX_PLANS = 16
"""Sizes planned at most before the search settles for the largest one known to fit."""

_MODEL_ERRORS = (ValueError, IndexError, RuntimeError, AssertionError)
"""What a model raises for a size it does not take (NOTE [fit: refused sizes])."""

_REFUSED = sys.maxsize
"""The leanest peak a refused size is given in the search: above every budget."""


@dataclass(frozen=True)
class BatchCandidate:
    """One size the search planned: the leanest plan's predicted peak there (whether it fits
    the budget), and, where it fits, the predicted step of the plan chosen at the budget and
    the samples per second that gives."""

    size: int
    minimum_peak_bytes: int
    fits: bool
    predicted_step_seconds: float | None = None
    samples_per_second: float | None = None
    estimated: bool = False
    """Not planned in full (no node run at this size): ``minimum_peak_bytes`` is its leanest
    peak from shapes alone plus the workspaces of the sizes planned in full, scaled to it
    (NOTE [fit: one probe, scaled])."""
    shapes_minimum_bytes: int | None = None
    """The leanest plan's peak from shapes alone (kernel workspaces left out): a lower bound."""
    probe_peak_bytes: int | None = None
    """Planned in full on a device: the allocator's peak while the probe ran at this size
    (the only real tensors planning makes; within the budget, NOTE [fit: one probe,
    scaled])."""


@dataclass(frozen=True, eq=False)
class BatchFit:
    """The answer of :func:`fit_batch`: the size, the model optimized at it (the optimizer in
    the budget when given), its plan, and every size planned on the way."""

    batch_size: int
    model: nn.Module
    plan: Plan
    objective: str
    candidates: tuple[BatchCandidate, ...]
    notes: tuple[str, ...] = ()
    refused_sizes: dict[int, str] = field(default_factory=dict)
    """Sizes the model refused while they were planned (its error's first line), treated as
    not fitting (NOTE [fit: refused sizes]); not among :attr:`candidates`."""

    @property
    def samples_per_second(self) -> float:
        """Predicted samples per second of the answer's plan."""
        return self.batch_size / self.plan.predicted_step_seconds

    def to_dict(self) -> dict[str, Any]:
        """The numbers, for JSON (the model is left out)."""
        return {
            "batch_size": self.batch_size,
            "objective": self.objective,
            "budget_bytes": self.plan.budget_bytes,
            "predicted_peak_bytes": self.plan.predicted_peak_bytes,
            "measured_peak_bytes": self.plan.measured_peak_bytes,
            "predicted_step_seconds": self.plan.predicted_step_seconds,
            "samples_per_second": self.samples_per_second,
            "candidates": [dataclasses.asdict(c) for c in self.candidates],
            "notes": list(self.notes),
            "refused_sizes": {str(n): line for n, line in self.refused_sizes.items()},
        }


def fit_batch(
    model: nn.Module,
    make_inputs: Callable[[int], Any],
    *,
    budget_gb: float | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    loss_fn: LossFn | None = None,
    make_loss: Callable[[int], LossFn] | None = None,
    objective: str = "largest",
    multiple_of: int = 1,
    max_batch_size: int | None = None,
    accumulation_steps: int = 1,
    solver: str = "auto",
    time_limit_s: float = 30.0,
    verify: bool = True,
    selective: bool = True,
    leaf_modules: Iterable[str] = (),
    max_stages: int = DEFAULT_MAX_STAGES,
    world_size: int = 1,
    sharding: str | None = None,
    fsdp_units: Iterable[str] | None = None,
    reshard_after_forward: bool | Mapping[str, bool] | None = None,
    progress: ProgressFn | None = None,
    target: Target | str | None = None,
    precision: Precision | str | None = None,
) -> BatchFit:
    """The batch size ``n`` (a multiple of ``multiple_of``) that fits ``budget_gb``, with
    ``model`` optimized at it.

    ``make_inputs(n)`` returns example inputs for size ``n`` (a batch size, or a sequence
    length: the caller decides what ``n`` scales). ``objective="largest"``: the largest size
    whose leanest plan fits (``n + multiple_of`` does not, which the search checks).
    ``objective="throughput"``: among the sizes that fit (the largest and smaller ones), the
    one whose plan at the budget is predicted to train the most samples per second (a larger
    batch with more recompute against a smaller one with less). The answer is optimized like
    :func:`autockpt.optimize` does (its step measured when ``verify``).

    ``loss_fn`` is the loss of every size; ``make_loss(n)`` instead builds the loss of size
    ``n`` (one that holds targets of the size: ``lambda n: lambda out: cross_entropy(out,
    targets(n))``), called once per size planned, after ``make_inputs(n)``; the answer is
    planned and verified with its own size's loss.

    No size runs on the device unless its prediction, kernel workspaces included, fits the
    budget, save the smallest, planned in full once its shapes fit (NOTE [fit: one probe,
    scaled]), and the answer's neighbour, planned in full where its probe's predicted peak
    fits (NOTE [fit: the neighbour in full]).

    With ``optimizer`` the budget covers the whole training iteration (its state and step);
    under ``sharding`` the size is one rank's batch and the budget per rank (FSDP2's
    ``reshard_after_forward`` as :func:`autockpt.optimize` takes it). A size the
    model raises for (past its position table, say) does not fit: the answer lists it in
    ``refused_sizes`` (NOTE [fit: refused sizes]). Raises :class:`InfeasibleBudgetError`
    when even ``multiple_of`` does not fit (its ``minimum_gb`` does), and
    :class:`BatchSizeError` when ``make_inputs`` fails, its inputs do not change with ``n``,
    or the model refuses even ``multiple_of``. See the module docstring for how sizes are
    searched and what it assumes.

    ``target`` and ``precision``: a model on the meta device is sized for the device the
    run uses, in the precision it trains in, as :func:`autockpt.optimize` plans it (docs/
    large-runs.md); ``budget_gb`` may then be left out (the target's memory less a reserve).

    Why this is long: the front door's signature and this docstring are most of it; the
    body checks every argument before any work, then hands the search to one object.
    """
    budget_gb = check_budget_gb(budget_or_default(budget_gb, target))
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    multiple_of = _positive_int("multiple_of", multiple_of)
    if max_batch_size is not None:
        max_batch_size = _positive_int("max_batch_size", max_batch_size)
        if max_batch_size < multiple_of:
            raise ValueError(
                f"max_batch_size ({max_batch_size}) is below multiple_of ({multiple_of})"
            )
    if not callable(make_inputs):
        raise BatchSizeError(
            f"make_inputs must be a function of the size n returning example inputs, got "
            f"{type(make_inputs).__name__}"
        )
    if make_loss is not None and (loss_fn is not None or not callable(make_loss)):
        raise ValueError(
            "make_loss must be a function of the size n returning the loss of that size, "
            "and is given instead of loss_fn, not with it"
        )
    options = {
        "optimizer": optimizer,
        "loss_fn": loss_fn,
        "accumulation_steps": accumulation_steps,
        "leaf_modules": tuple(leaf_modules),
        "max_stages": max_stages,
        "world_size": world_size,
        "sharding": sharding,
        "fsdp_units": fsdp_units,
        "reshard_after_forward": reshard_after_forward,
        "target": target,
        "precision": precision,
    }
    sizes = _Sizes(
        model,
        make_inputs,
        budget_in_bytes(budget_gb),
        multiple_of,
        max_batch_size,
        options,
        make_loss=make_loss,
        solver=solver,
        time_limit_s=time_limit_s,
        selective=selective,
        progress=progress or (lambda what: None),
    )
    answer = sizes.largest()
    if objective == "throughput":
        answer = sizes.fastest(answer)
    for _ in range(_MAX_PLANS):
        sizes.progress(f"optimizing at size {answer.size}")
        try:
            result = answer.ready.optimize(
                budget_gb=budget_gb,
                solver=solver,
                time_limit_s=time_limit_s,
                verify=verify,
                selective=selective,
            )
            break
        except InfeasibleBudgetError:
            # measured above its prediction right at the minimum: the size below fits
            if answer.size <= multiple_of:
                raise
            sizes.notes.append(
                f"size {answer.size} measured above its leanest plan's prediction; "
                f"{answer.size - multiple_of} returned"
            )
            answer = sizes.full_below(answer.size)
    return BatchFit(
        batch_size=answer.size,
        model=result,
        plan=result.plan,
        objective=objective,
        candidates=sizes.candidates(),
        notes=(
            *sizes.notes,
            *sizes.refused_note(),
            *sizes.probe_note(),
            *sizes.unconfirmed_note(answer.size),
        ),
        refused_sizes=dict(sorted(sizes.refused.items())),
    )


@dataclass
class _Planned:
    size: int
    planner: Planner | None
    """None where the model refused the size (:attr:`refused`) or it was held back."""
    inputs: Inputs | None
    refused: str | None = None
    """The model's error at this size, its first line (NOTE [fit: refused sizes])."""
    held: str | None = None
    """Why this size was not planned in full: its prediction does not fit (NOTE [fit: one
    probe, scaled])."""

    @property
    def minimum(self) -> int:
        if self.planner is None:
            return _REFUSED
        return self.planner.minimum_peak_bytes

    @property
    def ready(self) -> Planner:
        """The planner of a size the model took."""
        assert self.planner is not None, f"size {self.size} was refused or held back"
        return self.planner


class _Sizes:
    """The sizes planned so far, and the search over them (module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        make_inputs: Callable[[int], Any],
        budget_bytes: int,
        multiple_of: int,
        max_batch_size: int | None,
        options: dict[str, Any],
        *,
        make_loss: Callable[[int], LossFn] | None,
        solver: str,
        time_limit_s: float,
        selective: bool,
        progress: ProgressFn,
    ) -> None:
        self.model, self.make_inputs, self.budget = model, make_inputs, budget_bytes
        self.make_loss = make_loss
        self.multiple_of, self.cap = multiple_of, max_batch_size
        self.options, self.progress = options, progress
        self.solver, self.time_limit_s, self.selective = solver, time_limit_s, selective
        self.rows: dict[int, BatchCandidate] = {}  # sizes planned in full
        self.shapes: dict[int, _Planned] = {}  # planned from shapes alone
        self.full: dict[int, _Planned] = {}  # planned in full (or refused, or held back)
        self.notes: list[str] = []
        self.inputs: dict[int, Inputs] = {}
        self.losses: dict[int, LossFn] = {}
        self.gaps: dict[int, int] = {}
        """Per size planned in full, what the workspace model missed there
        (:func:`autockpt.fit.estimates.model_gap`)."""
        self.refused: dict[int, str] = {}
        """Sizes the model refused, with its error's first line."""
        self.neighbours: set[int] = set()
        """Sizes above a size that fits, planned in full to settle the answer where their
        estimate alone said they do not fit (NOTE [fit: the neighbour in full])."""
        self.unconfirmed: dict[int, str] = {}
        """Such sizes not planned in full after all: why (their probe's prediction)."""
        self.limit: int | None = None
        """The smallest size the probe refused where shapes alone took it (:meth:`_limit`):
        every size from it up is taken as refused, unplanned."""

    # -- one size ---------------------------------------------------------------------------

    def example(self, size: int) -> Any:
        """``make_inputs(size)``, checked: it must not raise and must change with the size."""
        try:
            example = self.make_inputs(size)
        except Exception as error:
            raise BatchSizeError(
                f"make_inputs({size}) raised {type(error).__name__}: {error}"
            ) from error
        inputs = Inputs.of(example)
        signature = inputs.signature()
        same = [n for n, seen in self.inputs.items() if n != size and seen.signature() == signature]
        if same:
            raise BatchSizeError(
                f"make_inputs({same[0]}) and make_inputs({size}) return inputs of the same "
                f"shapes ({signature}): make_inputs(n) must build inputs of size n"
            )
        self.inputs[size] = inputs
        return example

    def loss(self, size: int) -> LossFn | None:
        """The loss of ``size``: ``make_loss(size)`` once per size, else ``loss_fn``."""
        if self.make_loss is None:
            return self.options["loss_fn"]
        if size not in self.losses:
            try:
                loss_fn = self.make_loss(size)
            except Exception as error:
                raise BatchSizeError(
                    f"make_loss({size}) raised {type(error).__name__}: {error}"
                ) from error
            if not callable(loss_fn):
                raise BatchSizeError(
                    f"make_loss({size}) returned {type(loss_fn).__name__}: it must return the "
                    "loss of size n, a function of the model's output"
                )
            self.losses[size] = loss_fn
        return self.losses[size]

    def plan(self, size: int, *, full: bool) -> _Planned:
        """A planner at ``size``: in full (the probe runs: workspaces, measured times) only
        where its prediction fits (:meth:`_held`), or from shapes alone (a lower bound of
        every plan's peak, the cost model's times)."""
        if self.limit is not None and size >= self.limit and size not in self.refused:
            return _Planned(size, None, None, f"above {self.limit}, which the model refused")
        cache = self.full if full else self.shapes
        if size in cache:
            return cache[size]
        if full:
            shapes = self.plan(size, full=False)
            if shapes.planner is None:  # refused in the fake step: refused in full alike
                return shapes
            held = self._held(size) if self.full else None  # the first: on its shapes
            if held is not None:
                return _Planned(size, None, None, held=held)
        self.progress(f"planning at size {size}" + ("" if full else " (shapes alone)"))
        example = self.example(size)
        options = {**self.options, "loss_fn": self.loss(size)}
        try:
            with _quiet_fake_tensor_errors():
                planner = Planner(self.model, example, probe=full, **options)
        except Exception as error:
            said = self._refusal(size, error)
            if said is None:
                raise
            return self._refused(size, said, error)
        planned = _Planned(size, planner, self.inputs[size])
        if not full:
            self.shapes[size] = planned
            return planned
        self.full[size] = planned
        self.rows[size] = self._row(planned)
        return planned

    def _row(self, planned: _Planned) -> BatchCandidate:
        """The candidate of a size planned in full: where it fits, the plan at the budget's
        predicted step and the samples per second that gives."""
        planner, size = planned.ready, planned.size
        row = BatchCandidate(
            size,
            planned.minimum,
            planned.minimum <= self.budget,
            shapes_minimum_bytes=self.shapes[size].minimum,
            probe_peak_bytes=planner.planning_peak_bytes,
        )
        if not row.fits:
            return row
        solution = planner.solve(
            self.budget,
            solver=self.solver,
            time_limit_s=self.time_limit_s,
            selective=self.selective,
        )
        step = planner.step_seconds + planner.recompute_seconds(
            solution.segments, solution.kept or ()
        )
        return dataclasses.replace(
            row, predicted_step_seconds=step, samples_per_second=size / step if step > 0 else None
        )

    def _held(self, size: int) -> str | None:
        """Why ``size`` may not be planned in full (None: it may): its predicted leanest
        peak, workspaces scaled, is over the budget (NOTE [fit: one probe, scaled]); for the
        answer's neighbour, its probe's predicted peak (NOTE [fit: the neighbour in full])."""
        if size in self.neighbours:
            probe = self._probe_estimate(size)
            if probe > self.budget:
                return f"its probe predicted at {probe} bytes, over the budget"
            return None
        predicted = self.predicted(size)
        if predicted > self.budget:
            return f"predicted {predicted} bytes, over the budget"
        return None

    # -- predictions --------------------------------------------------------------------------

    def predicted(self, size: int) -> int:
        """The leanest plan's peak at ``size`` (planned from shapes alone first): exact where
        planned in full, else its shapes plus the workspaces scaled to it (NOTE [fit: one
        probe, scaled]); above every budget where refused or held back."""
        done = self.full.get(size)
        if done is not None:
            return done.minimum
        return self._estimate(size)

    def _estimate(self, size: int) -> int:
        """Its shapes plus the workspaces of the sizes planned in full, scaled to ``size``."""
        shapes = self.plan(size, full=False)
        if shapes.planner is None:
            return _REFUSED
        full = {n: p for n, p in self.full.items() if p.planner is not None}
        below = full.get(size - self.multiple_of)
        if below is not None:  # one size above one planned in full: what it added, scaled
            added = max(0, below.minimum - self.shapes[below.size].minimum)
            return shapes.minimum + scaled({below.size: added}, size, 0)
        if not full:
            return shapes.minimum
        measured = {n: (p.ready, self.shapes[n].ready) for n, p in full.items()}
        return max(with_workspaces(shapes.ready, size, measured, self.gaps), shapes.minimum)

    def candidates(self) -> tuple[BatchCandidate, ...]:
        """Every size planned, by size: those planned in full as they were, the others by
        their final prediction (``estimated``); sizes refused are left out."""
        rows = dict(self.rows)
        for n, shapes in self.shapes.items():
            if n in rows or shapes.planner is None or n in self.refused:
                continue
            predicted = self._estimate(n)
            rows[n] = BatchCandidate(
                n,
                predicted,
                predicted <= self.budget and n not in self.full,
                estimated=True,
                shapes_minimum_bytes=shapes.minimum,
            )
        return tuple(rows[n] for n in sorted(rows))

    # -- refusals -------------------------------------------------------------------------------

    def _refusal(self, size: int, error: Exception) -> str | None:
        """What the model said refusing ``size`` (its error's type and first line), or None
        where ``error`` is not a refusal (NOTE [fit: refused sizes]): autockpt's own errors
        are not, except a capture that fails where a smaller size captured."""
        if isinstance(error, _MODEL_ERRORS) and not isinstance(error, AutockptError):
            lines = str(error).strip().splitlines()
            return f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]
        cause: BaseException | None = error
        while cause is not None and not isinstance(cause, TraceError):
            cause = cause.__cause__
        took = any(n < size and p.planner is not None for n, p in self.shapes.items())
        if isinstance(cause, TraceError) and took:
            said = f"cannot capture at {cause.location}: `{cause.source_line}` ({cause.reason})"
            return said[:300]
        return None

    def _refused(self, size: int, said: str, error: Exception) -> _Planned:
        """``size`` marked refused: it does not fit, in shapes alone and in full alike; the
        smallest size refused is a :class:`BatchSizeError`."""
        if size <= self.multiple_of:
            raise BatchSizeError(
                f"the model refuses even the smallest size, {size}: {said}. make_inputs(n) "
                "must build inputs the model takes for every size from multiple_of up"
            ) from error
        refused = _Planned(size, None, self.inputs[size], refused=said)
        self.refused[size] = said
        self.shapes[size] = self.full[size] = refused
        self.rows.pop(size, None)
        return refused

    def probe_note(self) -> list[str]:
        """The answer's note on sizes whose probe peaked above the budget (none: no note)."""
        over = {
            n: c.probe_peak_bytes
            for n, c in self.rows.items()
            if (c.probe_peak_bytes or 0) > self.budget
        }
        if not over:
            return []
        listed = ", ".join(f"{n} ({peak} bytes)" for n, peak in sorted(over.items()))
        return [
            f"planning in full peaked above the budget at size(s) {listed}: the probe, which "
            "runs each node alone on copies of its inputs while the graph's values stay "
            "alive, needed more than the leanest plan predicted at that size"
        ]

    def refused_note(self) -> list[str]:
        """The answer's note on the sizes the model refused (none: no note)."""
        if not self.refused:
            return []
        sizes = sorted(self.refused)
        return [
            f"the model refused {len(sizes)} size(s) ({', '.join(map(str, sizes))}; the smallest: "
            f"{self.refused[sizes[0]]}): treated as not fitting (refused_sizes lists each); "
            "max_batch_size keeps the search below them"
        ]

    def _limit(self, refused: int) -> None:
        """NOTE [fit: refused sizes]: ``refused`` was refused by the probe (an index past a
        table, which fake tensors do not check) where shapes alone took it, so shapes alone
        cannot find the model's limit: it is bisected planning in full, between the largest
        size taken in full and ``refused``, all sizes predicted to fit the budget. From the
        smallest refused up, every size is then taken as refused."""
        m = self.multiple_of
        low = max(n for n, p in self.full.items() if p.planner is not None and n < refused)
        high = refused
        while high - low > m:
            middle = _between(low, high, m)
            if self.plan(middle, full=True).planner is not None:
                low = middle
            else:
                high = middle
        if high not in self.refused:  # held back by its prediction: not the model's limit
            return
        self.limit = high
        for n, planned in list(self.shapes.items()):
            if n >= high and planned.refused is None:
                self.shapes[n] = _Planned(n, None, None, f"above {high}, which the model refused")
                self.rows.pop(n, None)

    # -- the search -----------------------------------------------------------------------------

    def largest(self) -> _Planned:
        """The largest size that fits (NOTE [fit: one probe, scaled]); raises
        InfeasibleBudgetError when even ``multiple_of`` does not.

        The smallest size from shapes alone, then in full; then, until the bracket settles
        on a size planned in full: the bracket from shapes alone under the corrected
        predictions, and its answer planned in full (which corrects them)."""
        m = self.multiple_of
        first = self.plan(m, full=False)
        if first.minimum > self.budget:  # refused: BatchSizeError already
            raise self._infeasible(first, floor=True)
        low = self.plan(m, full=True)
        if low.minimum > self.budget:
            raise self._infeasible(low, floor=False)
        for _ in range(_MAX_PLANS):
            size = self._bracket()
            above = self._unsettled(size)
            if above is not None:  # NOTE [fit: the neighbour in full]; if it fits, so does size
                planned = self.plan(above, full=True)
                if planned.planner is None and planned.refused is None:
                    self.unconfirmed[above] = planned.held or ""
                continue
            done = self.full.get(size)
            if done is not None and done.planner is not None:
                return done  # fits, and the size above does not
            planned = self.plan(size, full=True)
            if planned.refused is not None and self.limit is None:
                self._limit(size)  # by the probe, where shapes alone took it
        self.notes.append(f"stopped after planning {_MAX_PLANS} sizes in full")
        fitting = [n for n, p in self.full.items() if p.planner is not None]
        return self.full[max(n for n in fitting if self.full[n].minimum <= self.budget)]

    def _unsettled(self, low: int) -> int | None:
        """The size above ``low`` (the bracket's largest size predicted to fit) where only
        an estimate says it does not fit (NOTE [fit: the neighbour in full]): not planned in
        full, not refused, within ``max_batch_size``, its shapes' lower bound within the
        budget. None: settled."""
        above = low + self.multiple_of
        if above in self.full or above in self.unconfirmed:  # refused sizes are in full
            return None
        if (self.cap is not None and above > self.cap) or (
            self.limit is not None and above >= self.limit
        ):
            return None
        shapes = self.plan(above, full=False)
        if shapes.planner is None or shapes.minimum > self.budget:
            return None  # refused, or over the budget before any workspace
        self.neighbours.add(above)
        return above

    def _probe_estimate(self, size: int) -> int:
        """The probe's allocator peak at ``size``, from its peaks where sizes were planned in
        full: what does not grow (parameters, buffers) plus the rest in proportion to the
        size above the largest (it errs high: a probe's working set grows at most like the
        activations). 0 where no probe ran (the meta device: nothing runs for real)."""
        known = {
            n: p.ready.planning_peak_bytes
            for n, p in self.full.items()
            if p.planner is not None and p.ready.planning_peak_bytes is not None
        }
        if not known:
            return 0
        top = self.full[max(known)].ready
        fixed = 0
        if top.nested is None:
            fixed = top.profile.param_bytes + top.profile.buffer_bytes
        return scaled(known, size, min(fixed, min(known.values())))

    def unconfirmed_note(self, answer: int) -> list[str]:
        """The answer's note where its neighbour was judged by an estimate alone, its probe
        predicted over the budget (none: no note; a size further up does not matter)."""
        above = answer + self.multiple_of
        if above not in self.unconfirmed:
            return []
        return [
            f"size {above} was judged not to fit from shapes and the workspaces measured at "
            f"other sizes ({self.predicted(above)} bytes predicted), not planned in full: "
            f"{self.unconfirmed[above]}; the answer may be one size short"
        ]

    def _infeasible(self, planned: _Planned, *, floor: bool) -> InfeasibleBudgetError:
        """Even ``multiple_of`` does not fit: from shapes alone (a floor, nothing run) or in
        full (its minimum)."""
        m = self.multiple_of
        advice = (
            "Raise the budget, shrink what checkpointing cannot touch (parameters, the "
            "optimizer's state: a lighter optimizer, sharding), or shorten the sequence."
        )
        if floor:
            hint = (
                f"Even a batch of {m} does not fit: from shapes alone its leanest plan needs "
                "at least the floor stated (kernel workspaces come on top), so nothing was "
                f"run at it. {advice}"
            )
            breakdown = planned.ready.breakdown
            return InfeasibleBudgetError(
                self.budget, None, breakdown, "total", hint, floor_bytes=planned.minimum
            )
        hint = f"Even a batch of {m} does not fit: its leanest plan needs the minimum stated. "
        return InfeasibleBudgetError(
            self.budget, planned.minimum, planned.ready.breakdown, "total", hint + advice
        )

    def _bracket(self) -> int:
        """The largest size predicted to fit, the size above it predicted not to (or past
        ``max_batch_size``): the secant search of the module docstring, from shapes alone."""
        m, budget = self.multiple_of, self.budget
        for _ in range(_MAX_PLANS):
            known = {n: self.predicted(n) for n in list(self.shapes)}
            low = max(n for n, v in known.items() if v <= budget)  # multiple_of fits in full
            high = min((n for n, v in known.items() if v > budget and n > low), default=None)
            if self.cap is not None and low + m > self.cap:
                if not any("max_batch_size" in note for note in self.notes):
                    self.notes.append(
                        f"max_batch_size {self.cap} reached while the batch still fits: "
                        "larger ones were not tried"
                    )
                return low
            if high is not None and high - low <= m:
                return low
            self.plan(self._guess(low, high, known), full=False)
        self.notes.append(f"stopped after planning {_MAX_PLANS} sizes from shapes alone")
        return low

    def _guess(self, low: int, high: int | None, known: dict[int, int]) -> int:
        """The next size to plan: where a straight line through what is known reaches the
        budget, inside ``(low, high)``, a multiple of ``multiple_of``. The line is the secant
        between the two sizes that bracket the answer (or the two largest that fit); from
        one size alone, the line through the part that does not grow with the size."""
        m, budget = self.multiple_of, self.budget
        below = [n for n in known if n < low and known[n] <= budget]
        if high is not None and known[high] < _REFUSED:
            slope = (known[high] - known[low]) / (high - low)
        elif below:
            other = max(below)
            slope = (known[low] - known[other]) / (low - other)
        else:
            slope = self._growth(low)
        if slope <= 0:  # a smaller size that needed more (a batch of 1's other kernels)
            slope = self._growth(low)
        estimate = low + (budget - known[low]) / max(slope, 1e-9)
        guess = m * math.floor(estimate / m)
        if guess <= low:
            guess = low + m  # the neighbour above the best so far
        if high is not None:
            if known[high] >= _REFUSED and guess >= high:
                guess = _between(low, high, m)  # the model's limit, not the budget's
            guess = min(guess, high - m)
        if self.cap is not None:
            guess = min(guess, m * (self.cap // m))
        if guess in known:  # the line repeats itself: halve the interval instead
            top = high if high is not None else 2 * low
            guess = max(low + m, m * ((low + top) // (2 * m)))
        return guess

    def _growth(self, size: int) -> float:
        """How much the prediction grows per unit of size, from ``size`` alone: planned in
        full, its own; else its shapes' plus the scaled workspaces per unit."""
        full = self.full.get(size)
        if full is not None and full.planner is not None:
            return growth_per_size(full.ready, size)
        shapes = self.shapes[size]
        return growth_per_size(shapes.ready, size) + (self.predicted(size) - shapes.minimum) / size

    def full_below(self, size: int) -> _Planned:
        """The largest size below ``size`` planned in full that the model takes."""
        below = self.plan(size - self.multiple_of, full=True)
        while below.planner is None:  # the smallest was planned in full first
            below = self.plan(below.size - self.multiple_of, full=True)
        return below

    def fastest(self, largest: _Planned) -> _Planned:
        """Among the sizes that fit (the largest, about three quarters and half of it, and
        any planned in full on the way), the one with the most predicted samples per second
        (sizes are planned in full for it: the probe's measured times)."""
        m = self.multiple_of
        for fraction in (0.75, 0.5):
            self.plan(max(m, m * round(fraction * largest.size / m)), full=True)
        fitting = [c for c in self.rows.values() if c.fits and c.samples_per_second]
        if not fitting:
            return largest
        best = max(fitting, key=lambda c: (c.samples_per_second, c.size))
        return self.full[best.size]


def _between(low: int, high: int, m: int) -> int:
    """A multiple of ``m`` between ``low`` and ``high`` (exclusive, ``high - low > m``): their
    geometric mean while ``high`` is more than 4 times ``low`` (a refused guess may lie
    orders of magnitude above the model's limit), else their midpoint."""
    middle = math.sqrt(low * high) if high > 4 * low else (low + high) / 2
    return max(low + m, min(high - m, m * math.floor(middle / m)))


@contextlib.contextmanager
def _quiet_fake_tensor_errors() -> Iterator[None]:
    """Without torch's log of an operator that failed on fake tensors: a size the model
    refuses fails so in the fake step, and torch logs the whole traceback at ERROR before
    raising it. The error itself still propagates (a refusal's first line is in the answer);
    only that log line, for the sizes this search plans, is dropped."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")

    def keep(record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("failed while attempting to run meta")

    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)
