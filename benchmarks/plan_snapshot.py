"""Plans of the zoo at two budgets, written without their timing fields, to show that a
change of the code's shape changed no plan.

    AUTOCKPT_CACHE_DIR=out/snapshot_store python -m benchmarks.plan_snapshot --out out/plans_before
    ... change the code ...
    AUTOCKPT_CACHE_DIR=out/snapshot_store python -m benchmarks.plan_snapshot --out out/plans_after
    diff -r out/plans_before out/plans_after

Why a shared store: plans are ranked by measured node seconds, which the first process on a
machine publishes to the store and every later one reads (NOTE [timing: published once]), so
two runs over the same store plan from the same seconds and must give the same bytes. Timing
fields (every ``*_seconds``, a solve's gap, the version strings) are measured or stamped,
not planned, and are left out; everything else of each plan is written as the plan's JSON.
Each model is planned through ``Planner`` (its range, then ``optimize`` verified at 30% and
70% of the way from its minimum to its no-checkpoint peak) and through ``solve`` at the same
budgets, and the frontier-facing numbers (minimum, no-checkpoint, as-written peaks, the
breakdown) are written beside the plans.
"""

from __future__ import annotations

import argparse
import json
import os
import warnings
from pathlib import Path
from typing import Any

FRACTIONS = (0.3, 0.7)
UNSTABLE = {"autockpt_version", "torch_version", "solver_gap"}


def _stable(value: Any) -> Any:
    """``value`` without its measured or stamped fields (keys ending in ``seconds``)."""
    if isinstance(value, dict):
        return {
            k: _stable(v)
            for k, v in value.items()
            if not k.endswith("seconds") and k not in UNSTABLE
        }
    if isinstance(value, list):
        return [_stable(v) for v in value]
    return value


def snapshot(names: list[str], out: Path) -> None:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from autockpt.api import Planner
    from autockpt_zoo.toy import ZOO

    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        model, inputs = ZOO[name]()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            planner = Planner(model, inputs)
            low, high = planner.minimum_peak_bytes, planner.no_checkpoint_peak_bytes
            found: dict[str, Any] = {
                "minimum_peak_bytes": low,
                "no_checkpoint_peak_bytes": high,
                "as_written_peak_bytes": planner.as_written_peak_bytes,
                "breakdown": dict(planner.breakdown),
            }
            for fraction in FRACTIONS:
                budget = int(low + fraction * (high - low))
                result = planner.optimize(budget_gb=budget / 2**30)
                plan = json.loads(result.plan.to_json())
                found[f"plan_{fraction}"] = _stable(plan)
                if planner.nested is None:
                    solution = planner.solve(budget)
                    found[f"solve_{fraction}"] = {
                        "segments": [list(s) for s in solution.segments],
                        "kept": [list(k) for k in solution.kept],
                        "peak_bytes": solution.peak_bytes,
                    }
        (out / f"{name}.json").write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")
        print(name, "minimum", low, "no-checkpoint", high, flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--models", default="", help="comma-separated zoo names (default all)")
    args = parser.parse_args(argv)
    from autockpt_zoo.toy import ZOO

    names = [n for n in args.models.split(",") if n] or sorted(ZOO)
    snapshot(names, args.out)


if __name__ == "__main__":
    main()
