"""Submodules fx cannot trace whole: the stated minimum against each block checkpointed by hand.

    python -m benchmarks.leaves [--out out/leaves]

The budget contract says a leaf never raises the minimum above checkpointing each repeated
block by hand. One whisper-style model (a convolution stem and 6 residual blocks in an
encoder, beside a token embedding that holds most parameters; 16 x 256 frames of width
128) is planned with five encoders whose forward differs in one line before or around its
blocks: none, an assertion on shapes (a guard in the graph), a branch on a shape (taken by
torch.export), a branch on values and LayerDrop's draw (neither fx nor export: planned as
units, NOTE [routes: leaves that hide blocks]). Each row: how it was planned, the stated
minimum and no-checkpoint peaks, the measured peak of each block checkpointed by hand
(every block run: the worst case a LayerDrop plan is made for), and the plan made at that
hand budget, measured. Writes ``leaves.json``, ``leaves.csv`` and ``leaves.png``.
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from autockpt.api import Planner
from autockpt.errors import AutockptError
from autockpt.measure import measure

MIB = 2**20
FORMS = ("plain", "shape assert", "shape branch", "value branch", "layerdrop")


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class Encoder(nn.Module):
    """The encoder; ``form`` picks the one line that differs (module docstring)."""

    def __init__(self, form: str, mels: int = 16, frames: int = 256, width: int = 128) -> None:
        super().__init__()
        self.form, self.drop = form, 0.1
        self.conv1 = nn.Conv1d(mels, width, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(width, width, kernel_size=3, stride=2, padding=1)
        self.register_buffer("positions", torch.randn(frames // 2, width))
        self.blocks = nn.ModuleList(Block(width) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.form == "value branch" and x.abs().max() > 100:
            x = x / 100
        x = F.gelu(self.conv2(F.gelu(self.conv1(x)))).permute(0, 2, 1)
        if self.form == "shape assert":
            assert x.shape[1:] == self.positions.shape, "incorrect audio shape"
        if self.form != "shape branch" or x.shape[1] > 1:
            x = x + self.positions
        for block in self.blocks:
            if self.form == "layerdrop" and self.training and torch.rand([]) < self.drop:
                continue
            x = block(x)
        return x


class Speech(nn.Module):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.encoder = Encoder(form)
        self.embedding = nn.Embedding(50_000, 128)
        self.head = nn.Linear(128, 10)

    def forward(self, mel: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(tokens) + self.encoder(mel).mean(1, keepdim=True))


def _loss(output: torch.Tensor) -> torch.Tensor:
    return output.square().mean()


def _by_hand(model: Speech) -> Speech:
    model = copy.deepcopy(model)
    model.encoder.drop = 0.0  # every block runs: the worst case
    for block in model.encoder.blocks:
        block.forward = lambda x, _f=block.forward: checkpoint(_f, x, use_reentrant=False)
    return model


def _row(form: str) -> dict:
    torch.manual_seed(0)
    model = Speech(form).train()
    inputs = (torch.randn(16, 16, 256), torch.randint(0, 50_000, (16, 8)))
    hand = measure(_by_hand(model), inputs, loss_fn=_loss, repeat=1).peak_bytes
    row: dict = {"form": form, "hand_mib": hand / MIB}
    started = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            planner = Planner(model, inputs, loss_fn=_loss)
    except AutockptError as error:
        row.update(planned_as="refused", error=str(error).splitlines()[0][:200])
        return row
    row["plan_seconds"] = time.perf_counter() - started
    row["planned_as"] = "units" if planner.nested else planner.capture.method
    row["minimum_mib"] = planner.minimum_peak_bytes / MIB
    row["no_checkpoint_mib"] = planner.no_checkpoint_peak_bytes / MIB
    try:
        plan = planner.optimize(budget_gb=hand / 2**30).plan
    except AutockptError as error:
        row["at_hand"] = f"refused: {type(error).__name__}"
        return row
    row["at_hand"] = "planned"
    row["at_hand_predicted_mib"] = plan.predicted_peak_bytes / MIB
    row["at_hand_measured_mib"] = (plan.measured_peak_bytes or 0) / MIB
    return row


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    xs = range(len(rows))
    ax.bar(
        [x - 0.2 for x in xs], [r.get("minimum_mib", 0) for r in rows], 0.4, label="stated minimum"
    )
    ax.bar([x + 0.2 for x in xs], [r["hand_mib"] for r in rows], 0.4, label="each block by hand")
    ax.set_xticks(list(xs), [f"{r['form']}\n({r['planned_as']})" for r in rows], fontsize=8)
    ax.set_ylabel("peak (MiB)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out/leaves"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    rows = []
    for form in FORMS:
        rows.append(_row(form))
        print(json.dumps(rows[-1]))
    (args.out / "leaves.json").write_text(json.dumps(rows, indent=1))
    with open(args.out / "leaves.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=sorted({k for r in rows for k in r}))
        writer.writeheader()
        writer.writerows(rows)
    _plot(rows, args.out / "leaves.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
