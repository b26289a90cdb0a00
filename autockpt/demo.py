"""The seed tutorial's workload: the block stack ``autockpt demo`` plans.

The tutorial this project grew from wraps each block of a 100-block
``Linear -> ReLU -> Linear`` stack in ``torch.utils.checkpoint`` by hand. The demo plans the
same workload under a budget instead, so it ships with the library (the rest of the model
zoo lives in ``autockpt_zoo``, outside it).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["Block", "BlockStack", "block_stack", "seed_block_stack"]


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
