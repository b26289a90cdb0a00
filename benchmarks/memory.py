"""Memory truth over the zoo: is every plan's measured peak under its budget, and how close
is the simulator's prediction to the measurement?

    python -m benchmarks.memory [--models a,b] [--out out/memory]
    python -m benchmarks.memory --large [--layers 38 --dim 4096 --seq 2048 --batch 4]

Budgets (scope="total"): for each model, ``A`` is its *activation memory*, the measured
no-checkpoint peak minus what no plan can remove (parameters, buffers, inputs and parameter
gradients). The budget at fraction ``f`` is ``static + gradients + f * A``. Each cell reports
the plan's predicted peak, its measured peak (``autockpt.measure``, the allocator-level
truth, measured again independently of the planner's own verification), the error
``(predicted - measured) / measured`` and whether the measurement is within the budget. A
budget below the leanest plan raises ``InfeasibleBudgetError``; the cell then reports its
stated minimum and plans again *at* that minimum to check it is achievable.

Held-out models (not in the zoo) run the same check: a stack of
``torch.nn.TransformerEncoderLayer``, a stacked-LSTM tagger and a small vision transformer
built on ``torch.nn.MultiheadAttention``.

``--large`` plans a decoder with about 30 GiB of parameters built on the meta device: no
parameter is ever allocated; times are FLOP estimates; peak RSS of the process is reported.

Writes ``memory.json``, ``memory.csv`` and ``memory.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import resource
import time
import warnings
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("KINETO_LOG_LEVEL", "5")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from autockpt.api import Planner  # noqa: E402
from autockpt.base.rng import worst_case_draws  # noqa: E402
from autockpt.capture import Inputs  # noqa: E402
from autockpt.errors import GIB, InfeasibleBudgetError  # noqa: E402
from autockpt.measure import measure  # noqa: E402
from autockpt_zoo.toy import ZOO, CheckedLM, LayerDropEncoder  # noqa: E402

FRACTIONS = (0.3, 0.5, 0.7, 0.9)
TOLERANCE = 0.05


# -- held-out models ---------------------------------------------------------------------------


class EncoderClassifier(nn.Module):
    """Embedding -> a stack of ``nn.TransformerEncoderLayer`` (post-norm) -> mean pool ->
    classifier. Built-in ``torch.nn`` layers are fx leaves, so segments are whole layers."""

    def __init__(self, vocab: int, dim: int, heads: int, layers: int, classes: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.1, batch_first=True)
            for _ in range(layers)
        )
        self.head = nn.Linear(dim, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(h.mean(dim=1))


def transformer_encoder(batch: int = 8, seq: int = 64) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = EncoderClassifier(vocab=256, dim=64, heads=4, layers=6, classes=10).train()
    return model, torch.randint(0, 256, (batch, seq))


class LSTMTagger(nn.Module):
    """Three separately stacked LSTMs with a projection between each, and a tag head."""

    def __init__(self, vocab: int, dim: int, layers: int, tags: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.lstms = nn.ModuleList(nn.LSTM(dim, dim, batch_first=True) for _ in range(layers))
        self.projections = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))
        self.head = nn.Linear(dim, tags)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for lstm, projection in zip(self.lstms, self.projections, strict=True):
            h = torch.tanh(projection(lstm(h)[0])) + h
        return self.head(h)


def lstm_tagger(batch: int = 16, seq: int = 48) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = LSTMTagger(vocab=200, dim=96, layers=3, tags=12).train()
    return model, torch.randint(0, 200, (batch, seq))


class PatchMixer(nn.Module):
    """A small vision transformer: conv patch embedding, blocks of ``nn.MultiheadAttention``
    (a built-in leaf) and a GELU MLP around pre-norms, class head on the mean token."""

    def __init__(self, dim: int, heads: int, depth: int, classes: int) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, dim, kernel_size=4, stride=4)
        self.norms1 = nn.ModuleList(nn.LayerNorm(dim) for _ in range(depth))
        self.attns = nn.ModuleList(
            nn.MultiheadAttention(dim, heads, batch_first=True) for _ in range(depth)
        )
        self.norms2 = nn.ModuleList(nn.LayerNorm(dim) for _ in range(depth))
        self.mlps = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
            for _ in range(depth)
        )
        self.head = nn.Linear(dim, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        h = self.patch(images).flatten(2).transpose(1, 2)
        for norm1, attn, norm2, mlp in zip(
            self.norms1, self.attns, self.norms2, self.mlps, strict=True
        ):
            x = norm1(h)
            h = h + attn(x, x, x, need_weights=False)[0]
            h = h + mlp(norm2(h))
        return self.head(h.mean(dim=1))


def patch_mixer(batch: int = 8, size: int = 32) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = PatchMixer(dim=96, heads=4, depth=4, classes=10).train()
    return model, torch.randn(batch, 3, size, size)


def layerdrop_encoder(batch: int = 8, seq: int = 128) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = LayerDropEncoder(dim=96, depth=6, p=0.2, features=16).train()
    return model, torch.randn(batch, seq, 16)


def checked_lm(batch: int = 8, seq: int = 128) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = CheckedLM(vocab=512, dim=96, depth=4).train()
    tokens = torch.randint(0, 512, (batch, seq))
    return model, {"idx": tokens, "labels": torch.randint(0, 512, (batch, seq))}


HELD_OUT = {
    "transformer_encoder": transformer_encoder,
    "lstm_tagger": lstm_tagger,
    "patch_mixer": patch_mixer,
    "layerdrop_encoder": layerdrop_encoder,
    "checked_lm": checked_lm,
}


def zoo_models() -> dict[str, Any]:
    models = dict(ZOO)
    models.pop("gpt_checkpointed", None)  # the same graph as gpt once captured
    return models


# -- the check -----------------------------------------------------------------------------


def check_model(
    name: str, factory: Any, fractions: tuple[float, ...], held_out: bool
) -> list[dict]:
    """Plan ``name`` at each budget fraction; return one row per cell."""
    model, example = factory()
    inputs = Inputs.of(example)
    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        planner = Planner(model, inputs)
    setup_seconds = time.perf_counter() - started
    # a root not captured whole is planned as units (NOTE [nested: units])
    nested = planner.nested
    eager = _measure(model, inputs)  # the benchmark's reference, not planning's
    if nested is None:
        fixed = planner.profile.static_bytes + planner.profile.param_grad_bytes
    else:
        fixed = nested.static_total
    activations = eager.peak_bytes - fixed
    rows = []
    for fraction in fractions:
        budget = fixed + int(fraction * activations)
        row: dict[str, Any] = {
            "model": name,
            "held_out": held_out,
            "fraction": fraction,
            "budget_bytes": budget,
            "activation_bytes": activations,
            "fixed_bytes": fixed,
            "eager_peak_bytes": eager.peak_bytes,
            "setup_seconds": setup_seconds,
        }
        try:
            fast = planner.optimize(budget_gb=budget / GIB)
        except InfeasibleBudgetError as error:
            row["infeasible"] = True
            row["minimum_bytes"] = error.minimum_bytes
            try:
                at_minimum = planner.optimize(budget_gb=error.minimum_bytes / GIB)
            except InfeasibleBudgetError:  # verification measured the leanest plan above it
                row["minimum_achieved"] = False
                lean = planner.search.leanest().segments
                measured = _measure(planner.rewrite(lean), inputs).peak_bytes
                predicted = planner.predict(lean)
                row["segments"] = len(lean)
            else:
                measured = _measure(at_minimum, inputs).peak_bytes
                predicted = at_minimum.plan.predicted_peak_bytes
                row["minimum_achieved"] = measured <= at_minimum.plan.budget_bytes
                row["segments"] = len(at_minimum.plan.segments)
        else:
            row["infeasible"] = False
            measured = _measure(fast, inputs).peak_bytes
            predicted = fast.plan.predicted_peak_bytes
            row["segments"] = len(fast.plan.segments)
            row["within_budget"] = measured <= budget
        row["predicted_bytes"] = predicted
        row["measured_bytes"] = measured
        row["error"] = (predicted - measured) / measured
        row["activation_error"] = (predicted - measured) / max(1, measured - fixed)
        rows.append(row)
        print(_line(row), flush=True)
    return rows


def _measure(model: nn.Module, inputs: Inputs) -> Any:
    """One measured step with scalar draws at their worst case (every LayerDrop layer
    runs), as plans are made for: the allocator's truth for the worst case."""
    with worst_case_draws():
        return measure(model, inputs, repeat=1)


def _line(row: dict) -> str:
    mib = 2**20
    if row["infeasible"]:
        verdict = (
            f"infeasible: minimum {row['minimum_bytes'] / mib:.3f} MiB, at it "
            f"{'fits' if row['minimum_achieved'] else 'DOES NOT FIT'}"
        )
    else:
        verdict = "within budget" if row["within_budget"] else "OVER BUDGET"
    return (
        f"{row['model']:<22} {int(100 * row['fraction']):>3}%  budget "
        f"{row['budget_bytes'] / mib:8.3f}  predicted {row['predicted_bytes'] / mib:8.3f}  "
        f"measured {row['measured_bytes'] / mib:8.3f} MiB  error {100 * row['error']:+6.2f}%  "
        f"{verdict}"
    )


def markdown(rows: list[dict]) -> str:
    mib = 2**20
    lines = [
        "| model | budget | budget (MiB) | predicted (MiB) | measured (MiB) | error | "
        "error / activations | segments | result |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        name = r["model"] + (" (held out)" if r["held_out"] else "")
        if r["infeasible"]:
            result = (
                f"infeasible; minimum {r['minimum_bytes'] / mib:.3f} MiB "
                f"{'achieved' if r['minimum_achieved'] else 'NOT achieved'}"
            )
        else:
            result = "within budget" if r["within_budget"] else "**over budget**"
        lines.append(
            f"| {name} | {int(100 * r['fraction'])}% | {r['budget_bytes'] / mib:.3f} | "
            f"{r['predicted_bytes'] / mib:.3f} | {r['measured_bytes'] / mib:.3f} | "
            f"{100 * r['error']:+.2f}% | {100 * r['activation_error']:+.2f}% | "
            f"{r['segments']} | {result} |"
        )
    return "\n".join(lines) + "\n"


def summary(rows: list[dict]) -> str:
    worst = max(rows, key=lambda r: abs(r["error"]))
    over = [r for r in rows if not r["infeasible"] and not r["within_budget"]]
    missed = [r for r in rows if abs(r["error"]) > TOLERANCE]
    unachieved = [r for r in rows if r["infeasible"] and not r["minimum_achieved"]]
    return (
        f"{len(rows)} cells; worst |error| {100 * abs(worst['error']):.2f}% ({worst['model']} at "
        f"{int(100 * worst['fraction'])}%); cells above 5%: {len(missed)}; over budget: "
        f"{len(over)}; infeasible cells whose minimum was not achieved: {len(unachieved)}"
    )


# -- planning a model that does not fit: the meta device --------------------------------------


def large_meta_plan(layers: int, dim: int, seq: int, batch: int, budget_gb: float | None) -> dict:
    """Plan a GPT-style decoder with ~30 GiB of parameters on the meta device."""
    from autockpt_zoo.toy import gpt

    started = time.perf_counter()
    with torch.device("meta"):  # parameters get shapes, never memory
        model, (idx, targets) = gpt(
            layers=layers,
            dim=dim,
            heads=max(1, dim // 128),
            vocab_size=32000,
            block_size=seq,
            batch=batch,
            seq_len=seq,
            dropout=0.0,
        )
    build_seconds = time.perf_counter() - started
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        planner = Planner(model, (idx, targets))
    if budget_gb is None:
        budget_gb = (planner.minimum_peak_bytes + planner.no_checkpoint_peak_bytes) / 2 / GIB
    fast = planner.optimize(budget_gb=budget_gb, verify=False)
    plan = fast.plan
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return {
        "layers": layers,
        "dim": dim,
        "seq": seq,
        "batch": batch,
        "parameter_bytes": params,
        "budget_bytes": plan.budget_bytes,
        "predicted_peak_bytes": plan.predicted_peak_bytes,
        "no_checkpoint_peak_bytes": plan.no_checkpoint_peak_bytes,
        "minimum_peak_bytes": plan.minimum_peak_bytes,
        "segments": len(plan.segments),
        "times_estimated": plan.times_estimated,
        "device": plan.device,
        "build_seconds": build_seconds,
        "total_seconds": time.perf_counter() - started,
        "peak_rss_bytes": rss,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.memory",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--models", help="comma-separated subset (zoo or held-out names)")
    parser.add_argument("--out", default="out/memory", type=Path)
    parser.add_argument("--large", action="store_true", help="meta-device plan of a ~30 GiB model")
    parser.add_argument("--layers", type=int, default=38)
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--budget-gb", type=float, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    args.out.mkdir(parents=True, exist_ok=True)
    if args.large:
        result = large_meta_plan(args.layers, args.dim, args.seq, args.batch, args.budget_gb)
        for key, value in result.items():
            print(
                f"{key:<26} {value / GIB:.3f} GiB"
                if key.endswith("bytes")
                else f"{key:<26} {value}"
            )
        (args.out / "large.json").write_text(json.dumps(result, indent=2) + "\n")
        return 0
    models = {
        **{k: (v, False) for k, v in zoo_models().items()},
        **{k: (v, True) for k, v in HELD_OUT.items()},
    }
    names = args.models.split(",") if args.models else list(models)
    rows: list[dict] = []
    for name in names:
        factory, held_out = models[name]
        rows.extend(check_model(name, factory, FRACTIONS, held_out))
    (args.out / "memory.json").write_text(json.dumps(rows, indent=2) + "\n")
    with open(args.out / "memory.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=sorted({k for r in rows for k in r}))
        writer.writeheader()
        writer.writerows(rows)
    text = markdown(rows) + "\n" + summary(rows) + "\n"
    (args.out / "memory.md").write_text(text)
    print(summary(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
