"""Smoke tests of the end-to-end benchmark (benchmarks/e2e.py) on tiny models.

The full run is `autockpt bench e2e`; here: the hand-written baselines train like eager, the
Llama-style decoder plans and trains like eager, one tiny case runs end to end and writes its
files with a computed budget-violation flag, and the target check flags an over-budget plan.
"""

from __future__ import annotations

import csv
import json

import pytest
import torch

from autockpt.api import Planner
from autockpt.errors import GIB
from autockpt.zoo import block_stack
from benchmarks import e2e
from benchmarks.e2e_models import Case, llama, per_block, sequential, sqrt_segments
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


@pytest.mark.parametrize("wrap", [per_block, sequential], ids=["per_block", "sequential"])
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
        methods=("none", "per_block", "auto", "rockmate"),
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
    for cell in planned:
        assert cell.over_budget is (cell.measured_peak_bytes > cell.budget_bytes)
        assert cell.over_budget is False  # autockpt never exceeds its budget
    # A peer that cannot run here still gets its rows, each with the reason.
    for cell in by_method["rockmate"]:
        if cell.error is not None:
            assert "rockmate" in cell.error.lower()

    targets = e2e.evaluate_targets(cells)
    never = [t for t in targets if t.target == "never over budget"]
    assert never and all(t.met for t in never)
    e2e.write(cells, targets, tmp_path, {"command": "test"})
    payload = json.loads((tmp_path / "e2e.json").read_text())
    assert len(payload["cells"]) == len(cells)
    assert payload["cells"][1]["times"] == blocks.times
    assert {t["target"] for t in payload["targets"]} >= {"never over budget"}
    with open(tmp_path / "e2e.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == len(cells) and "over_budget" in rows[0]
    assert (tmp_path / "e2e_frontier.png").stat().st_size > 0
    assert (tmp_path / "e2e_budget.png").stat().st_size > 0
    assert "### Targets" in (tmp_path / "summary.md").read_text()
    headline = (tmp_path / "headline.md").read_text()
    assert "tiny_stack" in headline and "per-block" in headline


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
    assert targets["step <= 0.98x per-block at per-block's peak"].value == pytest.approx(0.75)
    assert targets["step <= 0.98x per-block at per-block's peak"].met is True
    assert targets["step <= 0.90x per-block halfway to no checkpointing"].met is False


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
