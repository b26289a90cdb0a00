"""Real architectures: capture, plan, train and measure every model of the zoo.

    python -m benchmarks.models [--models hf_gpt2 gpt ...] [--out out/models] [--docs docs/models.md]

For each model (the Hugging Face zoo, the held-out Hugging Face architectures and the
torch-only classics), one :class:`autockpt.api.Planner` captures and profiles it; plans are
made at three budgets spread over the plannable range (10%, 50% and 90% of the way from the
leanest plan's predicted peak to the no-checkpoint peak). For every plan the benchmark checks
the same things the tests do, on the same seeds: loss, every gradient and every buffer equal
to eager's, and the measured peak (allocator-level) within the budget. At the 50% budget it
also times the plan against the unmodified model: single steps alternate between the two,
and the median of the per-pair ratios is reported (shared machines are noisy: read the
ratio, not the seconds).

Writes ``models.json`` and ``models.md`` into ``--out``; with ``--docs`` it replaces the
generated tables of that markdown file (between ``<!-- models:begin -->`` and
``<!-- models:end -->``).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("KINETO_LOG_LEVEL", "5")

import torch  # noqa: E402

from autockpt.api import Planner  # noqa: E402
from autockpt.base.runtime import default_loss, tensors_in  # noqa: E402
from autockpt.capture import Inputs  # noqa: E402
from autockpt.errors import GIB  # noqa: E402
from autockpt.measure import measure  # noqa: E402
from autockpt_zoo.toy import ZOO  # noqa: E402
from benchmarks.budgets import _step_seconds  # noqa: E402

FRACTIONS = (0.1, 0.5, 0.9)
CLASSICS = ("gpt", "resnet", "unet", "mlp_mixer")
BEGIN, END = "<!-- models:begin -->", "<!-- models:end -->"


def factories() -> dict[str, tuple[str, Any]]:
    """``name -> (group, factory)`` for every model the benchmark runs."""
    from autockpt_zoo.hf import HF_HELD_OUT, HF_ZOO

    table: dict[str, tuple[str, Any]] = {}
    table.update({name: ("hf", f) for name, f in HF_ZOO.items()})
    table.update({name: ("classic", ZOO[name]) for name in CLASSICS})
    table.update({name: ("held-out", f) for name, f in HF_HELD_OUT.items()})
    return table


def _step(model: torch.nn.Module, inputs: Inputs, seed: int = 1234) -> dict[str, Any]:
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(seed)
    output = model(*inputs.args, **inputs.kwargs)
    loss = default_loss(output)
    loss.backward()
    result = {
        "loss": loss.detach(),
        "outputs": [t.detach() for t in tensors_in(output)],
        "grads": {
            n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None
        },
        "buffers": {n: b.detach().clone() for n, b in model.named_buffers()},
    }
    for p in model.parameters():
        p.grad = None
    return result


def _same(expected: dict[str, Any], got: dict[str, Any]) -> bool:
    """The test suite's tolerances (tests/conftest.py assert_same_step), as a yes/no."""
    try:
        torch.testing.assert_close(got["loss"], expected["loss"], rtol=1e-5, atol=1e-6)
        for a, b in zip(got["outputs"], expected["outputs"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        if got["grads"].keys() != expected["grads"].keys():
            return False
        for name, grad in expected["grads"].items():
            torch.testing.assert_close(got["grads"][name], grad, rtol=1e-4, atol=1e-6)
        if got["buffers"].keys() != expected["buffers"].keys():
            return False
        for name, buffer in expected["buffers"].items():
            torch.testing.assert_close(got["buffers"][name], buffer, rtol=1e-5, atol=1e-6)
    except (AssertionError, ValueError):
        return False
    return True


def run_model(name: str, group: str, factory: Any, pairs: int = 41) -> dict[str, Any]:
    """Capture, plan at three budgets, check and measure one model; one result row."""
    model, example = factory()
    inputs = Inputs.of(example)
    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        planner = Planner(model, inputs)
    row: dict[str, Any] = {
        "model": name,
        "group": group,
        "class": type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "nodes": len(planner.capture.compute_nodes()),
        "capture": planner.capture.method,
        "stages": len(planner.chain.stages),
        "eager_peak_bytes": measure(model, inputs, repeat=1).peak_bytes,
        "minimum_peak_bytes": planner.minimum_peak_bytes,
        "no_checkpoint_peak_bytes": planner.no_checkpoint_peak_bytes,
        "planner_seconds": time.perf_counter() - started,
        "budgets": [],
    }
    low, high = planner.minimum_peak_bytes, planner.no_checkpoint_peak_bytes
    for fraction in FRACTIONS:
        budget = int(low + fraction * (high - low))
        fast = planner.optimize(budget_gb=budget / GIB)
        expected = _step(copy.deepcopy(model), inputs)
        got = _step(fast, inputs)
        peak = measure(fast, inputs, repeat=1).peak_bytes
        entry = {
            "fraction": fraction,
            "budget_bytes": budget,
            "predicted_peak_bytes": fast.plan.predicted_peak_bytes,
            "measured_peak_bytes": peak,
            "within_budget": peak <= budget,
            "segments": len(fast.plan.segments),
            "gradients_equal": _same(expected, got),
            "predicted_recompute_fraction": fast.plan.recompute_fraction,
        }
        if fraction == 0.5:
            # Alternate single steps and take the median of per-pair ratios: load bursts
            # from other processes then hit both sides of a pair alike.
            _step_seconds(model, inputs, 2)  # warm up both
            _step_seconds(fast, inputs, 2)
            eager_times: list[float] = []
            ratios: list[float] = []
            for _ in range(pairs):
                eager = _step_seconds(model, inputs, 1)[0]
                plan = _step_seconds(fast, inputs, 1)[0]
                eager_times.append(eager)
                ratios.append(plan / eager)
            eager_step = statistics.median(eager_times)
            entry["step_ratio"] = statistics.median(ratios)
            # the planner's recompute estimate against the eager step timed alongside
            entry["predicted_overhead"] = fast.plan.predicted_recompute_seconds / eager_step
        row["budgets"].append(entry)
    return row


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def markdown(rows: list[dict[str, Any]], machine: str) -> str:
    """The tables of docs/models.md: one per group, one row per model."""
    header = (
        "| model | parameters | nodes traced | capture | eager peak (MiB) | plan peak at 50% "
        "(MiB) | budget / predicted / measured at 50% (MiB) | recompute overhead at 50% (measured, "
        "predicted) | within budget at 10/50/90% | gradients equal |\n"
        "|---|---:|---:|:-:|---:|---:|---:|---:|:-:|:-:|\n"
    )
    titles = {
        "hf": "Hugging Face zoo (`autockpt_zoo.hf.HF_ZOO`)",
        "classic": "Torch-only classics (`autockpt_zoo.toy.ZOO`)",
        "held-out": "Held-out Hugging Face architectures (`autockpt_zoo.hf.HF_HELD_OUT`)",
    }
    parts = [f"Produced by `python -m benchmarks.models --docs docs/models.md` on {machine}.\n"]
    for group, title in titles.items():
        mine = [r for r in rows if r["group"] == group]
        if not mine:
            continue
        lines = [f"\n#### {title}\n\n", header]
        for r in mine:
            mid = next(b for b in r["budgets"] if b["fraction"] == 0.5)
            within = "/".join("yes" if b["within_budget"] else "NO" for b in r["budgets"])
            equal = "yes" if all(b["gradients_equal"] for b in r["budgets"]) else "NO"
            lines.append(
                f"| {r['model']} ({r['class']}) | {r['parameters']:,} | {r['nodes']} "
                f"| {r['capture']} | {_mib(r['eager_peak_bytes'])} "
                f"| {_mib(mid['measured_peak_bytes'])} "
                f"| {_mib(mid['budget_bytes'])} / {_mib(mid['predicted_peak_bytes'])} / "
                f"{_mib(mid['measured_peak_bytes'])} "
                f"| {100 * (mid['step_ratio'] - 1):+.0f}%, "
                f"{100 * mid['predicted_overhead']:+.0f}% "
                f"| {within} | {equal} |\n"
            )
        parts.append("".join(lines))
    return "".join(parts)


def _replace_section(path: Path, body: str) -> None:
    text = path.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{path} has no {BEGIN} ... {END} section to replace")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    path.write_text(f"{head}{BEGIN}\n{body}{END}{tail}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", help="model names (default: all)")
    parser.add_argument("--out", type=Path, default=Path("out/models"))
    parser.add_argument("--docs", type=Path, help="markdown file whose tables to regenerate")
    gpu = "a GPU" if torch.cuda.is_available() else "no GPU"
    parser.add_argument(
        "--machine", default=f"{os.cpu_count()}-core {platform.machine()} CPU, {gpu}"
    )
    args = parser.parse_args()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    table = factories()
    names = args.models or list(table)
    unknown = sorted(set(names) - set(table))
    if unknown:
        raise SystemExit(f"unknown models {unknown}; choose from {sorted(table)}")
    rows = []
    for name in names:
        group, factory = table[name]
        row = run_model(name, group, factory)
        mid = row["budgets"][1]
        print(
            f"{name:<16} {row['capture']:<9} nodes {row['nodes']:>4}  eager "
            f"{_mib(row['eager_peak_bytes'])} MiB  plan@50% {_mib(mid['measured_peak_bytes'])} MiB"
            f"  step {mid['step_ratio']:.2f}x  equal "
            f"{all(b['gradients_equal'] for b in row['budgets'])}  within "
            f"{all(b['within_budget'] for b in row['budgets'])}",
            flush=True,
        )
        rows.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "models.json").write_text(json.dumps(rows, indent=2) + "\n")
    body = markdown(rows, args.machine)
    (args.out / "models.md").write_text(body)
    if args.docs is not None:
        _replace_section(args.docs, body)


if __name__ == "__main__":
    main()
