"""Repeated blocks: the layers people checkpoint by hand, found once for every consumer.

"Checkpoint every layer" (``gradient_checkpointing_enable()``, a ``checkpoint`` call in the
loop over ``self.layers``) is the plan most training code uses, and three parts of autockpt
need the same notion of "the layers": the chain (:func:`block_cut_positions` becomes
``build_chain(required_cuts=...)`` so that the per-block plan is always in the solvers' plan
space and can be priced and compared), the frontier's per-block baseline
(``report.repeated_block_segments``) and the default FSDP units
(``distributed.detect_units``). One finder serves all three, so the baseline the frontier
draws, the units FSDP shards and the cuts the chain keeps are the same blocks.

The rule (:func:`find_repeated_blocks`) has two steps.

1. *The block class*: the class of the children of the ``nn.ModuleList`` /
   ``nn.Sequential`` / ``nn.ModuleDict`` (layers by name) with at least two children, all of exactly one class, that holds the
   most parameters.

   * *Same class*: repeated layers are instances of one class (``GPT2Block``,
     ``BasicBlock``); a mixed ``Sequential`` (a stem: conv, norm, activation) is a
     pipeline, not layers.
   * *Most parameters*: the layers hold the model's bulk. Nested candidates resolve
     towards the one that covers more of the model (Hugging Face ResNet's
     ``encoder.stages`` over one stage's ``layers``); a small repeated group (the two
     projections of an attention block, the heads of a classifier) never sets the class.
   * *With parameters at all*: a parameter-free container (activations, pooling) is
     nothing anyone checkpoints or shards by hand; if it is all a model has, it has no
     blocks.
   * *Ties*: more children, then the smallest qualified name, so every process (every
     rank) picks the same class whatever the order of ``named_modules()``.

2. *The blocks*: the children of *every* ``ModuleList`` / ``Sequential`` whose children
   (one or more) are all of exactly that class, except containers inside a block already
   taken, in ``named_modules()`` order (registration order, the same in every process).
   Why every container: the layers of many models are split over several containers, and
   the hand plan checkpoints all of them. torchvision's ResNet keeps its ``BasicBlock`` s
   in ``layer1`` .. ``layer4``, T5 its ``T5Block`` s in ``encoder.block`` and
   ``decoder.block``; the container with the most parameters alone is ``layer4`` or the
   decoder, and a plan or FSDP wrapping built from it leaves most blocks out. One child is
   enough here (a stage of one block, as in a ResNet configured with one block per
   layer): the class is already known from step 1, and that block is as much a layer as
   its siblings elsewhere. Containers inside a taken block (a ``BasicBlock``'s
   ``downsample``, a transformer block's own list of sub-layers) belong to that block:
   a block is checkpointed or sharded whole, so blocks never nest.

   A generic class (``nn.Linear`` when a model's biggest repeated group is a list of
   plain linears) takes every list of that class outside a taken block; the rule does not
   guess which of those lists are "layers", it stays the one rule for all three users.

Both finders this module replaced applied step 1 except at the edges (one admitted
parameter-free containers and broke ties towards the *largest* name, the other broke ties
by traversal order) and stopped there; step 2 is what a hand-written per-block plan spread
over several containers needs.

NOTE [blocks: every class]. The rule above names *the* blocks (the frontier's baseline, the
FSDP units). The plan space is wider: for every class step 1 admits (a container of two or
more children all of it, with parameters), "checkpoint each instance" is a plan someone
writes in one line, at any depth (timm's stages and the blocks inside them, torchvision's
dense layers inside each ``_DenseBlock``). :func:`find_block_classes` returns them all; the
chain keeps every one of their boundaries as a required cut (coarsening to ``max_stages``
never merges them away: required cuts are kept past that cap), and each class's plan
seeds the search, so the stated minimum is at most each of them by construction.

NOTE [blocks: shares]. Between checkpointing every block and checkpointing none lies the
straight line a user gets by checkpointing a share of them. :func:`share_plans` gives the
points of that line, checkpointing the *first* k blocks: recomputing a block during
backward happens while every un-checkpointed block before it still holds its activations,
so leaving the last blocks un-checkpointed (freed before any recompute starts) is the
leanest way to checkpoint k of them. They seed the search too, so at every budget the plan
is at least as cheap, under the time model the solver ranks by, as the share that fits.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch.fx as fx
from torch import nn

from autockpt.capture.captured import Capture, module_paths
from autockpt.costs.problem import Chain, NodeRange, StageRange


@dataclass(frozen=True)
class RepeatedBlocks:
    """The repeated blocks of a model: their class's name, the qualified names of the
    containers that hold them (``""`` for the root itself) and the blocks' own qualified
    names, container by container in registration order."""

    block_class: str
    containers: tuple[str, ...]
    children: tuple[str, ...]

    @property
    def label(self) -> str:
        """The containers' names, joined (``"h"``; ``"layer1, layer2, layer3, layer4"``):
        where the blocks are, for reports and figures."""
        return ", ".join(self.containers)


_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
"""What holds layers: a list, a pipeline, or layers by name (``nn.ModuleDict``)."""

NO_BLOCKS = (
    "no repeated blocks: no nn.ModuleList, nn.Sequential or nn.ModuleDict holds two or more "
    "children of one class with parameters (autockpt/costs/blocks.py)"
)
"""Why a model has no per-block plan, for reports that would show one."""


def find_repeated_blocks(model: nn.Module) -> RepeatedBlocks | None:
    """Every child of class C of every ``ModuleList``/``Sequential``/``ModuleDict`` whose
    children are all of class C and that lies outside another such child, C being the class
    of the children of the container of >= 2 same-class children holding the most parameters
    (ties: more children, then the smallest name); ``None`` when the model has none. See the
    module docstring for why this rule."""
    classes = find_block_classes(model)
    return classes[0] if classes else None


def find_block_classes(model: nn.Module) -> tuple[RepeatedBlocks, ...]:
    """The blocks of *every* class that step 1 of the rule admits (a container of >= 2
    children all of that class, with parameters), each expanded by step 2, ordered as step
    1 ranks them (the class of :func:`find_repeated_blocks` first).

    Why every class: "checkpoint each instance" is a one-line plan for each of them, and
    the block a user would checkpoint often sits below the container with the most
    parameters (timm's blocks inside its stages, a dense layer inside a dense block). The
    search seeds itself with every such plan and the chain cuts at all their boundaries, so
    the stated minimum is never above any of them (NOTE [blocks: every class])."""
    containers = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, _CONTAINERS) and len(module) > 0
    ]
    best: dict[type[nn.Module], tuple[int, int, str]] = {}
    for name, module in containers:
        child_types = {type(child) for child in module.children()}
        if len(module) < 2 or len(child_types) != 1:
            continue
        params = sum(p.numel() for p in module.parameters())
        if params == 0:
            continue
        block_type = child_types.pop()
        key = (params, len(module), name)
        held = best.get(block_type)
        if held is None or _ranks_before(key, held):
            best[block_type] = key
    ranked = sorted(best, key=lambda t: (-best[t][0], -best[t][1], best[t][2]))
    return tuple(_blocks_of(containers, block_type) for block_type in ranked)


def blocks_inside_notes(model: nn.Module, leaves: Iterable[str]) -> list[str]:
    """One note per leaf of the capture that holds repeated blocks (:func:`find_block_classes`),
    naming them: a leaf runs as one call, so its blocks cannot be checkpointed one by one, and
    the stated minimum may lie above checkpointing each of them by hand. Said, never silent
    (what still makes a leaf: a branch on values or a draw in its own code, NOTE [capture:
    checks on values])."""
    classes = find_block_classes(model)
    notes = []
    for leaf in sorted(leaves):
        inside = [
            (kind.block_class, [c for c in kind.children if _within(c, leaf) and c != leaf])
            for kind in classes
        ]
        named = "; ".join(
            f"{paths[0]} ... {paths[-1]} ({len(paths)} x {name})"
            for name, paths in inside
            if len(paths) > 1
        )
        if named:
            notes.append(
                f"{leaf} runs as one call, so the repeated blocks inside it ({named}) cannot "
                "be checkpointed one by one: the plan's minimum may lie above checkpointing "
                "each of them by hand"
            )
    return notes


def _ranks_before(key: tuple[int, int, str], other: tuple[int, int, str]) -> bool:
    """Step 1's order: more parameters, then more children, then the smaller name."""
    return key[:2] > other[:2] or (key[:2] == other[:2] and key[2] < other[2])


def _blocks_of(
    containers: list[tuple[str, nn.Module]], block_type: type[nn.Module]
) -> RepeatedBlocks:
    """Step 2: the children of every container whose children are all ``block_type``,
    outside a block already taken, in registration order."""
    taken: list[str] = []
    children: list[str] = []
    for name, module in containers:
        if any(type(child) is not block_type for child in module.children()):
            continue
        if any(_within(name, block) for block in children):
            continue
        taken.append(name)
        prefix = f"{name}." if name else ""
        children.extend(f"{prefix}{child}" for child, _ in module.named_children())
    return RepeatedBlocks(block_type.__name__, tuple(taken), tuple(children))


def block_node_ranges(capture: Capture, blocks: RepeatedBlocks | None) -> tuple[NodeRange, ...]:
    """Per block, the half-open range of compute-node indices it runs, in graph order.

    A node belongs to the block whose qualified name is a module path on its
    ``nn_module_stack`` (fx and ``torch.export`` graphs both carry it), or a prefix of one,
    or of its ``call_module`` target (a block captured as a leaf is one node). A block's
    range spans its first to its last node. Nodes of the surrounding code that the graph
    places inside that span are merged into it: checkpointing a block's call runs them
    inside the checkpoint too (they are the block's argument handling), and a segment must
    be contiguous. Blocks that are never called (no nodes: unused, or hidden inside a leaf
    that holds a whole container) are left out, and so are blocks whose spans overlap
    another block's (a module called twice around another one): such a block has no range
    that is its own. The result may therefore hold fewer ranges than ``blocks.children``.
    """
    if blocks is None:
        return ()
    wanted = frozenset(blocks.children)
    span: dict[str, list[int]] = {}
    for index, node in enumerate(capture.compute_nodes()):
        block = _block_of(node, wanted)
        if block is not None:
            first_last = span.setdefault(block, [index, index])
            first_last[1] = index
    ranges = sorted(NodeRange(first, last + 1) for first, last in span.values())
    overlapping: set[int] = set()
    for k in range(1, len(ranges)):
        if ranges[k].first < ranges[k - 1].stop:
            overlapping |= {k - 1, k}
    return tuple(r for k, r in enumerate(ranges) if k not in overlapping)


def block_cut_positions(
    capture: Capture, blocks: RepeatedBlocks | Sequence[RepeatedBlocks] | None
) -> tuple[int, ...]:
    """Cut positions (between compute nodes ``p-1`` and ``p``) that a plan checkpointing
    each block needs (of every class given): every block's first and stop index, except the
    graph's own ends (0 and the node count), which bound the chain anyway. Sorted, without
    repeats; empty when ``blocks`` is ``None``."""
    if blocks is None:
        return ()
    classes = (blocks,) if isinstance(blocks, RepeatedBlocks) else tuple(blocks)
    n = len(capture.compute_nodes())
    return tuple(
        sorted(
            {
                p
                for each in classes
                for r in block_node_ranges(capture, each)
                for p in r
                if 0 < p < n
            }
        )
    )


@dataclass(frozen=True)
class PerBlockPlan:
    """ "Checkpoint each repeated block", as stage ranges of a chain: the hand-written
    baseline most code uses, priced and drawn beside autockpt's plans, and a seed of the
    search. ``exact``: each block is exactly one segment (the chain cuts at every block
    boundary, as it does when built with :func:`block_cut_positions` as required cuts)."""

    label: str
    """Where the blocks are (:attr:`RepeatedBlocks.label`)."""
    segments: tuple[StageRange, ...]
    exact: bool


def per_block_plan(
    chain: Chain, capture: Capture, blocks: RepeatedBlocks | None
) -> PerBlockPlan | None:
    """The per-block plan on ``chain`` (``None`` without repeated blocks). When a block
    boundary is not a cut of the chain, each block becomes the stages lying wholly inside
    it, and a block too small to hold a whole stage is skipped (``exact`` False)."""
    if blocks is None:
        return None
    ranges = block_node_ranges(capture, blocks)
    exact = chain.stage_ranges_for(ranges)
    if exact is not None:
        return PerBlockPlan(blocks.label, exact, True)
    segments: list[StageRange] = []
    for first, stop in ranges:
        inside = [
            k for k, stage in enumerate(chain.stages) if stage.first >= first and stage.stop <= stop
        ]
        if inside and (not segments or inside[0] >= segments[-1].end):
            segments.append(StageRange(inside[0], inside[-1] + 1))
    return PerBlockPlan(blocks.label, tuple(segments), False)


def share_plans(plan: PerBlockPlan) -> tuple[tuple[StageRange, ...], ...]:
    """The plans checkpointing the first ``k`` of ``plan``'s blocks, ``k`` = 1 .. n-1: the
    points of the line between checkpointing every block and none (NOTE [blocks: shares])."""
    segments = plan.segments
    return tuple(segments[:k] for k in range(1, len(segments)))


def _within(name: str, module: str) -> bool:
    """Whether the qualified name ``name`` is ``module`` or lies inside it."""
    return name == module or name.startswith(f"{module}.")


def _block_of(node: fx.Node, blocks: frozenset[str]) -> str | None:
    """The block (one of ``blocks``' qualified names, which never nest) that ``node`` runs
    inside, if any: the outermost module path of the node that is a block or inside one."""
    for path in module_paths(node):
        parts = path.split(".") if path else []
        for depth in range(1, len(parts) + 1):
            candidate = ".".join(parts[:depth])
            if candidate in blocks:
                return candidate
    return None
