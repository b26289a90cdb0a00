"""The batch that fits a budget: autockpt's answer against what users find by trying.

    autockpt bench fit [--quick] [--out out/fit]
    python -m benchmarks.fit [--quick] [--out out/fit] [--models gpt,hf_gpt2_124m]

For every model, with ``torch.optim.AdamW`` (whose state and step the budget covers), the
budget is what one whole training iteration without checkpointing measures at a reference
batch (the allocator's count, from steady state). Then, in one process:

* ``none`` and ``per_block``: the largest batch without checkpointing and with every
  repeated block checkpointed by hand (non-reentrant ``checkpoint``), found the way a user
  finds it, by measuring candidates (doubling, then halving the interval) until the next
  size's measured iteration exceeds the budget;
* ``largest`` and ``throughput``: ``autockpt.fit_batch`` with each objective, from
  predictions alone (the time it took, the sizes it planned, the ratio to one ``optimize``
  call at the size it returned);
* for each answer: the measured peak of its iteration and samples per second measured side
  by side (interleaved rounds, the process's CPU time on a CPU; each round times one
  iteration of every answer, starting at a rotating position).

Then one VGG-like stack of 3x3 convolutions (VGG19's layers at a quarter of its widths in
``--quick``, half otherwise, on small images, ``torch.optim.SGD``), where ``fit_batch`` is
timed against bisection with real steps, both in the same run: ``autockpt.optimize`` at
doubling sizes, then halving the interval, a size fitting when its verified plan (a real
step measured within the budget) comes back (what a user finds by trial and error; the
answer is the same by construction). Its row also says the highest allocator peak any real
run of ``fit_batch`` reached (its probes and its verifying step) against the budget.
``--models vgg19`` runs the same with VGG19's own widths on 224 x 224 images at 2 GiB.

Writes ``fit.json``, ``fit.csv``, ``fit.md`` (the table docs/benchmarks.md and the README
show) and ``fit.png`` (largest batch and samples per second per method and model).
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import os
import platform
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("KINETO_LOG_LEVEL", "5")

import torch  # noqa: E402
from torch import nn  # noqa: E402

import autockpt  # noqa: E402
from autockpt.base.runtime import default_loss  # noqa: E402
from autockpt.capture import Inputs  # noqa: E402
from autockpt.demo import (  # noqa: E402
    checkpoint_every_block,
    interleaved_seconds,
    largest_by_measuring,
)
from autockpt.errors import GIB  # noqa: E402
from autockpt_zoo.hf import gpt2 as hf_gpt2  # noqa: E402
from autockpt_zoo.toy import block_stack, gpt  # noqa: E402
from benchmarks.planning import hf_gpt2_124m  # noqa: E402

MIB = 2**20


@dataclass(frozen=True)
class Model:
    """A workload: ``make(n)`` builds ``(model, inputs)`` of size ``n`` (one model is kept)."""

    name: str
    make: Callable[[int], tuple[nn.Module, Any]]
    reference: int
    description: str


def _models(quick: bool) -> list[Model]:
    models = [
        Model("gpt", lambda n: gpt(batch=n), 8, "zoo GPT, 4 layers, width 64, sequence 32"),
        Model(
            "block_stack",
            lambda n: block_stack(blocks=16, width=128, batch=n),
            1024 if quick else 2048,
            "activation-dominated: 16 blocks Linear(128->256)->ReLU->Linear, rows of 128",
        ),
        Model(
            "hf_gpt2_small",
            lambda n: hf_gpt2(layers=4, hidden=128, heads=4, batch=n, seq_len=128),
            4,
            "Hugging Face GPT2LMHeadModel, 4 layers, width 128, sequence 128 (torch.export)",
        ),
    ]
    if not quick:
        models.append(
            Model(
                "hf_gpt2_124m",
                lambda n: hf_gpt2_124m(batch=n, seq_len=256),
                2,
                "Hugging Face GPT2LMHeadModel, 124M parameters, sequence 256",
            )
        )
    return models


def _iteration(model: nn.Module, inputs: Inputs, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    default_loss(model(*inputs.args, **inputs.kwargs)).backward()
    optimizer.step()


def _peak(model: nn.Module, example: Any, optimizer: torch.optim.Optimizer) -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autockpt.measure(model, example, optimizer=optimizer, repeat=0).peak_bytes


def run_model(spec: Model, rounds: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model, reference = spec.make(spec.reference)
    optimizer = torch.optim.AdamW(model.parameters())
    budget = _peak(model, reference, optimizer)
    row: dict[str, Any] = {
        "model": spec.name,
        "description": spec.description,
        "reference_batch": spec.reference,
        "budget_bytes": budget,
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    inputs_at = {spec.reference: reference}

    def inputs(n: int) -> Any:
        if n not in inputs_at:
            inputs_at[n] = spec.make(n)[1]
        return inputs_at[n]

    hand = checkpoint_every_block(model)
    hand_optimizer = torch.optim.AdamW(hand.parameters())
    answers: dict[str, tuple[nn.Module, int, torch.optim.Optimizer]] = {}
    for method, module, opt in (("none", model, optimizer), ("per_block", hand, hand_optimizer)):
        started = time.perf_counter()
        size, runs = largest_by_measuring(
            lambda n, m=module, o=opt: _peak(m, inputs(n), o), budget, spec.reference
        )
        row[f"{method}_batch"] = size
        row[f"{method}_steps_run"] = runs
        row[f"{method}_seconds"] = time.perf_counter() - started
        answers[method] = (module, size, opt)
        inputs_at = {k: v for k, v in inputs_at.items() if k in (size, spec.reference)}
    for objective in ("largest", "throughput"):
        started = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fit = autockpt.fit_batch(
                model, inputs, budget_gb=budget / GIB, optimizer=optimizer, objective=objective
            )
        seconds = time.perf_counter() - started
        row[f"{objective}_batch"] = fit.batch_size
        row[f"{objective}_seconds"] = seconds
        row[f"{objective}_sizes_planned"] = len(fit.candidates)
        row[f"{objective}_predicted_peak_bytes"] = fit.plan.predicted_peak_bytes
        row[f"{objective}_predicted_samples_per_second"] = fit.samples_per_second
        if objective == "largest":
            started = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                # fit_batch planned this size in full: without cache=False this call would
                # reuse its profile and time a fraction of what optimize costs on its own
                autockpt.optimize(
                    model,
                    inputs(fit.batch_size),
                    budget_gb=budget / GIB,
                    optimizer=optimizer,
                    cache=False,
                )
            row["optimize_seconds_at_largest"] = time.perf_counter() - started
            row["fit_over_optimize"] = seconds / row["optimize_seconds_at_largest"]
        answers[objective] = (fit.model, fit.batch_size, torch.optim.AdamW(model.parameters()))
    for method, (module, size, opt) in answers.items():
        row[f"{method}_peak_bytes"] = _peak(module, inputs(size), opt)
        row[f"{method}_within_budget"] = row[f"{method}_peak_bytes"] <= budget
    times = interleaved_seconds(
        {
            method: functools.partial(_iteration, module, Inputs.of(inputs(size)), opt)
            for method, (module, size, opt) in answers.items()
        },
        rounds,
    )
    for method, seconds in times.items():
        size = answers[method][1]
        row[f"{method}_step_seconds"] = seconds
        row[f"{method}_samples_per_second"] = size / seconds
    return row


METHODS = ("none", "per_block", "largest", "throughput")

VGG19 = (64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M")
VGG19 += (512, 512, 512, 512, "M", 512, 512, 512, 512, "M")


def vgg_like(divide: int, classes: int = 100) -> nn.Module:
    """VGG19's convolutions and pools with every width divided by ``divide``, then a pooled
    linear head: a VGG-like stack built by hand (no torchvision)."""
    layers: list[nn.Module] = []
    channels = 3
    for width in VGG19:
        if width == "M":
            layers.append(nn.MaxPool2d(2))
        else:
            layers += [nn.Conv2d(channels, width // divide, 3, padding=1), nn.ReLU(inplace=True)]
            channels = width // divide
    head = [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, classes)]
    return nn.Sequential(*layers, *head).train()


def _classes_loss(n: int) -> Callable[[torch.Tensor], torch.Tensor]:
    targets = torch.arange(n) % 100
    return lambda logits: torch.nn.functional.cross_entropy(logits, targets)


def run_bisection(quick: bool, vgg19: bool = False) -> dict[str, Any]:
    """The VGG-like row: ``fit_batch`` against bisection with real steps (module docstring).
    ``vgg19``: VGG19's own widths on 224 x 224 images at a 2 GiB budget (the issue's
    setting; ``--models vgg19``, about half an hour on 2 cores)."""
    from autockpt.costs import probe

    divide, side, reference = (4, 32, 4) if quick else (2, 64, 4)
    if vgg19:
        divide, side, reference = 1, 224, 4
    torch.manual_seed(0)
    model = vgg_like(divide)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def images(n: int) -> torch.Tensor:
        torch.manual_seed(n)
        return torch.randn(n, 3, side, side)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        budget = (
            2 * GIB
            if vgg19
            else autockpt.measure(
                model,
                images(reference),
                optimizer=optimizer,
                loss_fn=_classes_loss(reference),
                repeat=0,
            ).peak_bytes
        )
    row: dict[str, Any] = {
        "model": "vgg19" if vgg19 else "vgg_like",
        "kind": "bisection",
        "description": f"VGG19's layers, widths / {divide}, {side}x{side} images, SGD",
        "reference_batch": reference,
        "budget_bytes": budget,
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    probes: list[int] = []
    original = probe._probe

    def recorded(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        probes.append(result.peak_bytes)
        return result

    probe._probe = recorded
    try:
        started = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fit = autockpt.fit_batch(
                model, images, budget_gb=budget / GIB, optimizer=optimizer, make_loss=_classes_loss
            )
        row["fit_batch_seconds"] = time.perf_counter() - started
    finally:
        probe._probe = original
    row["fit_batch_batch"] = fit.batch_size
    row["fit_batch_sizes_planned_in_full"] = sum(not c.estimated for c in fit.candidates)
    row["fit_batch_sizes_from_shapes"] = sum(c.estimated for c in fit.candidates)
    row["fit_batch_measured_peak_bytes"] = fit.plan.measured_peak_bytes
    row["fit_batch_max_probe_peak_bytes"] = max(probes)
    row["fit_batch_max_real_peak_bytes"] = max(*probes, fit.plan.measured_peak_bytes or 0)
    row["fit_batch_max_real_peak_over_budget"] = row["fit_batch_max_real_peak_bytes"] / budget

    def optimized_peak(n: int) -> int:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                result = autockpt.optimize(
                    model,
                    images(n),
                    budget_gb=budget / GIB,
                    optimizer=optimizer,
                    loss_fn=_classes_loss(n),
                    cache=False,
                )
        except autockpt.InfeasibleBudgetError:
            return budget + 1
        return result.plan.measured_peak_bytes

    started = time.perf_counter()
    size, trials = largest_by_measuring(optimized_peak, budget, reference)
    row["bisection_seconds"] = time.perf_counter() - started
    row["bisection_batch"] = size
    row["bisection_optimize_calls"] = trials
    row["optimize_seconds_at_answer"] = row["bisection_seconds"]  # replaced just below
    started = time.perf_counter()
    optimized_peak(fit.batch_size)
    row["optimize_seconds_at_answer"] = time.perf_counter() - started
    row["fit_over_bisection"] = row["fit_batch_seconds"] / row["bisection_seconds"]
    row["fit_over_optimize"] = row["fit_batch_seconds"] / row["optimize_seconds_at_answer"]
    return row


def _bisection_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | budget | fit_batch: batch, seconds, sizes in full / from shapes | "
        "bisection with real steps: batch, seconds, optimize calls | fit / bisection | "
        "fit / one optimize | highest real peak / budget |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['budget_bytes'] / MIB:.1f} MiB | {r['fit_batch_batch']}, "
            f"{r['fit_batch_seconds']:.1f} s, {r['fit_batch_sizes_planned_in_full']} / "
            f"{r['fit_batch_sizes_from_shapes']} | {r['bisection_batch']}, "
            f"{r['bisection_seconds']:.1f} s, {r['bisection_optimize_calls']} | "
            f"{r['fit_over_bisection']:.2f}x | {r['fit_over_optimize']:.2f}x | "
            f"{r['fit_batch_max_real_peak_over_budget']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def _table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | budget | method | batch | measured peak | within | samples/s measured |",
        "|---|---:|---|---:|---:|---|---:|",
    ]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['model']} | | error: {row['error'][:80]} | | | | |")
            continue
        if row.get("kind") == "bisection":
            continue
        for method in METHODS:
            lines.append(
                f"| {row['model']} | {row['budget_bytes'] / MIB:.1f} MiB | {method} | "
                f"{row[f'{method}_batch']} | {row[f'{method}_peak_bytes'] / MIB:.2f} MiB | "
                f"{'yes' if row[f'{method}_within_budget'] else 'NO'} | "
                f"{_rate(row[f'{method}_samples_per_second'])} |"
            )
    lines += [
        "",
        "| model | fit_batch largest: seconds, sizes planned | one optimize at its answer | "
        "ratio | throughput: seconds, sizes | none / per-block: steps run by hand |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        if "error" in row or row.get("kind") == "bisection":
            continue
        lines.append(
            f"| {row['model']} | {row['largest_seconds']:.1f} s, {row['largest_sizes_planned']} "
            f"| {row['optimize_seconds_at_largest']:.1f} s | {row['fit_over_optimize']:.2f}x | "
            f"{row['throughput_seconds']:.1f} s, {row['throughput_sizes_planned']} | "
            f"{row['none_steps_run']} / {row['per_block_steps_run']} |"
        )
    bisection = [r for r in rows if r.get("kind") == "bisection" and "error" not in r]
    if bisection:
        lines += ["", _bisection_table(bisection).rstrip("\n")]
    return "\n".join(lines) + "\n"


def _rate(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _figure(rows: list[dict[str, Any]], path: Path) -> None:
    from autockpt.report import _figure as figure
    from autockpt.report import save_figure

    good = [r for r in rows if "error" not in r and r.get("kind") != "bisection"]
    if not good:
        return
    fig = figure(4 + 2 * len(good), 6)
    batch_ax, speed_ax = fig.subplots(2, 1)
    width = 0.8 / len(METHODS)
    for k, method in enumerate(METHODS):
        xs = [i + k * width for i in range(len(good))]
        batch_ax.bar(
            xs, [r[f"{method}_batch"] / r["reference_batch"] for r in good], width, label=method
        )
        speed_ax.bar(
            xs,
            [r[f"{method}_samples_per_second"] / r["none_samples_per_second"] for r in good],
            width,
            label=method,
        )
    for ax, label in ((batch_ax, "largest batch / reference"), (speed_ax, "samples/s / none's")):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(good))], [r["model"] for r in good])
        ax.set_ylabel(label)
        ax.legend(fontsize="small")
    batch_ax.set_title("under the budget of one AdamW iteration at the reference batch")
    save_figure(fig, path)


def run(quick: bool, out: Path, models: tuple[str, ...] | None = None) -> list[dict[str, Any]]:
    out.mkdir(parents=True, exist_ok=True)
    rounds = 5 if quick else 9
    rows: list[dict[str, Any]] = []
    for spec in _models(quick):
        if models is not None and spec.name not in models:
            continue
        started = time.perf_counter()
        try:
            row = run_model(spec, rounds)
        except Exception as error:  # noqa: BLE001 - a failing model gets a row with its error
            row = {"model": spec.name, "error": f"{type(error).__name__}: {error}"}
        row["seconds"] = time.perf_counter() - started
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if "description" not in k}), flush=True)
    stacks = ["vgg_like"] if models is None or "vgg_like" in models else []
    stacks += ["vgg19"] if models is not None and "vgg19" in models else []  # asked for only
    for name in stacks:
        started = time.perf_counter()
        try:
            row = run_bisection(quick, vgg19=name == "vgg19")
        except Exception as error:  # noqa: BLE001 - a failing model gets a row with its error
            row = {"model": name, "kind": "bisection", "error": f"{type(error).__name__}: {error}"}
        row["seconds"] = time.perf_counter() - started
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if "description" not in k}), flush=True)
    environment = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "device": "cpu",
        "quick": quick,
    }
    (out / "fit.json").write_text(json.dumps({"environment": environment, "rows": rows}, indent=2))
    keys = sorted({k for r in rows for k in r})
    with open(out / "fit.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
    (out / "fit.md").write_text(_table(rows))
    _figure(rows, out / "fit.png")
    print(_table(rows))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="out/fit")
    parser.add_argument("--models", default=None, help="comma-separated model names")
    args = parser.parse_args()
    models = tuple(args.models.split(",")) if args.models else None
    run(args.quick, Path(args.out), models)


if __name__ == "__main__":
    main()
