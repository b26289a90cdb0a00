"""FSDP2's gathered units, predicted and measured on two gloo ranks: segments over several
units, and every ``reshard_after_forward`` choice.

    python -m benchmarks.fsdp_gathers [--out out/fsdp_gathers]

A rank's peak under FSDP2 depends on which units are gathered when (NOTE [search: gathered
units], solvers/rank.py; NOTE [sharding: reshard after forward]): a checkpointed segment's
recompute gathers its units inside the backward, where FSDP2 does not reshard them, and a
unit kept gathered after forward (``reshard_after_forward=False``) is held until its own
backward. The model is ``autockpt_zoo.toy.param_heavy`` (six dense units of 2.1 MB around a
root of 1 MB, its loss outside it), whose units are a large part of a rank's peak. For each
case (a ``reshard_after_forward`` choice and a set of segments) the parent plans the
segments for two FSDP2 ranks (``Planner.predict``: the number the search compares) and
writes the plan; two spawned gloo ranks apply it (``autockpt.apply``), shard it as the plan
says (``autockpt.distributed.wrap(..., plan=plan)``) and measure one step with
:func:`autockpt.distributed.measure_rank`.

Written to ``fsdp_gathers.json``, ``.csv`` and ``.png`` and printed as a table; exits 1 when
a rank measures above its prediction.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("KINETO_LOG_LEVEL", "5")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import autockpt  # noqa: E402
from autockpt.api import Planner  # noqa: E402
from autockpt.distributed import measure_rank, wrap  # noqa: E402
from autockpt.errors import format_bytes  # noqa: E402
from autockpt.plan import Plan  # noqa: E402
from autockpt_zoo.toy import param_heavy, square_mean  # noqa: E402
from solvers.solution import Solution  # noqa: E402

WORLD_SIZE = 2
UNITS = (1, 7)  # the stages of the six units (one node each, between the root's two)
CASES: list[tuple[str, Any, list[tuple[int, int]]]] = [
    ("defaults, no checkpointing", None, []),
    ("defaults, one segment over the six units", None, [UNITS]),
    ("defaults, two segments of three units", None, [(1, 4), (4, 7)]),
    ("defaults, a segment per unit", None, [(k, k + 1) for k in range(*UNITS)]),
    ("every unit kept gathered, no checkpointing", False, []),
    ("every unit kept gathered, two segments of three", False, [(1, 4), (4, 7)]),
    ("the last unit kept gathered, no checkpointing", {"layers.5": False}, []),
    ("the root resharded after forward, no checkpointing", {"": True}, []),
]
"""(what it is, ``reshard_after_forward`` as ``optimize`` takes it, segments as stage ranges)."""


def plan_case(choice: Any, segments: list[tuple[int, int]]) -> tuple[Plan, float]:
    """The plan of ``segments`` for two FSDP2 ranks under ``choice``, and planning seconds."""
    started = time.perf_counter()
    model, batch = param_heavy()
    planner = Planner(
        model,
        batch,
        loss_fn=square_mean,
        world_size=WORLD_SIZE,
        sharding="fsdp",
        reshard_after_forward=choice,
    )
    predicted = planner.predict(segments)
    given = Solution(segments, 0.0, predicted, "feasible", "given", 0.0, None)
    return planner.route.plan_of(given, predicted), time.perf_counter() - started


def rank_main(rank: int, world_size: int, plans: list[str], out: str) -> None:
    """One spawned rank: every case's plan applied, sharded as it says, one step measured."""
    dist.init_process_group(
        "gloo", init_method=f"file://{out}/rendezvous", rank=rank, world_size=world_size
    )
    try:
        peaks = []
        for text in plans:
            plan = Plan.from_json(text)

            def build(plan: Plan = plan) -> tuple[torch.nn.Module, Any]:
                model, batch = param_heavy()
                return wrap(autockpt.apply(model, plan, batch), "fsdp", plan=plan), batch

            _, _, measured = measure_rank(build, loss_fn=square_mean)
            peaks.append((measured.peak_bytes, measured.resident_bytes))
        torch.save(peaks, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run(out: Path) -> list[dict[str, Any]]:
    """Plan every case here, measure them all on two spawned gloo ranks."""
    planned = [
        (name, choice, segments, *plan_case(choice, segments)) for name, choice, segments in CASES
    ]
    with tempfile.TemporaryDirectory() as scratch:
        mp.start_processes(
            rank_main,
            args=(WORLD_SIZE, [plan.to_json() for *_, plan, _ in planned], scratch),
            nprocs=WORLD_SIZE,
            start_method="spawn",
        )
        measured = [torch.load(Path(scratch) / f"rank{r}.pt") for r in range(WORLD_SIZE)]
    rows = []
    for k, (name, choice, segments, plan, seconds) in enumerate(planned):
        peaks = [measured[r][k][0] for r in range(WORLD_SIZE)]
        rows.append(
            {
                "case": name,
                "reshard_after_forward": choice,
                "fsdp_kept_gathered": list(plan.fsdp_kept_gathered or ()),
                "segments": [list(s) for s in segments],
                "predicted_peak_bytes": plan.predicted_peak_bytes,
                "measured_peak_bytes": peaks,
                "predicted_resident_bytes": plan.rank_memory.static,
                "measured_resident_bytes": [measured[r][k][1] for r in range(WORLD_SIZE)],
                "planning_seconds": seconds,
            }
        )
    out.mkdir(parents=True, exist_ok=True)
    (out / "fsdp_gathers.json").write_text(json.dumps(rows, indent=2))
    with open(out / "fsdp_gathers.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["case", "rank", "predicted_peak", "measured_peak", "predicted/measured"])
        for row in rows:
            for rank, peak in enumerate(row["measured_peak_bytes"]):
                ratio = row["predicted_peak_bytes"] / peak
                writer.writerow(
                    [row["case"], rank, row["predicted_peak_bytes"], peak, f"{ratio:.4f}"]
                )
    _figure(rows, out / "fsdp_gathers.png")
    return rows


def _figure(rows: list[dict[str, Any]], path: Path) -> None:
    """Predicted against measured peaks (rank 0), one pair of bars per case."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.6))
    ks = range(len(rows))
    mib = 2**20
    ax.bar(
        [k - 0.2 for k in ks],
        [r["predicted_peak_bytes"] / mib for r in rows],
        0.4,
        label="predicted",
    )
    ax.bar(
        [k + 0.2 for k in ks],
        [r["measured_peak_bytes"][0] / mib for r in rows],
        0.4,
        label="measured",
    )
    ax.set_xticks(list(ks), [str(k + 1) for k in ks])
    ax.set_xlabel("case (see fsdp_gathers.csv)")
    ax.set_ylabel("peak per rank, MiB")
    ax.set_title("param_heavy on 2 gloo ranks, FSDP2: gathered units by plan", fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def report(rows: list[dict[str, Any]]) -> bool:
    """Print the table; True when no rank measures above its prediction."""
    ok = True
    print(f"{'case':52s} {'predicted':>12s} {'measured':>12s} {'pred/meas':>9s}")
    for row in rows:
        worst = max(row["measured_peak_bytes"])
        ok = ok and worst <= row["predicted_peak_bytes"]
        print(
            f"{row['case']:52s} {format_bytes(row['predicted_peak_bytes']):>12s} "
            f"{format_bytes(worst):>12s} {row['predicted_peak_bytes'] / worst:9.4f}"
        )
    print("every rank at or under its prediction" if ok else "A RANK WENT OVER ITS PREDICTION")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out/fsdp_gathers"))
    args = parser.parse_args(argv)
    return 0 if report(run(args.out)) else 1


if __name__ == "__main__":
    # Run the importable copy: spawned ranks unpickle its functions by module name.
    from benchmarks.fsdp_gathers import main as _main

    raise SystemExit(_main())
