"""The batch that fits (autockpt/fit.py): the largest size whose leanest plan fits, the size
above it planned and found not to fit, the answer measured within the budget; the fastest
size by predicted samples per second; bad inputs refused with typed errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import autockpt
from autockpt.errors import GIB, BatchSizeError, InfeasibleBudgetError
from autockpt_zoo.toy import block_stack
from tests.conftest import quiet_planner

BUDGET = 6 * 2**20


def _model():
    model, _ = block_stack(blocks=6, width=64, batch=1)
    return model


def make_inputs(n: int) -> torch.Tensor:
    torch.manual_seed(n)
    return torch.randn(4 * n, 64, requires_grad=True)


@pytest.fixture(scope="module")
def largest():
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters())
    fit = autockpt.fit_batch(model, make_inputs, budget_gb=BUDGET / GIB, optimizer=optimizer)
    return model, optimizer, fit


def test_largest_fits_and_the_next_size_does_not(largest):
    model, optimizer, fit = largest
    n = fit.batch_size
    by_size = {c.size: c for c in fit.candidates}
    assert by_size[n].fits and by_size[n].minimum_peak_bytes <= BUDGET
    assert not by_size[n + 1].fits  # planned, not assumed
    again = quiet_planner(model, make_inputs(n + 1), optimizer=optimizer)
    assert again.minimum_peak_bytes > BUDGET
    # the answer's plan ran once, verified: the whole iteration within the budget
    measured = autockpt.measure(fit.model, make_inputs(n), optimizer=optimizer, repeat=0)
    assert measured.peak_bytes <= BUDGET and fit.plan.measured_peak_bytes == measured.peak_bytes
    assert fit.plan.optimizer.name == "AdamW"
    assert len(optimizer.state) == 0  # never stepped
    assert json.loads(json.dumps(fit.to_dict()))["batch_size"] == n


def test_throughput_takes_the_most_samples_per_second():
    model = _model()
    fit = autockpt.fit_batch(
        model, make_inputs, budget_gb=BUDGET / GIB, objective="throughput", multiple_of=2
    )
    fitting = [c for c in fit.candidates if c.fits and not c.estimated]  # planned in full
    best = max(fitting, key=lambda c: (c.samples_per_second, c.size))
    assert fit.batch_size == best.size and fit.batch_size % 2 == 0
    assert len(fitting) >= 3  # the largest, and smaller sizes to weigh against it
    assert fit.plan.measured_peak_bytes <= BUDGET


def test_max_batch_size_bounds_the_search_and_says_so():
    model = _model()
    fit = autockpt.fit_batch(model, make_inputs, budget_gb=BUDGET / GIB, max_batch_size=3)
    assert fit.batch_size == 3
    assert any("max_batch_size 3 reached" in note for note in fit.notes)


def test_a_budget_below_the_smallest_size_states_its_minimum():
    model = _model()
    with pytest.raises(InfeasibleBudgetError, match="Even a batch of 1") as error:
        autockpt.fit_batch(model, make_inputs, budget_gb=2**16 / GIB)
    planner = quiet_planner(model, make_inputs(1))
    assert error.value.minimum_bytes == planner.minimum_peak_bytes


def test_make_inputs_that_fail_or_ignore_the_size_are_refused():
    model = _model()

    def broken(n: int) -> torch.Tensor:
        if n > 1:
            raise RuntimeError("out of data")
        return make_inputs(n)

    with pytest.raises(BatchSizeError, match=r"make_inputs\(\d+\) raised RuntimeError"):
        autockpt.fit_batch(model, broken, budget_gb=BUDGET / GIB)
    with pytest.raises(BatchSizeError, match="same shapes"):
        autockpt.fit_batch(model, lambda n: make_inputs(1), budget_gb=BUDGET / GIB)
    with pytest.raises(ValueError, match="objective"):
        autockpt.fit_batch(model, make_inputs, budget_gb=1.0, objective="fastest")


def test_cli_fit_prints_the_answer(tmp_path):
    spec = tmp_path / "fit_models.py"
    spec.write_text(
        "import torch\n"
        "from autockpt_zoo.toy import block_stack\n"
        "def factory(n=1):\n"
        "    model, _ = block_stack(blocks=6, width=64, batch=1)\n"
        "    return model, torch.randn(4 * n, 64, requires_grad=True)\n"
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "autockpt.cli",
            "fit",
            "fit_models:factory",
            "--budget-gb",
            str(BUDGET / GIB),
            "--optimizer",
            "adamw",
            "--json",
            "--no-plot",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    assert answer["measured_peak_bytes"] <= BUDGET and answer["batch_size"] >= 1
    assert any(
        not c["fits"] and c["size"] == answer["batch_size"] + 1 for c in answer["candidates"]
    )
