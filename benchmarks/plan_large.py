"""Planning before launch at Llama 3 sizes: time and resident memory of planning a Hugging Face
``LlamaForCausalLM`` built on the meta device, for an H100, in bf16 autocast, with AdamW.

    python -m benchmarks.plan_large [--quick] [--out out/plan_large]
    autockpt bench large [--quick]

Each configuration is planned in its own process (so its peak RSS is its own): the planner's
phases and wall seconds, ``ru_maxrss``, the leanest plan's and the no-checkpoint step's
per-rank peaks, the breakdown, and, when a budget is asked for, the plan's segments and
predicted step under the target's roofline. Written to ``plan_large.json``, ``.csv`` and a
``.png`` of the seconds per phase. ``--quick``: the 1B configuration with 2 layers only.

The shapes are Llama 3.2 1B, Llama 3 8B and Llama 3 70B (hidden, layers, heads, KV heads, MLP,
vocabulary 128256), batch 1 x 8192 tokens; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

CONFIGS: dict[str, dict[str, int]] = {
    "llama3-1b": dict(hidden=2048, layers=16, heads=32, kv=8, mlp=8192),
    "llama3-8b": dict(hidden=4096, layers=32, heads=32, kv=8, mlp=14336),
    "llama3-70b": dict(hidden=8192, layers=80, heads=64, kv=8, mlp=28672),
}
RUNS: tuple[tuple[str, int, str | None, int, str], ...] = (
    # (shape, ranks, sharding, sequences of 8192 tokens per rank, precision)
    ("llama3-1b", 1, None, 1, "bf16-mixed"),
    ("llama3-8b", 1, None, 1, "bf16-mixed"),
    ("llama3-8b", 8, "fsdp", 1, "bf16-mixed"),
    ("llama3-70b", 8, "fsdp", 1, "bf16-mixed"),
    # FSDP2's MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32), torchtitan's
    # (docs/large-runs.md, "Against torchtitan's figures"); batch 2 is torchtitan's table's
    ("llama3-8b", 8, "fsdp", 1, "fsdp-bf16"),
    ("llama3-8b", 8, "fsdp", 2, "fsdp-bf16"),
)


def _one(
    name: str,
    world_size: int,
    sharding: str | None,
    layers: int | None,
    batch: int = 1,
    precision: str = "bf16-mixed",
) -> dict[str, Any]:
    """Plan one configuration in this process and return what was measured."""
    import resource
    import time
    import warnings

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import autockpt
    from autockpt.api import Planner
    from autockpt.distributed import fsdp_bf16_twin

    warnings.simplefilter("ignore")
    shape = CONFIGS[name]
    config = LlamaConfig(
        hidden_size=shape["hidden"],
        num_hidden_layers=layers or shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv"],
        intermediate_size=shape["mlp"],
        vocab_size=128256,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    started = time.perf_counter()
    with torch.device("meta"):
        model = LlamaForCausalLM(config).train()
    if precision == "bf16-true":
        model = model.to(torch.bfloat16)  # free on meta
    elif precision == "fsdp-bf16":
        model = fsdp_bf16_twin(model)  # what the policy computes with; free on meta
    ids = torch.empty(batch, 8192, dtype=torch.long, device="meta")
    planner = Planner(
        model,
        {"input_ids": ids, "labels": ids},
        optimizer=torch.optim.AdamW(model.parameters()),
        target="h100",
        precision=precision,
        world_size=world_size,
        sharding=sharding,
    )
    found: dict[str, Any] = {
        "config": name,
        "layers": config.num_hidden_layers,
        "world_size": world_size,
        "sharding": sharding,
        "batch": batch,
        "precision": precision,
        "parameters": sum(p.numel() for p in model.parameters()),
        "phases_s": {k: round(v, 2) for k, v in planner.phase_seconds.items()},
        "minimum_gib": planner.minimum_peak_bytes / 2**30,
        "no_checkpoint_gib": planner.no_checkpoint_peak_bytes / 2**30,
        "breakdown_gib": {k: v / 2**30 for k, v in planner.breakdown.items()},
        "no_checkpoint_step_s": planner.step_seconds,
    }
    if getattr(planner, "per_block_segments", None):
        found["per_layer_gib"] = planner.predict(planner.per_block_segments) / 2**30
    budget = autockpt.TARGETS["h100"].default_budget_bytes
    if planner.minimum_peak_bytes <= budget:
        solution = planner.solve(budget)
        found["plan_segments"] = len(solution.segments)
        found["plan_peak_gib"] = solution.peak_bytes / 2**30
    found["wall_s"] = time.perf_counter() - started
    found["max_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return found


def run(quick: bool, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    runs = (("llama3-1b", 1, None, 1, "bf16-mixed"),) if quick else RUNS
    rows = []
    for name, world_size, sharding, batch, precision in runs:
        command = [sys.executable, "-m", "benchmarks.plan_large", "--one", name]
        command += ["--world-size", str(world_size), "--batch", str(batch)]
        command += ["--precision", precision]
        command += ["--sharding", sharding] if sharding else []
        command += ["--layers", "2"] if quick else []
        env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
        root = Path(__file__).resolve().parents[1]  # `-m benchmarks.plan_large` from there
        done = subprocess.run(
            command, capture_output=True, text=True, env=env, check=False, cwd=root
        )
        if done.returncode != 0:
            rows.append({"config": name, "world_size": world_size, "error": done.stderr[-800:]})
            print(f"{name} x{world_size}: failed\n{done.stderr[-800:]}")
            continue
        row = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(
            f"{name} x{world_size} {sharding or '-'} batch {batch} {precision}: "
            f"{row['wall_s']:.1f} s, "
            f"RSS {row['max_rss_gib']:.2f} GiB, leanest {row['minimum_gib']:.2f} GiB, "
            f"no checkpointing {row['no_checkpoint_gib']:.2f} GiB per rank"
        )
    (out / "plan_large.json").write_text(json.dumps(rows, indent=2))
    with open(out / "plan_large.csv", "w", newline="") as f:
        keys = ["config", "layers", "world_size", "sharding", "batch", "precision", "wall_s"]
        keys += ["max_rss_gib"]
        keys += ["minimum_gib", "per_layer_gib", "no_checkpoint_gib", "plan_segments"]
        keys += ["plan_peak_gib"]
        writer = csv.DictWriter(f, keys, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    _figure(rows, out / "plan_large.png")


def _figure(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in rows if "phases_s" in r]
    if not done:
        return
    labels = [
        f"{r['config'].removeprefix('llama3-')} x{r['world_size']}\nb{r['batch']} "
        f"{r['precision'].split('-')[1]}"
        for r in done
    ]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    bottom = [0.0] * len(done)
    for phase in ("capture", "profile", "record", "search"):
        seconds = [r["phases_s"].get(phase, 0.0) for r in done]
        ax.bar(labels, seconds, bottom=bottom, label=phase)
        bottom = [b + s for b, s in zip(bottom, seconds, strict=True)]
    ax.set_ylabel("planning seconds (2-core CPU)")
    ax.set_title("Planning on the meta device for h100, bf16 autocast, AdamW")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("out/plan_large"))
    parser.add_argument("--one", choices=tuple(CONFIGS))
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--sharding", default=None)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--precision", default="bf16-mixed")
    args = parser.parse_args()
    if args.one:
        found = _one(
            args.one, args.world_size, args.sharding, args.layers, args.batch, args.precision
        )
        print(json.dumps(found))
    else:
        run(args.quick, args.out)


if __name__ == "__main__":
    main()
