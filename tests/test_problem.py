"""Linearising the profiled graph into a chain of stages: cuts, boundary bytes, the in-place
mutation rule and the stage cap."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from autockpt.capture import Capture, Inputs, capture
from autockpt.costs.problem import Chain, NodeRange, StageRange, build_chain
from autockpt.costs.profile import Profile, profile
from autockpt.planning.specs import buffers_used as _buffers_used
from autockpt.rewrite import SegmentSpec, rewrite
from tests.conftest import assert_same_step, train_step

F32 = 4
BATCH, WIDTH, BLOCKS = 3, 8, 4


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.act = nn.ReLU()
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))


class Stack(nn.Module):
    def __init__(self, blocks: int, width: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class LateInPlace(nn.Module):
    """``h`` is produced first and mutated in place near the end; in between, ``tanh``
    saves a value computed from ``h``. A segment that started after ``a`` and re-read ``h``
    at recompute time would see ``h + 1``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)
        self.c = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        y = torch.tanh(h * 2.0)
        y = self.b(y)
        h.add_(1)
        return self.c(y) + h


class InputInPlace(nn.Module):
    """Mutates its *input* in place after reading it: the model input is static memory, so
    the profile does not track its storage, and no cut is forbidden."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.b = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x * 2.0)
        y = self.b(h)
        x.add_(1)
        return y + x


def _pipeline(model: nn.Module, x: torch.Tensor) -> tuple[Capture, Profile]:
    torch.manual_seed(0)
    inputs = Inputs.of(x)
    cap = capture(model, inputs)
    return cap, profile(model, cap, inputs, repeat=1)


@pytest.fixture(scope="module")
def stack() -> tuple[Capture, Profile]:
    torch.manual_seed(0)
    return _pipeline(Stack(BLOCKS, WIDTH), torch.randn(BATCH, WIDTH, requires_grad=True))


def _assert_covers(chain: Chain, num_nodes: int) -> None:
    assert chain.stages[0][0] == 0
    assert chain.stages[-1][1] == num_nodes
    for (_, end), (next_start, _) in zip(chain.stages[:-1], chain.stages[1:], strict=True):
        assert end == next_start
    assert all(start < end for start, end in chain.stages)
    assert chain.num_stages == len(chain.stages) == chain.problem.num_stages


def test_stages_cover_every_node_contiguously(stack):
    cap, prof = stack
    chain = build_chain(cap, prof)
    n = len(cap.compute_nodes())
    assert n == 3 * BLOCKS
    _assert_covers(chain, n)
    assert chain.node_names == tuple(node.name for node in cap.compute_nodes())
    # a plain chain has a valid cut between every pair of nodes
    assert chain.num_stages == n
    assert chain.node_range(0, chain.num_stages) == (0, n)
    assert chain.node_range(1, 3) == (chain.stages[1][0], chain.stages[2][1])


def test_input_bytes_are_the_tensors_crossing_each_cut(stack):
    cap, prof = stack
    chain = build_chain(cap, prof)
    inputs = chain.problem.input_bytes
    assert inputs[0] == 0  # the model input is static, not a boundary activation
    for k, (start, _) in enumerate(chain.stages[1:], start=1):
        if start % 3 == 0:  # a block boundary: the block's output, BATCH x WIDTH
            assert inputs[k] == BATCH * WIDTH * F32
        else:  # inside a block: the hidden activation, BATCH x 2*WIDTH
            assert inputs[k] == BATCH * 2 * WIDTH * F32


def test_stage_numbers_fold_the_profile(stack):
    cap, prof = stack
    chain = build_chain(cap, prof)
    problem = chain.problem
    assert sum(problem.param_grad_bytes) == prof.param_grad_bytes
    # a storage saved by several stages (ReLU's output, saved again by the next Linear)
    # counts once over the chain
    assert sum(problem.saved_bytes) == prof.saved_bytes()
    for k, (start, end) in enumerate(chain.stages):
        saved = {s for i in range(start, end) for s in prof.nodes[i].saved}
        assert problem.saved_bytes[k] <= sum(prof.storage_bytes[s] for s in saved)
        # the solvers' forward cost is the profile's deterministic cost model
        assert problem.forward_seconds[k] == pytest.approx(
            sum(n.cost_seconds for n in prof.nodes[start:end])
        )
    # the first Linear saves only the (static) model input: nothing to free there
    assert problem.saved_bytes[0] == 0
    assert problem.static_bytes >= prof.static_bytes
    assert build_chain(cap, prof, static_bytes=0).problem.static_bytes < problem.static_bytes


@pytest.mark.parametrize("max_stages", [1, 2, 3, 5, 7])
def test_max_stages_caps_the_stage_count(stack, max_stages):
    cap, prof = stack
    chain = build_chain(cap, prof, max_stages=max_stages)
    assert chain.num_stages == max_stages
    _assert_covers(chain, len(cap.compute_nodes()))


def test_capped_cuts_prefer_few_crossing_bytes(stack):
    """With one stage per block, the cheapest cuts are the block boundaries (WIDTH floats
    cross) rather than points inside a block (2*WIDTH floats cross)."""
    cap, prof = stack
    chain = build_chain(cap, prof, max_stages=BLOCKS)
    assert chain.stages == tuple((3 * k, 3 * k + 3) for k in range(BLOCKS))
    assert all(b == BATCH * WIDTH * F32 for b in chain.problem.input_bytes[1:])


def test_stages_are_node_ranges_and_block_ranges_map_to_stage_ranges(stack):
    cap, prof = stack
    chain = build_chain(cap, prof, max_stages=BLOCKS)
    assert all(type(stage) is NodeRange for stage in chain.stages)
    assert chain.stages[1].first == chain.stages[0].stop == 3
    assert type(chain.node_range(1, 3)) is NodeRange and chain.node_range(1, 3) == (3, 9)
    blocks = [(3 * k, 3 * k + 3) for k in range(BLOCKS)]
    assert chain.stage_ranges_for(blocks) == tuple(StageRange(k, k + 1) for k in range(BLOCKS))
    assert chain.stage_ranges_for([(0, 6), (9, 12)]) == (StageRange(0, 2), StageRange(3, 4))
    assert chain.stage_ranges_for([]) == ()
    # 4 and 5 are not cuts of this chain; a range ending where it starts is no segment
    assert chain.stage_ranges_for([(0, 3), (4, 6)]) is None
    assert chain.stage_ranges_for([(3, 5)]) is None
    assert chain.stage_ranges_for([(3, 3)]) is None


def test_required_cuts_are_kept_first_then_the_cheapest(stack):
    """Cuts inside a block cost 2*WIDTH floats, block boundaries WIDTH: under a cap, the
    required cuts come first and the remaining room goes to the cheapest others."""
    cap, prof = stack
    n = 3 * BLOCKS
    chain = build_chain(cap, prof, max_stages=4, required_cuts=[1, 10])
    assert [stage.first for stage in chain.stages] == [0, 1, 3, 10]
    _assert_covers(chain, n)
    # more required cuts than the cap allows: all kept, nothing else added
    required = [1, 2, 4, 5, 7]
    chain = build_chain(cap, prof, max_stages=3, required_cuts=required)
    assert [stage.first for stage in chain.stages] == [0, *required]
    # positions outside (0, n) are no cuts, and repeats count once
    chain = build_chain(cap, prof, max_stages=3, required_cuts=[0, 5, 5, n, n + 3])
    assert [stage.first for stage in chain.stages] == [0, 3, 5]


def test_a_required_cut_the_in_place_rule_forbids_is_left_out():
    torch.manual_seed(0)
    cap, prof = _pipeline(LateInPlace(WIDTH), torch.randn(BATCH, WIDTH))
    names = [node.name for node in cap.compute_nodes()]
    producer, mutation = names.index("a"), names.index("add_")
    chain = build_chain(cap, prof, max_stages=3, required_cuts=[producer + 1, mutation + 1])
    assert [stage.first for stage in chain.stages] == [0, mutation + 1, mutation + 2]
    assert chain.stage_ranges_for([(producer + 1, mutation + 1)]) is None
    assert chain.stage_ranges_for([(0, mutation + 1)]) is not None


def test_no_cut_between_a_tensor_and_its_later_in_place_mutation():
    torch.manual_seed(0)
    cap, prof = _pipeline(LateInPlace(WIDTH), torch.randn(BATCH, WIDTH))
    names = [node.name for node in cap.compute_nodes()]
    producer, mutation = names.index("a"), names.index("add_")
    assert prof.nodes[mutation].mutates == prof.nodes[producer].outputs
    chain = build_chain(cap, prof)
    _assert_covers(chain, len(names))
    starts = {start for start, _ in chain.stages}
    forbidden = set(range(producer + 1, mutation + 1))
    assert not starts & forbidden, (chain.stages, names)
    # and the cut after the mutation is still available
    assert mutation + 1 in starts


@pytest.mark.parametrize(
    "model_class",
    [
        LateInPlace,
        pytest.param(
            InputInPlace,
            marks=pytest.mark.xfail(
                strict=True,
                reason=(
                    "in-place mutation of a model input is not tracked (inputs are static storages, "
                    "which _Recorder._storage_id skips, so NodeProfile.mutates is empty) and the chain "
                    "allows segments that read the input before the mutation; their backward then "
                    "fails with 'one of the variables needed for gradient computation has been "
                    "modified by an inplace operation'"
                ),
            ),
        ),
    ],
)
def test_every_segment_the_chain_allows_trains_like_eager(model_class):
    torch.manual_seed(0)
    model, x = model_class(WIDTH), torch.randn(BATCH, WIDTH)
    cap, prof = _pipeline(model, x.clone())
    chain = build_chain(cap, prof)
    nodes = cap.compute_nodes()
    mutated = set(prof.mutated_buffers)
    failures = []
    for a in range(chain.num_stages):
        for b in range(a + 1, chain.num_stages + 1):
            first, end = chain.node_range(a, b)
            spec = SegmentSpec(first, end, False, _buffers_used(nodes[first:end], mutated))
            fast = rewrite(model, cap, [spec])
            inputs = x.clone()
            try:
                assert_same_step(
                    train_step(copy.deepcopy(model), x.clone()), train_step(fast, inputs)
                )
                torch.testing.assert_close(inputs, x + 1 if model_class is InputInPlace else x)
            except (AssertionError, RuntimeError) as error:
                failures.append(((first, end), type(error).__name__))
    assert not failures, failures


def test_empty_graph_is_rejected():
    class Passthrough(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    cap, prof = _pipeline(Passthrough(), torch.randn(2, 2, requires_grad=True))
    with pytest.raises(ValueError, match="no compute nodes"):
        build_chain(cap, prof)
