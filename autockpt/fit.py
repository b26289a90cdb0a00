"""The batch that fits: the largest (or fastest) batch size whose training iteration fits the
budget, answered from predictions, without an out-of-memory trial.

Why not the usual way: batch finders (Lightning's ``scale_batch_size``, accelerate's
``find_executable_batch_size``) run real steps until one fails, which costs out-of-memory
errors and knows nothing of checkpointing. autockpt predicts the peak of any plan of a step
it never runs (fake tensors, one node at a time on the device), so a size *fits* when its
leanest plan's predicted peak (``Planner.minimum_peak_bytes``) is within the budget, and a
size is judged without running a step at it. Only the answer's plan runs, once, to verify
it (as ``optimize`` verifies its plan).

How the sizes are searched (:class:`_Sizes`), in two stages:

1. *From shapes alone* (``Planner(..., probe=False)``: the fake step and the search, no node
   run on the device). Kernel workspaces only add to a plan's peak, so a size whose shapes
   already put its leanest plan over the budget does not fit. Memory grows with the size,
   about linearly (the activations, the inputs), while the fixed part (parameters, buffers,
   gradients, the optimizer's state) does not: the first guess extrapolates from the
   smallest size through that fixed part, later ones interpolate between the largest size
   that fits and the smallest that does not (the secant), falling back to halving, until
   they are one ``multiple_of`` apart.
2. *In full* at the candidate: the probe measures its workspaces and times. Should they put
   it over, stage 1 runs again under the budget less what they added. The size above the
   answer is judged too: it does not fit in shapes alone, or, planned in full, it does not
   fit (the neighbour is checked, never assumed).

Only the answer's plan runs a real step, to verify it. The search assumes the peak grows
with the size (a model that pads to buckets may break that); ``max_batch_size`` bounds it.

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
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import numbers
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from autockpt.api import Planner, budget_in_bytes, check_budget_gb
from autockpt.base.inputs import Inputs
from autockpt.base.runtime import LossFn
from autockpt.costs.problem import DEFAULT_MAX_STAGES
from autockpt.costs.record import ACCUMULATED_GRADIENTS
from autockpt.errors import AutockptError, BatchSizeError, InfeasibleBudgetError, TraceError
from autockpt.plan import Plan
from autockpt.planning.request import ProgressFn
from solvers import replay

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
    """Judged from shapes alone (no node run: kernel workspaces unknown), the leanest peak
    then a lower bound: enough to tell that a size does not fit."""


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
    budget_gb: float,
    optimizer: torch.optim.Optimizer | None = None,
    loss_fn: LossFn | None = None,
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
    progress: ProgressFn | None = None,
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

    With ``optimizer`` the budget covers the whole training iteration (its state and step);
    under ``sharding`` the size is one rank's batch and the budget per rank. A size the
    model raises for (past its position table, say) does not fit: the answer lists it in
    ``refused_sizes`` (NOTE [fit: refused sizes]). Raises :class:`InfeasibleBudgetError`
    when even ``multiple_of`` does not fit (its ``minimum_gb`` does), and
    :class:`BatchSizeError` when ``make_inputs`` fails, its inputs do not change with ``n``,
    or the model refuses even ``multiple_of``. See the module docstring for how sizes are
    searched and what it assumes.

    Why this is long: the front door's signature and this docstring are most of it; the
    body checks every argument before any work, then hands the search to one object.
    """
    budget_gb = check_budget_gb(budget_gb)
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
    options = {
        "optimizer": optimizer,
        "loss_fn": loss_fn,
        "accumulation_steps": accumulation_steps,
        "leaf_modules": tuple(leaf_modules),
        "max_stages": max_stages,
        "world_size": world_size,
        "sharding": sharding,
        "fsdp_units": fsdp_units,
    }
    sizes = _Sizes(
        model,
        make_inputs,
        budget_in_bytes(budget_gb),
        multiple_of,
        max_batch_size,
        options,
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
        candidates=tuple(sorted(sizes.candidates.values(), key=lambda c: c.size)),
        notes=(*sizes.notes, *sizes.refused_note()),
        refused_sizes=dict(sorted(sizes.refused.items())),
    )


@dataclass
class _Planned:
    size: int
    planner: Planner | None
    """None where the model refused the size (:attr:`refused`)."""
    inputs: Inputs | None
    refused: str | None = None
    """The model's error at this size, its first line (NOTE [fit: refused sizes])."""

    @property
    def minimum(self) -> int:
        if self.planner is None:
            return _REFUSED
        return self.planner.minimum_peak_bytes

    @property
    def ready(self) -> Planner:
        """The planner of a size the model took."""
        assert self.planner is not None, f"size {self.size} was refused"
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
        solver: str,
        time_limit_s: float,
        selective: bool,
        progress: ProgressFn,
    ) -> None:
        self.model, self.make_inputs, self.budget = model, make_inputs, budget_bytes
        self.multiple_of, self.cap = multiple_of, max_batch_size
        self.options, self.progress = options, progress
        self.solver, self.time_limit_s, self.selective = solver, time_limit_s, selective
        self.candidates: dict[int, BatchCandidate] = {}
        self.shapes: dict[int, _Planned] = {}  # planned from shapes alone
        self.full: dict[int, _Planned] = {}  # planned in full
        self.notes: list[str] = []
        self.inputs: dict[int, Inputs] = {}
        self.refused: dict[int, str] = {}
        """Sizes the model refused, with its error's first line."""
        self.limit: int | None = None
        """The smallest size the probe refused where shapes alone took it (:meth:`_limit`):
        every size from it up is taken as refused, unplanned."""

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

    def plan(self, size: int, *, full: bool) -> _Planned:
        """A planner at ``size``: in full (the probe runs: workspaces, measured times), or
        from shapes alone (a lower bound of every plan's peak, the cost model's times)."""
        if self.limit is not None and size >= self.limit and size not in self.refused:
            return _Planned(size, None, None, f"above {self.limit}, which the model refused")
        cache = self.full if full else self.shapes
        if size in cache:
            return cache[size]
        self.progress(f"planning at size {size}" + ("" if full else " (shapes alone)"))
        example = self.example(size)
        try:
            with _quiet_fake_tensor_errors():
                planner = Planner(self.model, example, probe=full, **self.options)
        except Exception as error:
            said = self._refusal(size, error)
            if said is None:
                raise
            return self._refused(size, said, error)
        planned = _Planned(size, planner, self.inputs[size])
        fits = planned.minimum <= self.budget
        if not full:
            self.shapes[size] = planned
            if size not in self.candidates or self.candidates[size].estimated:
                self.candidates[size] = BatchCandidate(size, planned.minimum, fits, estimated=True)
            return planned
        row = BatchCandidate(size, planned.minimum, fits)
        if fits:
            solution = planner.solve(
                self.budget,
                solver=self.solver,
                time_limit_s=self.time_limit_s,
                selective=self.selective,
            )
            step = planner.step_seconds + planner.recompute_seconds(
                solution.segments, solution.kept or ()
            )
            row = dataclasses.replace(
                row,
                predicted_step_seconds=step,
                samples_per_second=size / step if step > 0 else None,
            )
        self.full[size] = planned
        self.candidates[size] = row
        return planned

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
        self.candidates.pop(size, None)
        return refused

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

    def full_below(self, size: int) -> _Planned:
        """The largest size below ``size`` planned in full that the model takes."""
        below = self.plan(size - self.multiple_of, full=True)
        while below.refused is not None:  # the smallest refused raises BatchSizeError
            below = self.plan(below.size - self.multiple_of, full=True)
        return below

    def _limit(self, refused: int) -> None:
        """NOTE [fit: refused sizes]: ``refused`` was refused by the probe (an index past a
        table, which fake tensors do not check) where shapes alone took it, so shapes alone
        cannot find the model's limit: it is bisected planning in full, between the largest
        size taken in full (or ``multiple_of``) and ``refused``, all sizes whose shapes fit
        the budget. From the smallest refused up, every size is then taken as refused."""
        m = self.multiple_of
        took = [n for n, p in self.full.items() if p.refused is None and n < refused]
        low = max(took) if took else self.plan(m, full=True).size  # m refused: BatchSizeError
        high = refused
        while high - low > m:
            middle = _between(low, high, m)
            if self.plan(middle, full=True).refused is None:
                low = middle
            else:
                high = middle
        self.limit = high
        for n, planned in list(self.shapes.items()):
            if n >= high and planned.refused is None:
                self.shapes[n] = _Planned(n, None, None, f"above {high}, which the model refused")
                self.candidates.pop(n, None)

    def largest(self) -> _Planned:
        """The largest size that fits (module docstring); raises InfeasibleBudgetError when
        even ``multiple_of`` does not.

        Sizes are bracketed from shapes alone, where no node runs (workspaces only add to a
        plan's peak, so a size whose shapes already put its leanest plan over the budget does
        not fit); the answer is then planned in full, and while its workspaces put it over,
        the bracket is searched again under the budget less what they added."""
        m = self.multiple_of
        budget = self.budget
        for _ in range(_MAX_PLANS):
            size = self._bracket(budget)
            if size == 0:
                break
            answer = self.plan(size, full=True)
            if answer.refused is not None:  # by the probe, where shapes alone took it
                self._limit(size)
                continue
            if answer.minimum <= self.budget:
                return self._above(answer)
            extra = answer.minimum - self.shapes[size].minimum  # what the probe added
            budget = min(budget, self.budget - extra) - 1
        low = self.plan(m, full=True)
        if low.minimum <= self.budget:
            return self._above(low)
        raise InfeasibleBudgetError(
            self.budget,
            low.minimum,
            low.ready.breakdown,
            "total",
            f"Even a batch of {m} does not fit: its leanest plan needs the minimum stated. "
            "Raise the budget, shrink what checkpointing cannot touch (parameters, the "
            "optimizer's state: a lighter optimizer, sharding), or shorten the sequence.",
        )

    def _bracket(self, budget: int) -> int:
        """The largest size whose leanest plan, from shapes alone, fits ``budget`` (0: not
        even ``multiple_of``): the secant search of the module docstring."""
        m = self.multiple_of
        fitting = sorted(n for n, p in self.shapes.items() if p.minimum <= budget)
        above = sorted(n for n, p in self.shapes.items() if p.minimum > budget)
        if not fitting:
            low = self.plan(m, full=False)
            if low.minimum > budget:
                return 0
            fitting = [m]
        low = self.shapes[fitting[-1]]
        high = next((self.shapes[n] for n in above if n > low.size), None)
        for _ in range(_MAX_PLANS):
            if self.cap is not None and low.size + m > self.cap:
                self.notes.append(
                    f"max_batch_size {self.cap} reached while the batch still fits: larger "
                    "ones were not tried"
                )
                return low.size
            if high is not None and high.size - low.size <= m:
                return low.size
            planned = self.plan(self._guess(low, high, budget), full=False)
            if planned.minimum <= budget:
                low = planned
            else:
                high = planned
        self.notes.append(f"stopped after planning {_MAX_PLANS} sizes from shapes alone")
        return low.size

    def _above(self, answer: _Planned) -> _Planned:
        """``answer``, once the size above it is known not to fit: from shapes alone when
        they already put it over the budget, else planned in full (and then, should it fit
        after all, the search goes on up one size at a time)."""
        m = self.multiple_of
        for _ in range(_MAX_PLANS):
            above = answer.size + m
            if self.cap is not None and above > self.cap:
                if not any("max_batch_size" in note for note in self.notes):
                    self.notes.append(
                        f"max_batch_size {self.cap} reached while the batch still fits: "
                        "larger ones were not tried"
                    )
                return answer
            if self.plan(above, full=False).minimum > self.budget:
                return answer
            planned = self.plan(above, full=True)
            if planned.minimum > self.budget:
                return answer
            answer = planned
        return answer

    def _guess(self, low: _Planned, high: _Planned | None, budget: int) -> int:
        """The next size to plan: where a straight line through what is known reaches the
        budget, inside ``(low, high)``, a multiple of ``multiple_of``. The line is the secant
        between the two sizes that bracket the answer (or the two largest that fit); from
        one size alone, the line through the part that does not grow with the size."""
        m = self.multiple_of
        below = sorted(n for n, p in self.shapes.items() if n < low.size and p.minimum <= budget)
        if high is not None and high.refused is None:
            slope = (high.minimum - low.minimum) / (high.size - low.size)
        elif below:
            other = self.shapes[below[-1]]
            slope = (low.minimum - other.minimum) / (low.size - other.size)
        else:
            slope = _growth_per_size(low.ready, low.size)
        estimate = low.size + (budget - low.minimum) / max(slope, 1e-9)
        guess = m * math.floor(estimate / m)
        if guess <= low.size:
            guess = low.size + m  # the neighbour above the best so far
        if high is not None:
            if high.refused is not None and guess >= high.size:
                guess = _between(low.size, high.size, m)  # the model's limit, not the budget's
            guess = min(guess, high.size - m)
        if self.cap is not None:
            guess = min(guess, m * (self.cap // m))
        if guess in self.shapes:  # the line repeats itself: halve the interval instead
            top = high.size if high is not None else 2 * low.size
            guess = max(low.size + m, m * ((low.size + top) // (2 * m)))
        return guess

    def fastest(self, largest: _Planned) -> _Planned:
        """Among the sizes that fit (the largest, about three quarters and half of it, and
        any planned in full on the way), the one with the most predicted samples per second
        (sizes are planned in full for it: the probe's measured times)."""
        m = self.multiple_of
        for fraction in (0.75, 0.5):
            size = max(m, m * round(fraction * largest.size / m))
            if self.plan(size, full=True).minimum > self.budget:
                continue  # a size that fits in shapes alone may not in full: skip it
        fitting = [
            c
            for c in self.candidates.values()
            if c.fits and c.samples_per_second and not c.estimated
        ]
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


def _growth_per_size(planner: Planner, size: int) -> float:
    """How much the leanest plan's peak grows per unit of size, judged from one size: its
    forward and backward peak (the optimizer's step, which does not grow, left out) above
    what does not grow with the size (parameters, buffers, their gradients, the optimizer's
    state), spread over the size. It errs high (the activations of a small size are no
    smaller than linear), so the first guess lands below the answer, where a planner is not
    wasted: the secant through it and the first size is then close."""
    if (
        planner.nested is not None
    ):  # planned as units (a root not captured whole): the line through the origin
        return planner.minimum_peak_bytes / size
    prof = planner.profile
    lean = planner.search.leanest()
    node_ranges, stash = planner.predictor.node_ranges(lean.segments)
    curve = replay.timeline(planner.trace, node_ranges, stash, lean.kept or None)
    working = max(b for phase, _, b in curve if phase != replay.OPTIMIZER)
    resident = dict(planner.trace.resident)
    gradients = resident.pop(ACCUMULATED_GRADIENTS, prof.param_grad_bytes)
    fixed = prof.param_bytes + prof.buffer_bytes + gradients + sum(resident.values())
    return max(working - fixed, prof.input_bytes, 1) / size


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)
