"""The headline comparison on one CUDA device.

    python -m benchmarks.gpu [--out out/gpu] [--models gpt2,llama] [--rounds 10] [--quick]
                             [--compile]

The CPU benchmark (:mod:`benchmarks.e2e`) times small models on two cores; whether its
ranking holds where training runs is a GPU question. This runs its two decoders (GPT-2-style
and Llama-style, at ``SIZES["cuda"]`` of :mod:`benchmarks.e2e_models`: GPT-2 small widths and
a 12-layer d=1024 Llama at sequence 1024, meant to take under 5 minutes together) with the
methods that matter for selective recompute: no checkpointing, per-block checkpointing,
torchtitan's per-block op policy (``titan_sac``), autockpt (``auto``) and autockpt's
segment-only plans (``auto_segments``), the last two at per-block's measured peak, at
``titan_sac``'s and halfway from per-block's to no checkpointing. Everything is
:func:`benchmarks.e2e.run_case`: peaks from ``torch.cuda.max_memory_allocated`` through
:func:`autockpt.measure`, step times from CUDA events over interleaved rounds; the files are
:func:`benchmarks.e2e.write`'s (``e2e.json``, ``e2e.csv``, ``summary.md`` with the targets,
``headline.md``, and the plots where matplotlib is installed). ``--compile`` adds
``torch.compile`` at ``activation_memory_budget`` 0.1, 0.3 and 0.5 and autockpt's compiled
route at each of their measured peaks (``compile_auto``; minutes of compiling more).

Without a GPU it says so in one line and exits 0, so it can sit in any script.
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path

import torch

from benchmarks import e2e
from benchmarks.e2e_models import cases

MODELS = ("gpt2", "llama")
METHODS = ("none", "per_block", "titan_sac", "auto", "auto_segments")
BUDGETS = ("per_block_peak", "titan_sac_peak", "halfway")
"""Budget labels of :func:`benchmarks.e2e._budgets` that the planned rows run at."""


def run(
    out_dir: Path,
    *,
    models: tuple[str, ...] = MODELS,
    rounds: int = 10,
    quick: bool = False,
    device: str = "cuda",
    compile: bool = False,
) -> list[e2e.Cell]:
    """Run the comparison and write its files into ``out_dir``; return the cells. ``quick``
    halves every batch; ``device`` other than ``cuda`` (with that device's sizes) is for
    checking the script itself."""
    chosen = [c for c in cases(device, quick=quick) if c.name in models]
    unknown = set(models) - {c.name for c in chosen}
    if unknown:
        raise ValueError(f"unknown model(s) {sorted(unknown)}; choose from {list(MODELS)}")
    started = time.perf_counter()
    methods = (*METHODS, *e2e.COMPILE_POINTS, e2e.COMPILED_PLAN) if compile else METHODS
    cells: list[e2e.Cell] = []
    for case in chosen:
        cells += e2e.run_case(
            case,
            methods=methods,
            rounds=rounds,
            device=torch.device(device),
            compile_models=models if compile else (),
            budget_labels=BUDGETS,
        )
    targets = e2e.evaluate_targets(cells)
    meta = {
        "command": "python -m benchmarks.gpu"
        + (" --quick" if quick else "")
        + (" --compile" if compile else ""),
        "machine": e2e.machine(),
        "device": device,
        "rounds": rounds,
        "methods": list(methods),
        "budgets": list(BUDGETS),
        "models": {c.name: c.description for c in chosen},
        "wall_seconds": time.perf_counter() - started,
    }
    plots = importlib.util.find_spec("matplotlib") is not None
    e2e.write(cells, targets, out_dir, meta, plots=plots)
    print(f"wrote {out_dir}/ in {meta['wall_seconds']:.0f}s")
    return cells


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out/gpu"))
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated subset")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="half batch")
    parser.add_argument(
        "--compile", action="store_true", help="add torch.compile's points and compile_auto"
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.gpu: no GPU present (torch.cuda.is_available() is False); skipped")
        return 0
    models = tuple(m for m in args.models.split(",") if m)
    run(args.out, models=models, rounds=args.rounds, quick=args.quick, compile=args.compile)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
