"""Stage 7 — measure: the truth about one training step's peak memory and time.

Peak memory follows the budget's definition: every byte of tensor memory alive during one
forward + backward step that belongs to the model's step — parameters, buffers, inputs,
parameter gradients, saved and recomputed activations, transient workspaces.

* CUDA: ``torch.cuda.reset_peak_memory_stats`` + ``max_memory_allocated``, minus whatever
  unrelated tensors were already allocated on the device before the step.
* CPU: the PyTorch profiler's allocator events (``profile_memory=True``). Every allocation
  and free through the CPU allocator is an event; the running sum of their sizes over the
  step, plus the static tensors alive when it starts, is the allocator-level peak. This sees
  kernel workspaces and autograd's own buffers, which a model of the graph cannot.

Step time is the median of ``repeat`` un-instrumented steps (``repeat=0``: memory only, step
time 0). The model, the inputs and the global random generators are left as found
(:func:`autockpt.base.runtime.as_found`).
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("KINETO_LOG_LEVEL", "5")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from autockpt.base import allocations  # noqa: E402
from autockpt.base.allocations import allocator_events, peak_above_start, profiler_session  # noqa: E402
from autockpt.base.inputs import Inputs  # noqa: E402
from autockpt.base.precision import fresh_autocast_cache  # noqa: E402
from autockpt.base.runtime import LossFn, as_found, clear_grads, default_loss, device_of, now  # noqa: E402


@dataclass(frozen=True)
class Measurement:
    """Measured peak memory (bytes) and median step time (seconds) of one training step."""

    peak_bytes: int
    static_bytes: int
    step_seconds: float
    device: str
    repeat: int

    @property
    def activation_peak_bytes(self) -> int:
        """What lies above parameters, buffers and inputs: parameter gradients included.
        What a plan's budget counts of a measured peak is ``plan.budgeted_bytes(peak)``."""
        return self.peak_bytes - self.static_bytes

    @property
    def peak_gb(self) -> float:
        return self.peak_bytes / 2**30


def measure(
    model: nn.Module,
    example_inputs: Any,
    *,
    loss_fn: LossFn | None = None,
    repeat: int = 5,
    warmup: int = 1,
) -> Measurement:
    """Measure peak memory and step time of ``loss_fn(model(*inputs)).backward()``.

    Called inside ``torch.autocast``, every step runs under it as in a fresh context per
    step: autocast's weight casts are made and counted in the step (the cache is emptied
    before and after each)."""
    inputs = Inputs.of(example_inputs)
    loss_fn = loss_fn or default_loss
    device = device_of(model, inputs)
    static = static_bytes(model, inputs)
    with as_found(model, inputs), fresh_autocast_cache():
        clear_grads(model)
        for _ in range(max(0, warmup)):
            _step(model, inputs, loss_fn)
            clear_grads(model)
        if device.type == "cuda":
            peak = _cuda_peak(model, inputs, loss_fn, device, static)
        else:
            peak = _cpu_peak(model, inputs, loss_fn, static)
        clear_grads(model)
        times = []
        for _ in range(max(0, repeat)):
            start = now(device)
            _step(model, inputs, loss_fn)
            times.append(now(device) - start)
            clear_grads(model)
    seconds = statistics.median(times) if times else 0.0
    return Measurement(peak, static, seconds, str(device), max(0, repeat))


def static_bytes(model: nn.Module, inputs: Inputs) -> int:
    """Bytes of the distinct storages of parameters, buffers and input tensors that a real
    step holds (``autockpt.base.allocations.static_bytes``; meta tensors hold none)."""
    return allocations.static_bytes(model, inputs, skip_meta=True)


def _step(model: nn.Module, inputs: Inputs, loss_fn: LossFn) -> None:
    # Under autocast, each step as in a fresh context: its weight casts are made in it and
    # freed after it (autockpt/base/precision.py), not left cached from the step before.
    with fresh_autocast_cache():
        loss = loss_fn(model(*inputs.args, **inputs.kwargs))
        loss.backward()


def _cpu_peak(model: nn.Module, inputs: Inputs, loss_fn: LossFn, static: int) -> int:
    with profiler_session() as session:
        _step(model, inputs, loss_fn)
    return static + peak_above_start([e.nbytes for e in allocator_events(session, "cpu")])


def _cuda_peak(
    model: nn.Module, inputs: Inputs, loss_fn: LossFn, device: torch.device, static: int
) -> int:
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    _step(model, inputs, loss_fn)
    torch.cuda.synchronize(device)
    unrelated = before - static
    return torch.cuda.max_memory_allocated(device) - unrelated
