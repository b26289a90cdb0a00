"""Stage 7 — measure: the truth about one training step's peak memory and time.

Peak memory follows the budget's definition: every byte of tensor memory alive during one
forward + backward step that belongs to the model's step — parameters, buffers, inputs,
parameter gradients, saved and recomputed activations, transient workspaces — and, given
the training loop's optimizer, one whole iteration from steady state: its state resident
from the start, its step after the backward (and with gradient accumulation, every
micro-batch of the iteration).

* CUDA: ``torch.cuda.reset_peak_memory_stats`` + ``max_memory_allocated``, minus whatever
  unrelated tensors were already allocated on the device before the step.
* CPU: the PyTorch profiler's allocator events (``profile_memory=True``). Every allocation
  and free through the CPU allocator is an event; the running sum of their sizes over the
  step, plus the static tensors alive when it starts, is the allocator-level peak. This sees
  kernel workspaces and autograd's own buffers, which a model of the graph cannot.

Step time is the median of ``repeat`` un-instrumented steps (``repeat=0``: memory only, step
time 0). The model, the inputs and the global random generators are left as found
(:func:`autockpt.base.runtime.as_found`); so is the optimizer: a stand-in of it steps
(autockpt/base/optimizer.py), and the parameters it moved get their values back.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

os.environ.setdefault("KINETO_LOG_LEVEL", "5")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from autockpt.base import allocations  # noqa: E402
from autockpt.base.allocations import allocator_events, peak_above_start, profiler_session  # noqa: E402
from autockpt.base.inputs import Inputs  # noqa: E402
from autockpt.base.optimizer import (  # noqa: E402
    check_optimizer,
    parameters_of,
    stand_in,
    state_tensors,  # noqa: E402
)
from autockpt.base.optimizer import step as optimizer_step  # noqa: E402
from autockpt.base.precision import fresh_autocast_cache  # noqa: E402
from autockpt.base.runtime import (  # noqa: E402
    LossFn,
    as_found,
    check_real_step,
    clear_grads,
    default_loss,
    device_of,
    now,
)

T = TypeVar("T")


@dataclass(frozen=True)
class Measurement:
    """Measured peak memory (bytes) and median step time (seconds) of one training step."""

    peak_bytes: int
    static_bytes: int
    step_seconds: float
    device: str
    repeat: int
    forward_seconds: float = 0.0
    """Median time of the timed steps' forward passes, loss included (0 when none timed):
    with ``step_seconds``, what the step factors are read from (NOTE [timing: step
    factors])."""

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
    optimizer: torch.optim.Optimizer | None = None,
    accumulation_steps: int = 1,
    max_seconds: float | None = None,
) -> Measurement:
    """Measure peak memory and step time of ``loss_fn(model(*inputs)).backward()``.

    With ``optimizer``, of one training iteration from steady state: ``accumulation_steps``
    forward and backward passes, then a step of a stand-in of the optimizer (the same class
    and hyperparameters, state of its own, made by a warm-up iteration and resident when
    the measured one starts: ``static_bytes`` includes it). The user's optimizer is never
    stepped and the parameters are as found afterwards.

    Called inside ``torch.autocast``, every step runs under it as in a fresh context per
    step: autocast's weight casts are made and counted in the step (the cache is emptied
    before and after each).

    ``max_seconds``: stop timing once the timed steps took that long together (at least one
    is timed); ``Measurement.repeat`` says how many were."""
    inputs = Inputs.of(example_inputs)
    if optimizer is not None:
        check_optimizer(optimizer, model)
    if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int):
        raise TypeError(f"accumulation_steps must be an int, got {accumulation_steps!r}")
    if accumulation_steps < 1:
        raise ValueError(f"accumulation_steps must be at least 1, got {accumulation_steps}")
    if max_seconds is not None and (
        isinstance(max_seconds, bool)
        or not isinstance(max_seconds, (int, float))
        or not max_seconds > 0
    ):
        raise ValueError(
            f"max_seconds must be a positive number of seconds or None, got {max_seconds!r}"
        )
    loss_fn = loss_fn or default_loss
    device = device_of(model, inputs)
    static = static_bytes(model, inputs)
    with (
        as_found(model, inputs),
        fresh_autocast_cache(),
        _Iteration(model, inputs, loss_fn, optimizer, accumulation_steps) as iteration,
    ):
        clear_grads(model)
        # the steady state has the optimizer's state: one iteration makes it
        for _ in range(max(0, warmup, 1 if optimizer is not None else 0)):
            iteration()
            clear_grads(model)
        static += iteration.state_bytes()
        if device.type == "cuda":
            peak = _cuda_peak(iteration, device, static)
        else:
            peak = _cpu_peak(iteration, static)
        clear_grads(model)
        times, forwards = [], []
        iteration.clock = device
        for _ in range(max(0, repeat)):
            start = now(device)
            iteration()
            times.append(now(device) - start)
            forwards.append(iteration.forward_seconds)
            clear_grads(model)
            if max_seconds is not None and sum(times) >= max_seconds:
                break
    seconds = statistics.median(times) if times else 0.0
    forward = statistics.median(forwards) if forwards else 0.0
    return Measurement(peak, static, seconds, str(device), len(times), forward)


class _Iteration:
    """One training iteration of ``model`` as its loop runs it: ``accumulation_steps``
    forward and backward passes, then the optimizer's step (a stand-in's, over the real
    parameters; ``zero_grad`` is the caller's). On exit the parameters the stand-in moved
    get their values back from host copies (no device memory) and its state is dropped."""

    def __init__(
        self,
        model: nn.Module,
        inputs: Inputs,
        loss_fn: LossFn,
        optimizer: torch.optim.Optimizer | None,
        accumulation_steps: int,
    ) -> None:
        self.model, self.inputs, self.loss_fn = model, inputs, loss_fn
        self.optimizer, self.accumulation_steps = optimizer, accumulation_steps
        self.stepping: torch.optim.Optimizer | None = None
        self.saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.clock: torch.device | None = None
        """The device whose clock times the forward passes (None: not timed)."""
        self.forward_seconds = 0.0
        """The last iteration's forward seconds (loss included), when timed."""

    def __enter__(self) -> _Iteration:
        if self.optimizer is not None:
            self.stepping = stand_in(self.optimizer, lambda p: p)
            self.saved = [
                (p, p.detach().to("cpu", copy=True)) for p in parameters_of(self.stepping)
            ]
        return self

    def __call__(self) -> None:
        self.forward_seconds = 0.0
        for _ in range(self.accumulation_steps):
            self.forward_seconds += _step(self.model, self.inputs, self.loss_fn, self.clock)
        if self.stepping is not None:
            optimizer_step(self.stepping)

    def state_bytes(self) -> int:
        """Bytes of the stand-in's state: resident between iterations."""
        if self.stepping is None:
            return 0
        return allocations.StorageSet(skip_meta=True).add(state_tensors(self.stepping))

    def __exit__(self, *exc: Any) -> None:
        self.stepping = None
        with torch.no_grad():
            for p, value in self.saved:
                p.copy_(value)
        self.saved = []


def static_bytes(model: nn.Module, inputs: Inputs) -> int:
    """Bytes of the distinct storages of parameters, buffers and input tensors that a real
    step holds (``autockpt.base.allocations.static_bytes``; meta tensors hold none)."""
    return allocations.static_bytes(model, inputs, skip_meta=True)


def _step(model: nn.Module, inputs: Inputs, loss_fn: LossFn, clock: torch.device | None) -> float:
    """One forward and backward; the forward's seconds when ``clock`` is a device, else 0."""
    # Under autocast, each step as in a fresh context: its weight casts are made in it and
    # freed after it (autockpt/base/precision.py), not left cached from the step before.
    with fresh_autocast_cache():
        start = now(clock) if clock is not None else 0.0
        output = model(*inputs.args, **inputs.kwargs)
        loss = loss_fn(output)
        forward = now(clock) - start if clock is not None else 0.0
        check_real_step(output, loss)  # a fake tensor kept from planning fails here, typed
        del output
        loss.backward()
    return forward


def _cpu_peak(iteration: Callable[[], None], static: int) -> int:
    with profiler_session() as session:
        iteration()
    return static + peak_above_start([e.nbytes for e in allocator_events(session, "cpu")])


def _cuda_peak(iteration: Callable[[], None], device: torch.device, static: int) -> int:
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    iteration()
    torch.cuda.synchronize(device)
    unrelated = before - static
    return torch.cuda.max_memory_allocated(device) - unrelated


def interleaved_rounds(
    steps: Sequence[Callable[[], None]],
    rounds: int,
    clock: Callable[[Callable[[], None]], T],
) -> list[list[T]]:
    """Every step timed side by side: NOTE [timing: interleaved rounds].

    One untimed run of each step (a compiled one compiles then), then ``rounds`` rounds;
    each round starts one step later, and runs every step twice in a row, timing the
    second with ``clock`` (which runs the step it is given and returns its reading).
    Returns each step's readings, in the order of ``steps``.

    NOTE [timing: interleaved rounds]: one step timed alone is no result on a shared
    machine, where a slow spell lasts several steps: rounds spread it over every step alike,
    and a ratio of two steps is taken within a round. The step timed follows the same
    step, as in a training loop: on a CPU the step that follows another model's step is not
    that step (the allocator's state differs); before this, the benchmark's rounds timed
    ResNet's steps at 136 ms against 189 ms in a loop, and predictions calibrated by
    planning's consecutive steps missed them (docs/design.md, "One time model")."""
    for step in steps:
        step()
    samples: list[list[T]] = [[] for _ in steps]
    for r in range(rounds):
        for k in range(len(steps)):
            i = (k + r) % len(steps)
            steps[i]()
            samples[i].append(clock(steps[i]))
    return samples


def process_seconds(step: Callable[[], None]) -> float:
    """``step``'s process CPU time: on a shared machine wall time mostly measures who else
    runs."""
    begin = time.process_time()
    step()
    return time.process_time() - begin


def wall_seconds(step: Callable[[], None]) -> float:
    """``step``'s wall time (host clock: steps that end in a host sync)."""
    begin = time.perf_counter()
    step()
    return time.perf_counter() - begin


def interleaved_seconds(
    steps: dict[str, Callable[[], None]],
    rounds: int = 5,
    clock: Callable[[Callable[[], None]], float] = process_seconds,
) -> dict[str, float]:
    """Median seconds of each named step over :func:`interleaved_rounds`, on ``clock``
    (process CPU time unless told)."""
    samples = interleaved_rounds(list(steps.values()), rounds, clock)
    return {name: statistics.median(values) for name, values in zip(steps, samples, strict=True)}


def time_steps(
    modules: list[nn.Module],
    example_inputs: Any,
    *,
    loss_fn: LossFn | None = None,
    rounds: int = 5,
) -> list[float]:
    """Median seconds of a forward + backward of each of ``modules`` (the same model planned
    differently), timed side by side (NOTE [timing: interleaved rounds]). The modules, the
    inputs and the random generators are left as found."""
    inputs = Inputs.of(example_inputs)
    loss = loss_fn or default_loss
    if not modules:
        return []
    device = device_of(modules[0], inputs)

    def stepper(module: nn.Module) -> Callable[[], None]:
        def step() -> None:
            _step(module, inputs, loss, None)
            clear_grads(module)

        return step

    def clock(step: Callable[[], None]) -> float:
        start = now(device)
        step()
        return now(device) - start

    with contextlib.ExitStack() as stack:
        for module in modules:
            stack.enter_context(as_found(module, inputs))
        times = interleaved_rounds([stepper(m) for m in modules], max(1, rounds), clock)
    return [statistics.median(t) for t in times]
