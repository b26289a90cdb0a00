"""A Llama of 124M parameters planned on the meta device for two FSDP2 ranks in bfloat16, then
trained on two gloo ranks: is each rank's peak the one the plan said, before launch?

    python -m benchmarks.llama_ranks [--quick] [--family hf|titan] [--out out/llama_ranks]

What runs (issue "The run users launch", "How it is shown"):

1. **Planned before launch.** Hugging Face ``LlamaForCausalLM`` (hidden 768, 12 layers, 12
   heads, 4 KV heads, MLP 2048, vocabulary 32000, untied head: 124M parameters) built on the
   meta device; one sequence of ``--seq`` tokens per rank, its own loss. Planned with
   ``precision="fsdp-bf16"`` (FSDP2's ``MixedPrecisionPolicy(param_dtype=bfloat16,
   reduce_dtype=float32)``) on its bfloat16 twin, ``world_size=2, sharding="fsdp"``, AdamW, at
   a per-rank budget ``--fraction`` of the way from the leanest plan's predicted peak to the
   no-checkpoint one. Nothing is allocated.
2. **Planned on real CPU tensors too**, from the same weights: the per-rank memory model
   must say the same thing of the same model whatever device it was planned on (minimum,
   no-checkpoint peak, the meta plan's segments' peak; the plans themselves may rank
   segments by different times: the meta step's are FLOP estimates, the real one's
   measured).
3. **Trained on two gloo ranks.** Each rank builds the float32 model (the same weights),
   applies the meta plan (``autockpt.apply``), ``fully_shard``s each unit and the root with
   the policy, builds AdamW over its shards and measures whole iterations with
   :func:`autockpt.distributed.measure_rank` (two warm-up iterations make AdamW's state; the
   third is measured: forward, backward, ``optimizer.step()``). The same model under FSDP2
   with the policy and without autockpt runs the same iterations; after them one more step's
   loss and full gradients of both are compared.

``--family titan`` runs the same on a torchtitan-shaped Llama written out (fx capture, its
own cross-entropy; :data:`FAMILIES`), written to ``llama_ranks_titan.*``.

Written to ``llama_ranks.json``, ``.csv`` and ``.png`` (predicted against measured, per
rank) and printed as a table. ``--seq`` defaults to 64 tokens:
on a CPU without native bfloat16 matrix multiplies (this project's 2-core machine: 0.5
GFLOP/s in bfloat16 against 83 in float32) the policy's bfloat16 step is slow, and a rank
runs eight whole iterations. ``--quick``: 2 layers, hidden 256, vocabulary 4096, 256 tokens
(a smoke test of the script, not the result).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("KINETO_LOG_LEVEL", "5")

import torch  # noqa: E402
from torch import Tensor, nn  # noqa: E402

import autockpt  # noqa: E402
from autockpt.api import Planner  # noqa: E402
from autockpt.distributed import fsdp_bf16_twin, measure_rank, wrap  # noqa: E402
from autockpt.errors import GIB, format_bytes  # noqa: E402
from autockpt.plan import Plan  # noqa: E402

WORLD_SIZE = 2
STEP_SEED = 1234
SHAPES: dict[str, dict[str, int]] = {
    # the 124M Llama (GPT-2 small's width and depth, Llama's blocks)
    "full": dict(hidden=768, layers=12, heads=12, kv=4, mlp=2048, vocab=32000, seq=64),
    "quick": dict(hidden=256, layers=2, heads=4, kv=2, mlp=512, vocab=4096, seq=256),
}


FAMILIES = ("hf", "titan")
"""``hf``: Hugging Face ``LlamaForCausalLM`` (captured with ``torch.export``); ``titan``: a
torchtitan-shaped Llama written out (``benchmarks/e2e_models.py``: RMSNorm, rotary tables as
buffers cast back to the activations' dtype, grouped-query SDPA, SwiGLU, untied head, its
own cross-entropy; captured with fx)."""


def llama(shape: dict[str, int], seed: int = 0, family: str = "hf") -> nn.Module:
    """The float32 model, its weights drawn under ``seed`` (on the current default device)."""
    if family == "titan":
        from benchmarks.e2e_models import Llama

        torch.manual_seed(seed)
        return Llama(
            shape["vocab"],
            shape["layers"],
            shape["hidden"],
            shape["heads"],
            shape["kv"],
            shape["mlp"],
            shape["seq"],
        ).train()
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=shape["hidden"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv"],
        intermediate_size=shape["mlp"],
        vocab_size=shape["vocab"],
        max_position_embeddings=shape["seq"],
        tie_word_embeddings=False,
        attention_dropout=0.0,
        use_cache=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).train()


def batch(shape: dict[str, int], rank: int, device: str = "cpu", family: str = "hf") -> Any:
    """Rank ``rank``'s sequence: ``input_ids`` and ``labels`` (the tokens: Hugging Face's
    model shifts them), or ``(tokens, next tokens)`` for the torchtitan-shaped one."""
    if device == "meta":
        ids = torch.empty(1, shape["seq"], dtype=torch.long, device="meta")
    else:
        generator = torch.Generator().manual_seed(100 + rank)
        ids = torch.randint(3, shape["vocab"], (1, shape["seq"]), generator=generator)
    if family == "titan":
        return (ids, ids.roll(-1, dims=1))
    return {"input_ids": ids, "labels": ids}


def loss_of(output: Any) -> Tensor:
    """The model's own loss: Hugging Face's ``.loss``, or the torchtitan-shaped model's
    output, which is its cross-entropy."""
    return output.loss if hasattr(output, "loss") else output


def cpu_target() -> autockpt.Target:
    """The device these ranks run on, for a plan made on the meta device: a CPU (its
    collectives are gloo's, which copy a reduce-scatter's input: NOTE [sharding: the
    backend's reduce-scatter]). Without a target a meta plan is for a GPU. Memory: this
    machine's; rates: a nominal 2-core CPU's (they rank segments, they bound no memory)."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    rates = (("bfloat16", 1e11), ("float16", 1e11), ("float32", 1e11))
    return autockpt.Target("cpu", "cpu", memory, rates, 2e10, "nominal rates of a 2-core CPU")


def planner(shape: dict[str, int], device: str, family: str = "hf") -> Planner:
    """One rank's planner for the policy, on ``device`` (meta: no memory, no values, for
    :func:`cpu_target`)."""
    with torch.device(device):
        model = llama(shape, family=family)
    twin = fsdp_bf16_twin(model)  # what the policy computes with; float32 state counted
    del model
    return Planner(
        twin,
        batch(shape, 0, device, family),
        loss_fn=loss_of,
        optimizer=torch.optim.AdamW(twin.parameters()),
        world_size=WORLD_SIZE,
        sharding="fsdp",
        precision="fsdp-bf16",
        target=cpu_target() if device == "meta" else None,
    )


def policy() -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def rank_main(
    rank: int, shape: dict[str, int], plan_json: str, out: str, steps: int, family: str = "hf"
) -> None:
    """One rank: the planned run and FSDP2 alone, each measured over whole AdamW iterations,
    then one more step of each whose loss and gradients are saved."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)  # two ranks on two cores
    store = f"file://{Path(out).resolve() / 'rendezvous'}"
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=WORLD_SIZE)
    plan = Plan.from_json(plan_json)
    mine = batch(shape, rank, family=family)

    def planned() -> tuple[nn.Module, Any]:
        result = autockpt.apply(llama(shape, family=family), plan, mine)
        return wrap(result, "fsdp", plan.fsdp_units, mp_policy=policy()), mine

    def alone() -> tuple[nn.Module, Any]:
        model = llama(shape, family=family)
        for unit in plan.fsdp_units:
            fully_shard(model.get_submodule(unit), mp_policy=policy())
        return fully_shard(model, mp_policy=policy()), mine

    found: dict[str, Any] = {}
    try:
        for name, build in (("planned", planned), ("fsdp2 alone", alone)):
            started = time.perf_counter()
            model, inputs, measured = measure_rank(
                build,
                loss_fn=loss_of,
                optimizer=lambda m: torch.optim.AdamW(m.parameters()),
                warmup=steps - 1,
            )
            seconds = (time.perf_counter() - started) / steps
            torch.manual_seed(STEP_SEED)
            loss = loss_of(model(*inputs.args, **inputs.kwargs))
            loss.backward()
            grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
            found[name] = {
                "measured": asdict(measured),
                "seconds_per_iteration": seconds,
                "loss": loss.detach().float(),
                "grads": grads,
            }
            del model, inputs
        torch.save(found, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run(
    quick: bool, out: Path, fraction: float, seq: int | None = None, family: str = "hf"
) -> dict[str, Any]:
    """Plan on meta and on real tensors, train on two ranks; return the row."""
    import torch.multiprocessing as mp

    shape = dict(SHAPES["quick" if quick else "full"])
    if seq is not None:
        shape["seq"] = seq
    started = time.perf_counter()
    on_meta = planner(shape, "meta", family)
    low, high = on_meta.minimum_peak_bytes, on_meta.no_checkpoint_peak_bytes
    budget = int(low + fraction * (high - low))
    plan = on_meta.optimize(budget_gb=budget / GIB).plan
    meta_seconds = time.perf_counter() - started
    started = time.perf_counter()
    on_cpu = planner(shape, "cpu", family)
    real = on_cpu.optimize(budget_gb=budget / GIB).plan
    cpu_seconds = time.perf_counter() - started
    agree = {
        "minimum": (low, on_cpu.minimum_peak_bytes),
        "no checkpointing": (high, on_cpu.no_checkpoint_peak_bytes),
        "the plan at the budget": (plan.predicted_peak_bytes, real.predicted_peak_bytes),
    }
    if not any(s.kept_ops for s in plan.segments):  # selective segments: compared as found
        ranges = [(s.start_stage, s.end_stage) for s in plan.segments]
        agree["the meta plan's segments"] = (plan.predicted_peak_bytes, on_cpu.predict(ranges))
    with tempfile.TemporaryDirectory() as folder:
        steps = 3
        mp.spawn(rank_main, args=(shape, plan.to_json(), folder, steps, family), nprocs=WORLD_SIZE)
        ranks = [torch.load(Path(folder) / f"rank{r}.pt") for r in range(WORLD_SIZE)]
    grad_error, loss_error = 0.0, 0.0
    for r in ranks:
        got, want = r["planned"], r["fsdp2 alone"]
        loss_error = max(loss_error, abs(float(got["loss"] - want["loss"])))
        for name, grad in want["grads"].items():
            grad_error = max(grad_error, float((got["grads"][name] - grad).abs().max()))
    with torch.device("meta"):
        parameters = sum(p.numel() for p in llama(shape, family=family).parameters())
    row = {
        "family": family,
        "capture": plan.capture_method,
        "shape": shape,
        "parameters": parameters,
        "world_size": WORLD_SIZE,
        "precision": "fsdp-bf16",
        "optimizer": "AdamW",
        "budget_bytes": plan.budget_bytes,
        # the ranks run on CPU (gloo): judged by the plan made for CPU ranks, whose
        # segments are the meta plan's (asserted); the meta plan is for GPU ranks (NCCL)
        "predicted_peak_bytes": real.predicted_peak_bytes,
        "meta_predicted_peak_bytes": plan.predicted_peak_bytes,
        "same_segments": _ranges(plan) == _ranges(real),
        "predicted_resident_bytes": real.rank_memory.static,
        "rank_memory": asdict(plan.rank_memory),
        "segments": [asdict(s) for s in plan.segments],
        "real_plan_segments": [asdict(s) for s in real.segments],
        "fsdp_units": list(plan.fsdp_units),
        "meta_vs_real": {k: list(v) for k, v in agree.items()},
        "planning_seconds": {"meta": meta_seconds, "real": cpu_seconds},
        "measured_peak_bytes": [r["planned"]["measured"]["peak_bytes"] for r in ranks],
        "measured_resident_bytes": [r["planned"]["measured"]["resident_bytes"] for r in ranks],
        "fsdp2_alone_peak_bytes": [r["fsdp2 alone"]["measured"]["peak_bytes"] for r in ranks],
        "seconds_per_iteration": [r["planned"]["seconds_per_iteration"] for r in ranks],
        "fsdp2_alone_seconds_per_iteration": [
            r["fsdp2 alone"]["seconds_per_iteration"] for r in ranks
        ],
        "max_loss_error": loss_error,
        "max_grad_error": grad_error,
    }
    out.mkdir(parents=True, exist_ok=True)
    name = "llama_ranks" if family == "hf" else f"llama_ranks_{family}"
    (out / f"{name}.json").write_text(json.dumps(row, indent=2, default=str))
    _table(row, out / f"{name}.csv")
    _figure(row, out / f"{name}.png")
    return row


def _table(row: dict[str, Any], path: Path) -> None:
    """Per rank: predicted and measured resident and peak bytes, FSDP2 alone's peak."""
    import csv

    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(
            ["rank", "budget", "predicted_peak", "measured_peak", "fsdp2_alone_peak",
             "predicted_resident", "measured_resident"]
        )  # fmt: skip
        for rank, peak in enumerate(row["measured_peak_bytes"]):
            writer.writerow(
                [rank, row["budget_bytes"], row["predicted_peak_bytes"], peak,
                 row["fsdp2_alone_peak_bytes"][rank], row["predicted_resident_bytes"],
                 row["measured_resident_bytes"][rank]]
            )  # fmt: skip


def _figure(row: dict[str, Any], path: Path) -> None:
    """Predicted against measured, per rank: resident memory and the iteration's peak."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = range(len(row["measured_peak_bytes"]))
    fig, ax = plt.subplots(figsize=(6, 3.2))
    width = 0.2
    bars = [
        ("resident, predicted", [row["predicted_resident_bytes"]] * len(ranks)),
        ("resident, measured", row["measured_resident_bytes"]),
        ("peak, predicted", [row["predicted_peak_bytes"]] * len(ranks)),
        ("peak, measured", row["measured_peak_bytes"]),
    ]
    for k, (label, values) in enumerate(bars):
        ax.bar(
            [r + (k - 1.5) * width for r in ranks], [v / GIB for v in values], width, label=label
        )
    ax.axhline(row["budget_bytes"] / GIB, color="black", linestyle="--", label="budget")
    ax.set_xticks(list(ranks), [f"rank {r}" for r in ranks])
    ax.set_ylabel("GiB")
    which = "Hugging Face" if row["family"] == "hf" else "torchtitan-shaped"
    ax.set_title(
        f"{which} Llama {row['parameters'] / 1e6:.0f}M planned on meta, 2 gloo ranks, fsdp-bf16",
        fontsize=9,
    )
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _ranges(plan: Plan) -> list[tuple[int, int, tuple[Any, ...]]]:
    return [(s.start_stage, s.end_stage, s.kept_ops) for s in plan.segments]


def report(row: dict[str, Any]) -> bool:
    """Print the row; True when every rank is within its budget and 1% of the prediction."""
    predicted = row["predicted_peak_bytes"]
    print(
        f"Llama {row['parameters'] / 1e6:.0f}M ({row['family']}, {row['capture']} capture), "
        f"{row['world_size']} ranks, FSDP2 + "
        f"{row['precision']}, AdamW; units {len(row['fsdp_units'])}, segments "
        f"{len(row['segments'])} (planned on real tensors: {len(row['real_plan_segments'])})"
    )
    print(
        f"planning: meta {row['planning_seconds']['meta']:.1f} s, real CPU tensors "
        f"{row['planning_seconds']['real']:.1f} s"
    )
    for what, (meta, real) in row["meta_vs_real"].items():
        print(
            f"  {what}: meta {format_bytes(meta)}, real {format_bytes(real)}, equal {meta == real}"
        )
    print(
        f"budget {format_bytes(row['budget_bytes'])}; predicted peak for CPU ranks "
        f"{format_bytes(predicted)} (the meta plan, for GPU ranks: "
        f"{format_bytes(row['meta_predicted_peak_bytes'])}); the same segments: "
        f"{row['same_segments']}"
    )
    ok = row["same_segments"]
    for rank, peak in enumerate(row["measured_peak_bytes"]):
        off = (peak - predicted) / predicted
        ok = ok and peak <= row["budget_bytes"] and abs(off) <= 0.01
        print(
            f"  rank {rank}: measured {format_bytes(peak)} ({off:+.2%} of the prediction); "
            f"resident {format_bytes(row['measured_resident_bytes'][rank])} (predicted "
            f"{format_bytes(row['predicted_resident_bytes'])}); FSDP2 alone "
            f"{format_bytes(row['fsdp2_alone_peak_bytes'][rank])}; "
            f"{row['seconds_per_iteration'][rank]:.1f} s/iteration against "
            f"{row['fsdp2_alone_seconds_per_iteration'][rank]:.1f}"
        )
    print(f"max |loss difference| {row['max_loss_error']:.2e}, |grad| {row['max_grad_error']:.2e}")
    print("every rank within its budget and 1% of the prediction" if ok else "TARGET MISSED")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--fraction", type=float, default=0.3)
    parser.add_argument("--seq", type=int, default=None, help="tokens per rank's sequence")
    parser.add_argument("--family", choices=FAMILIES, default="hf")
    parser.add_argument("--out", type=Path, default=Path("out/llama_ranks"))
    args = parser.parse_args(argv)
    row = run(args.quick, args.out, args.fraction, args.seq, args.family)
    return 0 if report(row) else 1


if __name__ == "__main__":
    # Run the importable copy: spawned ranks unpickle its functions by module name.
    from benchmarks.llama_ranks import main as _main

    raise SystemExit(_main())
