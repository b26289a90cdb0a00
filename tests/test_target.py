"""Planning for the device a run will use, from a machine without it (autockpt/base/target.py,
NOTE [runtime: meta runs as a device], NOTE [precision: a GPU's autocast on the CPU])."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autockpt
from autockpt.api import Planner
from autockpt.base.autocast_lists import CudaAutocastOnCpu
from autockpt.base.target import RESERVE_FRACTION, TARGETS
from autockpt.errors import GIB, PrecisionError, TargetError


class Attention(nn.Module):
    def __init__(self, d: int = 64, heads: int = 8) -> None:
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (
            part.view(b, t, self.heads, d // self.heads).transpose(1, 2)
            for part in self.qkv(x).chunk(3, -1)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


def attention_stack(device: str) -> nn.Module:
    torch.manual_seed(0)
    with torch.device(device):
        return nn.Sequential(Attention(), Attention()).train()


def mlp_stack() -> nn.Module:
    with torch.device("meta"):
        blocks = [
            nn.Sequential(nn.LayerNorm(256), nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
            for _ in range(3)
        ]
        return nn.Sequential(*blocks).train()


def loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


ACTIVATIONS = "activations without checkpointing"


def test_meta_attention_is_the_fused_kernels_not_the_math_paths():
    """On meta, scaled-dot-product attention saved seq x seq scores (the math path): 262.5 MiB
    here, where the CPU's fused kernel (and a GPU's) saves 4.6 MiB. A meta plan now counts
    what the CPU planner counts, byte for byte."""
    seq = 1024
    x = torch.randn(1, seq, 64)
    on_cpu = Planner(attention_stack("cpu"), x, loss_fn=loss, probe=False)
    on_meta = Planner(attention_stack("meta"), x.to("meta"), loss_fn=loss)
    assert on_meta.breakdown[ACTIVATIONS] == on_cpu.breakdown[ACTIVATIONS]
    scores = 8 * seq * seq * 4  # one layer's float32 scores: what the math path saves
    assert on_meta.breakdown[ACTIVATIONS] < scores


def test_a_gpus_autocast_is_planned_on_meta_with_cudas_float32_operators():
    """precision='bf16-mixed' on meta plans CUDA autocast on fake CPU tensors: matrix
    multiplies in bfloat16, layer norms in float32 (CUDA's list, not CPU's); the plan says
    it was planned under cuda autocast, which the training call is checked against."""
    x = torch.empty(256, 256, device="meta")
    fp32 = Planner(mlp_stack(), x, loss_fn=loss, target="h100")
    bf16 = Planner(mlp_stack(), x, loss_fn=loss, target="h100", precision="bf16-mixed")
    assert bf16.request.precision.autocast == (("cuda", "bfloat16"),)
    # every linear's saved input and output halves; the weight cache adds bf16 copies
    cache = sum(p.numel() * 2 for p in mlp_stack().parameters() if p.dim() == 2)
    assert bf16.breakdown[ACTIVATIONS] - cache < fp32.breakdown[ACTIVATIONS]
    # the roofline at the bf16 rate is faster than at float32's
    assert bf16.step_seconds < fp32.step_seconds


def test_a_meta_plan_for_a_gpus_autocast_is_the_same_on_a_machine_with_a_gpu(monkeypatch):
    """A meta model runs as fake CPU tensors, which torch.autocast("cuda") does not cast:
    planned on a machine that has a GPU, its step is still the GPU's autocast emulated on
    the CPU (a plan made there was of a float32 step: 16% above the measured peak of a 1B
    Llama on an H200, and an export graph without the casts the run's graph has)."""
    x = torch.empty(256, 256, device="meta")
    here = Planner(mlp_stack(), x, loss_fn=loss, target="h100", precision="bf16-mixed")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with_gpu = Planner(mlp_stack(), x, loss_fn=loss, target="h100", precision="bf16-mixed")
    assert with_gpu.breakdown == here.breakdown
    assert with_gpu.no_checkpoint_peak_bytes == here.no_checkpoint_peak_bytes
    fp32 = Planner(mlp_stack(), x, loss_fn=loss, target="h100")
    assert with_gpu.breakdown[ACTIVATIONS] != fp32.breakdown[ACTIVATIONS]


def test_cuda_autocast_rules_on_cpu_autocast():
    x = torch.randn(4, 8).bfloat16()
    w = torch.randn(8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16), CudaAutocastOnCpu(torch.bfloat16):
        assert F.layer_norm(x, (8,)).dtype == torch.float32  # CPU autocast: bfloat16
        assert F.softmax(x, -1).dtype == torch.float32
        assert torch.ops.aten.softmax.int(x, -1).dtype == torch.float32
        assert x.exp().dtype == torch.float32
        assert F.linear(x.float(), w).dtype == torch.bfloat16
        assert torch.einsum("ij,jk->ik", x.float(), w).dtype == torch.bfloat16
        assert (x.float() + 1).dtype == torch.float32  # not listed: as CPU autocast runs it


def test_cross_entropy_runs_as_cuda_autocast_runs_it():
    """CUDA autocast does not cast cross_entropy's logits (CPU autocast does): its
    log_softmax runs in bfloat16 and is saved so, and nll_loss gets a float32 copy. The
    chain and saved dtypes as an H200 recorded them (torch 2.11, docs/large-runs.md)."""
    logits = torch.randn(16, 100, requires_grad=True)
    target = torch.randint(0, 100, (16,))
    with torch.autocast("cpu", dtype=torch.bfloat16), CudaAutocastOnCpu(torch.bfloat16):
        loss = F.cross_entropy(logits.bfloat16(), target)
        smoothed = F.cross_entropy(logits.bfloat16(), target, label_smoothing=0.1)
    chain, node = [], loss.grad_fn
    while node is not None and len(chain) < 3:
        chain.append(node)
        node = node.next_functions[0][0]
    assert [type(n).__name__ for n in chain] == [
        "NllLossBackward0",
        "ToCopyBackward0",
        "LogSoftmaxBackward0",
    ]
    assert chain[0]._saved_self.dtype == torch.float32
    assert chain[2]._saved_result.dtype == torch.bfloat16
    with torch.autocast("cpu", enabled=False):
        want = F.cross_entropy(logits.bfloat16().float(), target)
    torch.testing.assert_close(loss, want, rtol=2e-2, atol=2e-2)
    assert smoothed.dtype == torch.float32  # other forms: as a float32 operator
    # an export graph of that loss writes log_softmax's dtype positionally: kept as given
    with torch.autocast("cpu", dtype=torch.bfloat16), CudaAutocastOnCpu(torch.bfloat16):
        scores = torch.ops.aten.log_softmax.int(logits.bfloat16(), 1, torch.bfloat16)
    assert scores.dtype == torch.bfloat16


def test_a_target_gives_the_default_budget_roofline_times_and_is_said_in_the_plan():
    x = torch.empty(256, 256, device="meta")
    fast = autockpt.optimize(mlp_stack(), x, loss_fn=loss, target="a100", precision="bf16")
    plan = fast.plan
    assert plan.budget_bytes == int(80 * GIB * (1 - RESERVE_FRACTION))
    assert plan.target == "a100" and plan.time_model == "roofline:a100"
    assert any("planned on the meta device for a100" in note for note in plan.notes)
    again = autockpt.Plan.from_json(plan.to_json())
    assert again == plan and json.loads(plan.to_json())["target"] == "a100"
    # the same model on a faster target: a shorter predicted step, the same memory
    h100 = Planner(mlp_stack(), x, loss_fn=loss, target="h100", precision="bf16")
    a100 = Planner(mlp_stack(), x, loss_fn=loss, target="a100", precision="bf16")
    assert h100.step_seconds < a100.step_seconds
    assert h100.no_checkpoint_peak_bytes == a100.no_checkpoint_peak_bytes
    assert set(TARGETS) == {"h100", "h200", "a100", "l4", "mi300x"}


def test_bad_targets_and_precisions_are_refused_before_any_work():
    x = torch.randn(4, 256)
    cpu_model = nn.Linear(256, 256)
    with pytest.raises(TargetError, match="known targets are"):
        Planner(mlp_stack(), x.to("meta"), target="h1000")
    with pytest.raises(TargetError, match="meta device"):
        Planner(cpu_model, x, target="h100")
    with pytest.raises(PrecisionError, match="one of"):
        Planner(mlp_stack(), x.to("meta"), precision="bf17")
    with pytest.raises(PrecisionError, match="convert it first"):
        Planner(mlp_stack(), x.to("meta"), precision="bf16-true")
    with pytest.raises(autockpt.BudgetError, match="target"):
        autockpt.optimize(cpu_model, x)


def test_the_command_line_plans_for_a_target_before_launch(tmp_path):
    """`autockpt plan SPEC --target h100 --precision bf16-mixed`: the model built on meta,
    the budget the target's default, the plan for the target; a budget that cannot fit is
    refused before profiling, in one line."""
    from autockpt.base.precision import PRECISIONS
    from autockpt.cli.options import PRECISION_NAMES, TARGET_NAMES
    from tests.test_cli import assert_user_error, run

    assert TARGET_NAMES == tuple(TARGETS) and set(PRECISION_NAMES) <= set(PRECISIONS)
    path = tmp_path / "plan.json"
    spec = "autockpt.zoo:gpt"
    done = run("plan", spec, "--target", "h100", "--precision", "bf16-mixed", "-o", str(path))
    assert done.returncode == 0, done.stderr
    plan = autockpt.Plan.load(path)
    assert plan.target == "h100" and plan.device == "meta"
    assert plan.budget_bytes == TARGETS["h100"].default_budget_bytes
    assert "cuda:bfloat16" in " ".join(plan.notes)
    refused = run("plan", spec, "--target", "l4", "--budget-gb", "0.000001", "-o", str(path))
    assert_user_error(refused, 3, "at least")


def test_the_command_line_plans_fsdp2_mixed_precision_for_the_float32_model(tmp_path):
    """`--precision fsdp-bf16`: the factory's float32 model planned as FSDP2's bfloat16
    policy runs it (its bfloat16 twin), so each rank keeps float32 shards and state of the
    model the run wraps; without FSDP ranks it is refused in one line, before any work."""
    from autockpt.zoo import gpt
    from tests.test_cli import assert_user_error, run

    path = tmp_path / "plan.json"
    args = ("plan", "autockpt.zoo:gpt", "--target", "h100", "--precision", "fsdp-bf16")
    done = run(*args, "--world-size", "4", "--sharding", "fsdp", "--optimizer", "adamw",
               "-o", str(path))  # fmt: skip
    assert done.returncode == 0, done.stderr
    plan = autockpt.Plan.load(path)
    fp32 = sum(p.nbytes for p in gpt()[0].parameters())
    assert plan.rank_memory.parameters == fp32 // 4  # float32 shards of the float32 model
    assert plan.rank_memory.optimizer_state >= 2 * fp32 // 4  # AdamW's two float32 moments
    assert any("kept in float32 by FSDP2's mixed precision" in note for note in plan.notes)
    assert_user_error(run(*args, "-o", str(path)), 2, "sharding='fsdp'")


def test_fit_batch_sizes_a_meta_model_per_rank_for_a_target():
    """The largest batch per rank for the device the run uses, with no device: a meta GPT,
    FSDP over 4 ranks, bf16 autocast on an L4; the answer's plan is for that target and its
    leanest plan fits the budget while the size above does not."""
    from autockpt_zoo.toy import gpt

    with torch.device("meta"):
        model, _ = gpt(dropout=0.0)

    def make_inputs(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.empty(n, 32, dtype=torch.long, device="meta")
        return idx, idx

    found = autockpt.fit_batch(
        model,
        make_inputs,
        budget_gb=0.004,
        target="l4",
        precision="bf16-mixed",
        world_size=4,
        sharding="fsdp",
        max_batch_size=256,
    )
    plan = found.plan
    assert plan.target == "l4" and plan.sharding == "fsdp" and plan.world_size == 4
    assert "cuda:bfloat16" in " ".join(plan.notes)
    assert plan.predicted_peak_bytes <= plan.budget_bytes
    above = [c for c in found.candidates if c.size > found.batch_size]
    assert found.batch_size < 256 and above and not any(c.fits for c in above)
