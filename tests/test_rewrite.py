"""The rewritten module trains exactly like eager for any set of checkpointed segments, keeps
the user's parameters and buffers, follows ``.to()``, deep-copies, and runs plainly without
autograd."""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import autockpt.rewrite.segment as rewrite_module
from autockpt.capture import Capture, Inputs, capture
from autockpt.costs.problem import Chain, build_chain
from autockpt.costs.profile import Profile, profile
from autockpt.planning.specs import buffers_used as _buffers_used
from autockpt.rewrite import CheckpointSegment, SegmentSpec, rewrite, segments_of
from tests.conftest import assert_same_step, train_step

WIDTH = 8


class DropoutBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.drop = nn.Dropout(0.3)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.drop(torch.nn.functional.gelu(self.up(x))))


class DropoutStack(nn.Module):
    def __init__(self, blocks: int = 3) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(DropoutBlock(WIDTH) for _ in range(blocks)))
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


class BatchNormCNN(nn.Module):
    """Convolutions with batch norm (running statistics) and in-place ReLUs."""

    def __init__(self, channels: int = 4) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, channels, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(channels)
        self.conv3 = nn.Conv2d(channels, channels, 3, padding=1)
        self.bn3 = nn.BatchNorm2d(channels)
        self.head = nn.Linear(channels, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.relu1(self.bn1(self.conv1(x)))
        h = torch.relu_(self.bn2(self.conv2(h)) + h)
        h = torch.relu_(self.bn3(self.conv3(h)) + h)
        return self.head(h.mean((2, 3)))


class TwoOutputs(nn.Module):
    """Keyword inputs with a specialised default, a skip tensor that crosses many nodes and
    two outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(WIDTH, WIDTH)
        self.mid = nn.Linear(WIDTH, WIDTH)
        self.head_a = nn.Linear(WIDTH, 3)
        self.head_b = nn.Linear(WIDTH, WIDTH)

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor,
        scale: float = 0.5,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.trunk(x))
        g = torch.sigmoid(self.mid(h * context)) * scale
        a = self.head_a(g + h)
        b = torch.relu(self.head_b(g)) * h
        return a, b


class ShapeBranch(nn.Module):
    """Branches on the input's shape at the root, so it is captured with torch.export; batch
    norm and dropout then appear as aten ops reading attributes of the user's modules."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.bn = nn.BatchNorm1d(2 * WIDTH)
        self.drop = nn.Dropout(0.4)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 1:
            x = self.up(x)
        return self.down(self.drop(torch.relu(self.bn(x))))


class ShapeRouter(nn.Module):
    """Untraceable (Python branches on a shape, which fx traces as a proxy): captured as one
    opaque leaf that still holds dropout and batch-norm statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.bn = nn.BatchNorm1d(WIDTH)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.bn(self.proj(x)))
        if x.shape[0] % 2 == 0:
            return h
        return -h


class WithLeaf(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.router = ShapeRouter()
        self.out = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.router(self.inp(x))))


class RunningCenter(nn.Module):
    """Reads a buffer, then updates it in place: a recompute must see the value the forward
    saw, and the update must happen once per step. The update flips the sign, so the buffer
    never settles at a fixed point where reading a stale value would go unnoticed."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("center", torch.ones(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.proj(x) - self.center)
        y = self.out(h)
        self.center.neg_().add_(h.detach().mean(0), alpha=0.1)
        return y


@dataclass
class Case:
    name: str
    model: nn.Module
    inputs: Inputs
    capture: Capture
    profile: Profile
    chain: Chain

    def eager_copy(self) -> nn.Module:
        return copy.deepcopy(self.model)

    def spec(self, first: int, end: int) -> SegmentSpec:
        """What the planner would attach to a segment over compute nodes ``[first, end)``."""
        nodes = self.capture.compute_nodes()
        random = any(self.profile.nodes[i].random for i in range(first, end))
        return SegmentSpec(
            first, end, random, _buffers_used(nodes[first:end], set(self.profile.mutated_buffers))
        )


def _make(name: str) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    if name == "dropout_stack":
        return DropoutStack().train(), torch.randn(4, WIDTH, requires_grad=True)
    if name == "bn_cnn":
        return BatchNormCNN().train(), torch.randn(2, 3, 6, 6)
    if name == "two_outputs":
        return TwoOutputs().train(), {"x": torch.randn(5, WIDTH), "context": torch.randn(5, WIDTH)}
    if name == "export_bn_dropout":
        return ShapeBranch().train(), torch.randn(4, WIDTH)
    if name == "leaf_router":
        return WithLeaf().train(), torch.randn(4, WIDTH)
    if name == "running_center":
        return RunningCenter().train(), torch.randn(4, WIDTH)
    raise KeyError(name)


CASES = (
    "dropout_stack",
    "bn_cnn",
    "two_outputs",
    "export_bn_dropout",
    "leaf_router",
    "running_center",
)
CAPTURE_METHODS = {"export_bn_dropout": "export", "leaf_router": "fx+leaves"}


@functools.cache
def _case(name: str) -> Case:
    model, example = _make(name)
    inputs = Inputs.of(example)
    cap = capture(model, inputs)
    assert cap.method == CAPTURE_METHODS.get(name, "fx")
    prof = profile(model, cap, inputs, repeat=1)
    return Case(name, model, inputs, cap, prof, build_chain(cap, prof))


def _step(model: nn.Module, case: Case) -> dict[str, Any]:
    return train_step(model, case.inputs)


def _segments(case: Case, labels: list[int]) -> list[SegmentSpec]:
    """Stage labels -> node ranges: 0 = not checkpointed, 1 = begins a segment, 2 = joins
    the segment of the previous stage (or begins one)."""
    ranges: list[list[int]] = []
    previous = 0
    for k, label in enumerate(labels):
        start, end = case.chain.stages[k]
        if label == 2 and previous:
            ranges[-1][1] = end
        elif label:
            ranges.append([start, end])
        previous = label
    return [case.spec(first, end) for first, end in ranges]


# --------------------------------------------------------------------------------------------
# the property


@pytest.mark.parametrize("name", CASES)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_segmentation_trains_like_eager(name, data):
    """Any sorted, disjoint set of segments over the chain's stages, with RNG preservation
    where a random node is inside and the mutated buffers it touches restored: loss, outputs,
    every gradient, every buffer and the RNG state equal eager's from the same state."""
    case = _case(name)
    stages = case.chain.num_stages
    labels = data.draw(
        st.lists(st.integers(0, 2), min_size=stages, max_size=stages), label="labels"
    )
    specs = _segments(case, labels)
    eager = case.eager_copy()
    fast = rewrite(case.model, case.capture, specs)
    segments = list(segments_of(fast).values())
    assert [(m.spec.first, m.spec.end) for m in segments] == [(s.first, s.end) for s in specs]
    assert_same_step(_step(eager, case), _step(fast, case))


@pytest.mark.parametrize("name", CASES)
def test_everything_in_one_segment_and_every_node_alone(name):
    case = _case(name)
    n = len(case.capture.compute_nodes())
    for specs in (
        [case.spec(0, n)],
        [case.spec(start, end) for start, end in case.chain.stages],
    ):
        eager = case.eager_copy()
        fast = rewrite(case.model, case.capture, specs)
        assert_same_step(_step(eager, case), _step(fast, case))


def test_the_harness_notices_a_missing_rng_stash():
    """Negative control: recomputing dropout without the RNG stash draws another mask, and
    the comparison with eager catches it."""
    case = _case("dropout_stack")
    n = len(case.capture.compute_nodes())
    spec = case.spec(0, n)
    assert spec.preserve_rng
    careless = rewrite(case.model, case.capture, [SegmentSpec(0, n, False, spec.restore_buffers)])
    with pytest.raises(AssertionError):
        assert_same_step(_step(case.eager_copy(), case), _step(careless, case))


def test_the_harness_notices_batchnorm_updated_twice():
    """Negative control: without restoring running statistics, the recompute moves them a
    second time and the comparison with eager catches it."""
    case = _case("bn_cnn")
    n = len(case.capture.compute_nodes())
    spec = case.spec(0, n)
    assert set(spec.restore_buffers) == set(case.profile.mutated_buffers)
    careless = rewrite(case.model, case.capture, [SegmentSpec(0, n, False, ())])
    eager, got = _step(case.eager_copy(), case), _step(careless, case)
    assert (
        got["buffers"]["bn1.num_batches_tracked"] == eager["buffers"]["bn1.num_batches_tracked"] + 1
    )
    with pytest.raises(AssertionError):
        assert_same_step(eager, got)


# --------------------------------------------------------------------------------------------
# the module the user gets back


@pytest.mark.parametrize("name", CASES)
def test_state_dict_keys_and_parameter_order_are_the_originals(name):
    case = _case(name)
    specs = [case.spec(start, end) for start, end in case.chain.stages[1:3]]
    fast = rewrite(case.model, case.capture, specs)
    assert list(fast.state_dict().keys()) == list(case.model.state_dict().keys())
    assert [id(p) for p in fast.parameters()] == [id(p) for p in case.model.parameters()]
    assert [id(b) for b in fast.buffers()] == [id(b) for b in case.model.buffers()]
    assert [n for n, _ in fast.named_parameters()] == [n for n, _ in case.model.named_parameters()]
    # the segments hold no tensors and are not registered: the module tree is the user's
    assert [n for n, _ in fast.named_modules()] == [n for n, _ in case.model.named_modules()]
    assert not any(isinstance(m, CheckpointSegment) for m in fast.modules())
    for segment in segments_of(fast).values():
        assert list(segment.parameters()) == [] and list(segment.buffers()) == []
    # and a state dict saved from the original loads into the result
    fast.load_state_dict(case.model.state_dict())


def test_to_float64_moves_the_one_copy_and_segments_follow():
    model, example = _make("bn_cnn")
    inputs = Inputs.of(example)
    cap = capture(model, inputs)
    prof = profile(model, cap, inputs, repeat=1)
    case = Case("bn_cnn", model, inputs, cap, prof, build_chain(cap, prof))
    half = case.chain.num_stages // 2
    fast = rewrite(
        model,
        cap,
        [
            case.spec(*case.chain.node_range(0, half)),
            case.spec(*case.chain.node_range(half, case.chain.num_stages)),
        ],
    )
    eager = copy.deepcopy(model).to(torch.float64)
    assert fast.to(torch.float64) is fast
    assert all(p.dtype == torch.float64 for p in model.parameters())  # shared, not copied
    x = example.to(torch.float64)
    expected, got = train_step(eager, x), train_step(fast, x)
    assert all(out.dtype == torch.float64 for out in got["outputs"])
    assert all(g.dtype == torch.float64 for g in got["grads"].values())
    assert_same_step(expected, got)


@pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")  # torch's own, via copyreg
@pytest.mark.parametrize("name", CASES)
def test_deepcopy_of_the_result_is_independent_and_trains_like_eager(name):
    case = _case(name)
    fast = rewrite(
        case.model,
        case.capture,
        [case.spec(*case.chain.node_range(0, case.chain.num_stages // 2 + 1))],
    )
    clone = copy.deepcopy(fast)
    assert all(a is not b for a, b in zip(clone.parameters(), fast.parameters(), strict=True))
    reference = case.eager_copy()
    assert_same_step(_step(reference, case), _step(clone, case))
    # the clone's segments read the clone's parameters, not the original's
    with torch.no_grad():
        for p in (*clone.parameters(), *reference.parameters()):
            p.mul_(0.5)
    assert_same_step(_step(reference, case), _step(clone, case))
    # and the original was not touched by training or scaling the clone
    assert_same_step(_step(case.eager_copy(), case), _step(fast, case))


@pytest.mark.parametrize("name", CASES)
def test_no_grad_runs_segments_without_checkpoint(name, monkeypatch):
    """Without autograd there is nothing to save: segments call their code directly, and
    the step (outputs, RNG draws, running statistics) is eager's."""
    case = _case(name)
    specs = [case.spec(start, end) for start, end in case.chain.stages[::2]]
    fast = rewrite(case.model, case.capture, specs)
    calls = []
    real = rewrite_module.checkpoint

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(rewrite_module, "checkpoint", spy)
    eager = case.eager_copy()
    results = []
    for module in (eager, fast):
        torch.manual_seed(7)
        with torch.no_grad():
            out = module(*case.inputs.args, **case.inputs.kwargs)
        results.append(
            (out, {n: b.clone() for n, b in module.named_buffers()}, torch.get_rng_state())
        )
    assert calls == []
    (expected, expected_buffers, expected_rng), (got, got_buffers, got_rng) = results
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(got_buffers, expected_buffers)
    assert torch.equal(got_rng, expected_rng)
    fast(*case.inputs.args, **case.inputs.kwargs)
    assert len(calls) == len(specs)
    assert all(call["use_reentrant"] is False for call in calls)


@pytest.mark.parametrize("name", ["dropout_stack", "bn_cnn", "leaf_router"])
def test_eval_mode_reaches_the_modules(name):
    case = _case(name)
    fast = rewrite(case.model, case.capture, [case.spec(*case.chain.node_range(0, 2))])
    eager = case.eager_copy()
    fast.eval()
    eager.eval()
    try:
        # one module tree: eval() reached the original's submodules
        assert not any(m.training for m in case.model.children())
        with torch.no_grad():
            torch.testing.assert_close(fast(*case.inputs.args), eager(*case.inputs.args))
    finally:
        fast.train()


class FunctionalDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.dropout(torch.tanh(self.proj(x)), 0.5, self.training)


@pytest.mark.parametrize("name", ["functional_dropout", "export_bn_dropout"])
def test_eval_mode_reaches_code_that_reads_the_training_flag(name):
    if name == "functional_dropout":
        torch.manual_seed(0)
        model, x = FunctionalDropout().train(), torch.randn(4, WIDTH)
    else:
        model, x = _make(name)
    fast = rewrite(model, capture(model, Inputs.of(x)), [])
    eager = copy.deepcopy(model).eval()
    fast.eval()
    with torch.no_grad():
        torch.testing.assert_close(fast(x), eager(x))


def test_result_returns_the_same_structure_and_accepts_keywords():
    case = _case("two_outputs")
    n = len(case.capture.compute_nodes())
    fast = rewrite(case.model, case.capture, [case.spec(1, n - 1)])
    kwargs = case.inputs.kwargs
    got = fast(**kwargs)
    expected = case.model(**kwargs)
    assert isinstance(got, tuple) and len(got) == 2
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(fast(kwargs["x"], kwargs["context"]), expected)


@pytest.mark.parametrize(
    "bad",
    [
        [(0, 0)],  # empty
        [(2, 1)],  # reversed
        [(0, 3), (2, 4)],  # overlapping
        [(3, 4), (0, 2)],  # not sorted
        [(0, 999)],  # past the last node
        [(-1, 2)],  # before the first node
    ],
)
def test_bad_segment_specs_are_rejected(bad):
    case = _case("dropout_stack")
    with pytest.raises(ValueError, match="segments"):
        rewrite(case.model, case.capture, [SegmentSpec(a, b, False) for a, b in bad])


def test_unbound_segment_says_so():
    case = _case("dropout_stack")
    fast = rewrite(case.model, case.capture, [case.spec(0, 2)])
    segment = CheckpointSegment(fast._autockpt_segment_0._fn, case.spec(0, 2), "a", "b")
    with pytest.raises(RuntimeError, match="not bound"):
        segment(torch.randn(2, WIDTH))
