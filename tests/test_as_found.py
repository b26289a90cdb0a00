"""Planning, profiling and measuring leave the user's model, the caller's tensors and the
global random generators exactly as they found them.

The models are tiny ones written for the purpose: a module that lazily rebuilds a registered
buffer on its first call (as timm's ConViT attention does), one that replaces a buffer on
every call, a forward that scales its input in place, forwards that draw from Python's and
NumPy's generators, and batch norm with mixed training modes and existing gradients.
"""

from __future__ import annotations

import copy
import functools
import random
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import autockpt
from autockpt.api import Planner
from tests.conftest import assert_same_step, budget_gb_between, quiet_planner, train_step

DIM = 32
SEQ = 32
BATCH = 8
LEAVES = ("count",)  # fx drops a buffer assignment from its graph: the counter runs whole


class LazyTable(nn.Module):
    """Like timm's ConViT attention (GPSA): a registered placeholder buffer is replaced by
    the full table (a reassignment, not an in-place write) the first time forward sees the
    sequence length. The shape test makes it an automatic fx leaf."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.register_buffer("table", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        if self.table.shape != (n, n):
            self.table = torch.linspace(-1, 1, n * n, dtype=x.dtype, device=x.device).reshape(n, n)
        return torch.tanh(self.proj(self.table @ x))


class Counter(nn.Module):
    """Replaces its buffer on every call (a functional update): a recompute must read the
    count the forward read, and the count must advance once per step."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps = self.steps + 1
        return torch.tanh(self.proj(x) * (1 + 0.1 * self.steps))


class TableNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(DIM, DIM)
        self.table = LazyTable(DIM)
        self.count = Counter(DIM)
        self.tail = nn.Sequential(
            *[nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(4)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tail(self.count(self.table(self.a(x))))


class ScalesInput(nn.Module):
    """Updates its input in place before using it."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            *[nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(5)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2.0)
        return self.layers(x)


class Noisy(nn.Module):
    """Draws from Python's and NumPy's global generators on every call (run as a leaf)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (1.0 + 1e-3 * random.random() + 1e-3 * float(np.random.rand()))


class NoisyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(DIM, DIM)
        self.drop = nn.Dropout(0.3)
        self.noisy = Noisy()
        self.tail = nn.Sequential(
            *[nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(4)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tail(self.noisy(self.drop(self.a(x))))


def _bn_net() -> nn.Module:
    return nn.Sequential(
        nn.Linear(DIM, DIM),
        nn.BatchNorm1d(SEQ),
        nn.Tanh(),
        nn.Dropout(0.2),
        nn.Linear(DIM, DIM),
        nn.BatchNorm1d(SEQ),
        nn.Tanh(),
        nn.Linear(DIM, DIM),
        nn.Tanh(),
        nn.Linear(DIM, DIM),
    )


def _made(factory: Any, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return factory()


def _example(seed: int = 1) -> torch.Tensor:
    return torch.randn(BATCH, SEQ, DIM, generator=torch.Generator().manual_seed(seed))


def _nodes_of(planner: Planner, seg: autockpt.Segment) -> set[str]:
    """The compute nodes a plan's segment recomputes."""
    names = list(planner.chain.node_names)
    return set(names[names.index(seg.first_node) : names.index(seg.last_node) + 1])


# -- what "as found" means, checked object by object ------------------------------------------


class _Snapshot:
    """Every module's training flag and buffer objects, every buffer's and parameter's value,
    every parameter object and its ``.grad`` (object and value)."""

    def __init__(self, model: nn.Module) -> None:
        self.modules = list(model.modules())
        self.training = [m.training for m in self.modules]
        self.buffers = [dict(m._buffers) for m in self.modules]
        self.buffer_values = [
            {k: None if b is None else b.detach().clone() for k, b in m._buffers.items()}
            for m in self.modules
        ]
        self.parameters = [dict(m._parameters) for m in self.modules]
        self.values = {id(p): p.detach().clone() for p in model.parameters()}
        self.grads = {id(p): p.grad for p in model.parameters()}
        self.grad_values = {
            id(p): p.grad.detach().clone() for p in model.parameters() if p.grad is not None
        }

    def check(self, model: nn.Module, when: str) -> None:
        assert list(model.modules()) == self.modules, when
        for m, training, buffers, values, params in zip(
            self.modules,
            self.training,
            self.buffers,
            self.buffer_values,
            self.parameters,
            strict=True,
        ):
            assert m.training == training, (when, type(m).__name__, "training")
            assert list(m._buffers) == list(buffers), (when, type(m).__name__, "buffer names")
            for name, b in buffers.items():
                assert m._buffers[name] is b, (when, type(m).__name__, name, "buffer object")
                if b is not None:
                    assert b.shape == values[name].shape, (when, name)
                    assert torch.equal(b, values[name]), (when, type(m).__name__, name)
            assert m._parameters == params, (when, type(m).__name__, "parameter objects")
        for p in model.parameters():
            assert torch.equal(p, self.values[id(p)]), (when, "parameter value")
            assert p.grad is self.grads[id(p)], (when, "grad object")
            if p.grad is not None:
                assert torch.equal(p.grad, self.grad_values[id(p)]), (when, "grad value")


def _same_buffers(model: nn.Module, reference: nn.Module) -> None:
    got, want = dict(model.named_buffers()), dict(reference.named_buffers())
    assert got.keys() == want.keys()
    for name, b in want.items():
        assert got[name].shape == b.shape, name
        assert torch.equal(got[name], b), name


def _sgd(model: nn.Module, grads: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            p -= 0.1 * grads[name]


# -- (a) a buffer replaced in forward -----------------------------------------------------------


def test_planning_leaves_a_lazily_rebuilt_buffer_as_found():
    model = _made(TableNet)
    untouched = copy.deepcopy(model)
    x = _example()
    snap = _Snapshot(model)
    planner = quiet_planner(model, x, leaf_modules=LEAVES)
    snap.check(model, "Planner")
    fast = planner.optimize(budget_gb=budget_gb_between(planner, 0.0))
    snap.check(model, "Planner.optimize")
    autockpt.optimize(model, x, budget_gb=budget_gb_between(planner, 0.5), leaf_modules=LEAVES)
    snap.check(model, "optimize")
    autockpt.apply(model, fast.plan, x)
    snap.check(model, "apply")
    assert model.table.table.shape == (1,)
    _same_buffers(model, untouched)
    model.eval()
    untouched.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x), untouched(x), rtol=0, atol=0)
    _same_buffers(model, untouched)


def test_measure_leaves_a_lazily_rebuilt_buffer_as_found():
    model = _made(TableNet)
    untouched = copy.deepcopy(model)
    x = _example()
    snap = _Snapshot(model)
    autockpt.measure(model, x, repeat=1)
    snap.check(model, "measure")
    _same_buffers(model, untouched)
    fast = quiet_planner(model, x, leaf_modules=LEAVES).optimize(budget_gb=10.0, verify=False)
    fast_snap = _Snapshot(fast)
    autockpt.measure(fast, x, repeat=1)
    fast_snap.check(fast, "measure of the optimized model")
    snap.check(model, "measure of the optimized model")


def test_capture_leaves_no_trace_of_tracing_in_the_model():
    from autockpt.capture import Inputs, capture

    model = _made(TableNet)
    snap = _Snapshot(model)
    capture(model, Inputs.of(_example()))  # fx traces Counter and assigns it a proxy
    snap.check(model, "capture")
    assert type(model.count.steps) is torch.Tensor


def test_profile_counts_a_reassigned_buffer_as_mutated():
    planner = quiet_planner(_made(TableNet), _example(), leaf_modules=LEAVES)
    assert {"table.table", "count.steps"} <= set(planner.profile.mutated_buffers)


@pytest.mark.parametrize("fraction", [0.0, 0.4, 1.0])
def test_a_model_replacing_buffers_trains_like_eager(fraction):
    model = _made(TableNet)
    eager = copy.deepcopy(model)
    x = _example()
    planner = quiet_planner(model, x, leaf_modules=LEAVES)
    fast = planner.optimize(budget_gb=budget_gb_between(planner, fraction))
    inside = set().union(*(_nodes_of(planner, seg) for seg in fast.plan.segments))
    if fraction == 0.0:
        # the leanest plan recomputes both modules: their buffers must be restored around it
        assert {"table", "count"} <= inside, fast.plan.segments
    for seg in fast.plan.segments:
        for module, buffer in (("table", "table.table"), ("count", "count.steps")):
            if module in _nodes_of(planner, seg):
                assert buffer in seg.restore_buffers, seg
    for seed in (0, 1, 2):
        expected = train_step(eager, x, seed=seed)
        got = train_step(fast, x, seed=seed)
        assert_same_step(expected, got)
        _sgd(eager, expected["grads"])
        _sgd(fast, got["grads"])
    assert fast.count.steps.item() == 3
    assert fast.table.table.shape == (SEQ, SEQ)


# -- (b) a forward that writes its input ------------------------------------------------------


def test_forward_scaling_its_input_leaves_the_callers_tensor_as_found():
    model = _made(ScalesInput)
    eager = copy.deepcopy(model)
    x = _example()
    keep = x.clone()

    def unchanged(when: str) -> None:
        assert torch.equal(x, keep), when
        assert (x.dtype, x.shape, x.stride()) == (keep.dtype, keep.shape, keep.stride()), when
        assert not x.requires_grad and x.grad is None, when

    planner = quiet_planner(model, x)
    unchanged("Planner")
    fast = planner.optimize(budget_gb=budget_gb_between(planner, 0.0))
    unchanged("Planner.optimize")
    autockpt.optimize(model, x, budget_gb=budget_gb_between(planner, 0.5))
    unchanged("optimize")
    autockpt.measure(model, x, repeat=2)
    unchanged("measure")
    autockpt.measure(fast, x, repeat=2)
    unchanged("measure of the optimized model")
    for seed in (0, 1):
        assert_same_step(
            train_step(eager, keep.clone(), seed), train_step(fast, keep.clone(), seed)
        )


def test_an_input_that_requires_grad_is_left_as_found():
    model = _made(TableNet)
    x = _example().requires_grad_()
    version = x._version
    planner = quiet_planner(model, x, leaf_modules=LEAVES)
    fast = planner.optimize(budget_gb=budget_gb_between(planner, 0.0))
    autockpt.measure(fast, x, repeat=1)
    autockpt.measure(model, x, repeat=1)
    assert x.grad is None
    assert x._version == version  # never written: a caller's graph that saved it stays valid
    sentinel = torch.full_like(x, 3.0)
    x.grad = sentinel
    autockpt.measure(model, x, repeat=1)
    assert x.grad is sentinel and torch.equal(sentinel, torch.full_like(x, 3.0))


def test_a_fake_step_never_touches_the_real_inputs():
    from autockpt.base.runtime import fake_step
    from autockpt.capture import Inputs

    x = _example()
    keep, version = x.clone(), x._version
    model = _made(ScalesInput)
    with fake_step(model, Inputs.of(x)) as fake:
        model(*fake.args).sum().backward()
    assert x._version == version and torch.equal(x, keep)
    leaf = _example().requires_grad_()
    model = _made(TableNet)
    with fake_step(model, Inputs.of(leaf)) as fake:
        model(*fake.args).sum().backward()
    assert leaf.grad is None and leaf._version == 0


# -- (c) the global random generators ---------------------------------------------------------


def _generators() -> tuple[torch.Tensor, Any, Any]:
    return torch.get_rng_state(), random.getstate(), np.random.get_state()


def _assert_generators(before: tuple[torch.Tensor, Any, Any], when: str) -> None:
    torch_state, python_state, numpy_state = _generators()
    assert torch.equal(torch_state, before[0]), (when, "torch")
    assert python_state == before[1], (when, "random")
    assert numpy_state[0] == before[2][0] and np.array_equal(numpy_state[1], before[2][1]), when
    assert tuple(numpy_state[2:]) == tuple(before[2][2:]), (when, "numpy")


def test_planning_leaves_the_global_generators_as_found():
    model = _made(NoisyNet)
    x = _example()
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    before = _generators()
    planner = quiet_planner(model, x, leaf_modules=("noisy",))
    _assert_generators(before, "Planner")
    fast = planner.optimize(budget_gb=budget_gb_between(planner, 0.0))
    _assert_generators(before, "Planner.optimize")
    autockpt.optimize(model, x, budget_gb=budget_gb_between(planner, 0.5), leaf_modules=("noisy",))
    _assert_generators(before, "optimize")
    autockpt.measure(model, x, repeat=1)
    _assert_generators(before, "measure")
    autockpt.measure(fast, x, repeat=1)
    _assert_generators(before, "measure of the optimized model")
    autockpt.apply(model, fast.plan, x)
    _assert_generators(before, "apply")


def test_a_seeded_run_does_not_depend_on_whether_optimize_ran():
    x = _example()

    def run(optimize_first: bool) -> list[torch.Tensor]:
        model = _made(NoisyNet)
        torch.manual_seed(11)
        random.seed(11)
        np.random.seed(11)
        if optimize_first:
            planner = quiet_planner(model, x, leaf_modules=("noisy",))
            planner.optimize(budget_gb=budget_gb_between(planner, 0.0))
        seen = []
        for _ in range(3):
            out = model(x)
            out.sum().backward()
            seen += [out.detach(), model.a.weight.grad.clone()]
        return seen

    for with_plan, without in zip(run(True), run(False), strict=True):
        assert torch.equal(with_plan, without)


def test_dropout_model_trains_like_eager_after_seeded_planning():
    model = _made(NoisyNet)
    model.noisy = nn.Identity()
    eager = copy.deepcopy(model)
    x = _example()
    planner = quiet_planner(model, x)
    fast = planner.optimize(budget_gb=budget_gb_between(planner, 0.0))
    assert any(seg.preserve_rng for seg in fast.plan.segments)
    for seed in (0, 1, 2):
        assert_same_step(train_step(eager, x, seed), train_step(fast, x, seed))


# -- (d) training modes, gradients, parameters, batch-norm statistics -------------------------


def test_planning_and_measuring_leave_the_model_state_as_found():
    model = _made(_bn_net)
    x = _example()
    model.train()
    model[5].eval()  # a frozen batch norm inside a training model
    model[3].eval()
    with torch.no_grad():
        model(x)  # running statistics and counters away from their initial values
    model[0].weight.grad = torch.full_like(model[0].weight, 7.0)
    model[4].bias.grad = torch.zeros_like(model[4].bias)
    snap = _Snapshot(model)
    assert model[1].num_batches_tracked.item() == 1
    planner = quiet_planner(model, x)
    snap.check(model, "Planner")
    fast = planner.optimize(budget_gb=budget_gb_between(planner, 0.0))
    snap.check(model, "Planner.optimize")
    autockpt.optimize(model, x, budget_gb=budget_gb_between(planner, 0.5))
    snap.check(model, "optimize")
    autockpt.measure(model, x, repeat=1)
    snap.check(model, "measure")
    autockpt.measure(fast, x, repeat=1)
    snap.check(model, "measure of the optimized model")
    autockpt.apply(model, fast.plan, x)
    snap.check(model, "apply")
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        planner = quiet_planner(model, x)
    snap.training = [False] * len(snap.modules)
    snap.check(model, "Planner in eval mode")


# -- the mechanism itself ---------------------------------------------------------------------


class _Rearranges(nn.Module):
    """Replaces one buffer by a bigger one, resizes another in place, sets a third to None,
    registers a new one, flips a child's mode and draws from every generator."""

    def __init__(self) -> None:
        super().__init__()
        self.child = nn.Linear(2, 2)
        self.register_buffer("grown", torch.ones(2))
        self.register_buffer("resized", torch.arange(3.0))
        self.register_buffer("dropped", torch.ones(1))

    def forward(self) -> None:
        self.grown = torch.zeros(5, 5)
        self.resized.resize_(7).fill_(-1)
        self.dropped = None
        self.register_buffer("new", torch.ones(4), persistent=False)
        self.child.eval()
        self.child.weight.grad = torch.ones(2, 2)
        torch.rand(3)
        random.random()
        np.random.rand()


def test_as_found_puts_back_objects_values_and_generators():
    from autockpt.base.runtime import as_found

    model = _Rearranges()
    x = _example()
    keep = x.clone()
    snap = _Snapshot(model)
    before = _generators()
    state_keys = list(model.state_dict())
    with as_found(model, (x,)):
        model()
        x.add_(1)
        assert model.grown.shape == (5, 5) and model.dropped is None
    snap.check(model, "as_found")
    _assert_generators(before, "as_found")
    assert torch.equal(x, keep)
    assert list(model.state_dict()) == state_keys
    assert "new" not in model._non_persistent_buffers_set


def test_as_found_restores_on_error():
    from autockpt.base.runtime import as_found

    model = _Rearranges()
    snap = _Snapshot(model)
    before = _generators()
    with pytest.raises(RuntimeError, match="boom"):
        with as_found(model, ()):
            model()
            raise RuntimeError("boom")
    snap.check(model, "as_found on error")
    _assert_generators(before, "as_found on error")


@functools.lru_cache(maxsize=4)
def _position_index(size: int) -> torch.Tensor:
    """Built once per size and cached process-wide, as Hugging Face's BEiT caches its
    relative position index (there behind a closure: compile_compatible_method_lru_cache)."""
    return torch.arange(size).flip(0)


def _cached_in_a_closure():
    cache = functools.lru_cache(maxsize=4)(lambda size: torch.ones(size))

    def wrapper(size: int) -> torch.Tensor:
        return cache(size)

    return wrapper


class CachedPositions(nn.Module):
    bias = staticmethod(_cached_in_a_closure())

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        order = _position_index(x.shape[1])  # a real index on every real call
        return self.proj(x[:, order] * self.bias(x.shape[-1]))


def test_caches_the_model_fills_on_fake_tensors_are_emptied():
    # Planning runs the model's code on fake tensors (a fake step, export's tracing): a
    # process-wide cache it fills would hand every later real call a tensor without data.
    _position_index.cache_clear()
    model = nn.Sequential(CachedPositions(DIM), CachedPositions(DIM)).train()
    x = torch.randn(BATCH, SEQ, DIM)
    reference = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = autockpt.optimize(model, x, budget_gb=1.0)
    assert _position_index.cache_info().currsize == 0
    assert CachedPositions.bias.__closure__[0].cell_contents.cache_info().currsize == 0
    assert_same_step(train_step(reference, x), train_step(fast, x))
