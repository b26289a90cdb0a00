"""The user guide's first model (docs/user-guide.md, "Your first model"): a GPT written the
way most training code writes one — it returns logits, and the loop computes the loss —
planned under a budget with the loss and the optimizer the loop uses, then trained.

Run from this folder: ``python first_model.py`` (about a minute on a laptop CPU).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.nn import functional as F

import autockpt


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, dim = x.shape
        q, k, v = self.qkv(x).split(dim, dim=-1)
        q, k, v = (t.view(batch, tokens, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, tokens, dim))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, dropout)
        self.mlp = nn.Sequential(
            nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(
        self, vocab: int = 4096, context: int = 128, dim: int = 128, depth: int = 6, heads: int = 4
    ) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(context, dim)
        self.drop = nn.Dropout(0.1)
        self.blocks = nn.ModuleList(Block(dim, heads, 0.1) for _ in range(depth))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.tokens(idx) + self.positions(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))  # logits: the loss is the training loop's


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def batch(size: int = 16, context: int = 128, vocab: int = 4096) -> tuple[torch.Tensor, ...]:
    data = torch.randint(0, vocab, (size, context + 1))
    return data[:, :-1], data[:, 1:]  # inputs, and the next token of each


def first_model() -> tuple[nn.Module, torch.Tensor, object]:
    """The command line's factory: (model, example_inputs, loss_fn)."""
    torch.manual_seed(0)
    idx, targets = batch()
    return GPT(), idx, functools.partial(next_token_loss, targets=targets)


def main(budget_gb: float = 0.2, steps: int = 3) -> None:
    torch.manual_seed(0)
    model = GPT()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    idx, targets = batch()
    loss_fn = functools.partial(next_token_loss, targets=targets)  # the loss the loop uses

    fast = autockpt.optimize(model, (idx,), budget_gb=budget_gb, loss_fn=loss_fn, optimizer=opt)
    print(fast.plan.summary())

    for step in range(steps):  # the loop the budget covers: any batch of this size
        idx, targets = batch()
        opt.zero_grad()
        loss = next_token_loss(fast(idx), targets)
        loss.backward()
        opt.step()
        print(f"step {step}: loss {loss.item():.3f}")
    fast.plan.save("first_model_plan.json")


if __name__ == "__main__":
    main()
