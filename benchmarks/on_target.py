"""A Llama planned on the meta device for the GPU it will train on, then trained on that GPU:
does the plan made before launch hold where the run happens?

    python -m benchmarks.on_target [--quick] [--families hf,titan] [--seq 8192]
                                   [--out out/on_target]

The CPU checks (:mod:`benchmarks.llama_ranks`) plan for the CPU they run on; what a user asks
before launch is planned for a GPU from a machine without one: attention as the GPU's fused
kernels save it (output and log-sum-exp, no seq x seq scores), autocast as CUDA casts, a
roofline of the target's datasheet rates as the time model. Only a GPU can say whether those
hold. What runs, per family (``hf``: Hugging Face ``LlamaForCausalLM``, captured with
``torch.export``; ``titan``: the torchtitan-shaped Llama of :mod:`benchmarks.e2e_models`,
captured with fx):

1. **Planned on meta** for the target of the GPU present (``autockpt.TARGETS``, read from the
   device's name), bf16 autocast (``precision="bf16-mixed"``), AdamW, one sequence of
   ``--seq`` tokens: the leanest plan's and the no-checkpoint step's predicted peaks, and a
   plan at each of four budgets (the no-checkpoint peak, per-layer checkpointing's predicted
   peak, halfway between the leanest and no checkpointing, the leanest). Nothing is
   allocated.
2. **Trained on the GPU**: the float32 model built there from the same seed, the meta plan
   applied (``autockpt.apply``), one AdamW iteration measured with :func:`autockpt.measure`
   under ``torch.autocast("cuda", torch.bfloat16)`` (peak: ``max_memory_allocated``; a
   warm-up iteration makes AdamW's state, which the peak includes) and timed over rounds;
   the model without autockpt the same way.

Written to ``on_target.json``, ``.csv`` (one row per family and budget: predicted and measured
peak and step time) and ``.png`` where matplotlib is installed. ``--quick``: 2 layers of
width 512, 1024 tokens. Without a GPU it says so and exits 0 (``--device cpu`` runs the same
steps at a toy size against a CPU target, a check of the script itself).

Shape: Llama 3.2 1B (hidden 2048, 16 layers, 32 heads, 8 KV heads, MLP 8192, vocabulary
128256, untied head) at 8192 tokens: one GPU of 80 GiB or more holds its no-checkpoint step.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_map_only

import autockpt
from autockpt.api import Planner
from autockpt.errors import GIB
from benchmarks.llama_ranks import batch, cpu_target, llama, loss_of

SHAPES: dict[str, dict[str, int]] = {
    "full": dict(hidden=2048, layers=16, heads=32, kv=8, mlp=8192, vocab=128256, seq=8192),
    "quick": dict(hidden=512, layers=2, heads=8, kv=4, mlp=1024, vocab=8192, seq=1024),
    # --device cpu: bfloat16 matrix multiplies run at 0.5 GFLOP/s on a CPU without them
    "cpu": dict(hidden=64, layers=2, heads=4, kv=2, mlp=128, vocab=512, seq=64),
}
FAMILIES = ("hf", "titan")
ROUNDS = 5


def target_of(device: torch.device) -> autockpt.Target:
    """The target a user planning for this device names (its kernels, rates, capacity)."""
    if device.type != "cuda":
        return cpu_target()
    name = torch.cuda.get_device_name(device).lower()
    for key in ("h200", "h100", "a100", "l4", "mi300x"):
        if key in name:
            return autockpt.TARGETS[key]
    raise SystemExit(f"benchmarks.on_target: no target in autockpt.TARGETS for {name!r}")


def _planner(shape: dict[str, int], family: str, target: autockpt.Target) -> Planner:
    with torch.device("meta"):
        model = llama(shape, family=family)
    return Planner(
        model,
        batch(shape, 0, "meta", family),
        loss_fn=loss_of,
        optimizer=torch.optim.AdamW(model.parameters()),
        precision="bf16-mixed",
        target=target,
    )


def _on_device(shape: dict[str, int], family: str, device: torch.device, plan: Any) -> Any:
    """One AdamW iteration of the model (planned when ``plan`` is given) on ``device``."""
    with torch.device(device):
        model = llama(shape, family=family)
    inputs = tree_map_only(torch.Tensor, lambda t: t.to(device), batch(shape, 0, family=family))
    if plan is not None:
        model = autockpt.apply(model, plan, inputs)
    optimizer = torch.optim.AdamW(model.parameters())
    with torch.autocast(device.type, torch.bfloat16):
        measured = autockpt.measure(
            model, inputs, loss_fn=loss_of, optimizer=optimizer, repeat=ROUNDS
        )
    del model, optimizer, inputs
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return measured


def run_family(shape: dict[str, int], family: str, device: torch.device) -> list[dict[str, Any]]:
    """Plan on meta for ``device``'s target, then measure every budget's plan there. A plan
    that cannot be applied or run there is a row with its error (the run goes on)."""
    target = target_of(device)
    started = time.perf_counter()
    planner = _planner(shape, family, target)
    low, high = planner.minimum_peak_bytes, planner.no_checkpoint_peak_bytes
    budgets = {"no checkpointing": high, "leanest": low}
    if planner.per_block_segments:
        budgets["per-layer peak"] = planner.predict(planner.per_block_segments)
    budgets["halfway"] = (low + high) // 2
    plans = {label: planner.optimize(budget_gb=b / GIB).plan for label, b in budgets.items()}
    planning_seconds = time.perf_counter() - started
    print(f"{family}: planned on meta for {target.name} in {planning_seconds:.1f} s", flush=True)
    eager = _on_device(shape, family, device, None)
    rows = []
    for label, plan in plans.items():
        row = {
            "family": family,
            "capture": plan.capture_method,
            "target": target.name,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "budget": label,
            "budget_bytes": plan.budget_bytes,
            "segments": len(plan.segments),
            "predicted_peak_bytes": plan.predicted_peak_bytes,
            "predicted_step_s": plan.predicted_step_seconds,
            "eager_peak_bytes": eager.peak_bytes,
            "eager_step_s": eager.step_seconds,
            "minimum_bytes": low,
            "no_checkpoint_bytes": high,
            "time_model": plan.time_model,
            "planning_s": planning_seconds,
        }
        try:
            measured = _on_device(shape, family, device, plan)
        except Exception as error:  # recorded: the other plans still run
            row["error"] = f"{type(error).__name__}: {error}"[:2000]
            print(f"{family} {label}: {row['error'][:400]}", flush=True)
            rows.append(row)
            continue
        row.update(
            measured_peak_bytes=measured.peak_bytes,
            peak_error=measured.peak_bytes / plan.predicted_peak_bytes - 1,
            within_budget=measured.peak_bytes <= plan.budget_bytes,
            measured_step_s=measured.step_seconds,
            rounds=measured.repeat,
        )
        rows.append(row)
        print(_line(row), flush=True)
    return rows


def _line(row: dict[str, Any]) -> str:
    mib = 2**20
    return (
        f"{row['family']:6} {row['budget']:17} segments {row['segments']:3}  peak predicted "
        f"{row['predicted_peak_bytes'] / mib:9.1f} measured {row['measured_peak_bytes'] / mib:9.1f}"
        f" MiB ({row['peak_error']:+.2%})  step predicted {row['predicted_step_s'] * 1e3:8.1f} "
        f"measured {row['measured_step_s'] * 1e3:8.1f} ms  (eager {row['eager_step_s'] * 1e3:.1f})"
    )


def _figure(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    labels = [f"{r['family']}\n{r['budget']}" for r in rows]
    x = range(len(rows))
    for ax, key, unit, scale in (
        (axes[0], "peak", "GiB", 1 / GIB),
        (axes[1], "step", "ms", 1e3),
    ):
        pk, mk = (
            ("predicted_peak_bytes", "measured_peak_bytes")
            if key == "peak"
            else ("predicted_step_s", "measured_step_s")
        )
        ax.bar([i - 0.2 for i in x], [r[pk] * scale for r in rows], 0.4, label="predicted on meta")
        ax.bar([i + 0.2 for i in x], [r[mk] * scale for r in rows], 0.4, label="measured")
        ax.set_xticks(list(x), labels, fontsize=7)
        ax.set_ylabel(f"{key} ({unit})")
        ax.legend(fontsize=8)
    fig.suptitle(f"Planned on meta for {rows[0]['target']}, run on {rows[0]['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out/on_target"))
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("benchmarks.on_target: no GPU present (torch.cuda.is_available() is False); skipped")
        return 0
    size = "cpu" if args.device == "cpu" else "quick" if args.quick else "full"
    shape = dict(SHAPES[size])
    if args.seq:
        shape["seq"] = args.seq
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for family in [f for f in args.families.split(",") if f]:
        rows += run_family(shape, family, torch.device(args.device))
        # written after each family, so a run cut short keeps what it measured
        (args.out / "on_target.json").write_text(json.dumps({"shape": shape, "rows": rows}))
        with open(args.out / "on_target.csv", "w", newline="") as f:
            fields = list(dict.fromkeys(k for row in rows for k in row))
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows(rows)
    measured = [row for row in rows if "error" not in row]
    if measured and importlib.util.find_spec("matplotlib") is not None:
        _figure(measured, args.out / "on_target.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
