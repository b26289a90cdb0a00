"""Model factories for the command-line tests (``tests.cli_models:NAME``)."""

from __future__ import annotations

import torch
from torch import nn


class ValueBranch(nn.Module):
    """Branches on a tensor *value* in the root's own code: neither fx nor export can
    capture it, so autockpt must name this file and line."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if x.sum() > 0:
            h = h * 2
        return self.b(h)


def value_branch() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return ValueBranch(), torch.ones(4, 16)
