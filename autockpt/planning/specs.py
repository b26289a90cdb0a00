"""From the solver's stage ranges to what the rewrite and the plan record need.

The most delicate junction of the pipeline: solvers speak *stage* ranges of the chain, the
rewrite speaks *node* ranges of the captured graph, and selective recompute names kept
outputs by *operator calls*. :func:`segment_specs` translates all three at once, and the
plan records its result (``autockpt/planning/make_plan.py``), so that the rewrite reads
back exactly what the plan says (``autockpt.rewrite.apply.segment_specs_from_plan``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from autockpt.capture.captured import Capture
from autockpt.costs.problem import Chain
from autockpt.costs.profile import Profile
from autockpt.rewrite.segment import SegmentSpec
from solvers import Solution
from solvers.replay import MemoryTrace


def segment_specs(
    chain: Chain, prof: Profile, captured: Capture, solution: Solution, trace: MemoryTrace
) -> list[SegmentSpec]:
    """One :class:`~autockpt.rewrite.segment.SegmentSpec` per segment of ``solution``:

    * its stage range becomes the node range ``[first, stop)`` it covers;
    * it preserves the RNG state when any of its nodes draws random numbers (dropout), so
      that the recompute draws the forward's masks;
    * it restores the mutated buffers its nodes touch, and the parameters the forward
      writes in place (:func:`buffers_used`), so that they advance once per step and the
      recompute reads them as the forward did;
    * each kept node becomes the ``(node, operator, index)`` of its allocating operator call
      (:func:`kept_calls`): what the segment's selective-checkpoint policy matches.
    """
    mutated = set(prof.mutated_buffers)
    nodes = captured.compute_nodes()
    specs = []
    kept_per_segment = solution.kept or tuple(() for _ in solution.segments)
    for (start, end), kept in zip(solution.segments, kept_per_segment, strict=True):
        first, stop = chain.node_range(start, end)
        random = any(prof.nodes[i].random for i in range(first, stop))
        specs.append(
            SegmentSpec(
                first,
                stop,
                random,
                buffers_used(nodes[first:stop], mutated),
                kept_ops=tuple(
                    (nodes[i].name, op, index)
                    for i, op, index in kept_calls(trace, first, stop, kept)
                ),
            )
        )
    return specs


def kept_calls(
    trace: MemoryTrace, first: int, stop: int, kept: Sequence[int]
) -> list[tuple[int, str, int]]:
    """``(node, operator, index)`` of each kept node's allocating operator call, ``index``
    counting that operator's calls in the segment's forward from 0: the key the rewritten
    segment's selective-checkpoint policy matches calls by (autockpt/rewrite/segment.py)."""
    wanted = set(kept)
    counts: dict[str, int] = {}
    found = []
    for i in range(first, stop):
        for op in trace.forward_ops[i]:
            index = counts.get(op.name, 0)
            counts[op.name] = index + 1
            if i in wanted and op.allocations:
                found.append((i, op.name, index))
    return found


def buffers_used(nodes: Sequence[torch.fx.Node], mutated: set[str]) -> tuple[str, ...]:
    """Mutated buffers (and parameters the forward writes in place: NOTE [runtime:
    parameters the forward writes]) that a segment's nodes touch (via a module call or an
    attribute)."""
    used: set[str] = set()
    for node in nodes:
        if node.op == "call_module":
            prefix = f"{node.target}."
            used |= {name for name in mutated if name.startswith(prefix)}
        for arg in node.all_input_nodes:
            if arg.op == "get_attr" and arg.target in mutated:
                used.add(arg.target)
    return tuple(sorted(used))


def state_tensor(model: nn.Module, name: str) -> torch.Tensor:
    """The buffer or parameter ``name`` of ``model`` (a segment's ``restore_buffers`` names
    both: NOTE [runtime: parameters the forward writes])."""
    path, _, attr = name.rpartition(".")
    module = model.get_submodule(path)
    if attr in module._parameters:
        return module.get_parameter(attr)
    return module.get_buffer(attr)
