"""Model factories for docs/user-guide.md. Each returns ``(model, example_inputs)``;
run the guide's commands from this folder (``cd docs/examples``)."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    """The seed tutorial's block: Linear(n -> 2n) -> ReLU -> Linear(2n -> n)."""

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


def block_stack() -> tuple[nn.Module, torch.Tensor]:
    """The tutorial's workload with activations that matter: 32 blocks, width 128, batch 512."""
    torch.manual_seed(0)
    return Stack(blocks=32, width=128), torch.randn(512, 128, requires_grad=True)


def gpt2() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A small GPT-2 from a config (random weights, nothing downloaded). ``labels`` make the
    model return its own language-modelling loss, which autockpt differentiates."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=4,
        n_embd=128,
        n_head=4,
        n_positions=128,
        vocab_size=1000,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
    )
    model = GPT2LMHeadModel(config).train()
    input_ids = torch.randint(0, config.vocab_size, (8, 128))
    return model, {"input_ids": input_ids, "labels": input_ids.clone()}
