"""Plans under DDP and FSDP2 on several ranks: gradients equal to eager, peaks under budget.

    python -m benchmarks.distributed [--world-size 2] [--backend gloo] [--fraction 0.3]

For each case (a model and an engine) the parent process plans one rank's batch with
``autockpt.optimize(..., world_size=N, sharding=...)`` at a per-rank budget placed at
``fraction`` of the way from the leanest plan's predicted peak to the no-checkpoint peak.
It then spawns ``N`` ranks (gloo on CPU; nccl with ``--backend nccl`` on GPUs). Each rank
builds the model with the same weights and its own batch, re-applies the saved plan
(``autockpt.apply``), wraps it the way users do (``DDP(model)``, or ``fully_shard`` on each
``plan.fsdp_units`` and then on the model) and measures one step at allocator level with
:func:`autockpt.distributed.measure_rank`, then runs one more step and saves its loss and
full (all-gathered) parameter gradients. The parent compares them with single-process eager
on the union of the ranks' batches (mean of the per-rank losses) and prints per-rank budget,
predicted and measured peak and resident (static) memory.

``vit`` is a small vision transformer that is not in the model zoo: a held-out check that
unit detection and the memory model are not tuned to the zoo.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("KINETO_LOG_LEVEL", "5")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor, nn  # noqa: E402

import autockpt  # noqa: E402
from autockpt.api import Planner  # noqa: E402
from autockpt.base.runtime import default_loss  # noqa: E402
from autockpt.capture import Inputs  # noqa: E402
from autockpt.distributed import measure_rank, wrap  # noqa: E402
from autockpt.errors import GIB, format_bytes  # noqa: E402
from autockpt.plan import Plan  # noqa: E402
from autockpt_zoo.toy import gpt  # noqa: E402

STEP_SEED = 1234

# ---------------------------------------------------------------------------------------------
# a held-out model (not in autockpt.zoo)


class EncoderBlock(nn.Module):
    """Pre-norm encoder block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``, attention through
    ``scaled_dot_product_attention``."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, mlp_ratio * dim)
        self.fc2 = nn.Linear(mlp_ratio * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, c // self.heads).unbind(2)
        attn = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        )
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, c))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class TinyViT(nn.Module):
    """Patch embedding, a class token and position embedding held directly by the root,
    ``blocks`` (a ModuleList of :class:`EncoderBlock`), and a classifier returning the loss."""

    def __init__(
        self, size: int, patch: int, dim: int, depth: int, heads: int, classes: int
    ) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, patch, stride=patch)
        tokens = (size // patch) ** 2 + 1
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, tokens, dim) * 0.02)
        self.blocks = nn.ModuleList(EncoderBlock(dim, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, images: Tensor, labels: Tensor) -> Tensor:
        x = self.patch_embed(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(self.norm(x[:, 0])), labels)


def vit(
    *,
    size: int = 32,
    patch: int = 4,
    dim: int = 96,
    depth: int = 4,
    heads: int = 4,
    classes: int = 10,
    batch: int = 8,
    seed: int = 0,
) -> tuple[nn.Module, tuple[Tensor, Tensor]]:
    """:class:`TinyViT` and one batch ``(images, labels)``."""
    torch.manual_seed(seed)
    model = TinyViT(size, patch, dim, depth, heads, classes)
    images = torch.randn(batch, 3, size, size)
    labels = torch.randint(0, classes, (batch,))
    return model.train(), (images, labels)


MODELS: dict[str, Callable[..., tuple[nn.Module, Any]]] = {"gpt": gpt, "vit": vit}
DEFAULT_KWARGS: dict[str, dict[str, Any]] = {
    "gpt": {
        "layers": 4,
        "dim": 128,
        "heads": 4,
        "vocab_size": 256,
        "block_size": 64,
        "seq_len": 64,
        "batch": 8,
        "dropout": 0.1,
    },
    "vit": {},
}

# ---------------------------------------------------------------------------------------------
# cases


@dataclass(frozen=True)
class Case:
    """One model under one engine: what the ranks need to rebuild and check it."""

    name: str
    model: str
    kwargs: dict[str, Any]
    sharding: str
    plan_json: str

    def build(self, seed: int) -> tuple[nn.Module, Any]:
        return MODELS[self.model](**self.kwargs, seed=seed)

    def model_and_rank_batch(self, rank: int) -> tuple[nn.Module, Inputs]:
        """The shared weights (seed 0) and rank ``rank``'s own batch."""
        model, _ = self.build(0)
        _, batch = self.build(100 + rank)
        return model, Inputs.of(batch)


def plan_case(
    model_name: str,
    sharding: str,
    world_size: int,
    fraction: float,
    kwargs: dict[str, Any] | None = None,
) -> tuple[Case, Plan]:
    """Plan one rank's batch at ``fraction`` between the leanest and the no-checkpoint
    per-rank peak (both predicted by one planner)."""
    kwargs = dict(DEFAULT_KWARGS[model_name] if kwargs is None else kwargs)
    model, batch = MODELS[model_name](**kwargs, seed=0)
    planner = Planner(model, batch, world_size=world_size, sharding=sharding)
    low, high = planner.minimum_peak_bytes, planner.no_checkpoint_peak_bytes
    budget = low + fraction * (high - low)
    result = planner.optimize(budget_gb=budget / GIB)
    case = Case(f"{model_name}-{sharding}", model_name, kwargs, sharding, result.plan.to_json())
    return case, result.plan


def reference(case: Case, world_size: int) -> dict[str, Any]:
    """Single-process eager on every rank's batch: per-rank losses and the gradient of their
    mean (what DDP's all-reduce and FSDP's reduce-scatter average to)."""
    model, _ = case.build(0)
    losses = []
    for rank in range(world_size):
        _, inputs = case.model_and_rank_batch(rank)
        torch.manual_seed(STEP_SEED)
        losses.append(default_loss(model(*inputs.args, **inputs.kwargs)))
    (sum(losses) / world_size).backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    return {"losses": [loss.detach() for loss in losses], "grads": grads}


def rank_main(rank: int, world_size: int, backend: str, cases: list[Case], out: str) -> None:
    """One rank: for every case build, apply the plan, wrap, measure, step, save results."""
    import torch.distributed as dist

    device = "cuda" if backend == "nccl" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    # A file rendezvous in the run's own folder: no TCP port to pick or collide on.
    store = f"file://{Path(out).resolve() / 'rendezvous'}"
    dist.init_process_group(backend, init_method=store, rank=rank, world_size=world_size)
    try:
        for case in cases:
            plan = Plan.from_json(case.plan_json)

            def build(case: Case = case, plan: Plan = plan) -> tuple[nn.Module, Any]:
                model, inputs = case.model_and_rank_batch(rank)
                if device == "cuda":
                    model = model.cuda()
                    inputs = Inputs(
                        *torch.utils._pytree.tree_map(
                            lambda t: t.cuda() if isinstance(t, Tensor) else t,
                            (inputs.args, inputs.kwargs),
                        )
                    )
                result = autockpt.apply(model, plan)
                return wrap(result, plan.sharding, plan.fsdp_units), inputs

            started = time.perf_counter()
            wrapped, inputs, measured = measure_rank(build, device=device)
            torch.manual_seed(STEP_SEED)
            loss = default_loss(wrapped(*inputs.args, **inputs.kwargs))
            loss.backward()
            grads = {}
            for name, p in wrapped.named_parameters():
                grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                grads[name.removeprefix("module.")] = grad.detach().cpu().clone()
            torch.save(
                {
                    "loss": loss.detach().cpu(),
                    "grads": grads,
                    "measured": asdict(measured),
                    "seconds": time.perf_counter() - started,
                },
                Path(out) / f"{case.name}-rank{rank}.pt",
            )
            dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(
    cases: list[Case], world_size: int, backend: str = "gloo"
) -> dict[str, list[dict[str, Any]]]:
    """Spawn ``world_size`` ranks over ``cases``; return each case's per-rank results."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out:
        mp.spawn(rank_main, args=(world_size, backend, cases, out), nprocs=world_size)
        return {
            case.name: [
                torch.load(Path(out) / f"{case.name}-rank{r}.pt") for r in range(world_size)
            ]
            for case in cases
        }


def compare(case: Case, ranks: list[dict[str, Any]], expected: dict[str, Any]) -> dict[str, Any]:
    """Largest differences from eager, and the memory numbers of every rank."""
    plan = Plan.from_json(case.plan_json)
    loss_error = max(
        abs(float(r["loss"] - e)) for r, e in zip(ranks, expected["losses"], strict=True)
    )
    grad_error = 0.0
    for r in ranks:
        if r["grads"].keys() != expected["grads"].keys():
            raise AssertionError(f"{case.name}: gradient names differ from eager")
        for name, ref in expected["grads"].items():
            grad_error = max(grad_error, float((r["grads"][name] - ref).abs().max()))
    return {
        "case": case.name,
        "world_size": plan.world_size,
        "budget_bytes": plan.budget_bytes,
        "predicted_peak_bytes": plan.predicted_peak_bytes,
        "predicted_resident_bytes": plan.rank_memory.static if plan.rank_memory else None,
        "rank_memory": asdict(plan.rank_memory) if plan.rank_memory else None,
        "unsharded_parameters_bytes": plan.memory.parameters,
        "segments": len(plan.segments),
        "units": len(plan.fsdp_units),
        "measured_peak_bytes": [r["measured"]["peak_bytes"] for r in ranks],
        "measured_resident_bytes": [r["measured"]["resident_bytes"] for r in ranks],
        "max_loss_error": loss_error,
        "max_grad_error": grad_error,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    parser.add_argument("--fraction", type=float, default=0.3)
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    cases = []
    for model_name, sharding in (("gpt", "ddp"), ("gpt", "fsdp"), ("vit", "ddp"), ("vit", "fsdp")):
        case, plan = plan_case(model_name, sharding, args.world_size, args.fraction)
        cases.append(case)
    results = run_ranks(cases, args.world_size, args.backend)
    rows = [compare(case, results[case.name], reference(case, args.world_size)) for case in cases]
    print(
        f"{'case':10} {'budget':>10} {'predicted':>10} {'measured (per rank)':>22} "
        f"{'resident pred.':>14} {'resident meas.':>22} {'seg':>4} {'units':>5} {'max |dgrad|':>11}"
    )
    for row in rows:
        measured = " / ".join(format_bytes(b) for b in row["measured_peak_bytes"])
        resident = " / ".join(format_bytes(b) for b in row["measured_resident_bytes"])
        predicted_resident = format_bytes(row["predicted_resident_bytes"] or 0)
        print(
            f"{row['case']:10} {format_bytes(row['budget_bytes']):>10} "
            f"{format_bytes(row['predicted_peak_bytes']):>10} {measured:>22} "
            f"{predicted_resident:>14} {resident:>22} {row['segments']:>4} {row['units']:>5} "
            f"{row['max_grad_error']:>11.2e}"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    ok = all(max(r["measured_peak_bytes"]) <= r["budget_bytes"] for r in rows)
    print("every rank under its budget" if ok else "SOME RANK EXCEEDED ITS BUDGET")
    return 0 if ok else 1


if __name__ == "__main__":
    # Run the importable copy of this module: spawned ranks unpickle its classes by module
    # name, and a plan's graph fingerprint names the classes of the modules it calls.
    from benchmarks.distributed import main as _main

    raise SystemExit(_main())
