"""Repeated blocks: the layers people checkpoint by hand, found once for every consumer.

"Checkpoint every layer" (``gradient_checkpointing_enable()``, a ``checkpoint`` call in the
loop over ``self.layers``) is the plan most training code uses, and three parts of autockpt
need the same notion of "the layers": the chain (:func:`block_cut_positions` becomes
``build_chain(required_cuts=...)`` so that the per-block plan is always in the solvers' plan
space and can be priced and compared), the frontier's per-block baseline
(``report.repeated_block_segments``) and the default FSDP units
(``distributed.detect_units``). One finder serves all three, so the baseline the frontier
draws, the units FSDP shards and the cuts the chain keeps are the same blocks.

The rule (:func:`find_repeated_blocks`): the ``nn.ModuleList`` / ``nn.Sequential`` with at
least two children, all of exactly one class, that holds the most parameters. Why:

* *Same class*: repeated layers are instances of one class (``GPT2Block``, ``BasicBlock``);
  a mixed ``Sequential`` (a stem: conv, norm, activation) is a pipeline, not layers.
* *Most parameters*: the container of the layers holds the model's bulk. Nested candidates
  resolve towards the one that covers more of the model (Hugging Face ResNet's
  ``encoder.stages`` over one stage's ``layers``); a small repeated group (the two
  projections of an attention block, the heads of a classifier) never wins over the body.
* *With parameters at all*: a parameter-free container (activations, pooling) is nothing
  anyone checkpoints or shards by hand; if it is all a model has, it has no blocks.
* *Ties*: more children, then the smallest qualified name, so every process (every rank)
  picks the same container whatever the order of ``named_modules()``.

Both finders this module replaces applied this rule except at the edges: one admitted
parameter-free containers and broke ties towards the *largest* name, the other broke ties
by traversal order. The rule above is theirs with those edges made explicit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx
from torch import nn

from autockpt.problem import NodeRange
from autockpt.trace import Capture


@dataclass(frozen=True)
class RepeatedBlocks:
    """A container of repeated blocks: its qualified name (``""`` for the root itself) and
    its children's qualified names, in registration order."""

    container: str
    children: tuple[str, ...]


def find_repeated_blocks(model: nn.Module) -> RepeatedBlocks | None:
    """The ``ModuleList``/``Sequential`` of >= 2 same-class children holding the most
    parameters (ties: more children, then the smallest name); ``None`` when the model has
    none. See the module docstring for why this rule."""
    best: tuple[int, int, str] | None = None
    found: RepeatedBlocks | None = None
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < 2:
            continue
        children = list(module.named_children())
        if len({type(child) for _, child in children}) != 1:
            continue
        params = sum(p.numel() for p in module.parameters())
        if params == 0:
            continue
        key = (params, len(children), name)
        if best is None or key[:2] > best[:2] or (key[:2] == best[:2] and name < best[2]):
            best = key
            prefix = f"{name}." if name else ""
            found = RepeatedBlocks(name, tuple(f"{prefix}{child}" for child, _ in children))
    return found


def block_node_ranges(capture: Capture, blocks: RepeatedBlocks | None) -> tuple[NodeRange, ...]:
    """Per block, the half-open range of compute-node indices it runs, in graph order.

    A node belongs to the block whose qualified name prefixes a module path on its
    ``nn_module_stack`` (fx and ``torch.export`` graphs both carry it) or its
    ``call_module`` target (a block captured as a leaf is one node). A block's range spans
    its first to its last node. Nodes of the surrounding code that the graph places inside
    that span are merged into it: checkpointing a block's call runs them inside the
    checkpoint too (they are the block's argument handling), and a segment must be
    contiguous. Blocks that are never called (no nodes: unused, or hidden inside a leaf
    that holds the whole container) are left out, and so are blocks whose spans overlap
    another block's (a module called twice around another one): such a block has no range
    that is its own. The result may therefore hold fewer ranges than ``blocks.children``.
    """
    if blocks is None:
        return ()
    prefix = f"{blocks.container}." if blocks.container else ""
    wanted = set(blocks.children)
    span: dict[str, list[int]] = {}
    for index, node in enumerate(capture.compute_nodes()):
        child = _child_of(node, prefix)
        if child in wanted:
            first_last = span.setdefault(child, [index, index])
            first_last[1] = index
    ranges = sorted(NodeRange(first, last + 1) for first, last in span.values())
    overlapping: set[int] = set()
    for k in range(1, len(ranges)):
        if ranges[k].first < ranges[k - 1].stop:
            overlapping |= {k - 1, k}
    return tuple(r for k, r in enumerate(ranges) if k not in overlapping)


def block_cut_positions(capture: Capture, blocks: RepeatedBlocks | None) -> tuple[int, ...]:
    """Cut positions (between compute nodes ``p-1`` and ``p``) that a plan checkpointing
    each block needs: every block's first and stop index, except the graph's own ends
    (0 and the node count), which bound the chain anyway. Sorted, without repeats; empty
    when ``blocks`` is ``None``."""
    ranges = block_node_ranges(capture, blocks)
    n = len(capture.compute_nodes())
    return tuple(sorted({p for r in ranges for p in r if 0 < p < n}))


def _child_of(node: fx.Node, prefix: str) -> str | None:
    """The direct child of the container (``prefix``, with its trailing dot; ``""`` for the
    root) that ``node`` runs inside, if any."""
    paths = []
    for key, value in (node.meta.get("nn_module_stack") or {}).items():
        # fx and export store (qualified name, class); older graphs keyed by the name only
        paths.append(
            value[0] if isinstance(value, tuple) and value and isinstance(value[0], str) else key
        )
    if node.op == "call_module":
        paths.append(str(node.target))
    for path in paths:
        if path.startswith(prefix) and len(path) > len(prefix):
            # export marks a module's repeated calls as "name@1"; the module is the same
            return prefix + path[len(prefix) :].split(".")[0].split("@")[0]
    return None
