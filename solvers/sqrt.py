"""The sqrt(L) baseline: ceil(sqrt(L)) equal segments, all checkpointed.

Reference: T. Chen, B. Xu, C. Zhang, C. Guestrin, "Training Deep Nets with Sublinear
Memory Cost", arXiv:1604.06174, 2016, Section 4.1: cutting an ``n``-layer chain into
``sqrt(n)`` segments and recomputing each from its stored input gives ``O(sqrt(n))``
memory for one extra forward pass.

This is a fixed baseline: it ignores the budget and the per-stage sizes (segments are
equal by stage *count*, the first ``L mod k`` one stage longer) and does not search. The
caller reports whether it fits. Complexity: ``O(L)``.
"""

from __future__ import annotations

import math

from .chain import ChainProblem

__all__ = ["sqrt_plan"]


def sqrt_plan(problem: ChainProblem) -> list[tuple[int, int]]:
    """``ceil(sqrt(L))`` contiguous segments of ``floor`` or ``ceil(L / k)`` stages."""
    n = problem.num_stages
    k = math.isqrt(n - 1) + 1  # ceil(sqrt(n)) for n >= 1
    size, extra = divmod(n, k)
    segments: list[tuple[int, int]] = []
    start = 0
    for i in range(k):
        end = start + size + (1 if i < extra else 0)
        segments.append((start, end))
        start = end
    return segments
