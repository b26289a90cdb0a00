"""The budget contract in ``fit_batch`` (autockpt/fit.py, NOTE [fit: one probe, scaled]):
nothing runs for real at a size whose prediction, kernel workspaces included, does not fit
(a shapes-only guess is corrected by the workspaces measured at sizes planned in full, before
anything runs); every real step the call runs peaks within the budget; and the loss can be
built per size (``make_loss``, and ``autockpt fit`` with a factory returning its loss)."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autockpt
from autockpt.costs import probe as probe_module
from autockpt.errors import GIB, BatchSizeError
from tests.conftest import quiet_planner

measure_module = importlib.import_module("autockpt.measure")  # autockpt.measure: the function


class RealPeaks:
    """The allocator peaks of every real run inside a block: each step ``measure`` runs (its
    allocator events from steady state, the static part included) and each probe (the
    allocator's peak while it ran, the parameters and inputs included)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.steps: list[int] = []
        self.probes: list[int] = []
        cpu_peak, probe = measure_module._cpu_peak, probe_module._probe

        def recorded_step(*args, **kwargs):
            peak = cpu_peak(*args, **kwargs)
            self.steps.append(peak)
            return peak

        def recorded_probe(*args, **kwargs):
            result = probe(*args, **kwargs)
            self.probes.append(result.peak_bytes)
            return result

        monkeypatch.setattr(measure_module, "_cpu_peak", recorded_step)
        monkeypatch.setattr(probe_module, "_probe", recorded_probe)


def vgg_like(widths=(8, 8, "M", 16, 16, "M", 32, "M"), classes: int = 10) -> nn.Module:
    """A VGG-like stack of 3x3 convolutions and max-pools, built by hand."""
    layers: list[nn.Module] = []
    channels = 3
    for width in widths:
        if width == "M":
            layers.append(nn.MaxPool2d(2))
        else:
            layers += [nn.Conv2d(channels, width, 3, padding=1), nn.ReLU()]
            channels = width
    head = [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, classes)]
    return nn.Sequential(*layers, *head).train()


def images(n: int) -> torch.Tensor:
    torch.manual_seed(n)
    return torch.randn(n, 3, 16, 16)


def classes_loss(n: int, classes: int = 10):
    targets = torch.arange(n) % classes
    return lambda logits: F.cross_entropy(logits, targets)


def _fit(model, make_inputs, budget, monkeypatch, **options):
    peaks = RealPeaks(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit = autockpt.fit_batch(model, make_inputs, budget_gb=budget / GIB, **options)
    return fit, peaks


def _check_contract(fit, peaks: RealPeaks, budget: int, model, make_inputs, **options) -> None:
    # every real step the call ran (the answer's verification) peaked within the budget
    assert peaks.steps and max(peaks.steps) <= budget
    assert fit.plan.measured_peak_bytes is not None and fit.plan.measured_peak_bytes <= budget
    # every size planned in full was one whose prediction fit, save the answer's neighbour,
    # planned in full to settle the answer (NOTE [fit: the neighbour in full])
    n = fit.batch_size
    full = [c for c in fit.candidates if not c.estimated]
    assert all(c.fits for c in full if c.size != n + 1), full
    above = {c.size: c for c in fit.candidates}[n + 1]
    assert not above.fits
    assert above.shapes_minimum_bytes <= above.minimum_peak_bytes
    # one probe per size planned in full, each within the budget too (NOTE [profile:
    # probe's working set]), so no note says otherwise
    assert len(peaks.probes) == len(full)
    assert max(peaks.probes) <= budget
    assert not any("planning in full peaked above the budget" in n for n in fit.notes)
    # the answer is exact: the size above it, planned in full on its own, does not fit
    make_loss = options.pop("make_loss", None)
    if make_loss is not None:
        options["loss_fn"] = make_loss(n + 1)
    again = quiet_planner(model, make_inputs(n + 1), **options)
    assert again.minimum_peak_bytes > budget


def test_vgg_like_no_size_runs_whose_prediction_is_over_the_budget(monkeypatch):
    """On convolutions the CPU backward allocates a feature map per image that no operator
    returns: shapes alone underestimate every size, so the shapes' largest size is over the
    budget; it is corrected by the workspaces measured at the smallest size, and not
    planned in full unless it is the answer's neighbour (which then does not fit)."""
    model = vgg_like()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    budget = 700_000
    fit, peaks = _fit(
        model, images, budget, monkeypatch, optimizer=optimizer, make_loss=classes_loss
    )
    _check_contract(fit, peaks, budget, model, images, optimizer=optimizer, make_loss=classes_loss)
    by_size = {c.size: c for c in fit.candidates}
    # shapes alone would take a larger size than the answer
    assert any(c.shapes_minimum_bytes <= budget < c.minimum_peak_bytes for c in by_size.values())
    assert fit.batch_size >= 2


VGG19 = (64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M")
VGG19 += (512, 512, 512, 512, "M", 512, 512, 512, 512, "M")


def test_a_budget_measured_at_a_size_is_met_at_least_at_that_size(monkeypatch):
    """The budget is what a batch of 4 needs without checkpointing, so 4 fits whatever the
    estimates say. A batch of 1 runs other CPU convolutions (its workspaces larger than at
    2): estimated from it, 2 looked over the budget, and the answer was 1 (NOTE [fit: the
    neighbour in full]: an estimate alone never settles the answer)."""
    torch.manual_seed(0)
    model = vgg_like(tuple(w if w == "M" else w // 4 for w in VGG19), classes=100)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def inputs(n: int) -> torch.Tensor:
        torch.manual_seed(n)
        return torch.randn(n, 3, 32, 32)

    def loss(n: int):
        return classes_loss(n, classes=100)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        budget = autockpt.measure(
            model, inputs(4), optimizer=optimizer, loss_fn=loss(4), repeat=0
        ).peak_bytes
    fit, peaks = _fit(model, inputs, budget, monkeypatch, optimizer=optimizer, make_loss=loss)
    assert fit.batch_size >= 4
    _check_contract(fit, peaks, budget, model, inputs, optimizer=optimizer, make_loss=loss)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt", "resnet", "vgg_like"])
def test_the_whole_call_stays_within_the_budget_on_zoo_models(name, monkeypatch):
    from autockpt_zoo.toy import gpt, resnet

    if name == "gpt":
        model, _ = gpt(batch=1)

        def make_inputs(n):
            return gpt(batch=n)[1]

        budget, options = 6 * 2**20, {"loss_fn": lambda out: out[1]}
    elif name == "resnet":
        model, _ = resnet(batch=1)

        def make_inputs(n):
            return resnet(batch=n)[1]

        budget, options = 8 * 2**20, {}
    else:
        model, make_inputs = vgg_like((16, 16, "M", 32, 32, "M", 64, 64, "M")), images
        budget, options = 3 * 2**20, {"make_loss": classes_loss}
    optimizer = torch.optim.AdamW(model.parameters())
    fit, peaks = _fit(model, make_inputs, budget, monkeypatch, optimizer=optimizer, **options)
    _check_contract(fit, peaks, budget, model, make_inputs, optimizer=optimizer, **options)


class _Classifier(nn.Module):
    def __init__(self, width: int = 32, classes: int = 10) -> None:
        super().__init__()
        self.body = nn.Sequential(
            *[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(4)]
        )
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _rows(n: int) -> torch.Tensor:
    torch.manual_seed(n)
    return torch.randn(n, 32)


def test_make_loss_is_checked_before_any_planning():
    model = _Classifier().train()
    with pytest.raises(ValueError, match="make_loss"):
        autockpt.fit_batch(
            model, _rows, budget_gb=1.0, loss_fn=classes_loss(1), make_loss=classes_loss
        )

    def broken(n):
        raise KeyError("no targets")

    with pytest.raises(BatchSizeError, match=r"make_loss\(1\) raised KeyError"):
        autockpt.fit_batch(model, _rows, budget_gb=1.0, make_loss=broken)


@pytest.mark.slow
def test_make_loss_builds_each_sizes_loss():
    """A loss that holds targets of its size: with one loss for every size the search fails
    inside cross_entropy; ``make_loss(n)`` plans each size with its own."""
    model = _Classifier().train()
    sizes_asked: list[int] = []

    def make_loss(n):
        sizes_asked.append(n)
        return classes_loss(n)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit = autockpt.fit_batch(model, _rows, budget_gb=120_000 / GIB, make_loss=make_loss)
    assert fit.batch_size > 1 and fit.plan.measured_peak_bytes <= 120_000
    assert fit.batch_size in sizes_asked and len(set(sizes_asked)) == len(sizes_asked)


@pytest.mark.slow
def test_cli_fit_plans_each_size_with_the_factorys_loss(tmp_path):
    (tmp_path / "fit_loss_models.py").write_text(
        "import torch, torch.nn as nn, torch.nn.functional as F\n"
        "def factory(n=1):\n"
        "    torch.manual_seed(0)\n"
        "    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 10)).train()\n"
        "    x, y = torch.randn(n, 32), torch.randint(0, 10, (n,))\n"
        "    return model, x, lambda logits: F.cross_entropy(logits, y)\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "autockpt.cli", "fit", "fit_loss_models:factory"]
        + ["--budget-gb", str(400_000 / GIB), "--json", "--no-plot"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    answer = json.loads(result.stdout)
    assert answer["batch_size"] > 1 and answer["measured_peak_bytes"] <= 400_000


def test_workspaces_are_carried_to_a_size_node_by_node():
    """NOTE [fit: one probe, scaled]: from one measured size a workspace grows in proportion
    (an upper bound); between two, along their line; above them all, along the line of the
    two largest above the smallest size (which may run other kernels), never below the
    larger value, and in proportion to the largest while only one lies above the smallest;
    below them all, the smallest's value."""
    from autockpt.fit.estimates import per_node

    assert per_node({4: [100, 0, 30]}, 8) == [200, 0, 60]
    assert per_node({4: [100, 0, 30]}, 2) == [100, 0, 30]  # never scaled down
    two = {4: [100, 300, 50], 8: [200, 340, 40]}  # growing, mostly fixed, noisy
    assert per_node(two, 8) == [200, 340, 40]
    assert per_node(two, 6) == [150, 320, 45]
    assert per_node(two, 16) == [400, 680, 80]  # in proportion to 8: not through 4
    assert per_node(two, 2) == [100, 300, 50]
    three = {**two, 12: [300, 380, 45]}
    assert per_node(three, 16) == [400, 420, 50]  # the line of 8 and 12
    # a batch of 1 that runs other kernels: the line through it would fall below 14's
    batch_one = {1: [73728], 6: [51456]}
    assert per_node(batch_one, 14) == per_node({6: [51456]}, 14)
    assert per_node(batch_one, 14)[0] >= 116992  # what the probe measured at 14
