"""Profiling: saved storages from first principles, static memory, mutated buffers, RNG use,
FLOPs, the default loss, and that a profile leaves no trace in the model's training state."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from autockpt.base.runtime import default_loss, preserved_training_state
from autockpt.capture import Inputs, capture
from autockpt.costs.profile import Profile, profile

F32 = 4  # bytes per float32 element
N, A, B, C = 5, 6, 12, 3  # batch, in, hidden, out


def _profile(model: nn.Module, example: object, **kwargs) -> Profile:
    inputs = Inputs.of(example)
    return profile(model, capture(model, inputs), inputs, repeat=1, **kwargs)


def _linear_relu_linear() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(A, B), nn.ReLU(), nn.Linear(B, C))


def _bn_dropout_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(A, B), nn.BatchNorm1d(B), nn.ReLU(), nn.Dropout(0.5), nn.Linear(B, C)
    )


def _linear_bytes(fan_in: int, fan_out: int) -> int:
    return (fan_in * fan_out + fan_out) * F32


@pytest.mark.parametrize("input_requires_grad", [False, True])
def test_saved_storages_match_first_principles(input_requires_grad):
    """Linear(A->B) -> ReLU -> Linear(B->C) on a batch of N:

    * the first Linear saves its input (a model input: static, excluded) and its weight
      (a parameter: excluded), so it contributes nothing;
    * ReLU saves its output, N*B floats;
    * the second Linear saves its input, which is that same ReLU output: one storage.
    """
    model = _linear_relu_linear()
    x = torch.randn(N, A, requires_grad=input_requires_grad)
    prof = _profile(model, x)
    first, relu, second = prof.nodes
    assert [n.name for n in prof.nodes] == ["_0", "_1", "_2"]
    assert first.saved == ()
    assert len(relu.saved) == 1
    assert second.saved == relu.saved
    (shared,) = relu.saved
    assert prof.storage_bytes[shared] == N * B * F32
    assert relu.outputs == (shared,)  # what ReLU saves is its own output
    assert prof.saved_bytes() == N * B * F32
    # the first Linear's output is a different N*B storage (ReLU is not in place)
    assert first.outputs != relu.outputs
    assert prof.storage_bytes[first.outputs[0]] == N * B * F32
    assert prof.output_bytes == N * C * F32
    assert not any(n.mutates for n in prof.nodes)


def test_static_and_gradient_bytes_come_from_shapes():
    model = _bn_dropout_model()
    x = torch.randn(N, A)
    prof = _profile(model, x)
    params = _linear_bytes(A, B) + 2 * B * F32 + _linear_bytes(B, C)
    assert prof.param_bytes == params
    assert prof.param_bytes == sum(p.numel() * p.element_size() for p in model.parameters())
    assert prof.param_grad_bytes == params
    # running_mean, running_var (B floats each) and num_batches_tracked (one int64)
    assert prof.buffer_bytes == 2 * B * F32 + 8
    assert prof.input_bytes == N * A * F32
    assert prof.static_bytes == prof.param_bytes + prof.buffer_bytes + prof.input_bytes
    # gradient bytes are attributed to the node owning the parameters, once each
    per_node = [n.param_grad_bytes for n in prof.nodes]
    assert per_node == [_linear_bytes(A, B), 2 * B * F32, 0, 0, _linear_bytes(B, C)]
    assert sum(per_node) == prof.param_grad_bytes


def test_frozen_parameters_have_no_gradient_bytes():
    model = _linear_relu_linear()
    model[0].requires_grad_(False)
    prof = _profile(model, torch.randn(N, A))
    assert prof.param_bytes == _linear_bytes(A, B) + _linear_bytes(B, C)
    assert prof.param_grad_bytes == _linear_bytes(B, C)
    assert [n.param_grad_bytes for n in prof.nodes] == [0, 0, _linear_bytes(B, C)]


def test_shared_parameters_count_once():
    torch.manual_seed(0)
    shared = nn.Linear(A, A)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    prof = _profile(model, torch.randn(N, A))
    assert prof.param_bytes == _linear_bytes(A, A)
    assert prof.param_grad_bytes == _linear_bytes(A, A)


def test_mutated_buffers_are_the_batchnorm_statistics():
    model = _bn_dropout_model()
    prof = _profile(model, torch.randn(N, A))
    assert set(prof.mutated_buffers) == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    model.eval()
    assert _profile(model, torch.randn(N, A)).mutated_buffers == ()


def test_random_marks_dropout_nodes_only():
    model = _bn_dropout_model()
    prof = _profile(model, torch.randn(N, A))
    randoms = {n.name for n in prof.nodes if n.random}
    assert randoms == {"_3"}
    assert isinstance(model[3], nn.Dropout)
    model.eval()  # dropout is the identity in eval mode: no random numbers drawn
    assert not any(n.random for n in _profile(model, torch.randn(N, A)).nodes)


def test_functional_dropout_is_random_too():
    class Functional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(A, B)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.relu(self.proj(x))
            return nn.functional.dropout(h, 0.3, training=True).sum(-1)

    prof = _profile(Functional(), torch.randn(N, A))
    assert [n.random for n in prof.nodes] == [False, False, True, False]


def test_flops_of_linear_nodes():
    """A Linear on N rows is a (N x in) @ (in x out) matmul: 2 * N * in * out FLOPs
    (one multiply and one add per term)."""
    prof = _profile(_linear_relu_linear(), torch.randn(N, A))
    first, relu, second = prof.nodes
    assert first.flops == 2 * N * A * B
    assert second.flops == 2 * N * B * C
    assert relu.flops == 0


def test_timings_are_recorded():
    prof = _profile(_linear_relu_linear(), torch.randn(N, A))
    assert prof.step_seconds > 0
    assert all(n.forward_seconds >= 0 and n.backward_seconds >= 0 for n in prof.nodes)
    assert any(n.forward_seconds > 0 for n in prof.nodes)
    assert prof.device == "cpu"


def test_profiling_leaves_training_state_unchanged():
    model = _bn_dropout_model()
    x = torch.randn(N, A)
    # a step has happened: some buffers moved, one parameter holds an accumulated gradient
    with torch.no_grad():
        model(x)
    sentinel = torch.full_like(model[0].weight, 7.0)
    model[0].weight.grad = sentinel
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    torch.manual_seed(99)
    rng = torch.get_rng_state()

    _profile(model, x)

    assert model[0].weight.grad is sentinel
    assert torch.equal(sentinel, torch.full_like(sentinel, 7.0))
    assert all(p.grad is None for name, p in model.named_parameters() if name != "0.weight")
    for name, b in model.named_buffers():
        assert torch.equal(b, buffers[name]), name
    assert torch.equal(torch.get_rng_state(), rng)


def test_preserved_training_state_restores_on_error():
    model = _bn_dropout_model()
    x = torch.randn(N, A)
    sentinel = torch.zeros_like(model[0].weight)
    model[0].weight.grad = sentinel
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    rng = torch.get_rng_state()
    with pytest.raises(RuntimeError, match="boom"):
        with preserved_training_state(model):
            model(x).sum().backward()
            torch.rand(10)
            assert model[0].weight.grad is not None
            raise RuntimeError("boom")
    # the caller's gradient is the same tensor, not accumulated into
    assert model[0].weight.grad is sentinel
    assert not sentinel.any()
    assert all(p.grad is None for name, p in model.named_parameters() if name != "0.weight")
    for name, b in model.named_buffers():
        assert torch.equal(b, buffers[name]), name
    assert torch.equal(torch.get_rng_state(), rng)


def test_profile_rejects_non_scalar_loss():
    with pytest.raises(ValueError, match="scalar"):
        _profile(_linear_relu_linear(), torch.randn(N, A), loss_fn=lambda out: out * 2)


def test_custom_loss_runs_outside_the_profiled_graph():
    """A loss that squares the output saves the output: the model's own saved set does not
    change (the loss runs outside the graph), and the profile still completes."""
    model = _linear_relu_linear()
    prof = _profile(model, torch.randn(N, A), loss_fn=lambda out: (out**2).mean())
    assert prof.saved_bytes() == N * B * F32


# --------------------------------------------------------------------------------------------
# default_loss


def _leaf(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, requires_grad=True)


def test_default_loss_of_a_tensor_is_its_sum():
    t = _leaf(3, 4)
    torch.testing.assert_close(default_loss(t), t.sum())


def test_default_loss_sums_floating_tensors_that_require_grad():
    a, b = _leaf(2, 3), _leaf(4)
    ignored = [torch.randn(5), torch.arange(3), 7, "text", None]
    expected = a.sum() + b.sum()
    torch.testing.assert_close(default_loss((a, ignored, b)), expected)
    torch.testing.assert_close(default_loss({"a": a, "nested": {"b": b}, "i": ignored}), expected)


def test_default_loss_prefers_a_loss_field():
    loss, logits = _leaf(()), _leaf(2, 3)
    assert default_loss({"loss": loss, "logits": logits}) is loss

    class HFStyle:
        def __init__(self) -> None:
            self.loss = loss
            self.logits = logits

    assert default_loss(HFStyle()) is loss


def test_default_loss_of_a_dataclass_without_loss_sums_its_fields():
    @dataclasses.dataclass
    class Out:
        logits: torch.Tensor
        hidden: torch.Tensor
        loss: torch.Tensor | None = None

    a, b = _leaf(2), _leaf(3)
    torch.testing.assert_close(default_loss(Out(a, b)), a.sum() + b.sum())


def test_default_loss_upcasts_half_precision():
    """70000 exceeds float16's largest finite value (65504): a half-precision sum overflows."""
    t = torch.ones(70000, dtype=torch.float16, requires_grad=True)
    loss = default_loss(t)
    assert loss.dtype == torch.float32
    assert loss.item() == 70000.0


@pytest.mark.parametrize(
    "output",
    [
        torch.randn(3),
        (torch.randn(3), torch.arange(4)),
        {"logits": torch.randn(2)},
        [],
    ],
)
def test_default_loss_without_a_differentiable_tensor_says_to_pass_loss_fn(output):
    with pytest.raises(ValueError, match="loss_fn"):
        default_loss(output)


def test_meta_device_profile_estimates_times_from_flops_and_sees_saved_storages():
    """On the meta device nothing runs for real: saved storages are still found (by storage
    identity, every meta address being 0), times come from FLOPs, dropout counts as random."""
    from autockpt.costs.cost_model import NOMINAL_RATES, estimated_seconds

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Dropout(0.1), nn.Linear(512, 8))
        x = torch.randn(64, 256, requires_grad=True)
    inputs = Inputs.of(x)
    prof = profile(model, capture(model, inputs), inputs)
    assert prof.times_estimated and prof.device == "meta"
    first = prof.nodes[0]
    assert first.flops == 2 * 64 * 256 * 512
    # the cost model's roofline: reads x and the output's bytes, writes the output
    traffic = 4 * (64 * 256 + 64 * 512)
    assert (
        first.forward_seconds
        == first.cost_seconds
        == estimated_seconds(first.flops, traffic, "meta")
    )
    assert first.cost_seconds > first.flops / NOMINAL_RATES["meta"][0]
    assert first.backward_seconds == 2 * first.forward_seconds
    assert [node.random for node in prof.nodes] == [False, False, True, False]
    # ReLU saves its output (64 x 512 floats); dropout saves its mask; the last Linear its input
    assert prof.saved_bytes() >= 64 * 512 * 4
    assert prof.param_bytes == (256 * 512 + 512 + 512 * 8 + 8) * 4
    assert all(p.device.type == "meta" for p in model.parameters())


class _ValueBranch(nn.Module):
    """Control flow on a tensor's value: how much work (and memory) a step does depends on
    the data, which one example cannot bound."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(A, A)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        for _ in range(int(h.detach().abs().sum()) % 3 + 1):
            h = torch.tanh(self.proj(h))
        return h


def test_value_dependent_step_is_refused_with_the_operator_named_before_any_real_step():
    """Planning sizes a step on fake tensors and never runs it for real; a step whose work
    depends on tensor values gets a TraceError naming the operator and the graph node, and
    the model's state (RNG, buffers, grads) is untouched."""
    from autockpt.errors import TraceError

    model = nn.Sequential(nn.Linear(A, A), _ValueBranch())
    x = torch.randn(N, A)
    inputs = Inputs.of(x)
    captured = capture(model, inputs)  # fx fails inside the branch: it becomes a leaf
    rng = torch.get_rng_state()
    with pytest.raises(TraceError, match=r"_local_scalar_dense.*graph node '_1'"):
        profile(model, captured, inputs)
    assert torch.equal(rng, torch.get_rng_state())
    assert all(p.grad is None for p in model.parameters())


class _TakesKwargs(nn.Module):
    """A forward with ``**kwargs`` that fx traces (a Hugging Face head does this): fx gives
    the catch-all its own placeholder, which must receive an empty dict."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))

    def forward(self, x: torch.Tensor, scale: float = 1.0, **kwargs: object) -> torch.Tensor:
        return self.body(x) * scale


def test_a_var_keyword_placeholder_gets_an_empty_dict():
    import autockpt

    model = _TakesKwargs()
    x = torch.randn(4, 8)
    captured = capture(model, Inputs.of((x,)))
    assert any(str(n.target) == "**kwargs" for n in captured.graph.nodes if n.op == "placeholder")
    result = autockpt.optimize(model, (x,), budget_gb=1.0)
    expected = model(x)
    assert torch.equal(result(x), expected)


class _KeepsOutputOnCtx(torch.autograd.Function):
    """Keeps its output aside on ``ctx`` (not a saved tensor): the probe must not free it."""

    @staticmethod
    def forward(ctx, x):
        ctx.out = x.exp()
        return ctx.out

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.out


class _Twice(nn.Module):
    def forward(self, x):
        return _KeepsOutputOnCtx.apply(x) * 2


def test_the_probe_frees_only_outputs_of_calls_that_save_through_autograd():
    """NOTE [profile: probe's working set]: operators, methods and torch.nn modules save what
    their backward reads as saved tensors; a custom Function may keep it on ``ctx`` and a
    user's module may hold one, so their outputs are never freed."""
    from autockpt.costs.probe import _saves_through_autograd

    model = nn.Sequential(nn.Conv2d(3, 4, 3), _Twice())
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    nodes = [
        graph.call_module("0", (x,)),
        graph.call_function(torch.relu, (x,)),
        graph.call_function(torch.ops.aten.mm.default, (x, x)),
        graph.call_method("exp", (x,)),
        graph.call_function(_KeepsOutputOnCtx.apply, (x,)),
        graph.call_module("1", (x,)),
    ]
    assert [_saves_through_autograd(n, model) for n in nodes] == [1, 1, 1, 1, 0, 0]


def test_the_probe_frees_outputs_autograd_does_not_save_and_measures_the_same(monkeypatch):
    """Freeing the outputs no backward reads lowers the probe's peak by a feature map and
    changes no measured workspace."""
    from autockpt.costs import probe as probe_module

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.Conv2d(16, 16, 3, padding=1))
    x = torch.randn(4, 3, 32, 32)
    freed = _profile(model, x)
    monkeypatch.setattr(probe_module, "_saves_through_autograd", lambda n, m: False)
    kept = _profile(model, x)
    assert [(n.forward_workspace, n.backward_workspace) for n in freed.nodes] == [
        (n.forward_workspace, n.backward_workspace) for n in kept.nodes
    ]
    feature_map = 4 * 16 * 32 * 32 * F32
    assert freed.probe_peak_bytes <= kept.probe_peak_bytes - feature_map
    assert model[0].weight.grad is None  # the probe leaves no gradient behind
