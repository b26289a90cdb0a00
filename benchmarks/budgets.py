"""Budget sweep over the model zoo: measured peak and step time against no checkpointing.

    python -m benchmarks.budgets [--quick] [--out out/budgets]

For every zoo model, one :class:`autockpt.api.Planner` profiles the model once; plans are
made at budgets spread between the leanest plan's predicted peak and the no-checkpoint peak,
and each plan is measured side by side with the unmodified model in the same process, runs
interleaved (these machines are shared and noisy: compare ratios, not absolute times).
Writes ``budgets.json``, ``budgets.csv`` and ``budgets.png`` (measured peak vs budget, with
the diagonal; step-time ratio vs memory saved).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import time
import warnings
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("KINETO_LOG_LEVEL", "5")

import torch  # noqa: E402

from autockpt.api import Planner  # noqa: E402
from autockpt.base.runtime import default_loss  # noqa: E402
from autockpt.capture import Inputs  # noqa: E402
from autockpt.errors import GIB, InfeasibleBudgetError  # noqa: E402
from autockpt.measure import measure  # noqa: E402
from autockpt_zoo.toy import ZOO  # noqa: E402

QUICK_MODELS = ("block_stack_wide", "gpt", "resnet", "unet")
FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)
QUICK_FRACTIONS = (0.0, 0.5, 1.0)


def _factories() -> dict:
    from autockpt_zoo.toy import block_stack

    factories = dict(ZOO)
    factories.pop("gpt_checkpointed", None)  # already checkpointed by hand: not a baseline
    factories["block_stack_wide"] = lambda: block_stack(blocks=32, width=128, batch=512)
    return factories


def _step_seconds(model: torch.nn.Module, inputs: Inputs, repeat: int) -> list[float]:
    times = []
    for _ in range(repeat):
        for p in model.parameters():
            p.grad = None
        start = time.perf_counter()
        default_loss(model(*inputs.args, **inputs.kwargs)).backward()
        times.append(time.perf_counter() - start)
    for p in model.parameters():
        p.grad = None
    return times


def run(quick: bool, out_dir: Path) -> list[dict]:
    """Run the sweep and write JSON, CSV and PNG into ``out_dir``; return the rows."""
    out_dir.mkdir(parents=True, exist_ok=True)
    factories = _factories()
    names = QUICK_MODELS if quick else sorted(factories)
    fractions = QUICK_FRACTIONS if quick else FRACTIONS
    repeat = 5 if quick else 9
    rows = []
    for name in names:
        model, example = factories[name]()
        inputs = Inputs.of(example)
        started = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            planner = Planner(model, inputs)
        profile_seconds = time.perf_counter() - started
        eager_peak = measure(model, inputs, repeat=1).peak_bytes
        low, high = planner.minimum_peak_bytes, planner.no_checkpoint_peak_bytes
        for fraction in fractions:
            budget = int(low + fraction * (high - low))
            started = time.perf_counter()
            try:
                fast = planner.optimize(budget_gb=budget / GIB)
            except InfeasibleBudgetError as error:
                rows.append(
                    {
                        "model": name,
                        "fraction": fraction,
                        "budget_bytes": budget,
                        "error": str(error),
                    }
                )
                continue
            solve_seconds = time.perf_counter() - started
            plan_peak = measure(fast, inputs, repeat=1).peak_bytes
            eager_times, plan_times = [], []
            for _ in range(3):  # interleave: eager, plan, eager, plan, ...
                eager_times += _step_seconds(model, inputs, repeat)
                plan_times += _step_seconds(fast, inputs, repeat)
            eager_step = statistics.median(eager_times)
            plan_step = statistics.median(plan_times)
            rows.append(
                {
                    "model": name,
                    "fraction": fraction,
                    "budget_bytes": budget,
                    "eager_peak_bytes": eager_peak,
                    "predicted_peak_bytes": fast.plan.predicted_peak_bytes,
                    "measured_peak_bytes": plan_peak,
                    "within_budget": plan_peak <= budget,
                    "segments": len(fast.plan.segments),
                    "solver": fast.plan.solver,
                    "solver_status": fast.plan.solver_status,
                    "eager_step_seconds": eager_step,
                    "plan_step_seconds": plan_step,
                    "step_ratio": plan_step / eager_step,
                    "memory_ratio": plan_peak / eager_peak,
                    "profile_seconds": profile_seconds,
                    "plan_seconds": solve_seconds,
                }
            )
            print(_line(rows[-1]), flush=True)
    _write(rows, out_dir)
    return rows


def _line(row: dict) -> str:
    return (
        f"{row['model']:<22} budget {row['budget_bytes'] / 2**20:8.2f} MiB  measured "
        f"{row['measured_peak_bytes'] / 2**20:8.2f} MiB ({100 * row['memory_ratio']:5.1f}% of eager)  "
        f"step {row['step_ratio']:.2f}x  segments {row['segments']}"
    )


def summary_markdown(rows: list[dict]) -> str:
    """One table row per model and budget: budget, measured peaks, step-time ratio."""
    lines = [
        "| model | budget (MiB) | no-checkpoint peak (MiB) | plan peak (MiB) | predicted (MiB) "
        "| within budget | segments | step time vs none |",
        "|---|---:|---:|---:|---:|:-:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['budget_bytes'] / 2**20:.2f} | | | | error | | |")
            continue
        lines.append(
            f"| {r['model']} | {r['budget_bytes'] / 2**20:.2f} | {r['eager_peak_bytes'] / 2**20:.2f} "
            f"| {r['measured_peak_bytes'] / 2**20:.2f} | {r['predicted_peak_bytes'] / 2**20:.2f} "
            f"| {'yes' if r['within_budget'] else 'NO'} | {r['segments']} | {r['step_ratio']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def _write(rows: list[dict], out_dir: Path) -> None:
    (out_dir / "budgets.json").write_text(json.dumps(rows, indent=2) + "\n")
    (out_dir / "summary.md").write_text(summary_markdown(rows))
    keys = sorted({k for row in rows for k in row})
    with open(out_dir / "budgets.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    good = [r for r in rows if "error" not in r]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    for name in sorted({r["model"] for r in good}):
        mine = [r for r in good if r["model"] == name]
        left.scatter(
            [r["budget_bytes"] / 2**20 for r in mine],
            [r["measured_peak_bytes"] / 2**20 for r in mine],
            label=name,
            s=18,
        )
        right.plot(
            [r["memory_ratio"] for r in mine],
            [r["step_ratio"] for r in mine],
            marker="o",
            label=name,
        )
    top = max([r["budget_bytes"] / 2**20 for r in good] + [1])
    left.plot([0, top], [0, top], color="grey", linestyle="--", label="budget")
    left.set_xlabel("budget (MiB)")
    left.set_ylabel("measured peak (MiB)")
    left.set_title("measured peak never above the budget")
    right.set_xlabel("measured peak / no-checkpoint peak")
    right.set_ylabel("step time / no-checkpoint step time")
    right.set_title("memory saved vs time paid")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "budgets.png", dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("out/budgets"))
    args = parser.parse_args()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    run(args.quick, args.out)


if __name__ == "__main__":
    main()
