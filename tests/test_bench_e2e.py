"""Smoke tests of the end-to-end benchmark (benchmarks/e2e.py) on tiny models.

The full run is `autockpt bench e2e`; here: the hand-written baselines (per-block, selective
per-block with torchtitan's op policy or every matmul kept, checkpoint_sequential) train like
eager, the Llama-style decoder plans and trains like eager, one tiny case runs end to end and
writes its files with a computed budget-violation flag, the target check flags an over-budget
plan, a slow one and a compiled plan over its budget, and the GPU script exits cleanly
without a GPU.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from autockpt.api import Planner
from autockpt.errors import GIB
from autockpt_zoo.toy import block_stack
from benchmarks import e2e
from benchmarks.e2e_models import Case, llama, op_policy, per_block, sequential, sqrt_segments
from tests.conftest import assert_same_step, train_step


def _tiny_stack() -> Case:
    return Case(
        "tiny_stack",
        lambda: block_stack(blocks=6, width=32, batch=256),
        "layers",
        "6-block stack, width 32, batch 256",
    )


def _tiny_llama() -> Case:
    return Case(
        "tiny_llama",
        lambda: llama(
            layers=3, dim=32, heads=4, kv_heads=2, hidden=64, vocab_size=64, batch=2, seq_len=16
        ),
        "layers",
        "3-layer Llama-style decoder",
    )


def _titan(case: Case, model: torch.nn.Module) -> torch.nn.Module:
    return op_policy(case, model)


def _matmuls(case: Case, model: torch.nn.Module) -> torch.nn.Module:
    return op_policy(case, model, every_other=False)


@pytest.mark.parametrize(
    "wrap",
    [per_block, _titan, _matmuls, sequential],
    ids=["per_block", "titan_sac", "matmul_sac", "sequential"],
)
@pytest.mark.parametrize("make", [_tiny_stack, _tiny_llama], ids=["stack", "llama"])
def test_hand_written_baselines_train_like_eager(make, wrap) -> None:
    case = make()
    eager, inputs = case.build()
    wrapped, _ = case.build()
    wrapped = wrap(case, wrapped)
    kinds = {type(m).__name__ for m in wrapped.modules()}
    assert kinds & {"CheckpointedBlock", "SequentialCheckpointed"}
    expected, got = train_step(eager, inputs), train_step(wrapped, inputs)
    torch.testing.assert_close(got["loss"], expected["loss"], rtol=1e-5, atol=1e-6)
    # Wrapping renames parameters (``layers.0.inner...``); they keep their order.
    assert len(got["grads"]) == len(expected["grads"]) > 0
    for mine, ref in zip(got["grads"].values(), expected["grads"].values(), strict=True):
        torch.testing.assert_close(mine, ref, rtol=1e-4, atol=1e-6)
    assert torch.equal(got["rng"], expected["rng"])


class _CountProjections(TorchDispatchMode):
    """Counts the matmuls a Linear dispatches to (``aten.mm`` / ``aten.addmm``) that run."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            self.calls += 1
        return func(*args, **(kwargs or {}))


def test_titan_policy_recomputes_every_second_projection_only() -> None:
    """Per block of the tiny Llama (7 projections: q, k, v, o, gate, up, down), per-block
    checkpointing recomputes 6 (recomputation stops once the last tensor backward needs,
    ``down``'s input, is back), torchtitan's policy 3 (k, o, gate: every second) and keeping
    every matmul none (their gradients equal eager's: the test above)."""
    case = _tiny_llama()
    counts = {}
    for name, wrap in (
        ("eager", None),
        ("per_block", per_block),
        ("titan", _titan),
        ("matmuls", _matmuls),
    ):
        model, inputs = case.build()
        if wrap is not None:
            wrap(case, model)
        with _CountProjections() as counter:
            train_step(model, inputs)
        counts[name] = counter.calls - (0 if name == "eager" else counts["eager"])
    layers = 3
    assert counts == {
        "eager": counts["eager"],
        "per_block": 6 * layers,
        "titan": 3 * layers,
        "matmuls": 0,
    }


def test_sequential_refuses_a_model_that_is_not_a_chain() -> None:
    case = Case("u", _tiny_stack().build, "layers", "", sequential_reason="skip connections")
    model, _ = case.build()
    with pytest.raises(ValueError, match="skip connections"):
        sequential(case, model)


def test_sqrt_segments() -> None:
    assert [sqrt_segments(n) for n in (1, 4, 8, 16, 100)] == [1, 2, 3, 4, 10]


def test_llama_plans_and_trains_like_eager() -> None:
    model, inputs = _tiny_llama().build()
    planner = Planner(model, inputs)
    budget = (planner.minimum_peak_bytes + planner.no_checkpoint_peak_bytes) / 2
    fast = planner.optimize(budget_gb=budget / GIB)
    assert fast.plan.measured_peak_bytes <= fast.plan.budget_bytes
    assert_same_step(train_step(model, inputs), train_step(fast, inputs))


def test_one_case_end_to_end_writes_files_and_flags(tmp_path) -> None:
    cells = e2e.run_case(
        _tiny_stack(),
        methods=("none", "per_block", "titan_sac", "auto", "auto_segments", "rockmate"),
        rounds=2,
        device=torch.device("cpu"),
        compile_models=(),
        log=lambda _: None,
    )
    by_method = {}
    for cell in cells:
        by_method.setdefault(cell.method, []).append(cell)
    none, blocks = by_method["none"][0], by_method["per_block"][0]
    assert none.measured_peak_bytes > blocks.measured_peak_bytes  # checkpointing saved memory
    assert none.ratio_to_none == pytest.approx(1.0)
    assert len(blocks.times) == 2 and blocks.ratio_to_none > 0
    planned = [c for c in by_method["auto"] if c.error is None]
    assert planned, [c.error for c in by_method["auto"]]
    labels = {label for c in by_method["auto"] for label in c.budget_label.split("/")}
    assert {"leanest", "per_block_peak", "halfway", "none_peak"} <= labels
    for cell in planned + [c for c in by_method["auto_segments"] if c.error is None]:
        assert cell.over_budget is (cell.measured_peak_bytes > cell.budget_bytes)
        assert cell.over_budget is False  # autockpt never exceeds its budget
    titan = by_method["titan_sac"][0]
    assert titan.error is None, titan.error
    # (On this stack titan's policy keeps Linear1's output next to ReLU's, which eager keeps
    # anyway: its peak is above no checkpointing's, so it adds no budget here.)
    assert titan.measured_peak_bytes > 0 and len(titan.times) == 2
    # A peer that cannot run here still gets its rows, each with the reason.
    for cell in by_method["rockmate"]:
        if cell.error is not None:
            assert "rockmate" in cell.error.lower()

    targets = e2e.evaluate_targets(cells)
    never = [t for t in targets if t.target == "never over budget"]
    assert {t.method for t in never} == {"auto", "auto_segments"} and all(t.met for t in never)
    best = [t for t in targets if t.target.startswith("step <= fastest of")]
    assert best and all(t.value is not None and "fastest: " in t.note for t in best)
    for cell in (c for c in cells if c.wall_times):
        spread = (max(cell.wall_times) - min(cell.wall_times)) / cell.wall_step_seconds
        assert cell.wall_spread == pytest.approx(spread)
    e2e.write(cells, targets, tmp_path, {"command": "test"})
    payload = json.loads((tmp_path / "e2e.json").read_text())
    assert len(payload["cells"]) == len(cells)
    assert payload["cells"][1]["times"] == blocks.times
    assert payload["cells"][1]["wall_times"] == blocks.wall_times
    assert {t["target"] for t in payload["targets"]} >= {"never over budget"}
    with open(tmp_path / "e2e.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == len(cells) and "over_budget" in rows[0]
    assert (tmp_path / "e2e_frontier.png").stat().st_size > 0
    assert (tmp_path / "e2e_budget.png").stat().st_size > 0
    assert "### Targets" in (tmp_path / "summary.md").read_text()
    headline = (tmp_path / "headline.md").read_text()
    assert "tiny_stack" in headline and "per-block" in headline


def test_rounds_time_a_step_that_follows_its_own_step() -> None:
    """In a training loop a step follows the same model's step; every timed step of the
    rounds does too, while the rounds still rotate the cells (docs/design.md "One time
    model")."""
    calls: list[tuple[str, bool]] = []  # (cell, being timed)
    timing = [False]
    runners = [
        e2e._Runner(e2e.Cell("m", name), lambda name=name: calls.append((name, timing[0])))
        for name in ("a", "b", "c")
    ]
    timed = e2e._timed

    def spy(step, device):
        timing[0] = True
        try:
            return timed(step, device)
        finally:
            timing[0] = False

    e2e._timed, saved = spy, e2e._timed
    try:
        e2e._interleave(runners, rounds=3, device=torch.device("cpu"))
    finally:
        e2e._timed = saved
    assert [c for c, _ in calls[:3]] == ["a", "b", "c"]  # the warm-up round
    rounds = calls[3:]
    assert len(rounds) == 2 * 3 * 3
    for i in range(0, len(rounds), 2):
        (before, timed_before), (after, timed_after) = rounds[i], rounds[i + 1]
        assert before == after and not timed_before and timed_after
    firsts = [rounds[6 * r][0] for r in range(3)]
    assert firsts == ["a", "b", "c"]  # each round starts one cell later
    assert all(len(r.cell.wall_times) == 3 for r in runners)


def test_repeatability_table_sets_planning_against_the_rounds() -> None:
    timed = e2e.Cell(
        "m",
        "auto",
        "leanest",
        10,
        planning_step_seconds=0.3,
        wall_step_seconds=0.2,
        wall_spread=0.25,
        predicted_step_seconds=0.3,
        times=[0.2],
    )
    other = e2e.Cell("m", "none", wall_step_seconds=0.1, wall_spread=0.15, times=[0.1])
    # Predicted 2.0x measured; planning/rounds says the clock alone moved 1.5x, leaving 1.33x.
    slow = e2e.Cell(
        "m",
        "auto",
        "halfway",
        20,
        wall_step_seconds=0.1,
        wall_spread=0.35,
        predicted_step_seconds=0.2,
        times=[0.1],
    )
    text = e2e.repeatability_markdown([other, timed, slow])
    assert (
        "| m | auto leanest | 300.0 | 200.0 | 1.50 | 25% "
        "| 1.50-2.00 (0 of 2 within 15%) | 1.00-1.33 (1 of 2 within 15%) |"
    ) in text
    target = next(
        t for t in e2e._speed_targets("m", [other, timed]) if t.target.startswith("predicted")
    )
    assert target.value == pytest.approx(1.5) and "300.0 ms there" in target.note


def test_targets_flag_an_over_budget_plan_and_a_slow_one() -> None:
    none = e2e.Cell("m", "none", times=[1.0, 1.0])
    blocks = e2e.Cell("m", "per_block", measured_peak_bytes=100, times=[2.0, 2.0])
    at_blocks = e2e.Cell(
        "m",
        "auto",
        "per_block_peak",
        100,
        measured_peak_bytes=101,
        over_budget=True,
        times=[1.5, 1.5],
    )
    halfway = e2e.Cell(
        "m", "auto", "halfway", 150, measured_peak_bytes=140, over_budget=False, times=[1.9, 1.9]
    )
    targets = {t.target: t for t in e2e.evaluate_targets([none, blocks, at_blocks, halfway])}
    assert targets["never over budget"].met is False
    assert targets["step <= 0.90x per-block at per-block's peak"].value == pytest.approx(0.75)
    assert targets["step <= 0.90x per-block at per-block's peak"].met is True
    assert targets["step <= 0.80x per-block halfway to no checkpointing"].met is False


def _timed(cell: e2e.Cell) -> e2e.Cell:
    cell.step_seconds = cell.times[0]
    return cell


def test_targets_compare_with_the_fastest_baseline_that_fits() -> None:
    """At each budget ``auto`` is held to the fastest of titan_sac / per_block /
    auto_segments whose measured peak fits that budget; a faster one that does not fit
    does not count."""
    cells = [
        _timed(e2e.Cell("m", "none", measured_peak_bytes=300, times=[1.0, 1.0])),
        _timed(e2e.Cell("m", "per_block", measured_peak_bytes=100, times=[2.0, 2.0])),
        _timed(e2e.Cell("m", "titan_sac", measured_peak_bytes=180, times=[1.2, 1.2])),
        _timed(
            e2e.Cell(
                "m",
                "auto",
                "per_block_peak",
                100,
                measured_peak_bytes=99,
                over_budget=False,
                plan=[[0, 2]],
                times=[1.5, 1.5],
            )
        ),
        _timed(
            e2e.Cell(
                "m",
                "auto_segments",
                "per_block_peak",
                100,
                measured_peak_bytes=98,
                over_budget=False,
                plan=[[0, 3]],
                times=[1.4, 1.4],
            )
        ),
        _timed(
            e2e.Cell(
                "m",
                "auto",
                "halfway",
                200,
                measured_peak_bytes=190,
                over_budget=False,
                plan=[[0, 1]],
                times=[1.3, 1.3],
            )
        ),
    ]
    best = {
        t.budget_label: t
        for t in e2e.evaluate_targets(cells)
        if t.target.startswith("step <= fastest of")
    }
    # per_block_peak: titan (180 > 100) does not fit; auto_segments is the fastest that does.
    assert best["per_block_peak"].value == pytest.approx(1.5 / 1.4)
    assert best["per_block_peak"].met is False and "auto_segments" in best["per_block_peak"].note
    # halfway: titan fits and is fastest.
    assert best["halfway"].value == pytest.approx(1.3 / 1.2)
    assert "titan_sac" in best["halfway"].note


def test_targets_of_the_compiled_plan() -> None:
    reference = e2e.Cell("m", "compile_0.5", measured_peak_bytes=100, times=[1.0, 1.0])
    over = e2e.Cell(
        "m",
        "compile_auto",
        "compile_0.5_peak",
        100,
        measured_peak_bytes=110,
        over_budget=True,
        times=[0.9, 0.9],
    )
    targets = {t.target: t for t in e2e.evaluate_targets([reference, over])}
    assert targets["within compile_0.5's peak"].value == pytest.approx(1.1)
    assert targets["within compile_0.5's peak"].met is False
    assert targets["step <= compile_0.5"].value == pytest.approx(0.9)
    assert targets["step <= compile_0.5"].met is True
    assert "never over budget" not in targets  # the compiled model has its own budget target


def test_each_compile_point_gets_its_own_compiled_targets() -> None:
    """One ``compile_auto`` cell per compile point, each held to its own point; a cell
    that handed back compile's own partition says so."""
    cells = [
        e2e.Cell("m", "compile_0.1", measured_peak_bytes=90, times=[1.0, 1.0]),
        e2e.Cell("m", "compile_0.3", measured_peak_bytes=120, times=[1.0, 1.0]),
        e2e.Cell(
            "m",
            "compile_auto",
            "compile_0.1_peak",
            90,
            measured_peak_bytes=90,
            times=[1.0, 1.0],
            compile_memory_budget=0.1,
        ),
        e2e.Cell(
            "m", "compile_auto", "compile_0.3_peak", 120, measured_peak_bytes=100, times=[0.8, 0.8]
        ),
    ]
    targets = {(t.budget_label, t.target): t for t in e2e.evaluate_targets(cells)}
    assert targets[("compile_0.1_peak", "step <= compile_0.1")].value == pytest.approx(1.0)
    assert (
        "compile's own partition at 0.1"
        in targets[("compile_0.1_peak", "step <= compile_0.1")].note
    )
    assert targets[("compile_0.3_peak", "step <= compile_0.3")].value == pytest.approx(0.8)
    assert targets[("compile_0.3_peak", "within compile_0.3's peak")].met is True


class _Planner:
    """Records what ``optimize`` was called with."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def optimize(
        self, *, budget_gb: float, solver: str = "auto", verify: bool = True, selective: bool = True
    ) -> Any:
        self.calls.append(dict(solver=solver, verify=verify, selective=selective))


def test_segment_only_rows_ask_for_segment_only_plans() -> None:
    planner = _Planner()
    for method in ("auto", "auto_segments", "greedy"):
        e2e.optimize_row(planner, 2**20, method)
    assert planner.calls == [
        dict(solver="auto", verify=True, selective=True),
        dict(solver="auto", verify=True, selective=False),
        dict(solver="greedy", verify=True, selective=False),
    ]


def test_gpu_benchmark_without_a_gpu_says_so_and_exits_0(tmp_path) -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_WAIT_POLICY": "PASSIVE"}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu", "--out", str(tmp_path / "gpu")],
        cwd=Path(__file__).resolve().parents[1],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().count("\n") == 0 and "no GPU" in done.stdout
    assert not (tmp_path / "gpu").exists()


def test_cli_accepts_bench_e2e() -> None:
    from autockpt.cli import _parser

    args = _parser().parse_args(["bench", "e2e", "--quick", "--out", "x"])
    assert args.which == "e2e" and args.quick


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_one_case_on_cuda_uses_cuda_events_and_allocator_peaks() -> None:
    cells = e2e.run_case(
        _tiny_stack(),
        methods=("none", "per_block", "dp"),
        rounds=2,
        device=torch.device("cuda"),
        compile_models=(),
        log=lambda _: None,
    )
    none = next(c for c in cells if c.method == "none")
    blocks = next(c for c in cells if c.method == "per_block")
    assert none.measured_peak_bytes > blocks.measured_peak_bytes
    assert all(c.over_budget is False for c in cells if c.method == "dp" and c.error is None)
    assert all(t > 0 for t in none.times)
