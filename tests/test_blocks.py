"""Repeated blocks: one finder, the node ranges each block runs, and the per-block plan
("checkpoint every layer") always in the chain's plan space, training exactly like eager."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from autockpt.api import Planner
from autockpt.capture import Capture, Inputs, capture
from autockpt.costs.blocks import (
    RepeatedBlocks,
    block_cut_positions,
    block_node_ranges,
    find_block_classes,
    find_repeated_blocks,
)
from autockpt.costs.problem import DEFAULT_MAX_STAGES, Chain, NodeRange, StageRange, build_chain
from autockpt.costs.profile import Profile, profile
from autockpt.errors import ShardingError
from autockpt.planning.sharding import detect_units
from autockpt.planning.specs import buffers_used as _buffers_used
from autockpt.rewrite import SegmentSpec, rewrite
from autockpt_zoo.toy import ZOO
from solvers.search import recompute_seconds
from tests.conftest import assert_same_step, train_step

SMALL_MAX_STAGES = 8

# -- models ----------------------------------------------------------------------------------


class DenseLayer(nn.Module):
    """DenseNet layer: reads the concatenation of *every* earlier feature map, so the tensors
    crossing a block boundary grow with depth and block boundaries are the most expensive
    cuts of the graph (the cheapest-cuts rule alone never picks them)."""

    def __init__(self, in_channels: int, growth: int) -> None:
        super().__init__()
        self.norm1 = nn.BatchNorm2d(in_channels)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv1 = nn.Conv2d(in_channels, 2 * growth, 1, bias=False)
        self.norm2 = nn.BatchNorm2d(2 * growth)
        self.relu2 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(2 * growth, growth, 3, 1, 1, bias=False)

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        x = torch.cat(features, 1)
        return self.conv2(self.relu2(self.norm2(self.conv1(self.relu1(self.norm1(x))))))


class DenseNet(nn.Module):
    def __init__(self, layers: int, channels: int = 8, growth: int = 4) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, 1, 1)
        self.layers = nn.ModuleList(
            DenseLayer(channels + k * growth, growth) for k in range(layers)
        )
        self.head = nn.Linear(channels + layers * growth, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [self.stem(x)]
        for layer in self.layers:
            features.append(layer(features))
        return self.head(torch.cat(features, 1).mean((2, 3)))


class InPlaceResidual(nn.Module):
    """Pre-norm MLP block whose residual add is in place on the block's *own* output: the
    mutated tensor is produced and mutated inside the block, so no block boundary lies
    between them."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(self.norm(x)))).add_(x)


class InPlaceStream(nn.Module):
    """A residual stream updated in place: the block adds into its *input*. Legal in eager
    (nothing saves ``x``: dropout saves its mask, the Linear its dropped copy)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.1)
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.add_(self.fc(self.drop(x)))


class Stack(nn.Module):
    def __init__(self, block: type[nn.Module], width: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.blocks = nn.ModuleList(block(width) for _ in range(depth))
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


class CheckpointEachBlock(nn.Module):
    """What people write by hand: ``checkpoint(block, x)`` for every block."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=False)


def _dense(layers: int) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return DenseNet(layers).train(), torch.randn(2, 3, 8, 8)


def _stack(block: type[nn.Module]) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return Stack(block).train(), torch.randn(4, 16)


class TorchvisionBasicBlock(nn.Module):
    """torchvision's ``BasicBlock``: conv-BN-ReLU-conv-BN, a ``downsample`` Sequential
    (1x1 conv, BN) when the shape changes, in-place residual add and ReLU."""

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(
                nn.Conv2d(inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class TorchvisionResNet18(nn.Module):
    """torchvision's ResNet-18 layout: stem, ``layer1`` .. ``layer4`` (a ``Sequential`` of
    two :class:`TorchvisionBasicBlock` s each), pooled linear head. ``layer4`` alone holds
    most parameters, so the biggest container is a quarter of the blocks."""

    def __init__(self, width: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        inplanes = width
        for k in range(4):
            planes = width * 2**k
            stride = 1 if k == 0 else 2
            layer = nn.Sequential(
                TorchvisionBasicBlock(inplanes, planes, stride),
                TorchvisionBasicBlock(planes, planes),
            )
            setattr(self, f"layer{k + 1}", layer)
            inplanes = planes
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(inplanes, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def _resnet18() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return TorchvisionResNet18().train(), torch.randn(2, 3, 32, 32)


# -- the finder --------------------------------------------------------------------------------


def _linears(count: int, width: int) -> nn.ModuleList:
    return nn.ModuleList(nn.Linear(width, width) for _ in range(count))


class OtherLinear(nn.Linear):
    """A class of its own (the finder compares exact classes)."""


class ThirdLinear(nn.Linear):
    """Another class of its own."""


def test_finder_takes_the_class_of_the_same_class_container_with_most_parameters():
    model = nn.Module()
    model.stem = nn.Sequential(nn.Linear(64, 64), nn.ReLU())  # mixed classes: a pipeline
    model.small = nn.ModuleList(nn.Conv1d(4, 4, 1) for _ in range(3))  # fewer parameters
    model.acts = nn.ModuleList(nn.ReLU() for _ in range(5))  # no parameters: not layers
    model.big = _linears(2, 16)
    assert find_repeated_blocks(model) == RepeatedBlocks("Linear", ("big",), ("big.0", "big.1"))
    assert detect_units(model) == ("big.0", "big.1")


def test_finder_ties_go_to_more_children_then_the_smallest_name():
    model = nn.Module()
    model.b = _linears(2, 4)  # registered first: traversal order must not decide
    model.a = nn.ModuleList(OtherLinear(4, 4) for _ in range(2))
    assert find_repeated_blocks(model) == RepeatedBlocks("OtherLinear", ("a",), ("a.0", "a.1"))
    model.c = nn.ModuleList(ThirdLinear(4, 2) for _ in range(4))  # as many parameters
    assert sum(p.numel() for p in model.c.parameters()) == sum(
        p.numel() for p in model.a.parameters()
    )
    assert find_repeated_blocks(model).containers == ("c",)


class Nesting(nn.Module):
    """A block that may hold a list of blocks of its own class."""

    def __init__(self, width: int, inner: int = 0) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.inner = nn.ModuleList(Nesting(width) for _ in range(inner))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc(x)
        for block in self.inner:
            x = block(x)
        return x


class Layered(nn.Module):
    """Blocks of one class in several containers, called in an order of their own."""

    def __init__(self) -> None:
        super().__init__()
        self.lone = Nesting(4)
        self.layer1 = nn.Sequential(Nesting(4, inner=2), Nesting(4))
        self.mixed = nn.Sequential(Nesting(4), nn.ReLU())
        self.layer2 = nn.Sequential(Nesting(4))
        self.heads = _linears(2, 4)
        self.layer3 = nn.ModuleList(Nesting(4) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.mixed(self.lone(x))
        x = self.layer3[1](self.layer2(self.layer3[0](x)))
        return self.heads[1](self.heads[0](self.layer1(x)))


def test_finder_takes_every_container_of_the_block_class():
    """The class comes from the biggest container (``layer1``, with its nested blocks); the
    blocks are the children of every container of that class, in registration order: one
    child is enough (``layer2``), a mixed container is a pipeline (``mixed``), another class
    is not a block (``heads``), a lone block is in no container (``lone``), and a list
    inside a block is part of that block (``layer1.0.inner``): blocks never nest."""
    model = Layered()
    blocks = find_repeated_blocks(model)
    assert blocks == RepeatedBlocks(
        "Nesting",
        ("layer1", "layer2", "layer3"),
        ("layer1.0", "layer1.1", "layer2.0", "layer3.0", "layer3.1"),
    )
    assert blocks.label == "layer1, layer2, layer3"
    assert detect_units(model) == blocks.children
    # the node ranges follow the graph, whatever the registration order
    cap = capture(model, Inputs.of(torch.randn(2, 4)))
    ranges = _assert_ranges_are_the_blocks(cap, blocks, ordered=False)
    first = dict(zip(blocks.children, (r.first for r in ranges), strict=True))
    assert sorted(first, key=first.__getitem__) == [
        "layer3.0",
        "layer2.0",
        "layer3.1",
        "layer1.0",
        "layer1.1",
    ]
    assert block_node_ranges(cap, blocks) == tuple(sorted(ranges))


def test_finder_root_container_and_models_without_blocks():
    root = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    assert find_repeated_blocks(root) == RepeatedBlocks("Linear", ("",), ("0", "1", "2"))
    flat = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.ModuleList([nn.ReLU(), nn.ReLU()]))
    assert find_repeated_blocks(flat) is None
    plain = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    assert find_repeated_blocks(plain) is None
    assert block_node_ranges(capture(plain, Inputs.of(torch.randn(2, 4))), None) == ()
    with pytest.raises(ShardingError, match="found no repeated blocks"):
        detect_units(flat)


@pytest.mark.parametrize(
    ("name", "containers", "count"),
    [
        ("gpt", ("h",), 4),
        ("resnet", ("stages",), 6),
        ("mlp_mixer", ("layers",), 6),
        ("two_in_two_out", ("x_blocks",), 4),  # over y_blocks and y_to_x: most parameters
        ("kwargs_model", ("layers",), 6),
        ("untraceable_submodule", ("before", "after"), 6),  # both sides of the router
        ("unet", None, 0),  # encoder and decoder stages are all different: no blocks
    ],
)
def test_zoo_blocks_are_the_layers(name, containers, count):
    model, _ = ZOO[name]()
    blocks = find_repeated_blocks(model)
    if containers is None:
        assert blocks is None
        return
    assert blocks.containers == containers
    children = tuple(
        f"{container}.{k}"
        for container in containers
        for k in range(len(model.get_submodule(container)))
    )
    assert blocks.children == children and len(children) == count
    assert detect_units(model) == blocks.children  # the FSDP units are the same blocks


# -- node ranges -------------------------------------------------------------------------------


def _module_paths(node: torch.fx.Node) -> list[str]:
    paths = [value[0] for value in (node.meta.get("nn_module_stack") or {}).values()]
    return paths + ([str(node.target)] if node.op == "call_module" else [])


def _inside(node: torch.fx.Node, child: str) -> bool:
    return any(p == child or p.startswith(f"{child}.") for p in _module_paths(node))


def _assert_ranges_are_the_blocks(
    cap: Capture, blocks: RepeatedBlocks, ordered: bool = True
) -> tuple[NodeRange, ...]:
    """One range per block, each holding exactly that block's nodes; returned in graph
    order, which is the blocks' own order when ``ordered`` (else in the blocks' order)."""
    nodes = cap.compute_nodes()
    ranges = block_node_ranges(cap, blocks)
    assert len(ranges) == len(blocks.children)
    if not ordered:
        ranges = tuple(
            next(r for r in ranges if _inside(nodes[r.first], child)) for child in blocks.children
        )
    for child, (first, stop) in zip(blocks.children, ranges, strict=True):
        assert first < stop
        assert all(_inside(node, child) for node in nodes[first:stop]), child
    covered = {i for first, stop in ranges for i in range(first, stop)}
    for i, node in enumerate(nodes):
        if i not in covered:
            assert not any(_inside(node, child) for child in blocks.children), node.name
    return ranges


def test_ranges_from_fx_and_leaf_blocks():
    model, x = ZOO["resnet"]()
    blocks = find_repeated_blocks(model)
    assert blocks == RepeatedBlocks(
        "BasicBlock", ("stages",), tuple(f"stages.{k}" for k in range(6))
    )
    cap = capture(model, Inputs.of(x))
    ranges = _assert_ranges_are_the_blocks(cap, blocks)
    # a block captured as a leaf is one call_module node, and still a block
    leafy = capture(model, Inputs.of(x), leaf_modules=("stages.1",))
    leaf_ranges = _assert_ranges_are_the_blocks(leafy, blocks)
    assert leaf_ranges[1].stop - leaf_ranges[1].first == 1
    assert len(leafy.compute_nodes()) < len(cap.compute_nodes())
    # block ranges are adjacent here: one cut between two blocks, plus the outer two
    assert block_cut_positions(cap, blocks) == tuple(
        sorted({*(r.first for r in ranges), ranges[-1].stop})
    )
    # the whole container as one leaf: no block has nodes of its own
    assert block_node_ranges(capture(model, Inputs.of(x), leaf_modules=("stages",)), blocks) == ()


def test_ranges_from_an_export_graph(hf_gpt2):
    assert hf_gpt2.capture.method == "export"
    assert hf_gpt2.blocks == RepeatedBlocks(
        "GPT2Block", ("transformer.h",), ("transformer.h.0", "transformer.h.1")
    )
    _assert_ranges_are_the_blocks(hf_gpt2.capture, hf_gpt2.blocks)


def test_blocks_not_called_or_interleaved_are_left_out():
    class Partial(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = _linears(3, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.blocks[1](torch.relu(self.blocks[0](x)))  # blocks.2 is never called

    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = _linears(3, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.blocks[0](x)
            x = self.blocks[1](x)  # blocks.0 runs again after it: their spans overlap
            return self.blocks[2](self.blocks[0](x))

    x = torch.randn(2, 4)
    partial = Partial()
    blocks = find_repeated_blocks(partial)
    assert block_node_ranges(capture(partial, Inputs.of(x)), blocks) == ((0, 1), (2, 3))
    shared = Shared()
    cap = capture(shared, Inputs.of(x))
    assert block_node_ranges(cap, find_repeated_blocks(shared)) == ((3, 4),)
    assert block_cut_positions(cap, find_repeated_blocks(shared)) == (3,)


# -- the per-block plan is in the plan space and trains like eager ---------------------------


@dataclass
class Case:
    model: nn.Module
    example: Any
    capture: Capture
    profile: Profile
    blocks: RepeatedBlocks
    ranges: tuple[NodeRange, ...]
    cuts: tuple[int, ...]

    def chain(self, max_stages: int = DEFAULT_MAX_STAGES, required: bool = True) -> Chain:
        return build_chain(
            self.capture,
            self.profile,
            max_stages=max_stages,
            required_cuts=self.cuts if required else (),
        )

    def specs(self, ranges: tuple[NodeRange, ...]) -> list[SegmentSpec]:
        nodes = self.capture.compute_nodes()
        mutated = set(self.profile.mutated_buffers)
        return [
            SegmentSpec(
                first,
                stop,
                any(self.profile.nodes[i].random for i in range(first, stop)),
                _buffers_used(nodes[first:stop], mutated),
            )
            for first, stop in ranges
        ]


def _case(model: nn.Module, example: Any, method: str | None = None) -> Case:
    torch.manual_seed(0)
    inputs = Inputs.of(example)
    cap = capture(model, inputs, method=method)
    prof = profile(model, cap, inputs, repeat=1)
    blocks = find_repeated_blocks(model)
    assert blocks is not None
    ranges = _assert_ranges_are_the_blocks(cap, blocks)
    return Case(model, example, cap, prof, blocks, ranges, block_cut_positions(cap, blocks))


@pytest.fixture(scope="module")
def hf_gpt2() -> Case:
    pytest.importorskip("transformers")
    from autockpt_zoo.hf import HF_ZOO

    return _case(*HF_ZOO["hf_gpt2"]())


def _assert_per_block_plan_reachable(case: Case) -> None:
    """At the default stage cap and at a small one, the chain built with the blocks'
    required cuts has stage ranges covering exactly each block; checkpointing each block
    through those stage ranges trains exactly like eager."""
    for max_stages in (DEFAULT_MAX_STAGES, SMALL_MAX_STAGES):
        chain = case.chain(max_stages)
        assert chain.num_stages <= max(max_stages, len(case.cuts) + 1)
        assert all(isinstance(stage, NodeRange) for stage in chain.stages)
        stage_ranges = chain.stage_ranges_for(case.ranges)
        assert stage_ranges is not None, (max_stages, case.cuts, chain.stages)
        assert all(isinstance(r, StageRange) for r in stage_ranges)
        assert tuple(chain.node_range(*r) for r in stage_ranges) == case.ranges
    per_block = tuple(chain.node_range(*r) for r in stage_ranges)
    fast = rewrite(case.model, case.capture, case.specs(per_block))
    assert_same_step(
        train_step(copy.deepcopy(case.model), case.example), train_step(fast, case.example)
    )


@pytest.mark.parametrize("name", ["gpt", "resnet"])
def test_per_block_plan_is_reachable_on_zoo_models(name):
    model, example = ZOO[name]()
    case = _case(model, example)
    _assert_per_block_plan_reachable(case)
    # without the required cuts, a small cap loses block boundaries: the test can fail
    assert case.chain(SMALL_MAX_STAGES, required=False).stage_ranges_for(case.ranges) is None


def test_per_block_plan_is_reachable_on_a_hugging_face_model(hf_gpt2):
    _assert_per_block_plan_reachable(hf_gpt2)


RESNET18_BLOCKS = tuple(f"layer{k}.{i}" for k in range(1, 5) for i in range(2))


def test_torchvision_resnet18_blocks_are_all_four_layers():
    """``layer4`` holds the most parameters; all eight blocks of ``layer1`` .. ``layer4``
    are the blocks, not ``layer4``'s two (and not the ``downsample`` Sequentials inside)."""
    model, x = _resnet18()
    layer4 = sum(p.numel() for p in model.layer4.parameters())
    assert all(
        sum(p.numel() for p in model.get_submodule(f"layer{k}").parameters()) < layer4
        for k in range(1, 4)
    )
    blocks = find_repeated_blocks(model)
    assert blocks == RepeatedBlocks(
        "TorchvisionBasicBlock", ("layer1", "layer2", "layer3", "layer4"), RESNET18_BLOCKS
    )
    assert detect_units(model) == RESNET18_BLOCKS
    case = _case(model, x)
    # every block boundary is a required cut (the first block starts after the stem, the
    # last ends before the head; adjacent blocks share a cut)
    assert case.cuts == (*(r.first for r in case.ranges), case.ranges[-1].stop)
    _assert_per_block_plan_reachable(case)


def test_t5_blocks_are_the_encoder_and_the_decoder_blocks():
    """T5 keeps its ``T5Block`` s in ``encoder.block`` and ``decoder.block``: the per-block
    plan checkpoints both stacks (the decoder alone holds more parameters, cross-attention
    included)."""
    pytest.importorskip("transformers")
    from autockpt_zoo.hf import HF_ZOO

    model, inputs = HF_ZOO["hf_t5"]()
    encoder, decoder = (model.get_submodule(f"{s}.block") for s in ("encoder", "decoder"))
    assert sum(p.numel() for p in encoder.parameters()) < sum(
        p.numel() for p in decoder.parameters()
    )
    blocks = find_repeated_blocks(model)
    expected = ("encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1")
    assert blocks == RepeatedBlocks("T5Block", ("encoder.block", "decoder.block"), expected)
    assert detect_units(model) == expected
    case = _case(model, inputs)
    _assert_per_block_plan_reachable(case)


def test_per_block_plan_is_reachable_on_a_densenet():
    """Every block boundary carries all earlier features, so the fewest-bytes rule alone
    drops block boundaries first when the stage cap bites."""
    model, x = _dense(8)
    case = _case(model, x)
    assert case.chain(SMALL_MAX_STAGES, required=False).stage_ranges_for(case.ranges) is None
    _assert_per_block_plan_reachable(case)
    # more required cuts than the cap allows: they are all kept
    assert case.chain(SMALL_MAX_STAGES).num_stages == len(case.cuts) + 1 > SMALL_MAX_STAGES


@pytest.mark.slow
def test_per_block_plan_is_reachable_on_a_deep_densenet():
    """48 dense layers: ~340 nodes, more than the default stage cap, and the default cap
    alone loses block boundaries (as on T5 with 4+ layers)."""
    model, x = _dense(48)
    case = _case(model, x)
    assert len(case.capture.compute_nodes()) > DEFAULT_MAX_STAGES
    assert case.chain(required=False).stage_ranges_for(case.ranges) is None
    _assert_per_block_plan_reachable(case)


@pytest.mark.parametrize("method", [None, "export"])
def test_in_place_adds_inside_a_block_leave_its_boundaries_cuts(method):
    """``h.add_(x)`` mutates a tensor the block made itself: the in-place rule forbids the
    cut between its producer and the add (inside the block), never a block boundary."""
    model, x = _stack(InPlaceResidual)
    case = _case(model, x, method)
    assert case.capture.method == (method or "fx")
    mutating = [i for i, node in enumerate(case.profile.nodes) if node.mutates]
    assert len(mutating) == len(case.blocks.children)
    chain = case.chain()
    starts = {stage.first for stage in chain.stages}
    assert not starts & set(mutating)  # the rule is in force inside each block
    _assert_per_block_plan_reachable(case)


def test_a_block_that_mutates_its_input_cannot_be_checkpointed():
    """When a block adds into its *input* in place, every boundary it reads across is
    forbidden, and rightly: checkpoint keeps a segment's inputs to recompute from, and this
    one is changed after it was kept. Checkpointing each block by hand fails the same way,
    so the per-block plan is not a plan at all and the chain correctly leaves it out."""
    model, x = _stack(InPlaceStream)
    case = _case(model, x)
    chain = case.chain()
    block_starts = {first for first, _ in case.ranges}
    assert len(block_starts) == 4 and not {stage.first for stage in chain.stages} & block_starts
    assert chain.stage_ranges_for(case.ranges) is None
    by_hand = copy.deepcopy(model)
    for k, block in enumerate(by_hand.blocks):
        by_hand.blocks[k] = CheckpointEachBlock(block)
    train_step(copy.deepcopy(model), x)  # eager is fine
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        train_step(by_hand, x)


# -- every repeated class, and the shares of its blocks -----------------------------------------


class InnerBlock(nn.Module):
    """A bottleneck: the tensors inside are smaller than those between blocks, so the
    fewest-bytes rule alone cuts inside blocks first and the stage cap drops boundaries."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.down = nn.Linear(dim, dim // 8)
        self.up = nn.Linear(dim // 8, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.up(F.gelu(self.down(x))))


class OuterStage(nn.Module):
    """timm's pattern: a stage holds its blocks in a Sequential, the model its stages."""

    def __init__(self, dim: int, depth: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(InnerBlock(dim) for _ in range(depth)))
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.blocks(x))


class Staged(nn.Module):
    def __init__(self, stages: int, depth: int, dim: int = 16) -> None:
        super().__init__()
        self.stem = nn.Linear(dim, dim)
        self.stages = nn.Sequential(*(OuterStage(dim, depth) for _ in range(stages)))
        self.head = nn.Linear(dim, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.stem(x)))


def test_every_repeated_class_is_found_at_every_depth():
    """The stages (most parameters) come first and stay *the* blocks; the blocks inside
    the stages are a class of their own, across all three stages' containers."""
    model = Staged(stages=3, depth=2)
    classes = find_block_classes(model)
    assert [c.block_class for c in classes] == ["OuterStage", "InnerBlock"]
    assert classes[0] == find_repeated_blocks(model)
    assert classes[1].containers == ("stages.0.blocks", "stages.1.blocks", "stages.2.blocks")
    assert classes[1].children == tuple(f"stages.{s}.blocks.{b}" for s in range(3) for b in (0, 1))


def test_every_one_line_plan_is_exact_and_bounds_the_minimum_past_the_stage_cap():
    """A 4 x 32-block model of more than 500 nodes, capped at 160 stages: the inner blocks'
    plan would lose its boundaries to the cap with only the stages' cuts required; with
    every class's cuts required both one-line plans are exact plans of the chain, both
    seed the search, and the stated minimum is at most each of them."""
    torch.manual_seed(0)
    model, x = Staged(stages=4, depth=32), torch.randn(4, 16)
    planner = Planner(model, (x,), max_stages=DEFAULT_MAX_STAGES, cache=False)
    prepared = planner.prepared
    assert len(prepared.capture.compute_nodes()) > 500
    classes = find_block_classes(model)
    stages_only = build_chain(
        prepared.capture,
        prepared.profile,
        max_stages=DEFAULT_MAX_STAGES,
        required_cuts=block_cut_positions(prepared.capture, classes[0]),
    )
    inner = block_node_ranges(prepared.capture, classes[1])
    assert len(inner) == 128
    assert stages_only.stage_ranges_for(inner) is None  # the cap merges them away
    assert planner.chain.num_stages == DEFAULT_MAX_STAGES
    plans = prepared.block_plans
    assert [p.label for p in plans] == [c.label for c in classes]
    assert all(p.exact for p in plans)
    assert len(plans[1].segments) == 128
    for plan in plans:
        assert plan.segments in prepared.seeds
        assert planner.minimum_peak_bytes <= planner.predict(plan.segments)


def test_shares_seed_the_search_so_plans_stay_on_or_below_the_line():
    """ "Checkpoint the first k blocks" for every k seeds the search: under the time model
    the solver ranks by, the plan at every budget between per-block's peak and no
    checkpointing costs at most the straight line between the two, and never more than
    the plan of a tighter budget."""
    model, example = ZOO["gpt"]()
    planner = Planner(model, example, loss_fn=lambda out: out[1], cache=False)
    per_block = planner.per_block_segments
    assert per_block is not None and len(per_block) == 4
    for k in range(1, 4):
        assert per_block[:k] in planner.prepared.seeds
    chain = planner.search.replay_chain
    low, high = planner.predict(per_block), planner.predict([])
    cost_low = recompute_seconds(chain, per_block)
    previous = None
    for step in range(9):
        budget = low + (high - low) * step // 8
        found = planner.search.least_recompute(budget, selective=False)
        assert planner.predict(found.segments) <= budget
        cost = recompute_seconds(chain, found.segments)
        line = cost_low * (high - budget) / (high - low)
        assert cost <= line + 1e-12, (step, cost, line)
        if previous is not None:
            assert cost <= previous + 1e-12, (step, cost, previous)
        previous = cost


@pytest.mark.slow
def test_torchvision_densenet121_dense_layers_seed_the_search():
    """torchvision keeps its dense layers in ``_DenseBlock`` s, each an ``nn.ModuleDict``:
    the blocks are its 58 ``_DenseLayer`` s, their plan is exact, and the stated minimum is
    at most its peak."""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.densenet121(num_classes=10)
    blocks = find_repeated_blocks(model)
    assert blocks is not None and blocks.block_class == "_DenseLayer"
    assert len(blocks.children) == 58
    planner = Planner(model, (torch.randn(2, 3, 64, 64),), cache=False)
    per_block = planner.prepared.per_block
    assert per_block is not None and per_block.exact and len(per_block.segments) == 58
    assert planner.minimum_peak_bytes <= planner.predict(per_block.segments)
