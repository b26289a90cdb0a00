"""Solver benchmark on synthetic chains: speed and plan quality of every method.

Usage::

    python -m benchmarks.solvers_bench [--quick] [--out DIR]

Chains (deterministic, see the generators below): ``uniform`` (identical stages),
``random`` (heterogeneous, independent random sizes and times) and ``transformer``
(repeating 6-stage blocks shaped like pre-norm transformer layers). Sizes run from 10 to
2000 stages (``--quick``: up to 200). Budgets sit at 20%..90% of the way from the chain's
minimum feasible peak to its no-checkpoint peak. ``ilp`` only runs up to 200 stages, with
a time limit.

When ``benchmarks/zoo_chains.json`` (chains profiled from the model zoo, see
``benchmarks/zoo_chains.py``) is present, each of its chains is run too at the same budget
fractions and reported in a table of its own (the size tables and plots cover the
synthetic chains only).

Writes ``results.json``, ``results.csv``, ``summary.md``, ``solve_time.png`` (median solve
time vs stages per method, log-log) and ``relative_cost.png`` (recompute time relative to
dp's optimum per budget fraction) to ``--out`` (default ``out/solvers/``).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import pathlib
import platform
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable

import numpy as np

from solvers import ChainProblem, minimum_peak_bytes, simulate, solve

MB = 1 << 20
FULL_SIZES = (10, 20, 50, 100, 200, 500, 1000, 2000)
QUICK_SIZES = (10, 20, 50, 100, 200)
FRACTIONS = (0.2, 0.35, 0.5, 0.65, 0.8, 0.9)
METHOD_ORDER = ("dp", "auto", "ilp", "greedy", "sqrt")
ILP_MAX_STAGES = 200


def uniform_chain(n: int, seed: int = 0) -> ChainProblem:
    """Identical stages: 4 MiB saved, 1 MiB in, 1 MiB workspace, 1 ms forward."""
    del seed
    return ChainProblem(
        [4 * MB] * n, [MB] * n, [1e-3] * n, 0, static_bytes=1 << 30, transient_bytes=[MB] * n
    )


def random_chain(n: int, seed: int = 0) -> ChainProblem:
    """Heterogeneous: inputs 1-8 MiB, saved 1-4x the input, forward 0.2-2 ms."""
    rng = np.random.default_rng(seed)
    a = rng.integers(MB, 8 * MB, n)
    return ChainProblem(
        (a * rng.uniform(1, 4, n)).astype(np.int64).tolist(),
        a.tolist(),
        rng.uniform(0.2e-3, 2e-3, n).tolist(),
        0,
        static_bytes=1 << 30,
        param_grad_bytes=rng.integers(0, MB, n).tolist(),
        transient_bytes=(a * rng.uniform(0, 1, n)).astype(np.int64).tolist(),
    )


def transformer_chain(n: int, seed: int = 0) -> ChainProblem:
    """Repeating blocks: norm, qkv projection, attention, out projection, norm, MLP."""
    del seed
    h = 8 * MB
    saved = (h, 3 * h, 4 * h, h, h, 4 * h)
    inputs = (h, h, 3 * h, h, h, h)
    forward = (0.05e-3, 0.6e-3, 0.4e-3, 0.2e-3, 0.05e-3, 0.8e-3)
    transient = (0, h, 2 * h, 0, 0, 2 * h)
    grads = (0, 3 * MB, 0, MB, 0, 8 * MB)
    block = [k % 6 for k in range(n)]
    return ChainProblem(
        [saved[i] for i in block],
        [inputs[i] for i in block],
        [forward[i] for i in block],
        0,
        static_bytes=1 << 30,
        transient_bytes=[transient[i] for i in block],
        param_grad_bytes=[grads[i] for i in block],
    )


CHAINS: dict[str, Callable[[int, int], ChainProblem]] = {
    "uniform": uniform_chain,
    "random": random_chain,
    "transformer": transformer_chain,
}


def _limits(quick: bool) -> dict[str, float | None]:
    return {"dp": None, "auto": 30.0, "ilp": 5.0 if quick else 10.0, "greedy": None, "sqrt": None}


def run(quick: bool, out_dir: pathlib.Path) -> list[dict]:
    """Run the benchmark, write all artefacts to ``out_dir`` and return the records."""
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sizes = QUICK_SIZES if quick else FULL_SIZES
    limits = _limits(quick)
    records: list[dict] = []
    started = time.perf_counter()
    for chain_name, make in CHAINS.items():
        for n in sizes:
            records.extend(_bench_chain(chain_name, "synthetic", make(n, 0), limits, started))
    for name, problem in _zoo_chains().items():
        records.extend(_bench_chain(name, "zoo", problem, limits, started))
    _write(records, out_dir, quick)
    return records


def _zoo_chains() -> dict[str, ChainProblem]:
    """Chains profiled from the model zoo (``benchmarks/zoo_chains.json``), if present."""
    try:
        from benchmarks.zoo_chains import load
    except ImportError:
        return {}
    return load()


def _bench_chain(
    chain_name: str,
    family: str,
    base: ChainProblem,
    limits: dict[str, float | None],
    started: float,
) -> list[dict]:
    """Every method at every budget fraction of one chain."""
    n = base.num_stages
    t0 = time.perf_counter()
    least, _ = minimum_peak_bytes(base)
    min_peak_s = time.perf_counter() - t0
    most = simulate(base, []).peak_bytes
    records: list[dict] = []
    for fraction in FRACTIONS:
        problem = base.with_budget(least + int(fraction * (most - least)))
        rows = []
        for method in METHOD_ORDER:
            if method == "ilp" and n > ILP_MAX_STAGES:
                continue
            cpu0 = time.process_time()
            sol = solve(problem, method, time_limit_s=limits[method])
            cpu = time.process_time() - cpu0
            rows.append(
                {
                    "chain": chain_name,
                    "family": family,
                    "stages": n,
                    "budget_fraction": fraction,
                    "budget_bytes": problem.budget_bytes,
                    "min_peak_bytes": least,
                    "no_checkpoint_peak_bytes": most,
                    "min_peak_seconds": min_peak_s,
                    "method": method,
                    "answered_by": sol.method,
                    "status": sol.status,
                    "solve_seconds": sol.solve_seconds,
                    "cpu_seconds": cpu,
                    "time_limit_s": limits[method],
                    "recompute_seconds": sol.recompute_seconds,
                    "peak_bytes": sol.peak_bytes,
                    "segments": len(sol.segments),
                    "gap": sol.gap,
                }
            )
        optimum = next(r for r in rows if r["method"] == "dp")
        for r in rows:
            r["relative_cost"] = _relative(r, optimum)
        records.extend(rows)
        _progress(rows, started)
    return records


def _relative(row: dict, optimum: dict) -> float | None:
    """Recompute time relative to dp's optimum (``None`` when the plan does not fit)."""
    if row["status"] == "infeasible" or optimum["status"] != "optimal":
        return None
    best = optimum["recompute_seconds"]
    if best <= 0:
        return 1.0 if row["recompute_seconds"] <= 0 else math.inf
    return row["recompute_seconds"] / best


def _progress(rows: list[dict], started: float) -> None:
    r0 = rows[0]
    times = " ".join(f"{r['method']}={r['solve_seconds']:.3f}s" for r in rows)
    print(
        f"[{time.perf_counter() - started:7.1f}s] {r0['chain']:11s} n={r0['stages']:5d} "
        f"f={r0['budget_fraction']:.2f} {times}",
        file=sys.stderr,
        flush=True,
    )


def _environment(quick: bool) -> dict:
    import pulp

    return {
        "quick": quick,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "pulp": pulp.__version__,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }


def _write(
    records: list[dict], out_dir: pathlib.Path, quick: bool, environment: dict | None = None
) -> None:
    (out_dir / "results.json").write_text(
        json.dumps(
            {"environment": environment or _environment(quick), "records": records}, indent=1
        )
    )
    with open(out_dir / "results.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(records[0]))
        writer.writeheader()
        writer.writerows(records)
    (out_dir / "summary.md").write_text(summary_markdown(records))
    _plot(records, out_dir)


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def _synthetic(records: list[dict]) -> list[dict]:
    return [r for r in records if r.get("family", "synthetic") == "synthetic"]


def summary_markdown(records: list[dict]) -> str:
    """Markdown tables: median solve time per method and size; relative cost per budget
    (synthetic chains), then one row per zoo chain."""
    zoo = [r for r in records if r.get("family") == "zoo"]
    records = _synthetic(records)
    methods = [m for m in METHOD_ORDER if any(r["method"] == m for r in records)]
    sizes = sorted({r["stages"] for r in records})
    lines = [
        "Median wall-clock solve time in seconds (over chain types and budgets; n/a = not run):",
        "",
        "| stages | " + " | ".join(methods) + " |",
        "|---:|" + "---:|" * len(methods),
    ]
    for n in sizes:
        cells = []
        for m in methods:
            ts = [r["solve_seconds"] for r in records if r["stages"] == n and r["method"] == m]
            cells.append(f"{_median(ts):.3g}" if ts else "n/a")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "dp wall-clock solve time per chain type, median (max) over budgets, seconds:",
        "",
        "| stages | " + " | ".join(CHAINS) + " |",
        "|---:|" + "---:|" * len(CHAINS),
    ]
    for n in sizes:
        cells = []
        for chain in CHAINS:
            ts = [
                r["solve_seconds"]
                for r in records
                if r["stages"] == n and r["method"] == "dp" and r["chain"] == chain
            ]
            cells.append(f"{_median(ts):.3g} ({max(ts):.3g})" if ts else "n/a")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    ilp_rows = [r for r in records if r["method"] == "ilp"]
    if ilp_rows:
        lines += [
            "",
            "ilp per chain type (time limit "
            f"{ilp_rows[0]['time_limit_s']} s): proved optimal / runs, median "
            "wall-clock seconds:",
            "",
            "| stages | " + " | ".join(CHAINS) + " |",
            "|---:|" + "---:|" * len(CHAINS),
        ]
        for n in sorted({r["stages"] for r in ilp_rows}):
            cells = []
            for chain in CHAINS:
                rows = [r for r in ilp_rows if r["stages"] == n and r["chain"] == chain]
                proved = sum(r["status"] == "optimal" for r in rows)
                cells.append(
                    f"{proved}/{len(rows)}, {_median([r['solve_seconds'] for r in rows]):.3g}"
                )
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Recompute time relative to dp's optimum, median (max) over chain types and "
        "sizes; `inf` = baseline plan does not fit (its relative cost is unbounded), "
        "shown as the share of runs that did not fit:",
        "",
        "| budget fraction | " + " | ".join(methods) + " |",
        "|---:|" + "---:|" * len(methods),
    ]
    for fraction in FRACTIONS:
        cells = []
        for m in methods:
            rows = [r for r in records if r["budget_fraction"] == fraction and r["method"] == m]
            rel = [r["relative_cost"] for r in rows if r["relative_cost"] is not None]
            misses = sum(r["status"] == "infeasible" for r in rows)
            cell = f"{_median(rel):.3f} ({max(rel):.3f})" if rel else "-"
            if misses:
                cell += f", {misses}/{len(rows)} over budget"
            cells.append(cell)
        lines.append(f"| {fraction:.2f} | " + " | ".join(cells) + " |")
    statuses = defaultdict(lambda: defaultdict(int))
    for r in records:
        statuses[r["method"]][r["status"]] += 1
    lines += ["", "Status counts per method:", ""]
    for m in methods:
        counts = ", ".join(f"{k}: {v}" for k, v in sorted(statuses[m].items()))
        lines.append(f"- `{m}`: {counts}")
    if zoo:
        lines += ["", _zoo_markdown(zoo)]
    return "\n".join(lines) + "\n"


def _zoo_markdown(zoo: list[dict]) -> str:
    """One row per zoo chain: dp / ilp times and baseline costs over the budget fractions."""
    lines = [
        "Zoo chains (profiled models), over the budget fractions: dp median time, ilp "
        "proved / runs and median time, greedy and sqrt recompute time relative to dp "
        "(median, max):",
        "",
        "| chain | stages | dp s | ilp | greedy | sqrt |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for chain in sorted({r["chain"] for r in zoo}):
        rows = [r for r in zoo if r["chain"] == chain]

        def of(method: str, rows: list[dict] = rows) -> list[dict]:
            return [r for r in rows if r["method"] == method]

        def rel(method: str) -> str:
            vals = [r["relative_cost"] for r in of(method) if r["relative_cost"] is not None]
            misses = sum(r["status"] == "infeasible" for r in of(method))
            cell = f"{_median(vals):.3f}, {max(vals):.3f}" if vals else "-"
            return cell + (f" ({misses} over budget)" if misses else "")

        ilp = of("ilp")
        ilp_cell = (
            (
                f"{sum(r['status'] == 'optimal' for r in ilp)}/{len(ilp)}, "
                f"{_median([r['solve_seconds'] for r in ilp]):.3g} s"
            )
            if ilp
            else "n/a"
        )
        dp_s = _median([r["solve_seconds"] for r in of("dp")])
        lines.append(
            f"| {chain} | {rows[0]['stages']} | {dp_s:.3g} | {ilp_cell} | "
            f"{rel('greedy')} | {rel('sqrt')} |"
        )
    return "\n".join(lines)


def _plot(records: list[dict], out_dir: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = _synthetic(records)
    methods = [m for m in METHOD_ORDER if any(r["method"] == m for r in records)]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m in methods:
        sizes = sorted({r["stages"] for r in records if r["method"] == m})
        med = [
            _median([r["solve_seconds"] for r in records if r["method"] == m and r["stages"] == n])
            for n in sizes
        ]
        ax.plot(sizes, med, marker="o", label=m)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("stages")
    ax.set_ylabel("median solve time (s)")
    ax.set_title("Solve time vs chain length (median over chains and budgets)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "solve_time.png", dpi=120)
    plt.close(fig)

    chains = list(CHAINS)
    fig, axes = plt.subplots(1, len(chains), figsize=(4.2 * len(chains), 4), sharey=True)
    for ax, chain in zip(axes, chains, strict=True):
        for m in methods:
            xs, ys = [], []
            for fraction in FRACTIONS:
                rel = [
                    r["relative_cost"]
                    for r in records
                    if r["chain"] == chain
                    and r["method"] == m
                    and r["budget_fraction"] == fraction
                    and r["relative_cost"] is not None
                    and math.isfinite(r["relative_cost"])
                ]
                if rel:
                    xs.append(fraction)
                    ys.append(_median(rel))
            ax.plot(xs, ys, marker="o", label=m)
        ax.set_title(chain)
        ax.set_yscale("log")
        ax.set_xlabel("budget fraction (min peak -> no-checkpoint peak)")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("recompute time / dp optimum (median over sizes)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(out_dir / "relative_cost.png", dpi=120)
    plt.close(fig)


def rewrite(out_dir: pathlib.Path) -> list[dict]:
    """Regenerate CSV, summary and plots from an existing ``results.json``."""
    data = json.loads((pathlib.Path(out_dir) / "results.json").read_text())
    env = data["environment"]
    _write(data["records"], pathlib.Path(out_dir), bool(env.get("quick")), env)
    return data["records"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="sizes up to 200 stages only")
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        default=pathlib.Path("out/solvers"),
        help="output directory (default: out/solvers)",
    )
    parser.add_argument(
        "--rewrite",
        action="store_true",
        help="only regenerate tables and plots from OUT/results.json",
    )
    args = parser.parse_args(argv)
    records = rewrite(args.out) if args.rewrite else run(args.quick, args.out)
    print(summary_markdown(records))
    print(f"wrote {len(records)} records to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
