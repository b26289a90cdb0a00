"""Model factories for the command-line tests (``tests.cli_models:NAME``)."""

from __future__ import annotations

import torch
from torch import nn


class ValueBranch(nn.Module):
    """Branches on a tensor *value* in the root's own code and holds its weights itself (no
    submodule to plan inside instead): neither fx nor export can capture it, so autockpt
    must name this file and line."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(16, 16) / 4)
        self.b = nn.Parameter(torch.randn(16, 16) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.a
        if x.sum() > 0:
            h = h * 2
        return h @ self.b


def value_branch() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return ValueBranch(), torch.ones(4, 16)


class PatchAttentionBlock(nn.Module):
    """Pre-norm attention (written out, no fused kernel) plus a GELU MLP with dropout."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, 4 * dim), nn.GELU(), nn.Dropout(0.1), nn.Linear(4 * dim, dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        q, k, v = (
            t.reshape(batch, tokens, self.heads, dim // self.heads).transpose(1, 2)
            for t in (q, k, v)
        )
        weights = torch.softmax(q @ k.transpose(-2, -1) / (dim // self.heads) ** 0.5, dim=-1)
        mixed = (weights @ v).transpose(1, 2).reshape(batch, tokens, dim)
        x = x + self.proj(mixed)
        return x + self.mlp(self.norm2(x))


class TinyPatchTransformer(nn.Module):
    """A small vision transformer: conv patch embedding, a Sequential of blocks, a pooled
    classifier head. Not part of ``autockpt.zoo``: the command-line tests use it as a model
    the library was not written against."""

    def __init__(self, depth: int = 6, dim: int = 64, heads: int = 4, patch: int = 4) -> None:
        super().__init__()
        self.embed = nn.Conv2d(3, dim, kernel_size=patch, stride=patch)
        self.position = nn.Parameter(torch.zeros(1, (32 // patch) ** 2, dim))
        self.blocks = nn.Sequential(*(PatchAttentionBlock(dim, heads) for _ in range(depth)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.embed(images).flatten(2).transpose(1, 2) + self.position
        x = self.blocks(x)
        return self.head(self.norm(x).mean(dim=1))


def tiny_patch_transformer() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return TinyPatchTransformer(), torch.randn(16, 3, 32, 32)


def not_a_module() -> tuple[object, torch.Tensor]:
    """A factory that returns something other than a module first (a user mistake)."""
    return object(), torch.ones(2)


class LogitsLM(nn.Module):
    """A small causal LM that returns logits, as most third-party model code does; the loss
    (cross-entropy) is the training loop's. Its vocabulary is wide for its width, so the
    loss's own log-probabilities are a large share of the step's peak."""

    def __init__(self, vocab: int = 2048, dim: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.Sequential(*(PatchAttentionBlock(dim, 4) for _ in range(depth)))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)))


def next_token_loss(logits: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the logits against a fixed target sequence (``--loss`` form: a
    function of the model's output alone)."""
    targets = torch.arange(logits.shape[0] * logits.shape[1]) % logits.shape[-1]
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets)


def logits_lm() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return LogitsLM(), torch.randint(0, 2048, (8, 64))


def logits_lm_with_loss() -> tuple[nn.Module, torch.Tensor, object]:
    """The same model and inputs, with the loss the loop trains with as the third item."""
    model, tokens = logits_lm()
    return model, tokens, next_token_loss
