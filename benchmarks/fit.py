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


def _table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | budget | method | batch | measured peak | within | samples/s measured |",
        "|---|---:|---|---:|---:|---|---:|",
    ]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['model']} | | error: {row['error'][:80]} | | | | |")
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
        if "error" in row:
            continue
        lines.append(
            f"| {row['model']} | {row['largest_seconds']:.1f} s, {row['largest_sizes_planned']} "
            f"| {row['optimize_seconds_at_largest']:.1f} s | {row['fit_over_optimize']:.2f}x | "
            f"{row['throughput_seconds']:.1f} s, {row['throughput_sizes_planned']} | "
            f"{row['none_steps_run']} / {row['per_block_steps_run']} |"
        )
    return "\n".join(lines) + "\n"


def _rate(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _figure(rows: list[dict[str, Any]], path: Path) -> None:
    from autockpt.report import _figure as figure
    from autockpt.report import save_figure

    good = [r for r in rows if "error" not in r]
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
