"""Measuring the truth: allocator-level peak of one step against bounds derived by hand, the
static part, and that measuring leaves the model's training state alone."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autockpt.capture import Inputs
from autockpt.measure import Measurement, measure, static_bytes

F32 = 4
IN = OUT = 512  # the weight (1 MiB) dwarfs every activation
BATCH = 4
SCALARS = 1024  # loss, its gradient and other 0-d temporaries: a few bytes each


def _big_linear() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(IN, OUT, bias=False)


def _squared(output: torch.Tensor) -> torch.Tensor:
    return (output * output).sum()


def test_peak_of_one_big_linear_is_known_analytically():
    """One step of ``y = x @ W.T``, loss ``sum(y * y)``.

    When backward writes ``grad_W = grad_y.T @ x`` these are alive at once: the weight ``W``,
    the input ``x``, the output gradient ``grad_y = 2 * y`` (a real tensor, the matmul's
    operand) and ``grad_W`` itself. That is a lower bound. Above it there can only be ``y``
    (saved by the multiply until its backward ran) and 0-d scalars.
    """
    model, x = _big_linear(), torch.randn(BATCH, IN)
    params = grads = IN * OUT * F32
    inputs, output = BATCH * IN * F32, BATCH * OUT * F32
    result = measure(model, x, loss_fn=_squared, repeat=1)
    floor = params + grads + inputs + output
    assert floor <= result.peak_bytes <= floor + output + SCALARS, (result.peak_bytes, floor)
    assert result.static_bytes == params + inputs
    assert result.activation_peak_bytes == result.peak_bytes - result.static_bytes
    assert result.activation_peak_bytes >= grads
    assert result.peak_gb == result.peak_bytes / 2**30


def test_peak_with_the_default_loss_includes_the_gradients():
    """With ``sum(y)`` nothing is saved; still every parameter gradient exists at the end of
    backward next to the parameters and the input, and the output existed in forward."""
    model, x = _big_linear(), torch.randn(BATCH, IN)
    params = grads = IN * OUT * F32
    inputs, output = BATCH * IN * F32, BATCH * OUT * F32
    peak = measure(model, x, repeat=1).peak_bytes
    assert peak >= params + grads + inputs
    assert peak >= params + inputs + output
    assert peak <= params + grads + inputs + 2 * output + SCALARS


def test_peak_sees_activations_that_autograd_saves():
    """A stack of ReLU layers that each save a BATCH x WIDTH activation: the measured peak
    exceeds the parameters, their gradients and the input by at least those saved tensors."""
    torch.manual_seed(0)
    width, depth, batch = 64, 6, 512
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width, bias=False), nn.ReLU()]
    model = nn.Sequential(*layers)
    x = torch.randn(batch, width)
    params = depth * width * width * F32
    # ReLU outputs that the next Linear (or the ReLU's own backward) keeps for backward
    saved = depth * batch * width * F32
    result = measure(model, x, repeat=1)
    assert result.static_bytes == params + batch * width * F32
    assert result.activation_peak_bytes >= saved
    assert result.activation_peak_bytes < saved + params + 4 * batch * width * F32


def test_static_bytes_counts_parameters_buffers_and_inputs_once():
    torch.manual_seed(0)
    shared = nn.Linear(8, 8)
    model = nn.Sequential(shared, nn.BatchNorm1d(8), shared)
    x = torch.randn(6, 8)
    mask = torch.ones(6, 8)
    params = (8 * 8 + 8) * F32 + 2 * 8 * F32  # the shared Linear counts once; BN's affine
    buffers = 2 * 8 * F32 + 8  # running mean and var, int64 batch counter
    inputs = Inputs((x, x[2:]), {"mask": mask})  # a view of x is x's storage
    assert static_bytes(model, inputs) == params + buffers + 2 * 6 * 8 * F32


def test_measurement_static_bytes_match():
    model = nn.Sequential(nn.Linear(8, 4), nn.BatchNorm1d(4))
    x = torch.randn(6, 8)
    result = measure(model, x, repeat=2)
    assert result.static_bytes == static_bytes(model, Inputs.of(x))
    assert result.repeat == 2
    assert result.step_seconds > 0
    assert result.device == "cpu"


def test_timing_stops_once_the_timed_steps_took_max_seconds():
    """Planning times a long step fewer times (STEP_TIMING_SECONDS): at least one step is
    timed, and ``repeat`` says how many were."""
    model = nn.Sequential(nn.Linear(8, 4), nn.BatchNorm1d(4))
    x = torch.randn(6, 8)
    assert measure(model, x, repeat=4, max_seconds=1e-9).repeat == 1
    assert measure(model, x, repeat=4, max_seconds=3600.0).repeat == 4
    for bad in (0, -1.0, True, "1"):
        with pytest.raises(ValueError, match="max_seconds"):
            measure(model, x, max_seconds=bad)


def test_activation_peak_bytes_is_what_lies_above_static():
    m = Measurement(
        peak_bytes=3 * 2**30, static_bytes=2**30, step_seconds=0.1, device="cpu", repeat=1
    )
    assert m.activation_peak_bytes == 2 * 2**30
    assert m.peak_gb == 3.0


def test_measure_leaves_training_state_alone():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2))
    x = torch.randn(6, 8)
    sentinel = torch.full_like(model[0].weight, 3.0)
    model[0].weight.grad = sentinel
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    torch.manual_seed(5)
    rng = torch.get_rng_state()

    measure(model, x, repeat=2, warmup=2)

    assert model[0].weight.grad is sentinel
    assert torch.equal(sentinel, torch.full_like(sentinel, 3.0))
    for name, p in model.named_parameters():
        if name != "0.weight":
            assert p.grad is None, name
    for name, b in model.named_buffers():
        assert torch.equal(b, buffers[name]), name
    assert torch.equal(torch.get_rng_state(), rng)
    assert model.training


def test_measure_accepts_keyword_inputs_and_structured_outputs():
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> dict[str, torch.Tensor]:
            return {"a": self.a(x) * scale, "b": self.b(x)}

    x = torch.randn(3, 8)
    result = measure(Model(), {"x": x, "scale": 2.0}, repeat=1)
    assert result.peak_bytes > result.static_bytes == 2 * (8 * 8 + 8) * F32 + 3 * 8 * F32


def test_a_failing_step_inside_the_profiler_leaves_measure_usable():
    model, x = nn.Linear(4, 4), torch.randn(2, 4)
    with pytest.raises(RuntimeError, match="scalar"):
        measure(model, x, loss_fn=lambda out: out, repeat=1, warmup=0)
    assert all(p.grad is None for p in model.parameters())
    again = measure(model, x, repeat=1, warmup=0)
    assert again.peak_bytes > again.static_bytes


def test_interleaved_rounds_time_each_step_right_after_itself() -> None:
    """NOTE [timing: interleaved rounds]: a warm-up of each, then per round every step twice
    in a row with the second timed, the rounds starting one step later each time."""
    from autockpt.demo import interleaved_seconds
    from autockpt.measure import interleaved_rounds

    calls: list[tuple[str, bool]] = []
    timing = [False]
    steps = [lambda name=name: calls.append((name, timing[0])) for name in "abc"]

    def clock(step):
        timing[0] = True
        step()
        timing[0] = False
        return calls[-1][0]

    samples = interleaved_rounds(steps, 2, clock)
    assert samples == [["a", "a"], ["b", "b"], ["c", "c"]]
    assert calls[:3] == [("a", False), ("b", False), ("c", False)]
    rounds = calls[3:]
    assert [name for name, _ in rounds] == list("aabbcc" + "bbccaa")
    assert [timed for _, timed in rounds] == [False, True] * 6
    seconds = interleaved_seconds({"x": lambda: None, "y": lambda: sum(range(1000))}, rounds=3)
    assert set(seconds) == {"x", "y"} and all(s >= 0 for s in seconds.values())
