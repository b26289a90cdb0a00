"""The chain model: problem description, memory/cost model and its reference simulator.

Every solver in this package is scored by :func:`simulate`; the numpy kernels in
:mod:`solvers._kernels` are a vectorised restatement of the same formulas and the tests
check them against this file.

Why this model
--------------
A model is cut into stages ``0 .. L-1`` that run in order. Checkpointing follows the
semantics of non-reentrant ``torch.utils.checkpoint``:

* A checkpointed *segment* ``[i, j)`` runs its forward without keeping the tensors that
  its stages would normally save for backward; the recompute closure keeps the segment's
  *input* alive instead (``a_i`` bytes).
* When backward reaches the segment, it recomputes the whole segment ``i .. j-1`` from
  that input, and every recomputed saved tensor stays alive until the backward of its own
  stage frees it. So during recompute the saved tensors of the segment accumulate, and
  during the segment's backward they drain again from ``j-1`` down to ``i``.
* A stage that is not in any segment is *kept*: it stores its saved tensors ``s_k`` from
  its forward until its backward.

Notation
--------
``s_k`` saved bytes, ``a_k`` input bytes (``a_L = 0``: nothing enters the stage after the
last one), ``t_k`` transient bytes (workspace that only exists while stage ``k`` runs),
``g_k`` parameter-gradient bytes, ``f_k`` forward seconds, ``static`` = ``static_bytes``
(weights, optimizer state, anything resident for the whole step).

A plan partitions the stages into *units*: every kept stage ``k`` is the unit
``[k, k+1)`` storing ``s_k``; every segment ``[i, j)`` is one unit storing ``a_i``.
``before(k)`` is the sum of stored bytes of the units that end at or before ``k``
(entirely before ``k``), and ``G(k) = sum_{m >= k} g_m`` is the parameter gradient that
exists once backward has reached stage ``k`` (gradients persist to the end of the step).

Events (bytes live while the event runs):

* forward of kept stage ``k``:
  ``static + before(k) + a_k + s_k + t_k + a_{k+1}``
* forward of stage ``m`` inside segment ``[i, j)`` (its saved tensors exist while it runs
  and are dropped afterwards; the segment input ``a_i`` is held):
  ``static + before(i) + a_i*[m != i] + a_m + s_m + t_m + a_{m+1}``
* backward of kept stage ``k`` (gradient ``a_{k+1}`` arriving, gradient ``a_k``
  produced): ``static + before(k) + s_k + a_{k+1} + a_k + t_k + G(k)``
* recompute of stage ``m`` of segment ``[i, j)`` (the gradient ``a_j`` of the segment
  output waits meanwhile):
  ``static + before(i) + a_i + sum_{i<=n<m} s_n + a_m*[m != i] + s_m + t_m + a_{m+1}
  + a_j + G(j)``
* backward of stage ``m`` of segment ``[i, j)``, ``m = j-1 .. i``:
  ``static + before(i) + a_i + sum_{i<=n<=m} s_n + a_{m+1} + a_m + t_m + G(m)``

The peak is the maximum over all events. Timeline order: forward of stages ``0 .. L-1``,
then the units in reverse order (a segment: recompute ``i .. j-1``, then backward
``j-1 .. i``). A plan *fits* a budget when ``peak_bytes <= budget_bytes``.

Recompute cost: ``sum of f_k over checkpointed stages + segment_overhead_seconds *
number_of_segments``.

Key property (used by the exact solvers): every event of a unit ``u`` equals
``static + before(start(u)) + local(u)`` where ``local`` depends only on the unit (and
the fixed suffix ``G``). Units after ``u`` are not yet created during its forward and
already freed during its backward. Hence feasibility decomposes over prefixes:
``peak = static + max_u (before(start(u)) + local(u))``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

__all__ = ["ChainProblem", "Simulation", "simulate", "normalize_segments"]

Segment = tuple[int, int]
PHASES = ("forward", "recompute", "backward")


def _as_byte_count(name: str, value: object) -> int:
    """Return ``value`` as a non-negative Python int (integral floats are accepted)."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer byte count, got {value!r}")
    if isinstance(value, numbers.Integral):
        out = int(value)
    elif (
        isinstance(value, numbers.Real)
        and math.isfinite(float(value))
        and float(value).is_integer()
    ):
        out = int(value)
    else:
        raise ValueError(f"{name} must be an integer byte count, got {value!r}")
    if out < 0:
        raise ValueError(f"{name} must be >= 0, got {out}")
    return out


def _as_seconds(name: str, value: object) -> float:
    """Return ``value`` as a finite, non-negative float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a real number of seconds, got {value!r}")
    out = float(value)
    if not math.isfinite(out) or out < 0:
        raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
    return out


def _byte_tuple(name: str, values: Iterable[object], length: int | None) -> tuple[int, ...]:
    out = tuple(_as_byte_count(f"{name}[{k}]", v) for k, v in enumerate(values))
    if length is not None and len(out) != length:
        raise ValueError(f"{name} has {len(out)} entries, expected {length} (one per stage)")
    return out


def _seconds_tuple(name: str, values: Iterable[object], length: int) -> tuple[float, ...]:
    out = tuple(_as_seconds(f"{name}[{k}]", v) for k, v in enumerate(values))
    if len(out) != length:
        raise ValueError(f"{name} has {len(out)} entries, expected {length} (one per stage)")
    return out


@dataclass(frozen=True)
class ChainProblem:
    """A chain of ``L`` stages and a peak-memory budget (see the module docstring).

    Byte quantities are stored as tuples of Python ``int`` and times as tuples of
    ``float``; construction validates lengths and signs and raises ``ValueError``.
    ``backward_seconds`` defaults to ``2 * forward_seconds``; ``param_grad_bytes`` and
    ``transient_bytes`` default to zeros. ``backward_seconds`` does not enter the
    recompute cost (backward runs once whatever the plan) and is kept for reporting.
    """

    saved_bytes: tuple[int, ...]
    input_bytes: tuple[int, ...]
    forward_seconds: tuple[float, ...]
    budget_bytes: int
    backward_seconds: tuple[float, ...] | None = field(default=None, kw_only=True)
    static_bytes: int = field(default=0, kw_only=True)
    param_grad_bytes: tuple[int, ...] | None = field(default=None, kw_only=True)
    transient_bytes: tuple[int, ...] | None = field(default=None, kw_only=True)
    segment_overhead_seconds: float = field(default=0.0, kw_only=True)

    def __post_init__(self) -> None:
        saved = _byte_tuple("saved_bytes", self.saved_bytes, None)
        n = len(saved)
        if n < 1:
            raise ValueError("a chain needs at least one stage (saved_bytes is empty)")
        inputs = _byte_tuple("input_bytes", self.input_bytes, n)
        forward = _seconds_tuple("forward_seconds", self.forward_seconds, n)
        if self.backward_seconds is None:
            backward = tuple(2.0 * f for f in forward)
        else:
            backward = _seconds_tuple("backward_seconds", self.backward_seconds, n)
        grads = (
            (0,) * n
            if self.param_grad_bytes is None
            else _byte_tuple("param_grad_bytes", self.param_grad_bytes, n)
        )
        transient = (
            (0,) * n
            if self.transient_bytes is None
            else _byte_tuple("transient_bytes", self.transient_bytes, n)
        )
        setattr_ = object.__setattr__
        setattr_(self, "saved_bytes", saved)
        setattr_(self, "input_bytes", inputs)
        setattr_(self, "forward_seconds", forward)
        setattr_(self, "backward_seconds", backward)
        setattr_(self, "param_grad_bytes", grads)
        setattr_(self, "transient_bytes", transient)
        setattr_(self, "budget_bytes", _as_byte_count("budget_bytes", self.budget_bytes))
        setattr_(self, "static_bytes", _as_byte_count("static_bytes", self.static_bytes))
        setattr_(
            self,
            "segment_overhead_seconds",
            _as_seconds("segment_overhead_seconds", self.segment_overhead_seconds),
        )

    @property
    def num_stages(self) -> int:
        """Number of stages ``L``."""
        return len(self.saved_bytes)

    def with_budget(self, budget_bytes: int) -> ChainProblem:
        """The same chain under another budget (validated like the constructor)."""
        return replace(self, budget_bytes=budget_bytes)


@dataclass(frozen=True)
class Simulation:
    """Result of :func:`simulate`.

    ``forward_peak_bytes`` is the maximum over forward events; ``backward_peak_bytes`` the
    maximum over recompute and backward events. ``peak_stage``/``peak_phase`` locate the
    first event (in timeline order) that reaches ``peak_bytes``. ``timeline`` holds
    ``(phase, stage, bytes)`` for every event in execution order.
    """

    peak_bytes: int
    recompute_seconds: float
    forward_peak_bytes: int
    backward_peak_bytes: int
    peak_stage: int
    peak_phase: str
    timeline: tuple[tuple[str, int, int], ...]


def normalize_segments(segments: Iterable[Sequence[int]], num_stages: int) -> list[Segment]:
    """Validate ``segments`` against a chain of ``num_stages`` stages.

    Segments must be half-open ``(start, end)`` pairs of ints with
    ``0 <= start < end <= num_stages``, sorted and pairwise disjoint (touching is fine:
    ``(0, 2), (2, 4)`` are two segments). Returns them as a list of int tuples; raises
    ``ValueError`` otherwise. Sorting is required rather than performed so that a caller
    bug (e.g. a reversed list) is reported instead of silently repaired.
    """
    out: list[Segment] = []
    prev_end = 0
    for seg in segments:
        try:
            start, end = seg
        except (TypeError, ValueError):
            raise ValueError(f"segment {seg!r} is not a (start, end) pair") from None
        if not all(
            isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in (start, end)
        ):
            raise ValueError(f"segment {seg!r} must contain integers")
        start, end = int(start), int(end)
        if not 0 <= start < end <= num_stages:
            raise ValueError(
                f"segment ({start}, {end}) must satisfy 0 <= start < end <= {num_stages}"
            )
        if start < prev_end:
            raise ValueError(
                f"segments must be sorted and disjoint; ({start}, {end}) starts before "
                f"the previous segment ends ({prev_end})"
            )
        out.append((start, end))
        prev_end = end
    return out


def plan_units(segments: Sequence[Sequence[int]], num_stages: int) -> list[tuple[int, int, bool]]:
    """Split the chain into ``(start, end, is_segment)`` units, in stage order: each stage
    outside ``segments`` is a kept unit of its own."""
    units: list[tuple[int, int, bool]] = []
    k = 0
    for start, end in segments:
        units.extend((m, m + 1, False) for m in range(k, start))
        units.append((start, end, True))
        k = end
    units.extend((m, m + 1, False) for m in range(k, num_stages))
    return units


def simulate(problem: ChainProblem, segments: Iterable[Sequence[int]]) -> Simulation:
    """Replay one training step of ``problem`` under a plan and measure it exactly.

    ``segments`` lists the checkpointed ``(start, end)`` stage ranges (see
    :func:`normalize_segments`); stages outside them are kept. Runs in ``O(L)`` with exact
    integer arithmetic; this is the reference every solver's answer is reported through.
    """
    n = problem.num_stages
    segs = normalize_segments(segments, n)
    s = problem.saved_bytes
    a = (*problem.input_bytes, 0)
    t = problem.transient_bytes
    g_suffix = [0] * (n + 1)
    for k in range(n - 1, -1, -1):
        g_suffix[k] = g_suffix[k + 1] + problem.param_grad_bytes[k]
    static = problem.static_bytes
    units = plan_units(segs, n)

    timeline: list[tuple[str, int, int]] = []
    before = 0
    for start, end, is_seg in units:
        base = static + before
        if not is_seg:
            k = start
            timeline.append(("forward", k, base + a[k] + s[k] + t[k] + a[k + 1]))
            before += s[k]
            continue
        for m in range(start, end):
            held = a[start] if m != start else 0
            timeline.append(("forward", m, base + held + a[m] + s[m] + t[m] + a[m + 1]))
        before += a[start]

    for start, end, is_seg in reversed(units):
        before -= a[start] if is_seg else s[start]
        base = static + before
        if not is_seg:
            k = start
            timeline.append(("backward", k, base + s[k] + a[k + 1] + a[k] + t[k] + g_suffix[k]))
            continue
        waiting = a[end] + g_suffix[end]
        acc = 0
        for m in range(start, end):
            own_input = a[m] if m != start else 0
            timeline.append(
                (
                    "recompute",
                    m,
                    base + a[start] + acc + own_input + s[m] + t[m] + a[m + 1] + waiting,
                )
            )
            acc += s[m]
        for m in range(end - 1, start - 1, -1):
            timeline.append(
                ("backward", m, base + a[start] + acc + a[m + 1] + a[m] + t[m] + g_suffix[m])
            )
            acc -= s[m]

    peak_phase, peak_stage, peak = timeline[0]
    forward_peak = backward_peak = 0
    for phase, stage, value in timeline:
        if value > peak:
            peak_phase, peak_stage, peak = phase, stage, value
        if phase == "forward":
            forward_peak = max(forward_peak, value)
        else:
            backward_peak = max(backward_peak, value)

    f = problem.forward_seconds
    recompute = math.fsum(f[m] for start, end in segs for m in range(start, end))
    recompute += problem.segment_overhead_seconds * len(segs)
    return Simulation(
        peak_bytes=peak,
        recompute_seconds=recompute,
        forward_peak_bytes=forward_peak,
        backward_peak_bytes=backward_peak,
        peak_stage=peak_stage,
        peak_phase=peak_phase,
        timeline=tuple(timeline),
    )
