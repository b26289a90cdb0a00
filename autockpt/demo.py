"""The seed tutorial's workload and what its user does by hand: ``autockpt demo``.

The tutorial this project grew from wraps each block of a 100-block
``Linear -> ReLU -> Linear`` stack in ``torch.utils.checkpoint`` by hand. The demo plans the
same workload under a budget instead, so it ships with the library (the rest of the model
zoo lives in ``autockpt_zoo``, outside it), with the two things a user does without
autockpt: checkpoint every block (:func:`checkpoint_every_block`), and find the largest
batch by trying sizes until one does not fit (:func:`largest_by_measuring`). The demo and
``autockpt bench fit`` put autockpt's answers beside them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from autockpt.costs.blocks import find_repeated_blocks
from autockpt.measure import interleaved_seconds

__all__ = [
    "Block",
    "BlockStack",
    "CheckpointedBlock",
    "block_stack",
    "checkpoint_every_block",
    "interleaved_seconds",
    "largest_by_measuring",
    "seed_block_stack",
]


class Block(nn.Module):
    """One stage of the seed tutorial: ``Linear(n, 2n) -> ReLU -> Linear(2n, n)``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear1 = nn.Linear(width, 2 * width)
        self.relu = nn.ReLU()
        self.linear2 = nn.Linear(2 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear2(self.relu(self.linear1(x)))


class BlockStack(nn.Module):
    """The seed tutorial's workload: a plain chain of identical :class:`Block` s in ``layers``.

    The reference case: a purely sequential, fx-traceable graph whose optimal checkpointing
    schedule is known in closed form (every block has the same cost and activation size), and
    whose input requires grad, so the input's own gradient must survive rewriting.
    """

    def __init__(self, blocks: int, width: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(width) for _ in range(blocks))

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def block_stack(
    *,
    blocks: int = 16,
    width: int = 256,
    batch: int = 64,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> tuple[nn.Module, Tensor]:
    """Stack of ``blocks`` MLP blocks; input ``randn(batch, width, requires_grad=True)``.

    ``device="meta"`` builds parameters and input without allocating storage, which is how the
    full-size :func:`seed_block_stack` can be planned on a machine that cannot hold it.
    """
    torch.manual_seed(seed)
    with torch.device(device):
        model = BlockStack(blocks, width)
        x = torch.randn(batch, width, requires_grad=True)
    return model.train(), x


def seed_block_stack(
    *, device: str | torch.device = "cpu", seed: int = 0
) -> tuple[nn.Module, Tensor]:
    """The seed tutorial at its own size: 100 blocks, width 2048, batch 8.

    About 1.68 G parameters (~6.3 GiB in fp32), so it is not in :data:`ZOO`; pass
    ``device="meta"`` to build it for planning without allocating memory.
    """
    return block_stack(blocks=100, width=2048, batch=8, device=device, seed=seed)


class CheckpointedBlock(nn.Module):
    """``checkpoint(inner, *args, use_reentrant=False)``: one block checkpointed by hand."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(self.inner, *args, use_reentrant=False, **kwargs)


def checkpoint_every_block(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with every repeated block (``autockpt.costs.blocks``: the
    transformer layers, the tutorial's blocks) wrapped in non-reentrant ``checkpoint``: what
    the tutorial does by hand, and what ``gradient_checkpointing_enable()`` does."""
    wrapped = copy.deepcopy(model)
    blocks = find_repeated_blocks(wrapped)
    if blocks is None:
        raise ValueError(f"{type(model).__name__} has no repeated blocks to checkpoint")
    for path in blocks.children:
        parent_path, _, leaf = path.rpartition(".")
        parent = wrapped.get_submodule(parent_path) if parent_path else wrapped
        block = parent.get_submodule(leaf)
        if isinstance(parent, (nn.ModuleList, nn.Sequential)):
            parent[int(leaf)] = CheckpointedBlock(block)
        else:
            setattr(parent, leaf, CheckpointedBlock(block))
    return wrapped


def largest_by_measuring(
    peak_at: Callable[[int], int], budget_bytes: int, start: int = 1
) -> tuple[int, int]:
    """The largest size whose measured peak fits, found the way a user finds it without
    autockpt: real steps at doubling sizes from ``start`` until one does not fit, then
    halving the interval. Returns ``(size, steps run)`` (0 when ``start`` does not fit).
    On a GPU each size that does not fit is an out-of-memory error to recover from."""
    runs, low, high, size = 0, 0, None, start
    while high is None:
        runs += 1
        if peak_at(size) <= budget_bytes:
            low, size = size, 2 * size
        else:
            high = size
    while high - low > 1:
        middle = (low + high) // 2
        runs += 1
        if peak_at(middle) <= budget_bytes:
            low = middle
        else:
            high = middle
    return low, runs
