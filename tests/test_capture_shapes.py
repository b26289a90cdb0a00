"""Capture keeps buffer assignments, and export graphs take smaller batches and sequences.

(a) ``self.steps = self.steps + 1`` in forward: fx computes the new value and never stores
it. A submodule that assigns its buffer runs as a leaf (it assigns at run time); the root's
own assignment goes through torch.export, which keeps it as an in-place update, or is
refused naming the line when export cannot keep it. Counters must advance exactly like
eager's, step after step, with equal gradients.

(b) An export capture keeps the batch dimension and the sequence dimension of integer
inputs dynamic: a smaller last batch or a shorter padded sequence runs the same graph,
equal to eager and within the budget measured by the allocator; a larger one is refused
(or warned about) by the rule the fx path uses; a model export cannot keep dynamic falls
back to a graph specialised to the planned shapes, and says so.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import autockpt
import autockpt.capture.export as trace
from autockpt.api import Planner
from autockpt.capture import Inputs, capture
from autockpt.errors import GIB, PlanMismatchError, TraceError
from autockpt.rewrite import UncoveredCallWarning
from tests.conftest import assert_same_step, budget_between, quiet_planner, train_step

DIM = 32
BATCH = 64


def _segment_nodes(planner: Planner, fast: nn.Module) -> list[set[str]]:
    names = [node.name for node in planner.capture.compute_nodes()]
    return [
        set(names[names.index(seg.first_node) : names.index(seg.last_node) + 1])
        for seg in fast.plan.segments
    ]


def _sgd(model: nn.Module, grads: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in grads:
                p -= 0.1 * grads[name]


def _trains_like_eager(model: nn.Module, fast: nn.Module, x, steps: int = 3) -> None:
    """``steps`` seeded steps with an SGD update after each: loss, outputs, gradients,
    every buffer (the counters) and the RNG equal eager's after every one."""
    eager = copy.deepcopy(model)
    for seed in range(steps):
        expected = train_step(eager, x, seed=seed)
        got = train_step(fast, x, seed=seed)
        assert_same_step(expected, got)
        _sgd(eager, expected["grads"])
        _sgd(fast, got["grads"])


# -- (a) buffer assignments ----------------------------------------------------------------------


class Counter(nn.Module):
    """Replaces its buffer on every call (a functional update), then uses the new count."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps = self.steps + 1
        return torch.tanh(self.proj(x) * (1 + 0.1 * self.steps))


def _tail() -> nn.Sequential:
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Dropout(0.1)) for _ in range(4)]
    )


class CounterNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(DIM, DIM)
        self.count = Counter()
        self.tail = _tail()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tail(self.count(torch.tanh(self.a(x))))


class RootCounter(nn.Module):
    """The root's own forward reads its counter (autograd saves the buffer itself for the
    multiplication's backward), then replaces it, then uses the new one."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(DIM, DIM)
        self.tail = _tail()
        self.register_buffer("steps", torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x)) * self.steps
        self.steps = self.steps + 1
        return self.tail(h) / self.steps


def _made(cls: type) -> nn.Module:
    torch.manual_seed(0)
    return cls().train()


def _x(batch: int = BATCH) -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(batch, DIM)


def test_a_submodule_assigning_its_buffer_becomes_a_leaf():
    model = _made(CounterNet)
    cap = capture(model, Inputs.of(_x()))
    assert cap.method == "fx+leaves"
    assert cap.leaf_modules == ("count",)
    assert any("count.steps" in note and "leaf" in note for note in cap.warnings), cap.warnings
    # the leaf runs its own forward in the graph: the counter is a call, not a dropped op
    assert "count" in {str(n.target) for n in cap.graph.nodes if n.op == "call_module"}
    assert type(model.count.steps) is torch.Tensor and model.count.steps.item() == 0


def test_a_submodule_counter_advances_like_eager_inside_a_segment():
    model, x = _made(CounterNet), _x()
    planner = quiet_planner(model, x)
    assert "count.steps" in planner.profile.mutated_buffers
    fast = planner.optimize(budget_gb=planner.minimum_peak_bytes / GIB)
    covering = [
        seg
        for seg, nodes in zip(fast.plan.segments, _segment_nodes(planner, fast), strict=True)
        if "count" in nodes
    ]
    assert covering, "the leanest plan recomputes the counter"
    assert all("count.steps" in seg.restore_buffers for seg in covering)
    _trains_like_eager(model, fast, x)
    assert fast.count.steps.item() == 3  # once per step, not once more per recompute


def test_the_roots_own_assignment_is_kept_by_export():
    model, x = _made(RootCounter), _x()
    cap = capture(model, Inputs.of(x))
    assert cap.method == "export"
    assert any("buffer 'steps' assigned" in note for note in cap.warnings), cap.warnings
    assert any("in-place update" in note for note in cap.warnings), cap.warnings
    planner = quiet_planner(model, x)
    assert "steps" in planner.profile.mutated_buffers
    for fraction in (0.0, 0.5):
        fast = planner.optimize(budget_gb=budget_between(planner, fraction) / GIB)
        if fraction == 0.0:  # the leanest plan recomputes the read of the counter
            readers = {
                user.name
                for node in planner.capture.graph.nodes
                if node.op == "get_attr" and node.target == "steps"
                for user in node.users
            }
            covering = [
                seg
                for seg, nodes in zip(
                    fast.plan.segments, _segment_nodes(planner, fast), strict=True
                )
                if nodes & readers
            ]
            assert covering and all("steps" in seg.restore_buffers for seg in covering)
        _trains_like_eager(model, fast, x)
        assert fast.steps.item() == 4
        fast.steps.fill_(1.0)  # the model shares it: back to where eager's copy starts


class RootRebuildsTable(nn.Module):
    """Replaces its buffer by one of another shape: an in-place update cannot do that."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)
        self.register_buffer("table", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.table = torch.ones(x.shape[1], x.shape[1]) / x.shape[1]
        return torch.tanh(self.proj(x @ self.table))


class RootReplacesParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.proj.weight = nn.Parameter(self.proj.weight * 0.5)
        return torch.tanh(self.proj(x))


@pytest.mark.parametrize(
    ("cls", "line"),
    [
        (RootRebuildsTable, "self.table = torch.ones(x.shape[1], x.shape[1]) / x.shape[1]"),
        (RootReplacesParameter, "self.proj.weight = nn.Parameter(self.proj.weight * 0.5)"),
    ],
)
def test_an_assignment_export_cannot_keep_is_refused_naming_the_line(cls, line):
    model = _made(cls)
    with pytest.raises(TraceError) as info:
        capture(model, Inputs.of(_x(8)))
    assert info.value.source_line == line
    assert "assign" in info.value.reason
    assert model.proj.weight.shape == (DIM, DIM)


class RootMovesMask(nn.Module):
    """``self.mask = self.mask.to(x.dtype)``: the same tensor back when it already is."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)
        self.register_buffer("mask", torch.ones(DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.mask = self.mask.to(x.dtype)
        return torch.tanh(self.proj(x) * self.mask)


def test_putting_back_the_same_buffer_is_no_assignment_for_export():
    model, x = _made(RootMovesMask), _x(8)
    cap = capture(model, Inputs.of(x))
    assert cap.method == "export"  # fx saw a proxy assigned, export saw no change
    assert not any("in-place update" in note for note in cap.warnings), cap.warnings
    fast = quiet_planner(model, x).optimize(budget_gb=1.0)
    _trains_like_eager(model, fast, x, steps=1)


# -- (b) export graphs with dynamic batch and sequence sizes -------------------------------------


class RootShapeBranch(nn.Module):
    """Branches on the batch size in its root forward: fx cannot trace it, export can, and
    keeps the batch dimension dynamic with a guard for the branch taken."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.tail = _tail()
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        if x.shape[0] > 1:
            h = h - h.mean(0)
        return self.head(self.tail(h))


class TokenShapeBranch(nn.Module):
    """Token ids and labels: branches on the sequence length in its root forward."""

    def __init__(self, vocab: int = 50) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, DIM)
        self.tail = _tail()
        self.head = nn.Linear(DIM, vocab)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        if input_ids.shape[1] > 1:
            h = h + torch.roll(h, 1, dims=1)
        logits = self.head(self.tail(h))
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _tokens(batch: int, seq: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(2)
    ids = torch.randint(0, 50, (batch, seq))
    return {"input_ids": ids, "labels": ids.roll(-1, dims=1)}


@pytest.fixture(scope="module")
def planned_branch():
    model, x = _made(RootShapeBranch), _x()
    planner = quiet_planner(model, x)
    return model, x, planner, planner.optimize(budget_gb=budget_between(planner, 0.3) / GIB)


def test_export_keeps_the_batch_dimension_dynamic(planned_branch):
    _, _, planner, fast = planned_branch
    assert planner.capture.method == "export"
    assert planner.capture.dynamic_dims == ("x[0]",)
    assert planner.capture.shape_generic
    assert any("x[0]" in note for note in planner.capture.warnings)
    assert fast.plan.segments


def test_a_smaller_batch_runs_the_plan_like_eager_within_the_budget(planned_branch):
    model, x, _, fast = planned_branch
    smaller = x[: BATCH - 1].clone()
    _trains_like_eager(model, fast, smaller, steps=1)
    measured = autockpt.measure(fast, smaller, repeat=1)
    assert measured.peak_bytes <= fast.plan.budget_bytes, (
        measured.peak_bytes,
        fast.plan.budget_bytes,
    )
    # the graph ran (a call the plan does not cover would warn and run eagerly)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fast(smaller).sum().backward()


def test_a_larger_batch_follows_on_larger_input(planned_branch):
    model, x, _, fast = planned_branch
    larger = torch.cat([x, x[:8]])
    with pytest.raises(PlanMismatchError, match="larger"):
        fast(larger)
    copied = copy.deepcopy(fast)
    copied.on_larger_input = "warn"
    with pytest.warns(autockpt.LargerInputWarning, match="larger than planned"):
        got = train_step(copied, larger)
    assert_same_step(train_step(copy.deepcopy(model), larger), got)


def test_a_size_the_graph_is_specialised_against_is_refused(planned_branch):
    """A batch of one takes the other branch in eager: the graph is refused for it (a guard
    of export's, or the range it traced the batch size for), never run."""
    _, x, _, fast = planned_branch
    with pytest.raises(PlanMismatchError, match="dynamic"):
        fast(x[:1].clone())
    with pytest.raises(PlanMismatchError, match="dimension 1"):
        fast(torch.randn(BATCH, DIM - 1))  # a feature size is fixed


def test_a_shorter_token_sequence_and_batch_run_like_eager_within_the_budget():
    torch.manual_seed(0)
    model, inputs = TokenShapeBranch().train(), _tokens(8, 32)
    planner = quiet_planner(model, inputs)
    assert planner.capture.method == "export"
    assert {"input_ids[0]", "input_ids[1]", "labels[0]", "labels[1]"} <= set(
        planner.capture.dynamic_dims
    )
    fast = planner.optimize(budget_gb=budget_between(planner, 0.3) / GIB)
    assert fast.plan.segments
    smaller = _tokens(7, 20)
    _trains_like_eager(model, fast, smaller, steps=1)
    measured = autockpt.measure(fast, smaller, repeat=1)
    assert measured.peak_bytes <= fast.plan.budget_bytes
    with pytest.raises(PlanMismatchError, match="larger"):
        fast(**_tokens(8, 40))


class KwargsTokens(nn.Module):
    """Takes most of its inputs through ``**kwargs``, as Hugging Face forwards take the
    Trainer's ``num_items_in_batch``: labels (rank-2 integers), per-example weights (rank-1
    floats), a count (a 0-dim integer tensor), a plain int, a string and a ``None``; branches
    on the sequence length in its root forward (export capture)."""

    def __init__(self, vocab: int = 50) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, DIM)
        self.tail = _tail()
        self.head = nn.Linear(DIM, vocab)

    def forward(self, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
        h = self.embed(input_ids) * kwargs["weights"][:, None, None]
        if input_ids.shape[1] > 1:
            h = h + torch.roll(h, 1, dims=1)
        if kwargs["extra"] is not None:
            h = h + kwargs["extra"]
        logits = self.head(self.tail(h))
        loss = nn.functional.cross_entropy(
            logits.flatten(0, 1), kwargs["labels"].flatten(), reduction=kwargs["reduction"]
        )
        return loss * kwargs["scale"] / kwargs["num_items"]


def _kwargs_tokens(batch: int, seq: int) -> dict:
    inputs = _tokens(batch, seq)
    return {
        **inputs,
        "weights": torch.linspace(0.5, 1.5, batch),
        "num_items": torch.tensor(batch * seq),
        "scale": 2,
        "reduction": "sum",
        "extra": None,
    }


def test_the_dynamic_shapes_spec_gives_every_kwargs_input_an_entry():
    """Inputs through ``**kwargs`` get entries of their own at the top of the spec, as the
    forward is shown to export (torch.export fails on the spec nested under ``kwargs``):
    batch and integer sequence dimensions dynamic, a 0-dim tensor and non-tensors fixed."""
    from torch.export import Dim

    model = KwargsTokens()
    spec = trace._dynamic_shapes(model, Inputs.of(_kwargs_tokens(8, 32)))
    assert spec == {
        "input_ids": {0: Dim.AUTO, 1: Dim.AUTO},
        "labels": {0: Dim.AUTO, 1: Dim.AUTO},
        "weights": {0: Dim.AUTO},
        "num_items": None,
        "scale": None,
        "reduction": None,
        "extra": None,
    }
    assert "forward" not in vars(model)  # the forward as found


def test_inputs_through_kwargs_keep_export_sizes_dynamic():
    """A forward whose ``**kwargs`` receive tensors is exported with dynamic sizes: a
    smaller batch and a shorter sequence run the graph like eager within the budget."""
    torch.manual_seed(0)
    model, inputs = KwargsTokens().train(), _kwargs_tokens(8, 32)
    planner = quiet_planner(model, inputs)
    assert planner.capture.method == "export"
    dims = {"input_ids[0]", "input_ids[1]", "labels[0]", "labels[1]", "weights[0]"}
    assert set(planner.capture.dynamic_dims) == dims
    assert "forward" not in vars(model)
    fast = planner.optimize(budget_gb=budget_between(planner, 0.3) / GIB)
    assert fast.plan.segments
    smaller = _kwargs_tokens(5, 20)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UncoveredCallWarning)  # the graph runs it
        _trains_like_eager(model, fast, smaller, steps=1)
    assert autockpt.measure(fast, smaller, repeat=1).peak_bytes <= fast.plan.budget_bytes
    with pytest.raises(PlanMismatchError, match=r"num_items is \[1\]"):  # 0-dim: fixed
        fast(**{**smaller, "num_items": torch.tensor([100])})


def test_export_without_dynamic_sizes_falls_back_to_the_planned_shapes(monkeypatch):
    """When export cannot keep the sizes dynamic, capture keeps today's graph specialised
    to the example shapes, and says so."""
    from torch.export import Dim

    def impossible(model, inputs):  # the example's batch lies outside the range
        return {"x": {0: Dim("batch", max=BATCH // 2)}}

    monkeypatch.setattr(trace, "_dynamic_shapes", impossible)
    model, x = _made(RootShapeBranch), _x()
    cap = capture(model, Inputs.of(x))
    assert cap.method == "export"
    assert cap.dynamic_dims == () and not cap.shape_generic
    assert any("could not keep batch and sequence sizes dynamic" in n for n in cap.warnings)
    planner = quiet_planner(model, x)
    fast = planner.optimize(budget_gb=budget_between(planner, 0.3) / GIB)
    _trains_like_eager(model, fast, x, steps=1)
    with pytest.raises(PlanMismatchError, match="drop_last"):
        fast(x[: BATCH - 1].clone())


def test_the_fingerprint_is_the_same_on_every_capture_and_apply_works(planned_branch, tmp_path):
    """apply captures again with the planned inputs (the maxima): the same dynamic graph."""
    model, x, planner, fast = planned_branch
    assert capture(model, Inputs.of(x)).fingerprint() == fast.plan.graph_fingerprint
    path = tmp_path / "plan.json"
    fast.plan.save(path)
    fresh = _made(RootShapeBranch)
    again = autockpt.apply(fresh, autockpt.Plan.load(path), x)
    assert again.plan.segments == fast.plan.segments
    _trains_like_eager(fresh, again, x[:40].clone(), steps=1)


@pytest.mark.slow
def test_hugging_face_gpt2_takes_a_smaller_batch_and_sequence():
    """A tiny GPT-2 planned at batch 4 x 32 tokens (captured with export) trains at 3 x 20
    like eager within the budget; batch 5 is refused, or warned about and run."""
    pytest.importorskip("transformers")
    from autockpt_zoo.hf import gpt2

    model, inputs = gpt2(batch=4, seq_len=32)
    planner = quiet_planner(model, inputs)
    assert planner.capture.method == "export"
    assert {"input_ids[0]", "input_ids[1]"} <= set(planner.capture.dynamic_dims)
    fast = planner.optimize(budget_gb=budget_between(planner, 0.3) / GIB)
    assert fast.plan.segments
    for batch, seq in ((3, 20), (2, 7)):
        smaller = {name: value[:batch, :seq].contiguous() for name, value in inputs.items()}
        with warnings.catch_warnings():
            warnings.simplefilter("error", UncoveredCallWarning)  # the graph runs them
            assert_same_step(train_step(copy.deepcopy(model), smaller), train_step(fast, smaller))
        measured = autockpt.measure(fast, smaller, repeat=1)
        assert measured.peak_bytes <= fast.plan.budget_bytes
    larger = {name: torch.cat([value, value[:1]]) for name, value in inputs.items()}
    with pytest.raises(PlanMismatchError, match="larger"):
        fast(**larger)
    fast.on_larger_input = "warn"
    with pytest.warns(UncoveredCallWarning):
        assert torch.isfinite(fast(**larger).loss)
