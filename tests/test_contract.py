"""The budget contract's corners: no silent wrong gradient, no raw crash on unusual state,
and planning leaves the loss as found.

* A forward that updates a *parameter* in place (EDM2's forced weight normalisation) trains
  exactly like eager once checkpointed: each segment that recomputes the update restores
  the parameter's value around its recompute, as it does a mutated buffer (NOTE [runtime:
  parameters the forward writes]), and planning's own real steps leave it as found.
* Buffers and parameters without dense values (sparse, quantized, meta) are planned around
  and left as found by identity; a forward that reads one is refused with a typed error
  (NOTE [runtime: unusual state]).
* A loss that caches a tensor it builds on its first call gets a real tensor from planning,
  and a real step computed with a fake tensor kept from planning fails with a typed error
  (NOTE [runtime: the loss on fake tensors]).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

import autockpt
from autockpt.base import runtime
from autockpt.base.allocations import static_bytes
from autockpt.base.inputs import Inputs
from autockpt.base.optimizer import stand_in
from autockpt.base.optimizer import step as optimizer_step
from autockpt.base.runtime import (
    as_found,
    fake_step,
    parameters_written,
)
from autockpt.errors import AutockptError, FakeTensorLeakError, UnusualStateError
from tests.conftest import assert_same_step, quiet_planner, train_step

DIM = 64
BATCH = 256
STEPS = 3


class DecayLinear(nn.Module):
    """Updates its weight in place through ``.data`` in training: fx traces the update into
    the graph (no leaf), and a recompute that ran it again would decay the weight twice."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim, dim) / dim**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.weight.data.mul_(0.99)
        return F.linear(x, self.weight)


class NormLinear(nn.Module):
    """EDM2's forced weight normalisation (lucidrains' karras_unet.py), made to move the
    weight on every call: fx keeps it an opaque leaf (its ``no_grad`` region), so the
    recompute runs this Python again. ``seen`` records the weight each call starts from."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim, dim))
        self.seen: list[torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.seen is not None:
            self.seen.append(self.weight.detach().clone())
        if self.training:
            with torch.no_grad():
                self.weight.copy_(F.normalize(self.weight, dim=1) * 1.5 + 0.01 * self.weight)
        return F.linear(x, F.normalize(self.weight, dim=1))


class Stack(nn.Module):
    """Layers that update their weights, then a head holding most parameters (so that fx's
    automatic leaves stay a minority and the model is captured by fx)."""

    def __init__(self, layer: type[nn.Module], depth: int = 6, head: int = 1024) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layer(DIM) for _ in range(depth))
        self.head = nn.Linear(DIM, head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def _square_mean(output: torch.Tensor) -> torch.Tensor:
    return output.square().mean()


def _adamw_steps(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[tuple]:
    """``STEPS`` seeded AdamW steps: each step's loss and gradients."""
    found = []
    for step in range(STEPS):
        torch.manual_seed(step)
        x = torch.randn(BATCH, DIM)
        optimizer.zero_grad()
        loss = _square_mean(model(x))
        loss.backward()
        found.append((loss.detach().clone(), [p.grad.clone() for p in model.parameters()]))
        optimizer.step()
    return found


def _values(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in (*model.parameters(), *model.buffers())]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# -- a forward that updates parameters in place ------------------------------------------


@pytest.mark.parametrize(
    ("layer", "method"), [(DecayLinear, "fx"), (NormLinear, "fx+leaves")], ids=["data", "leaf"]
)
def test_a_forward_updating_its_parameters_trains_exactly_like_eager(layer, method):
    torch.manual_seed(0)
    model = Stack(layer).train()
    reference = copy.deepcopy(model)
    found = _values(model)
    optimizer = torch.optim.AdamW(model.parameters())
    x = torch.randn(BATCH, DIM)
    planner = quiet_planner(model, x, loss_fn=_square_mean, optimizer=optimizer)
    assert planner.capture.method == method
    written = {f"layers.{i}.weight" for i in range(len(model.layers))}
    assert written <= set(planner.profile.mutated_buffers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = planner.optimize(budget_gb=planner.minimum_peak_bytes / 2**30)
    # planning's real steps (the probe, verification) left the weights as found
    assert _same(_values(model), found)
    restored = {name for segment in fast.plan.segments for name in segment.restore_buffers}
    assert restored & written, "no segment recomputes a layer that updates its weight"
    assert any("updates parameters" in note for note in fast.plan.notes)

    eager = _adamw_steps(reference, torch.optim.AdamW(reference.parameters()))
    ours = _adamw_steps(fast, optimizer)
    for (loss, grads), (our_loss, our_grads) in zip(eager, ours, strict=True):
        assert torch.equal(our_loss, loss)
        assert _same(our_grads, grads)
    assert _same(_values(model), _values(reference))


def test_the_recompute_starts_from_the_weight_the_forward_saw():
    torch.manual_seed(0)
    model = Stack(NormLinear).train()
    x = torch.randn(BATCH, DIM)
    planner = quiet_planner(model, x, loss_fn=_square_mean)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = planner.optimize(budget_gb=planner.minimum_peak_bytes / 2**30)
    restored = {name for segment in fast.plan.segments for name in segment.restore_buffers}
    layer = next(layer for i, layer in enumerate(model.layers) if f"layers.{i}.weight" in restored)
    layer.seen = []
    _square_mean(fast(x)).backward()
    after = layer.weight.detach().clone()
    layer.seen, (forward, recompute) = None, layer.seen  # called twice: forward, recompute
    assert torch.equal(recompute, forward)
    assert not torch.equal(after, forward)  # updated once, as in eager
    eager = copy.deepcopy(layer)
    eager.weight.data.copy_(forward)
    eager(torch.randn(1, DIM))
    assert torch.equal(after, eager.weight)


def test_an_optimizer_step_is_not_a_forward_writing_parameters():
    # the recorded step steps a stand-in of the optimizer on the fake parameters: those
    # writes are not the forward's, and an ordinary model's profile names no parameter
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM, DIM), nn.GELU(), nn.Linear(DIM, DIM)).train()
    optimizer = torch.optim.AdamW(model.parameters())
    twins: dict[int, torch.Tensor] = {}
    with parameters_written() as names:
        with fake_step(model, Inputs((torch.randn(8, DIM),), {}), twins) as fake:
            model(*fake.args).sum().backward()
            optimizer_step(stand_in(optimizer, lambda p: twins[id(p)]))
    assert names == set()
    planner = quiet_planner(model, torch.randn(8, DIM), optimizer=optimizer)
    assert planner.profile.mutated_buffers == ()
    assert not any(runtime._WRITTEN_BY_FORWARD.get(id(p)) is p for p in model.parameters())


def test_as_found_keeps_the_values_of_parameters_the_forward_writes():
    torch.manual_seed(0)
    model = Stack(DecayLinear, depth=2, head=DIM).train()
    quiet_planner(model, torch.randn(4, DIM), probe=False)  # a fake step finds the writes
    found = _values(model)
    with as_found(model, ()):
        model(torch.randn(4, DIM))
    assert _same(_values(model), found)
    autockpt.measure(model, torch.randn(4, DIM), repeat=1)
    assert _same(_values(model), found)


# -- unusual state: sparse, quantized and meta tensors ------------------------------------


class WithExtra(nn.Module):
    """Two linear layers and one extra registered tensor that forward does not read
    (openai/whisper registers ``alignment_heads`` as a sparse COO buffer)."""

    def __init__(self, extra: torch.Tensor, as_parameter: bool = False) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(DIM, 256), nn.Linear(256, DIM)
        if as_parameter:
            self.extra = nn.Parameter(extra, requires_grad=False)
        else:
            self.register_buffer("extra", extra, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class ReadsExtra(WithExtra):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.extra.to_dense().float().sum()


def _heads() -> torch.Tensor:
    heads = torch.zeros(4, 6, dtype=torch.bool)
    heads[2:] = True
    return heads


UNUSUAL = {
    "sparse_coo": lambda: _heads().to_sparse(),
    "sparse_csr": lambda: torch.eye(6).to_sparse_csr(),
    "meta": lambda: torch.empty(16, 16, device="meta"),
    "quantized": lambda: torch.quantize_per_tensor(torch.randn(8), 0.1, 0, torch.qint8),
}


@pytest.mark.parametrize("kind", sorted(UNUSUAL))
def test_an_unusual_buffer_the_forward_does_not_read_is_planned_and_left_as_found(kind):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors' creation is deprecated
        extra = UNUSUAL[kind]()
    torch.manual_seed(0)
    model = WithExtra(extra).train()
    torch.manual_seed(0)
    reference = WithExtra(extra).train()  # deepcopy has no sparse CSR copy
    x = torch.randn(32, DIM)
    found = [p.detach().clone() for p in model.parameters()]
    planner = quiet_planner(model, x, loss_fn=_square_mean)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = planner.optimize(budget_gb=planner.minimum_peak_bytes / 2**30)
    assert model.extra is extra and fast.extra is extra
    assert _same([p.detach() for p in model.parameters()], found)
    assert fast.plan.measured_peak_bytes <= fast.plan.budget_bytes
    for seed in range(STEPS):
        assert_same_step(
            train_step(reference, x, seed=seed, loss_fn=_square_mean),
            train_step(fast, x, seed=seed, loss_fn=_square_mean),
        )


def test_an_unused_sparse_parameter_is_planned_around():
    model = WithExtra(_heads().to_sparse().float(), as_parameter=True).train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = autockpt.optimize(model, torch.randn(32, DIM), budget_gb=0.01)
    assert fast.extra is model.extra


@pytest.mark.parametrize("kind", ["sparse_coo", "sparse_csr", "quantized"])
def test_a_forward_reading_an_unusual_buffer_is_refused_with_a_typed_error(kind):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = ReadsExtra(UNUSUAL[kind]()).train()
    with pytest.raises(UnusualStateError, match="reads 'extra'") as caught:
        autockpt.optimize(model, torch.randn(32, DIM), budget_gb=0.01)
    assert isinstance(caught.value, AutockptError) and isinstance(caught.value, TypeError)


def test_as_found_puts_unusual_tensors_back_by_identity():
    sparse, meta = _heads().to_sparse(), torch.empty(3, device="meta")
    model = WithExtra(sparse).train()
    model.register_buffer("placeholder", meta)
    with as_found(model, (sparse,)):
        model.extra = torch.zeros(2)
        model.placeholder = None
    assert model.extra is sparse and model.placeholder is meta
    # a sparse tensor's bytes are its indices' and values'
    values = sparse._indices().nbytes + sparse._values().nbytes
    dense = sum(p.nbytes for p in model.parameters())
    assert static_bytes(model, Inputs((), {}), skip_meta=True) == dense + values


# -- planning leaves the loss as found -----------------------------------------------------


class Classifier(nn.Module):
    def __init__(self, classes: int = 512) -> None:
        super().__init__()
        self.body = nn.Sequential(
            *[nn.Sequential(nn.Linear(DIM, DIM), nn.GELU()) for _ in range(4)]
        )
        self.head = nn.Linear(DIM, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _targets(n: int) -> torch.Tensor:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(n))


def test_a_loss_caching_targets_on_its_first_call_keeps_real_ones():
    # what a user writes for fit_batch, whose loss sees only the output: targets built and
    # cached per batch size on the first call, which planning makes on fake tensors
    cache: dict[int, torch.Tensor] = {}

    def loss_by_size(logits: torch.Tensor) -> torch.Tensor:
        n = logits.shape[0]
        if n not in cache:
            cache[n] = _targets(n)
        return F.cross_entropy(logits, cache[n])

    torch.manual_seed(0)
    model = Classifier().train()
    reference = copy.deepcopy(model)
    x = torch.randn(128, DIM)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = autockpt.optimize(model, x, budget_gb=0.01, loss_fn=loss_by_size)
    assert type(cache[128]) is torch.Tensor and torch.equal(cache[128], _targets(128))
    step = train_step(fast, x, loss_fn=loss_by_size)
    assert not isinstance(step["loss"], FakeTensor) and step["loss"].item() > 0
    assert not any(isinstance(g, FakeTensor) for g in step["grads"].values())
    real = train_step(reference, x, loss_fn=lambda logits: F.cross_entropy(logits, _targets(128)))
    assert_same_step(real, step)


def test_a_real_step_computing_with_a_fake_tensor_kept_from_planning_is_refused():
    # a tensor made from the output (fake while planning) and kept: the verifying step finds
    # a fake loss and says what to do, never a fake loss handed on in silence
    cache: dict[int, torch.Tensor] = {}

    def loss_keeping_zeros(out: torch.Tensor) -> torch.Tensor:
        if out.shape[0] not in cache:
            cache[out.shape[0]] = torch.zeros_like(out)
        return F.mse_loss(out, cache[out.shape[0]])

    with pytest.raises(FakeTensorLeakError, match="loss_fn kept a tensor"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            autockpt.optimize(
                Classifier().train(),
                torch.randn(32, DIM),
                budget_gb=0.01,
                loss_fn=loss_keeping_zeros,
            )


def test_measure_refuses_a_fake_loss():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = torch.zeros(())
    model = nn.Linear(DIM, DIM)
    with pytest.raises(FakeTensorLeakError):
        autockpt.measure(model, torch.randn(4, DIM), loss_fn=lambda out: out.sum() * 0 + fake)
