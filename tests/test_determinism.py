"""Deterministic plans: the same model, inputs, budget and solver give the same plan in
every process, also when the processes compete for the machine and measure at the same
moment: plans are ranked by measured seconds, and the first process to store them decides
for all (NOTE [timing: stored]); with nothing stored, by the deterministic cost model."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_PLAN_ONE = r"""
import json, sys, warnings
warnings.simplefilter("ignore")
import torch
import autockpt
from autockpt.api import Planner
from autockpt.zoo import ZOO

name, fraction = sys.argv[1], float(sys.argv[2])
model, example = ZOO[name]()
planner = Planner(model, example)
budget = planner.minimum_peak_bytes + fraction * (
    planner.no_checkpoint_peak_bytes - planner.minimum_peak_bytes
)
plan = planner.optimize(budget_gb=budget / autockpt.errors.GIB).plan
print(json.dumps({
    "segments": [[s.first_node, s.last_node] for s in plan.segments],
    "predicted": plan.predicted_peak_bytes,
    "minimum": plan.minimum_peak_bytes,
    "step_seconds": plan.predicted_step_seconds,
}))
"""


def _plans_in_parallel(name: str, fraction: float, processes: int, store: str) -> list[dict]:
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", AUTOCKPT_CACHE_DIR=store)
    running = [
        subprocess.Popen(
            [sys.executable, "-c", _PLAN_ONE, name, str(fraction)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(processes)
    ]
    results = []
    for proc in running:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


@pytest.mark.parametrize("name", ["gpt", "resnet"])
def test_three_processes_on_a_busy_machine_make_the_same_plan(name, tmp_path):
    """gpt has dropout (random segments), resnet BatchNorm (restored buffers); three
    planners start at once on two cores with an empty store, so each measures its own node
    times; one stores them first and all three rank (and report) by those."""
    results = _plans_in_parallel(name, 0.4, 3, str(tmp_path))
    assert results[0]["segments"], "the budget should need checkpointing"
    for other in results[1:]:
        assert other["segments"] == results[0]["segments"]
        assert other["predicted"] == results[0]["predicted"]
        assert other["minimum"] == results[0]["minimum"]
        assert other["step_seconds"] == results[0]["step_seconds"]
    # one file of node seconds, one of step factors (NOTE [timing: step factors])
    stored = sorted(path.name for path in (tmp_path / "timing").iterdir())
    assert len(stored) == 2 and stored[0].endswith(".json") and stored[1].endswith(".step.json")


@pytest.mark.slow
def test_with_nothing_stored_three_processes_make_the_same_plan():
    """``AUTOCKPT_CACHE_DIR=""``: nothing stored, the cost model ranks; the measured times
    (reported) differ from process to process, the plan does not."""
    results = _plans_in_parallel("gpt", 0.4, 3, "")
    assert results[0]["segments"], "the budget should need checkpointing"
    for other in results[1:]:
        assert other["segments"] == results[0]["segments"]
        assert other["predicted"] == results[0]["predicted"]
    assert len({r["step_seconds"] for r in results}) > 1
