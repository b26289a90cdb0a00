"""Tests for the torch-free ``solvers`` package.

Reference values are computed by hand from the model in ``solvers/chain.py``; property
tests compare every method with brute force over all plans of small chains.
"""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from functools import cache

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import solvers
from solvers import METHODS, ChainProblem, Simulation, Solution, minimum_peak_bytes, simulate, solve
from solvers._kernels import ChainArrays
from solvers.greedy import chen_segments
from solvers.sqrt import sqrt_plan

# ---------------------------------------------------------------------------------------
# Hand-computed reference: 3 stages
#   s = (10, 20, 30), a = (1, 2, 3) (a_3 = 0), t = (4, 5, 6), g = (1, 2, 3)
#   G = (6, 5, 3, 0), static = 1000, f = (1, 2, 3), overhead 0.5 s per segment.
# ---------------------------------------------------------------------------------------


def tiny(budget: int = 10_000) -> ChainProblem:
    return ChainProblem(
        [10, 20, 30],
        [1, 2, 3],
        [1.0, 2.0, 3.0],
        budget,
        static_bytes=1000,
        transient_bytes=[4, 5, 6],
        param_grad_bytes=[1, 2, 3],
        segment_overhead_seconds=0.5,
    )


def test_simulate_no_segments_by_hand() -> None:
    sim = simulate(tiny(), [])
    assert sim.timeline == (
        ("forward", 0, 1000 + 0 + 1 + 10 + 4 + 2),  # 1017
        ("forward", 1, 1000 + 10 + 2 + 20 + 5 + 3),  # 1040
        ("forward", 2, 1000 + 30 + 3 + 30 + 6 + 0),  # 1069
        ("backward", 2, 1000 + 30 + 30 + 0 + 3 + 6 + 3),  # 1072
        ("backward", 1, 1000 + 10 + 20 + 3 + 2 + 5 + 5),  # 1045
        ("backward", 0, 1000 + 0 + 10 + 2 + 1 + 4 + 6),  # 1023
    )
    assert (sim.peak_bytes, sim.peak_stage, sim.peak_phase) == (1072, 2, "backward")
    assert (sim.forward_peak_bytes, sim.backward_peak_bytes) == (1069, 1072)
    assert sim.recompute_seconds == 0.0


def test_simulate_one_segment_by_hand() -> None:
    # Segment [1, 3): stage 0 kept (stores 10), the segment stores a_1 = 2.
    sim = simulate(tiny(), [(1, 3)])
    assert sim.timeline == (
        ("forward", 0, 1017),
        ("forward", 1, 1000 + 10 + 0 + 2 + 20 + 5 + 3),  # 1040: m == i holds no a_i
        ("forward", 2, 1000 + 10 + 2 + 3 + 30 + 6 + 0),  # 1051
        ("recompute", 1, 1010 + 2 + 0 + 0 + 20 + 5 + 3 + 0),  # 1040: waits a_3 + G(3) = 0
        ("recompute", 2, 1010 + 2 + 20 + 3 + 30 + 6 + 0 + 0),  # 1071
        ("backward", 2, 1010 + 2 + 50 + 0 + 3 + 6 + 3),  # 1074
        ("backward", 1, 1010 + 2 + 20 + 3 + 2 + 5 + 5),  # 1047
        ("backward", 0, 1023),
    )
    assert (sim.peak_bytes, sim.peak_stage, sim.peak_phase) == (1074, 2, "backward")
    assert (sim.forward_peak_bytes, sim.backward_peak_bytes) == (1051, 1074)
    assert sim.recompute_seconds == pytest.approx(2.0 + 3.0 + 0.5)


def test_simulate_all_in_one_segment_by_hand() -> None:
    sim = simulate(tiny(), [(0, 3)])
    assert [e[2] for e in sim.timeline] == [
        1000 + 0 + 1 + 10 + 4 + 2,  # forward 0: 1017
        1000 + 1 + 2 + 20 + 5 + 3,  # forward 1: 1031
        1000 + 1 + 3 + 30 + 6 + 0,  # forward 2: 1040
        1000 + 1 + 0 + 0 + 10 + 4 + 2,  # recompute 0: 1017
        1000 + 1 + 10 + 2 + 20 + 5 + 3,  # recompute 1: 1041
        1000 + 1 + 30 + 3 + 30 + 6 + 0,  # recompute 2: 1070
        1000 + 1 + 60 + 0 + 3 + 6 + 3,  # backward 2: 1073
        1000 + 1 + 30 + 3 + 2 + 5 + 5,  # backward 1: 1046
        1000 + 1 + 10 + 2 + 1 + 4 + 6,  # backward 0: 1024
    ]
    assert [e[0] for e in sim.timeline] == ["forward"] * 3 + ["recompute"] * 3 + ["backward"] * 3
    assert [e[1] for e in sim.timeline] == [0, 1, 2, 0, 1, 2, 2, 1, 0]
    assert (sim.peak_bytes, sim.peak_stage, sim.peak_phase) == (1073, 2, "backward")
    assert sim.recompute_seconds == pytest.approx(6.5)


def test_simulate_segment_waits_for_output_gradient_by_hand() -> None:
    # Segment [0, 2) with stage 2 kept: recompute holds a_2 + G(2) = 6 for the waiting grad.
    sim = simulate(tiny(), [(0, 2)])
    assert sim.timeline == (
        ("forward", 0, 1017),
        ("forward", 1, 1031),
        ("forward", 2, 1000 + 1 + 3 + 30 + 6 + 0),  # 1040: before(2) = a_0
        ("backward", 2, 1000 + 1 + 30 + 0 + 3 + 6 + 3),  # 1043
        ("recompute", 0, 1000 + 1 + 0 + 0 + 10 + 4 + 2 + 6),  # 1023
        ("recompute", 1, 1000 + 1 + 10 + 2 + 20 + 5 + 3 + 6),  # 1047
        ("backward", 1, 1000 + 1 + 30 + 3 + 2 + 5 + 5),  # 1046
        ("backward", 0, 1000 + 1 + 10 + 2 + 1 + 4 + 6),  # 1024
    )
    assert (sim.peak_bytes, sim.peak_stage, sim.peak_phase) == (1047, 1, "recompute")
    assert (sim.forward_peak_bytes, sim.backward_peak_bytes) == (1040, 1047)
    assert sim.recompute_seconds == pytest.approx(3.5)


def test_simulate_peak_is_first_event_reaching_it() -> None:
    p = ChainProblem([5, 5], [0, 0], [1.0, 1.0], 100)
    sim = simulate(p, [])
    # forward 1 (5 + 5) and backward 1 (5 + 5) tie; the earlier event is reported.
    assert (sim.peak_bytes, sim.peak_stage, sim.peak_phase) == (10, 1, "forward")


def test_simulate_validates_segments() -> None:
    p = tiny()
    for bad in (
        [(2, 1)],
        [(1, 1)],
        [(0, 4)],
        [(-1, 2)],
        [(1, 3), (0, 1)],
        [(0, 2), (1, 3)],
        [(0,)],
        [("a", 2)],
        [(0.0, 2)],
    ):
        with pytest.raises(ValueError):
            simulate(p, bad)
    assert simulate(p, [(0, 1), (1, 3)]).peak_bytes > 0  # touching segments are fine


def test_problem_validation_and_defaults() -> None:
    p = ChainProblem([1, 2], (3, 4), np.array([0.5, 1.5]), 100)
    assert p.saved_bytes == (1, 2) and p.input_bytes == (3, 4)
    assert p.forward_seconds == (0.5, 1.5) and p.backward_seconds == (1.0, 3.0)
    assert p.param_grad_bytes == (0, 0) and p.transient_bytes == (0, 0)
    assert p.num_stages == 2 and p.static_bytes == 0
    assert all(type(v) is int for v in p.saved_bytes + p.input_bytes)
    q = p.with_budget(7)
    assert q.budget_bytes == 7 and q.saved_bytes == p.saved_bytes and p.budget_bytes == 100
    assert ChainProblem([2.0], [1], [1], 8e3).budget_bytes == 8000  # integral floats accepted
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.budget_bytes = 3  # type: ignore[misc]
    bad_calls = [
        lambda: ChainProblem([], [], [], 1),
        lambda: ChainProblem([1, 2], [1], [1.0, 1.0], 1),
        lambda: ChainProblem([1], [1], [1.0, 2.0], 1),
        lambda: ChainProblem([-1], [1], [1.0], 1),
        lambda: ChainProblem([1.5], [1], [1.0], 1),
        lambda: ChainProblem([1], [1], [float("nan")], 1),
        lambda: ChainProblem([1], [1], [-1.0], 1),
        lambda: ChainProblem([1], [1], [1.0], -1),
        lambda: ChainProblem([1], [1], [1.0], 1, static_bytes=-1),
        lambda: ChainProblem([1], [1], [1.0], 1, transient_bytes=[1, 2]),
        lambda: ChainProblem([1], [1], [1.0], 1, param_grad_bytes=[-2]),
        lambda: ChainProblem([1], [1], [1.0], 1, backward_seconds=[1.0, 2.0]),
        lambda: ChainProblem([1], [1], [1.0], 1, segment_overhead_seconds=-0.1),
        lambda: p.with_budget(-5),
    ]
    for call in bad_calls:
        with pytest.raises(ValueError):
            call()


def test_unknown_method_lists_valid_ones() -> None:
    with pytest.raises(ValueError, match="auto, dp, ilp, sqrt, greedy"):
        solve(tiny(), "beam")
    assert METHODS == ("auto", "dp", "ilp", "sqrt", "greedy")


def test_public_types() -> None:
    assert dataclasses.is_dataclass(Solution) and dataclasses.is_dataclass(Simulation)
    sol = solve(tiny(budget=1072), "dp")
    assert sol.status == "optimal" and sol.gap == 0.0 and sol.method == "dp"
    assert sol.segments == [] and sol.recompute_seconds == 0.0 and sol.peak_bytes == 1072
    with pytest.raises(dataclasses.FrozenInstanceError):
        sol.status = "feasible"  # type: ignore[misc]
    assert sol.raise_if_infeasible() is sol
    bad = solve(tiny(budget=1000), "dp")
    with pytest.raises(solvers.InfeasibleError):
        bad.raise_if_infeasible(1000)


def test_package_never_imports_torch() -> None:
    code = (
        "import sys, solvers, solvers.dp, solvers.ilp, solvers.greedy, solvers.sqrt; "
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_sqrt_and_chen_shapes() -> None:
    def problem(n: int) -> ChainProblem:
        return ChainProblem([1] * n, [1] * n, [1.0] * n, 10**6)

    assert sqrt_plan(problem(1)) == [(0, 1)]
    assert sqrt_plan(problem(10)) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert len(sqrt_plan(problem(100))) == 10
    cs = np.array([0, 1, 2, 3, 4, 5])
    # Running sum exceeds 2 at the third stage of each run.
    assert chen_segments(cs, 2.0, keep_tail=False) == [(0, 3), (3, 5)]
    assert chen_segments(cs, 2.0, keep_tail=True) == [(0, 3)]


# ---------------------------------------------------------------------------------------
# Brute force over every plan of a small chain
# ---------------------------------------------------------------------------------------


@cache
def all_plans(n: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Every set of sorted, disjoint, non-empty segments of ``0 .. n-1``."""

    def rec(p: int):
        if p == n:
            yield ()
            return
        yield from rec(p + 1)  # stage p kept
        for q in range(p + 1, n + 1):
            for rest in rec(q):
                yield ((p, q), *rest)

    return tuple(rec(0))


def brute_force(problem: ChainProblem) -> list[tuple[tuple[tuple[int, int], ...], Simulation]]:
    return [(plan, simulate(problem, plan)) for plan in all_plans(problem.num_stages)]


def best_cost(table, budget: int) -> float | None:
    costs = [sim.recompute_seconds for _, sim in table if sim.peak_bytes <= budget]
    return min(costs) if costs else None


@st.composite
def chains(draw, max_stages: int = 7) -> ChainProblem:
    n = draw(st.integers(1, max_stages))
    small = st.integers(0, 40)
    return ChainProblem(
        draw(st.lists(small, min_size=n, max_size=n)),
        draw(st.lists(small, min_size=n, max_size=n)),
        # Dyadic values: recompute costs are exact sums, so ties are real ties.
        draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0]), min_size=n, max_size=n)),
        0,
        static_bytes=draw(st.integers(0, 10)),
        param_grad_bytes=draw(st.lists(st.integers(0, 8), min_size=n, max_size=n)),
        transient_bytes=draw(st.lists(st.integers(0, 8), min_size=n, max_size=n)),
        segment_overhead_seconds=draw(st.sampled_from([0.0, 0.0, 0.25])),
    )


def draw_budget(data, table) -> int:
    peaks = sorted({sim.peak_bytes for _, sim in table})
    choice = data.draw(st.sampled_from(["min-1", "peak", "between"]))
    if choice == "min-1":
        return max(0, peaks[0] - 1)
    if choice == "peak":
        return data.draw(st.sampled_from(peaks))
    return data.draw(st.integers(peaks[0], peaks[-1] + 1))


SETTINGS = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def assert_consistent(problem: ChainProblem, sol: Solution) -> Simulation:
    """Every answer reports simulate's numbers and never claims to fit when it does not."""
    sim = simulate(problem, sol.segments)
    assert sol.peak_bytes == sim.peak_bytes
    assert sol.recompute_seconds == sim.recompute_seconds
    assert sol.status in ("optimal", "feasible", "infeasible")
    assert sol.feasible == (sim.peak_bytes <= problem.budget_bytes)
    if sol.status == "optimal":
        assert sol.gap == 0.0
    if sol.status == "infeasible":
        assert sol.gap is None
    assert sol.segments == sorted(sol.segments)
    return sim


@SETTINGS
@given(problem=chains(), data=st.data())
def test_dp_equals_brute_force(problem: ChainProblem, data) -> None:
    table = brute_force(problem)
    problem = problem.with_budget(draw_budget(data, table))
    optimum = best_cost(table, problem.budget_bytes)
    sol = solve(problem, "dp")
    assert_consistent(problem, sol)
    if optimum is None:
        assert sol.status == "infeasible"
        assert sol.peak_bytes == min(sim.peak_bytes for _, sim in table)
        return
    assert sol.status == "optimal" and sol.method == "dp"
    assert math.isclose(sol.recompute_seconds, optimum, rel_tol=1e-12, abs_tol=1e-12)
    # Tie-break: fewest segments among the cheapest fitting plans, then lowest peak.
    cheapest = [
        (len(plan), sim.peak_bytes)
        for plan, sim in table
        if sim.peak_bytes <= problem.budget_bytes
        and math.isclose(sim.recompute_seconds, optimum, rel_tol=1e-12, abs_tol=1e-12)
    ]
    assert (len(sol.segments), sol.peak_bytes) == min(cheapest)
    assert solve(problem, "dp").segments == sol.segments  # deterministic


@SETTINGS
@given(problem=chains(), data=st.data())
def test_baselines_and_auto_never_beat_dp_and_always_fit(problem: ChainProblem, data) -> None:
    table = brute_force(problem)
    problem = problem.with_budget(draw_budget(data, table))
    exact = solve(problem, "dp")
    for method in ("sqrt", "greedy", "auto"):
        sol = solve(problem, method, time_limit_s=10)
        assert_consistent(problem, sol)
        if sol.feasible:
            assert exact.feasible
            assert exact.recompute_seconds <= sol.recompute_seconds + 1e-12
        elif not exact.feasible:
            # No plan fits: every method reports the least achievable peak.
            assert sol.peak_bytes == exact.peak_bytes
    auto = solve(problem, "auto", time_limit_s=10)
    assert auto.status == exact.status
    assert math.isclose(auto.recompute_seconds, exact.recompute_seconds, abs_tol=1e-12)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=chains(max_stages=6), data=st.data())
def test_ilp_equals_dp_when_it_claims_optimal(problem: ChainProblem, data) -> None:
    table = brute_force(problem)
    problem = problem.with_budget(draw_budget(data, table))
    exact = solve(problem, "dp")
    sol = solve(problem, "ilp", time_limit_s=5)
    assert_consistent(problem, sol)
    assert sol.feasible == exact.feasible
    if sol.status == "optimal":
        assert math.isclose(
            sol.recompute_seconds, exact.recompute_seconds, rel_tol=1e-9, abs_tol=1e-12
        )
    elif sol.status == "feasible":
        assert sol.recompute_seconds >= exact.recompute_seconds - 1e-12


@SETTINGS
@given(problem=chains())
def test_minimum_peak_equals_brute_force(problem: ChainProblem) -> None:
    table = brute_force(problem)
    least = min(sim.peak_bytes for _, sim in table)
    peak, plan = minimum_peak_bytes(problem)
    assert peak == least
    assert simulate(problem, plan).peak_bytes == least
    # The plan is the cheapest among minimum-peak plans.
    assert math.isclose(
        simulate(problem, plan).recompute_seconds,
        best_cost(table, least),
        rel_tol=1e-12,
        abs_tol=1e-12,
    )
    assert solve(problem.with_budget(least), "dp").status == "optimal"
    if least > 0:
        below = solve(problem.with_budget(least - 1), "auto")
        assert below.status == "infeasible" and below.peak_bytes == least


@SETTINGS
@given(problem=chains(max_stages=8))
def test_kernel_peaks_equal_simulate(problem: ChainProblem) -> None:
    arrays = ChainArrays(problem)
    for plan in all_plans(problem.num_stages)[::7]:
        assert arrays.plan_peak(plan) == simulate(problem, plan).peak_bytes


# ---------------------------------------------------------------------------------------
# Larger chains (correctness only, no timing assertions)
# ---------------------------------------------------------------------------------------


def random_chain(n: int, seed: int = 0) -> ChainProblem:
    rng = np.random.default_rng(seed)
    a = rng.integers(1 << 20, 8 << 20, n)
    return ChainProblem(
        (a * rng.uniform(1, 4, n)).astype(np.int64).tolist(),
        a.tolist(),
        rng.uniform(0.2e-3, 2e-3, n).tolist(),
        0,
        static_bytes=1 << 30,
        param_grad_bytes=rng.integers(0, 1 << 20, n).tolist(),
        transient_bytes=(a * rng.uniform(0, 1, n)).astype(np.int64).tolist(),
    )


def halfway_budget(problem: ChainProblem) -> ChainProblem:
    least, _ = minimum_peak_bytes(problem)
    most = simulate(problem, []).peak_bytes
    return problem.with_budget(least + (most - least) // 2)


def test_dp_1000_stages_smoke() -> None:
    problem = halfway_budget(random_chain(1000))
    sol = solve(problem, "dp")
    sim = assert_consistent(problem, sol)
    assert sol.status == "optimal" and sim.peak_bytes <= problem.budget_bytes
    greedy = solve(problem, "greedy")
    assert greedy.feasible and sol.recompute_seconds <= greedy.recompute_seconds
    assert 0 < sol.recompute_seconds < sum(problem.forward_seconds)


def test_time_limits_return_fitting_plans() -> None:
    problem = halfway_budget(random_chain(600, seed=3))
    for method in ("dp", "auto"):
        sol = solve(problem, method, time_limit_s=1e-3)
        assert_consistent(problem, sol)
        assert sol.status == "feasible" and sol.gap is None


def test_ilp_100_stages_matches_dp() -> None:
    problem = halfway_budget(random_chain(100, seed=1))
    exact = solve(problem, "dp")
    sol = solve(problem, "ilp", time_limit_s=20)
    assert_consistent(problem, sol)
    assert sol.feasible and sol.recompute_seconds >= exact.recompute_seconds - 1e-12
    if sol.status == "optimal":
        assert math.isclose(sol.recompute_seconds, exact.recompute_seconds, rel_tol=1e-9)
    else:
        assert sol.gap is None or sol.gap >= 0
