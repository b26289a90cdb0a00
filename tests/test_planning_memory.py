"""Planning fits where the plan fits: planning a model may not take more memory than the plan
it returns may.

The bound (``benchmarks.planning.planning_bound``): ``max(budget, stated minimum)`` plus a
slack of ``max(5% of that, 64 MiB)``. The budget lies 35% of the way from the planner's
stated minimum (the leanest plan's peak) to the no-checkpoint peak: the plain step alone
needs about twice that here, so a planner that runs the un-checkpointed step with real
tensors cannot fit the bound.

How it is measured (``benchmarks.planning.run_window``; its module docstring has the
details): a fresh Python process plans a tiny model of the same kind first (imports, the
profiler's and OpenMP's one-time set-up stay outside), builds the model and inputs without
running a step, collects garbage and trims the C heap, then reads its resident size and
resets its resident high-water mark; it plans (``Planner`` + ``optimize``, what
``autockpt.optimize`` does) and reads the high-water mark again. The increase is compared
with the bound less the static bytes that exist before planning starts (parameters, buffers,
inputs), which the budget counts but the increase cannot contain.

What the resident size includes, and why each part is handled as it is:

* the high-water mark is the process's own ``VmHWM``, reset as planning starts, not
  ``getrusage(RUSAGE_SELF).ru_maxrss``: a child process inherits its parent's ``maxrss``
  (a pytest process that once held 2 GiB would make every child report 2 GiB and hide the
  window), and ``ru_maxrss`` cannot be reset;
* the C allocator's cache: glibc's dynamic mmap threshold keeps freed blocks of up to 32 MiB
  resident in its heap, which left one eager step ~10% above its allocator-level peak; the
  measuring process fixes the threshold (``MALLOC_MMAP_THRESHOLD_``), so the resident
  increase of an eager step equals its allocator-level peak to about 1 MiB -- checked here
  on every run, so a broken instrument fails rather than passes;
* Python's own objects (graphs, profiles, profiler event lists) are in the increase: they
  are planning's cost too, and the slack is there for them.

The same process then checks the returned model: one step gives eager's loss and gradients,
and its measured peak (``autockpt.measure``) is under the budget. The same harness around one
plain eager step is printed next to planning's number.

The model (``benchmarks.planning.residual_mlp``): residual ``LayerNorm -> Linear(w, 4w) ->
GELU -> Linear(4w, w)`` blocks, activations 99% of the eager peak. Default run: batch 16384
(eager peak ~252 MiB); ``-m slow``: batch 49152 (~755 MiB).
"""

from __future__ import annotations

import pytest

from benchmarks.planning import HEAVY, MIB, Case, WindowResult, _interleaved, run_window

SMALL = Case("residual_mlp_16k", HEAVY.factory, {"batch": 16384}, HEAVY.warmup)


def _mib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / MIB:.1f} MiB"


def _report(plan: WindowResult, eager: WindowResult) -> str:
    return (
        f"{plan.model}: planning +{_mib(plan.rss_increase_bytes)} resident in "
        f"{plan.window_seconds:.1f} s; allowed +{_mib(plan.allowed_increase_bytes)} (bound "
        f"{_mib(plan.bound_bytes)} = max(budget {_mib(plan.budget_bytes)}, stated minimum "
        f"{_mib(plan.minimum_peak_bytes)}) + slack, less static {_mib(plan.static_bytes)}); "
        f"one eager step: +{_mib(eager.rss_increase_bytes)} resident, measured peak "
        f"{_mib(eager.eager_peak_bytes)}; plan: predicted {_mib(plan.predicted_peak_bytes)}, "
        f"measured {_mib(plan.measured_peak_bytes)} [{plan.rss_source}]"
    )


@pytest.mark.parametrize(
    "case",
    [SMALL, pytest.param(HEAVY, marks=pytest.mark.slow)],
    ids=lambda case: case.name,
)
def test_planning_fits_where_the_plan_fits(case: Case) -> None:
    eager = run_window(case, "eager")
    plan = run_window(case, "plan")
    print(_report(plan, eager))

    # The model is one whose activations dominate the step.
    assert eager.eager_peak_bytes is not None and eager.activation_share is not None
    assert eager.activation_share >= 0.8, _report(plan, eager)
    # The instrument sees a step: one eager step's resident increase is its allocator-level
    # peak above the static bytes (activations and gradients), to within 5% or 16 MiB.
    above_static = eager.eager_peak_bytes - eager.static_bytes
    assert abs(eager.rss_increase_bytes - above_static) <= max(0.05 * above_static, 16 * MIB), (
        _report(plan, eager)
    )

    # The returned model trains like the original and fits its budget.
    assert plan.trains_like_eager, plan.train_error
    assert plan.budget_bytes is not None and plan.measured_peak_bytes is not None
    assert plan.measured_peak_bytes <= plan.budget_bytes, _report(plan, eager)

    # Planning took no more than the plan may.
    assert plan.allowed_increase_bytes is not None
    assert plan.rss_increase_bytes <= plan.allowed_increase_bytes, _report(plan, eager)


def test_the_benchmark_times_each_step_right_after_itself() -> None:
    """The shared interleaving (NOTE [timing: interleaved rounds]): a warm-up of each step,
    then per round, starting one step later each time, every step twice in a row."""
    calls: list[str] = []
    medians = _interleaved(
        {"eager": lambda: calls.append("e"), "plan": lambda: calls.append("p")}, 2
    )
    assert "".join(calls) == "ep" + "eepp" + "ppee"
    assert set(medians) == {"eager", "plan"} and all(v >= 0 for v in medians.values())
