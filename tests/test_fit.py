"""The batch that fits (autockpt/fit.py): the largest size whose leanest plan fits, the size
above it planned and found not to fit, the answer measured within the budget; the fastest
size by predicted samples per second; sizes the model refuses treated as not fitting; bad
inputs refused with typed errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch import nn

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


def test_a_budget_below_the_smallest_size_states_its_floor_and_runs_nothing():
    """Shapes alone put even the smallest size over the budget: its leanest peak from
    shapes is stated as a floor (every plan lies above it), and nothing ran at it."""
    model = _model()
    with pytest.raises(InfeasibleBudgetError, match="Even a batch of 1") as error:
        autockpt.fit_batch(model, make_inputs, budget_gb=2**16 / GIB)
    shapes = quiet_planner(model, make_inputs(1), probe=False)
    assert error.value.minimum_bytes is None
    assert error.value.floor_bytes == shapes.minimum_peak_bytes
    planner = quiet_planner(model, make_inputs(1))
    assert error.value.floor_bytes <= planner.minimum_peak_bytes
    # the smallest size's minimum is a budget that succeeds: the smallest size, verified
    fit = autockpt.fit_batch(model, make_inputs, budget_gb=planner.minimum_peak_bytes / GIB)
    assert fit.batch_size == 1 and fit.plan.budget_bytes == planner.minimum_peak_bytes
    assert fit.plan.measured_peak_bytes <= fit.plan.budget_bytes


class _Positions(nn.Module):
    """A tiny model with a table of ``rows`` positions: the size is the sequence length.
    ``"slice"`` adds ``pos[:T]`` (past the table the fake step fails to broadcast);
    ``"embedding"`` looks positions up (fake tensors do not check indices: the probe fails)."""

    def __init__(self, how: str, rows: int = 256, dim: int = 16) -> None:
        super().__init__()
        self.how = how
        self.pos = nn.Parameter(torch.randn(rows, dim) * 0.02)
        self.lin = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        if self.how == "slice":
            return self.lin(x + self.pos[:length])
        return self.lin(x + nn.functional.embedding(torch.arange(length), self.pos))


def _sequences(n: int) -> torch.Tensor:
    torch.manual_seed(n)
    return torch.randn(2, n, 16)


def _square(y: torch.Tensor) -> torch.Tensor:
    return y.pow(2).mean()


@pytest.mark.parametrize(("how", "error"), [("slice", "RuntimeError"), ("embedding", "IndexError")])
def test_sizes_the_model_refuses_do_not_fit_and_are_listed(how, error):
    """The first guess lands far past the 256-row table (the budget alone allows millions):
    the model's own error does not escape; the answer is the table's length, and the sizes
    refused are listed with the error's first line."""
    torch.manual_seed(0)
    fit = autockpt.fit_batch(
        _Positions(how).train(), _sequences, budget_gb=0.25, multiple_of=16, loss_fn=_square
    )
    assert fit.batch_size == 256
    assert fit.refused_sizes and min(fit.refused_sizes) == 256 + 16  # the size above: refused
    assert all(line.startswith(error) for line in fit.refused_sizes.values())
    assert all(c.size <= 256 for c in fit.candidates)
    assert any("the model refused" in note for note in fit.notes)
    assert fit.plan.measured_peak_bytes <= fit.plan.budget_bytes
    assert json.loads(json.dumps(fit.to_dict()))["refused_sizes"][str(256 + 16)].startswith(error)


def test_a_model_that_refuses_even_the_smallest_size_is_a_batch_size_error():
    with pytest.raises(BatchSizeError, match="refuses even the smallest size, 16: RuntimeError"):
        autockpt.fit_batch(
            _Positions("slice", rows=8), _sequences, budget_gb=0.25, multiple_of=16, loss_fn=_square
        )


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
