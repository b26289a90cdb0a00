"""The device a run will use, when planning happens elsewhere: its kernels, capacity and speed.

NOTE [target: planning for another device]. People plan before they launch, on a laptop or a
login node, for the GPUs the job will get: the model is built on the meta device (no memory,
no values) and the plan must hold on the target. Three things of the target enter a plan:

* **Kernels.** Activation sizes depend on which kernel runs: the GPUs here run
  ``scaled_dot_product_attention`` as flash or memory-efficient attention (the output and a
  float32 log-sum-exp saved, no seq x seq scores), where the meta device would run the math
  path. A meta step runs on fake CPU tensors (NOTE [runtime: meta runs as a device]), whose
  fused attention saves what the GPU kernels save (to the log-sum-exp's padding to 32 rows
  on the memory-efficient kernel, a few KiB).
* **Capacity.** The target's memory, less a reserve for what the budget does not count
  (:data:`RESERVE_FRACTION`), is the default budget.
* **Speed.** Where nothing can be measured (the meta device), each node's time is a roofline:
  the slower of its FLOPs at the target's peak rate for its dtype and its bytes read and
  written at the target's memory bandwidth (autockpt/costs/cost_model.py). Plans are ranked
  by it and say so; a plan made on the device itself ranks by measured seconds instead.

The table is the vendors' datasheets (dense peak rates, without sparsity). A roofline is an
upper bound of speed: it ranks plans (which nodes are cheap to recompute) well and predicts a
step's seconds optimistically (real kernels reach 30-70% of peak on large matrix multiplies,
less on small ones), which is why a predicted step time is labelled with its time model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autockpt.errors import GIB, TargetError

__all__ = ["RESERVE_FRACTION", "TARGETS", "Target", "resolve_target"]

RESERVE_FRACTION = 0.10
"""The part of a target's memory the default budget leaves out: the CUDA context, NCCL's
buffers and the caching allocator's rounding and fragmentation, which the budget (peak
allocated bytes, ``torch.cuda.max_memory_allocated``) does not count. torchtitan's published
Llama runs reserve 2-9% more than they allocate; 10% leaves room for the context too."""

_TFLOPS = 1e12
_TBS = 1e12


@dataclass(frozen=True)
class Target:
    """A device a plan is made for: name, device type, memory and peak rates."""

    name: str
    device_type: str
    """``"cuda"`` (also for ROCm, as torch names it) or ``"cpu"``."""
    capacity_bytes: int
    """The device's memory (datasheet; HBM capacities are binary, ``80 GB`` is 80 GiB)."""
    flops: tuple[tuple[str, float], ...]
    """Peak dense FLOP/s per dtype name (``"bfloat16"``, ``"float16"``, ``"float32"``):
    float32 is the non-tensor-core rate (matrix multiplies in float32 without TF32)."""
    bandwidth: float
    """Memory bandwidth, bytes/s."""
    source: str
    """Where the numbers come from."""

    @property
    def default_budget_bytes(self) -> int:
        """The budget a plan for this target gets when none is given: its memory less
        :data:`RESERVE_FRACTION`."""
        return int(self.capacity_bytes * (1 - RESERVE_FRACTION))

    def flop_rate(self, dtype: torch.dtype | str | None) -> float:
        """Peak FLOP/s for work in ``dtype`` (the float32 rate for anything not listed)."""
        name = str(dtype).removeprefix("torch.") if dtype is not None else "float32"
        rates = dict(self.flops)
        return rates.get(name, rates["float32"])

    def describe(self) -> str:
        """``"h100 (cuda, 80.0 GiB, 989 TFLOP/s bf16, 3.35 TB/s)"``."""
        bf16 = dict(self.flops).get("bfloat16", dict(self.flops)["float32"])
        return (
            f"{self.name} ({self.device_type}, {self.capacity_bytes / GIB:.1f} GiB, "
            f"{bf16 / _TFLOPS:.0f} TFLOP/s bf16, {self.bandwidth / _TBS:.2f} TB/s)"
        )


def _gpu(name: str, gib: float, bf16: float, fp32: float, tbs: float, source: str) -> Target:
    return Target(
        name,
        "cuda",
        int(gib * GIB),
        (("bfloat16", bf16 * _TFLOPS), ("float16", bf16 * _TFLOPS), ("float32", fp32 * _TFLOPS)),
        tbs * _TBS,
        source,
    )


TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        _gpu(
            "h100",
            80,
            989.4,
            66.9,
            3.35,
            "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column "
            "(https://www.nvidia.com/en-us/data-center/h100/)",
        ),
        _gpu(
            "h200",
            141,
            989.4,
            66.9,
            4.8,
            "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column "
            "(https://www.nvidia.com/en-us/data-center/h200/)",
        ),
        _gpu(
            "a100",
            80,
            312.0,
            19.5,
            2.039,
            "NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM column "
            "(https://www.nvidia.com/en-us/data-center/a100/)",
        ),
        _gpu(
            "l4",
            24,
            121.0,
            30.3,
            0.3,
            "NVIDIA L4 Tensor Core GPU datasheet (https://www.nvidia.com/en-us/data-center/l4/)",
        ),
        _gpu(
            "mi300x",
            192,
            1307.4,
            163.4,
            5.3,
            "AMD Instinct MI300X accelerator datasheet "
            "(https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html)",
        ),
    )
}
"""The targets known by name (dense rates; bf16 and fp16 equal on all of them)."""


def resolve_target(target: Target | str | None, device: torch.device) -> Target | None:
    """``target`` checked against the device the model is on: a name from :data:`TARGETS`
    (case-insensitive) or a :class:`Target`; only a model on the meta device is planned for
    another device (a real model is planned where it is, by measurement). ``None`` stays
    ``None``: a meta model without a target is planned for a generic fused-attention GPU."""
    if target is None:
        return None
    if isinstance(target, str):
        found = TARGETS.get(target.lower())
        if found is None:
            raise TargetError(
                f"unknown target {target!r}: known targets are {', '.join(TARGETS)} (or pass an "
                "autockpt.Target with your device's memory, peak FLOP/s and bandwidth)"
            )
        target = found
    if not isinstance(target, Target):
        raise TargetError(
            f"target must be a name ({', '.join(TARGETS)}) or an autockpt.Target, got "
            f"{type(target).__name__}"
        )
    if device.type != "meta" and device.type != target.device_type:
        raise TargetError(
            f"target {target.name!r} is a {target.device_type} device and the model is on "
            f"{device}: a real model is planned on the device it is on, by measurement. Build "
            "the model on the meta device (with torch.device('meta'): ...) to plan for "
            f"{target.name} from here, or drop target="
        )
    return target
