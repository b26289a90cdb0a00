"""Chains profiled from the real models of the zoo, for the solver benchmark.

    python -m benchmarks.zoo_chains [--out benchmarks/zoo_chains.json]

Each zoo model is captured and profiled once (the same path ``autockpt.optimize`` takes),
and its calibrated :class:`solvers.ChainProblem` is stored as plain numbers. The solver
benchmark reads the stored file, so it stays torch-free and repeatable; rerun this module to
refresh the chains after changing the profiler or the zoo.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import warnings
from pathlib import Path

from solvers import ChainProblem

DEFAULT_PATH = Path(__file__).with_name("zoo_chains.json")


def profile_zoo() -> dict[str, ChainProblem]:
    """Profile every zoo model (needs torch) and return its chain problem."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from autockpt.api import Planner
    from autockpt_zoo.toy import ZOO

    problems = {}
    for name in sorted(ZOO):
        if name == "gpt_checkpointed":
            continue  # the same graph as gpt once captured
        model, inputs = ZOO[name]()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            planner = Planner(model, inputs)
        problems[name] = planner.chain.problem
    return problems


def save(problems: dict[str, ChainProblem], path: Path = DEFAULT_PATH) -> None:
    data = {name: dataclasses.asdict(problem) for name, problem in problems.items()}
    path.write_text(json.dumps(data, indent=1) + "\n")


def load(path: Path = DEFAULT_PATH) -> dict[str, ChainProblem]:
    """The stored zoo chains (empty when the file is missing)."""
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    problems = {}
    for name, fields in data.items():
        problems[name] = ChainProblem(
            fields.pop("saved_bytes"),
            fields.pop("input_bytes"),
            fields.pop("forward_seconds"),
            fields.pop("budget_bytes"),
            **fields,
        )
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_PATH)
    args = parser.parse_args()
    problems = profile_zoo()
    save(problems, args.out)
    for name, problem in problems.items():
        print(f"{name:<24} {problem.num_stages:>4} stages")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
