"""The survey harness (benchmarks/survey.py): its rows say true things.

A surveyed model that works must come out bitwise equal to eager (dropout on, same seed),
measured within the budget, with planning leaving the global generators as found; a model
that fails must become a row naming the stage and the cause, not a crash. The default run
checks the harness in-process on a small residual MLP with dropout; ``-m slow`` runs the real thing
(one process per model, files written) on a Hugging Face model.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn

from benchmarks import survey


class _Block(nn.Module):
    """Pre-norm residual MLP block with dropout (the step draws from the RNG)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(torch.relu(self.up(self.norm(x)))))


class _Stack(nn.Module):
    def __init__(self, width: int = 32, blocks: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(width) for _ in range(blocks))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).sum()


def _stack(**_: object):
    torch.manual_seed(0)
    return _Stack().train(), torch.randn(64, 32)


def test_row_of_a_working_model_is_equal_to_eager_and_within_budget() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        row = survey.survey_one(survey.Model("stack", "torch", _stack, needs=""))
    assert row["status"] == "ok", row.get("error")
    assert row["captured"] and row["capture"] == "fx"
    # the optimized step is the eager step, bit for bit, dropout and RNG included
    assert row["eager_exact"] is True, row
    assert row["eager_max_abs_diff"] == 0.0 and row["eager_rng_differs"] == []
    assert row["planning_moved_rng"] == [] and row["planning_changed_buffers"] == []
    # halfway between the stated minimum and no checkpointing, measured by the allocator
    low, high = row["minimum_peak_bytes"], row["no_checkpoint_peak_bytes"]
    assert low < row["budget_bytes"] < high
    assert row["measured_peak_bytes"] <= row["budget_bytes"]
    assert row["within_budget"] is True and row["segments"] > 0
    assert abs(row["prediction_error"]) < 0.05
    assert row["plan_seconds"] > 0
    # the per-block hand plan: one segment per block, never under the stated minimum
    assert row["block_segments"] == 3
    assert row["per_block_measured_bytes"] >= low


class _Broken(nn.Module):
    """Value-dependent control flow and no submodule to plan inside: nothing captures."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4, 4))

    def forward(self, x):
        if x.sum() > 0:
            return (x @ self.weight).sum()
        return (-x @ self.weight).sum()


def _broken(**_: object):
    return _Broken(), torch.ones(2, 4)


def _unbuildable(**_: object):
    raise RuntimeError("no such config\nsecond line")


@pytest.mark.parametrize(
    ("factory", "stage", "cause"),
    [(_unbuildable, "build", "RuntimeError: no such config"), (_broken, "capture", "TraceError")],
)
def test_a_failure_is_a_row_with_its_stage_and_cause(factory, stage, cause) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        row = survey.survey_one(survey.Model("broken", "torch", factory, needs=""))
    assert row["status"] == "failed"
    assert row["stage"] == stage and row["captured"] is False
    assert row["error"].startswith(cause) and "\n" not in row["error"]
    assert "Traceback" in row["traceback"]


def test_report_counts_and_lists_failures(tmp_path) -> None:
    ok = {
        "model": "a", "family": "torch", "status": "ok", "class": "A", "captured": True,
        "capture": "fx", "nodes": 3, "eager_peak_bytes": 4 << 20, "activation_share": 0.5,
        "budget_bytes": 3 << 20, "predicted_peak_bytes": 3 << 20, "measured_peak_bytes": 3 << 20,
        "prediction_error": 0.0, "within_budget": True, "eager_exact": True,
        "eager_close": True, "plan_seconds": 1.0, "segments": 1,
        "minimum_peak_bytes": 2 << 20,
    }  # fmt: skip
    failed = {"model": "b", "family": "vision", "status": "failed", "stage": "capture",
              "error": "TraceError: x", "captured": False, "class": "B"}  # fmt: skip
    skipped = {"model": "c", "family": "timm", "status": "skipped", "stage": "build",
               "error": "Unavailable: timm is not installed", "captured": False}  # fmt: skip
    rows = [ok, failed, skipped]
    counts = survey.counts(rows)
    assert counts == {
        "models": 3, "skipped": 1, "built": 2, "captured": 1, "planned": 1, "eager_exact": 1,
        "eager_close": 1, "within_budget": 1, "failed": 1,
    }  # fmt: skip
    text = survey.summary_markdown(rows)
    assert "- **b** (failed at capture): `TraceError: x`" in text
    assert "| a | torch | A | fx | 3 | 4.00 | 50% |" in text
    survey._write(rows, tmp_path, 1.0, quick=True)
    assert json.loads((tmp_path / "survey.json").read_text())["counts"] == counts
    assert (tmp_path / "survey.csv").read_text().count("\n") == 4
    assert (tmp_path / "survey.png").stat().st_size > 0


@pytest.mark.slow
def test_quick_survey_runs_each_model_in_its_own_process(tmp_path) -> None:
    pytest.importorskip("transformers")
    rows = survey.run(True, tmp_path, ("hf_gpt2",))
    (row,) = rows
    assert row["status"] == "ok", row.get("error")
    assert row["capture"] == "export"
    assert row["eager_exact"] is True
    assert row["measured_peak_bytes"] <= row["budget_bytes"]
    assert row["process_seconds"] > row["plan_seconds"]
    for name in ("survey.json", "survey.csv", "survey.md", "survey.png"):
        assert (tmp_path / name).exists()
