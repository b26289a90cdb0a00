"""Built-in model zoo: small, deterministic workloads that exercise autockpt end to end.

Every factory has the signature ``name(**overrides) -> (model, example_inputs)``:

* the model is freshly built under a fixed ``torch.manual_seed`` (override with ``seed=``), so
  two calls return identical parameters, buffers and inputs.  Note that this reseeds the global
  RNG, which also makes the first dropout mask after construction reproducible;
* the model is in train mode (dropout and BatchNorm behave as during training, which is where
  activation memory matters);
* ``example_inputs`` is a ``Tensor``, a ``tuple`` of positional arguments or a ``dict`` of
  keyword arguments; :func:`call_example` applies it to a model;
* the defaults are small (forward + backward well under 0.3 s on two CPU cores) while keeping
  saved activations at or above the parameter bytes (``block_stack``, kept at the tutorial's
  shape, saves only ~0.2x) and at least six checkpointable stages, so a checkpointing plan
  has something real to choose from.
  Keyword overrides (``blocks=``, ``width=``, ``batch=`` ...) scale a model up.

Each model is in the zoo because it stresses a different part of graph capture or memory
accounting; the class docstrings say which.  Only ``torch`` and the standard library are
imported here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from autockpt.demo import Block, BlockStack, block_stack, seed_block_stack

ExampleInputs: TypeAlias = Tensor | tuple[Any, ...] | dict[str, Any]
"""What a factory returns next to the model: one tensor, positional args or keyword args."""

ModelFactory: TypeAlias = Callable[..., tuple[nn.Module, ExampleInputs]]

__all__ = [
    "DEFAULT_MODEL",
    "Block",
    "BlockStack",
    "HEAVY_ZOO",
    "ZOO",
    "ExampleInputs",
    "ModelFactory",
    "block_stack",
    "call_example",
    "gpt",
    "gpt_checkpointed",
    "kwargs_model",
    "mlp_mixer",
    "param_heavy",
    "resnet",
    "root_shape_branch",
    "seed_block_stack",
    "square_mean",
    "two_in_two_out",
    "unet",
    "untraceable_submodule",
]


def call_example(model: nn.Module, example_inputs: ExampleInputs) -> Any:
    """Call ``model`` on ``example_inputs``: a tensor, a positional tuple or a kwargs dict."""
    if isinstance(example_inputs, Tensor):
        return model(example_inputs)
    if isinstance(example_inputs, tuple):
        return model(*example_inputs)
    if isinstance(example_inputs, Mapping):
        return model(**example_inputs)
    raise TypeError(f"unsupported example_inputs type: {type(example_inputs).__name__}")


# ---------------------------------------------------------------------------------------------
# 1. block_stack / seed_block_stack: the seed tutorial's workload, shipped with the library
#    (autockpt/demo.py, which the CLI demo plans)
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# 2. resnet
# ---------------------------------------------------------------------------------------------


class BasicBlock(nn.Module):
    """Residual block: two 3x3 conv + BatchNorm, projection shortcut when the shape changes."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )
        else:
            self.shortcut = nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += self.shortcut(x)
        return self.relu(out)


class ResNet(nn.Module):
    """Small CIFAR-style ResNet: stem, three stages of :class:`BasicBlock` s, pooled linear head.

    Exercises in-place ops (``ReLU(inplace=True)`` and ``out += shortcut``), whose saved
    tensors alias their inputs, BatchNorm running-stat buffers that are mutated in train mode
    (a recomputed forward updates them a second time), strided downsampling blocks with
    projection shortcuts, and a conv workload where activations dwarf parameters.
    """

    def __init__(self, width: int, blocks_per_stage: int, num_classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, 1, 1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
        )
        stages: list[nn.Module] = []
        in_channels = width
        for stage in range(3):
            out_channels = width * 2**stage
            for i in range(blocks_per_stage):
                stride = 2 if stage > 0 and i == 0 else 1
                stages.append(BasicBlock(in_channels, out_channels, stride))
                in_channels = out_channels
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_channels, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.stages(self.stem(x))
        return self.fc(torch.flatten(self.pool(x), 1))


def resnet(
    *,
    width: int = 16,
    blocks_per_stage: int = 2,
    num_classes: int = 10,
    batch: int = 8,
    image_size: int = 32,
    seed: int = 0,
) -> tuple[nn.Module, Tensor]:
    """ResNet with ``3 * blocks_per_stage`` residual blocks; input ``(batch, 3, size, size)``."""
    torch.manual_seed(seed)
    model = ResNet(width, blocks_per_stage, num_classes)
    x = torch.randn(batch, 3, image_size, image_size)
    return model.train(), x


# ---------------------------------------------------------------------------------------------
# 3. gpt / 10. gpt_checkpointed
# ---------------------------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with an explicit mask buffer and attention dropout."""

    bias: Tensor

    def __init__(self, dim: int, heads: int, block_size: int, dropout: float) -> None:
        super().__init__()
        if dim % heads != 0:
            raise ValueError(f"dim={dim} is not divisible by heads={heads}")
        self.heads = heads
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)
        mask = torch.tril(torch.ones(block_size, block_size))
        self.register_buffer("bias", mask.view(1, 1, block_size, block_size))

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        k = k.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        v = v.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = self.attn_dropout(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class GPTMLP(nn.Module):
    """Position-wise feed-forward: ``Linear(C, 4C) -> GELU -> Linear(4C, C) -> Dropout``."""

    def __init__(self, dim: int, dropout: float) -> None:
        super().__init__()
        self.c_fc = nn.Linear(dim, 4 * dim)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * dim, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class GPTBlock(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``."""

    def __init__(self, dim: int, heads: int, block_size: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, block_size, dropout)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = GPTMLP(dim, dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT-style decoder returning ``(logits, loss)``.

    Exercises: dropout everywhere (recomputation must replay the same RNG stream), a causal mask
    held as a buffer and sliced with a length read from the input (``x.size(1)``), the
    ``masked_fill``/``softmax`` attention pattern whose ``T x T`` scores grow quadratically
    with sequence length, a tied weight (``lm_head.weight is wte.weight``) that appears twice in
    the graph but must be counted once, integer (non-differentiable) inputs, and a tuple output.
    Plain ``torch.fx.symbolic_trace`` fails here (a real buffer indexed by a proxy length); a
    tracer with ``proxy_buffer_attributes = True`` and ``torch.export`` both succeed.

    With ``checkpoint_blocks=True`` every block already runs under
    ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``, the case in which
    autockpt should warn that the model is checkpointed by hand.
    """

    def __init__(
        self,
        vocab_size: int,
        block_size: int,
        layers: int,
        dim: int,
        heads: int,
        dropout: float,
        checkpoint_blocks: bool = False,
    ) -> None:
        super().__init__()
        self.block_size = block_size
        self.checkpoint_blocks = checkpoint_blocks
        self.wte = nn.Embedding(vocab_size, dim)
        self.wpe = nn.Embedding(block_size, dim)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(GPTBlock(dim, heads, block_size, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying
        nn.init.normal_(self.wte.weight, std=0.02)
        nn.init.normal_(self.wpe.weight, std=0.02)

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        T = idx.size(1)
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            if self.checkpoint_blocks:
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def gpt(
    *,
    layers: int = 4,
    dim: int = 64,
    heads: int = 4,
    vocab_size: int = 128,
    block_size: int = 64,
    batch: int = 4,
    seq_len: int = 32,
    dropout: float = 0.1,
    checkpoint_blocks: bool = False,
    seed: int = 0,
) -> tuple[nn.Module, tuple[Tensor, Tensor]]:
    """GPT decoder; inputs ``(idx, targets)``, both ``LongTensor(batch, seq_len)``.

    ``seq_len`` defaults to less than ``block_size`` so that slicing the mask buffer is not a
    no-op.
    """
    if seq_len > block_size:
        raise ValueError(f"seq_len={seq_len} exceeds block_size={block_size}")
    torch.manual_seed(seed)
    model = GPT(vocab_size, block_size, layers, dim, heads, dropout, checkpoint_blocks)
    idx = torch.randint(0, vocab_size, (batch, seq_len))
    targets = torch.randint(0, vocab_size, (batch, seq_len))
    return model.train(), (idx, targets)


def gpt_checkpointed(**overrides: Any) -> tuple[nn.Module, tuple[Tensor, Tensor]]:
    """:func:`gpt` with every block wrapped in non-reentrant ``torch.utils.checkpoint``.

    Same parameters and inputs as :func:`gpt` for the same overrides; autockpt should detect
    the existing checkpointing and warn.
    """
    return gpt(**{**overrides, "checkpoint_blocks": True})


# ---------------------------------------------------------------------------------------------
# 4. unet
# ---------------------------------------------------------------------------------------------


class DoubleConv(nn.Module):
    """``(Conv3x3 -> BatchNorm -> ReLU) x 2``, the U-Net building block."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(out_channels),
            nn.ReLU(),
            nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(out_channels),
            nn.ReLU(),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class UpBlock(nn.Module):
    """Transposed-conv upsampling, concatenation with the encoder skip, then :class:`DoubleConv`."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(in_channels, out_channels, 2, stride=2)
        self.conv = DoubleConv(2 * out_channels, out_channels)

    def forward(self, x: Tensor, skip: Tensor) -> Tensor:
        return self.conv(torch.cat([self.up(x), skip], dim=1))


class UNet(nn.Module):
    """2-D U-Net with three downsampling levels and concatenated long skip connections.

    The skips keep every encoder activation alive until the mirrored decoder level, so the
    graph is not a chain: the liveness of a tensor spans most of the network, the peak sits at
    the bottom of the U, and checkpointing an encoder stage frees less than its size suggests.
    Upsampling modules also take two tensor inputs.
    """

    def __init__(self, in_channels: int, out_channels: int, width: int) -> None:
        super().__init__()
        w = width
        self.enc1 = DoubleConv(in_channels, w)
        self.enc2 = DoubleConv(w, 2 * w)
        self.enc3 = DoubleConv(2 * w, 4 * w)
        self.pool = nn.MaxPool2d(2)
        self.bottleneck = DoubleConv(4 * w, 8 * w)
        self.up3 = UpBlock(8 * w, 4 * w)
        self.up2 = UpBlock(4 * w, 2 * w)
        self.up1 = UpBlock(2 * w, w)
        self.head = nn.Conv2d(w, out_channels, 1)

    def forward(self, x: Tensor) -> Tensor:
        s1 = self.enc1(x)
        s2 = self.enc2(self.pool(s1))
        s3 = self.enc3(self.pool(s2))
        x = self.bottleneck(self.pool(s3))
        x = self.up3(x, s3)
        x = self.up2(x, s2)
        x = self.up1(x, s1)
        return self.head(x)


def unet(
    *,
    width: int = 16,
    in_channels: int = 1,
    out_channels: int = 2,
    batch: int = 4,
    image_size: int = 32,
    seed: int = 0,
) -> tuple[nn.Module, Tensor]:
    """U-Net; input ``(batch, in_channels, size, size)``, ``size`` divisible by 8."""
    if image_size % 8 != 0:
        raise ValueError(f"image_size={image_size} must be divisible by 8 (three 2x poolings)")
    torch.manual_seed(seed)
    model = UNet(in_channels, out_channels, width)
    x = torch.randn(batch, in_channels, image_size, image_size)
    return model.train(), x


# ---------------------------------------------------------------------------------------------
# 5. two_in_two_out
# ---------------------------------------------------------------------------------------------


class ResidualMLP(nn.Module):
    """Pre-LayerNorm residual MLP: ``x + fc2(gelu(fc1(norm(x))))``."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class GatedTokenBlock(nn.Module):
    """Token-wise MLP on the ``y`` branch, gated by the ``x`` branch and scaled by a Python float.

    ``scale`` is a plain ``float`` argument with a default: capture must keep it a constant
    (or a non-tensor input) rather than trying to make it a tensor.
    """

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, width)
        self.gate = nn.Linear(width, width)

    def forward(self, y: Tensor, context: Tensor, scale: float = 0.5) -> Tensor:
        update = self.fc2(self.act(self.fc1(self.norm(y))))
        gate = torch.sigmoid(self.gate(context)).unsqueeze(1)
        return y + scale * update * gate


class TwoInTwoOut(nn.Module):
    """Two inputs of different shapes, two interacting branches, a dict of two outputs.

    Exercises multi-input/multi-output capture: ``x`` is ``(B, Fx)`` and requires grad, ``y``
    is ``(B, L, Fy)`` and does not; at every depth the ``x`` branch reads a pooled summary of
    ``y`` and the ``y`` branch is gated by ``x``, so neither branch can be scheduled on its own.
    ``forward`` takes a non-tensor ``scale: float = 0.5`` and passes it through to the ``y``
    branch, and returns ``{"a": (B, out), "b": (B, L, width)}``.
    """

    def __init__(
        self, x_features: int, y_features: int, width: int, depth: int, out_features: int
    ) -> None:
        super().__init__()
        self.x_in = nn.Linear(x_features, width)
        self.y_in = nn.Linear(y_features, width)
        self.y_to_x = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.x_blocks = nn.ModuleList(ResidualMLP(width, 4 * width) for _ in range(depth))
        self.y_blocks = nn.ModuleList(GatedTokenBlock(width, 2 * width) for _ in range(depth))
        self.head_a = nn.Linear(width, out_features)
        self.norm_b = nn.LayerNorm(width)

    def forward(self, x: Tensor, y: Tensor, scale: float = 0.5) -> dict[str, Tensor]:
        hx = self.x_in(x)
        hy = self.y_in(y)
        for y_to_x, x_block, y_block in zip(self.y_to_x, self.x_blocks, self.y_blocks, strict=True):
            hx = x_block(hx + y_to_x(hy.mean(dim=1)))
            hy = y_block(hy, hx, scale=scale)
        return {"a": self.head_a(hx), "b": self.norm_b(hy)}


def two_in_two_out(
    *,
    width: int = 64,
    depth: int = 4,
    batch: int = 32,
    tokens: int = 16,
    x_features: int = 48,
    y_features: int = 24,
    out_features: int = 10,
    seed: int = 0,
) -> tuple[nn.Module, tuple[Tensor, Tensor]]:
    """Two-branch model; inputs ``(x, y)`` with ``x: (batch, x_features)`` requiring grad and
    ``y: (batch, tokens, y_features)`` not; ``scale`` is left at its default."""
    torch.manual_seed(seed)
    model = TwoInTwoOut(x_features, y_features, width, depth, out_features)
    x = torch.randn(batch, x_features, requires_grad=True)
    y = torch.randn(batch, tokens, y_features)
    return model.train(), (x, y)


# ---------------------------------------------------------------------------------------------
# 6. untraceable_submodule
# ---------------------------------------------------------------------------------------------


class ShapeDependentRouter(nn.Module):
    """Submodule whose Python control flow depends on its input's *shape*, so ``torch.fx``
    (which traces shapes as proxies) cannot trace it, while every run on inputs of one shape
    does the same work.

    It picks a sign from the batch size's parity and runs a refinement loop a
    width-dependent number of times (bounded by ``max_steps``).  Both paths use the same
    parameters.  (Control flow on tensor *values* would make the step's memory depend on the
    data, which one example cannot bound: autockpt refuses such a model with a TraceError.)
    """

    def __init__(self, width: int, max_steps: int = 3) -> None:
        super().__init__()
        self.max_steps = max_steps
        self.proj = nn.Linear(width, width)
        self.refine = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[0] % 2 == 0:
            x = x + torch.tanh(self.proj(x))
        else:
            x = x - torch.tanh(self.proj(x))
        steps = min(x.shape[-1] % self.max_steps + 1, self.max_steps)
        for _ in range(steps):
            x = x + 0.5 * torch.tanh(self.refine(x))
        return x


class UntraceableSubmodule(nn.Module):
    """Traceable residual MLP stack with one :class:`ShapeDependentRouter` in the middle.

    ``torch.fx.symbolic_trace`` fails on the whole model, but succeeds once the router (the
    ``router`` attribute, class :attr:`LEAF_MODULE`) is declared a leaf, leaving the blocks on
    both sides available for checkpointing.  Tests the capture layer's fallback of treating an
    untraceable submodule as an opaque node.
    """

    LEAF_MODULE: type[nn.Module] = ShapeDependentRouter

    def __init__(self, in_features: int, width: int, blocks: int, num_classes: int) -> None:
        super().__init__()
        half = blocks // 2
        self.in_proj = nn.Linear(in_features, width)
        self.before = nn.Sequential(*(ResidualMLP(width, 4 * width) for _ in range(half)))
        self.router = ShapeDependentRouter(width)
        self.after = nn.Sequential(*(ResidualMLP(width, 4 * width) for _ in range(blocks - half)))
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.before(self.in_proj(x))
        x = self.router(x)
        return self.head(self.after(x))


def untraceable_submodule(
    *,
    width: int = 64,
    blocks: int = 6,
    batch: int = 128,
    in_features: int = 32,
    num_classes: int = 10,
    seed: int = 0,
) -> tuple[nn.Module, Tensor]:
    """MLP stack around a shape-dependent router; input ``(batch, in_features)``."""
    torch.manual_seed(seed)
    model = UntraceableSubmodule(in_features, width, blocks, num_classes)
    x = torch.randn(batch, in_features)
    return model.train(), x


# ---------------------------------------------------------------------------------------------
# 7. root_shape_branch
# ---------------------------------------------------------------------------------------------


class RootShapeBranch(nn.Module):
    """Model whose *root* ``forward`` branches and loops on the input's shape.

    ``if x.shape[-1] > self.width`` decides whether to project the features, and a recurrent
    head unrolls ``for t in range(x.size(1))`` over the sequence.  ``torch.fx.symbolic_trace``
    fails at the root (shapes are proxies, and there is no submodule to declare a leaf), while
    ``torch.export.export(..., strict=False)`` specialises the shapes and succeeds.  The
    unrolled recurrence is also a long chain of small ops after the block stack.
    """

    def __init__(self, in_features: int, width: int, blocks: int, num_classes: int) -> None:
        super().__init__()
        self.width = width
        self.in_proj = nn.Linear(in_features, width)
        self.blocks = nn.ModuleList(ResidualMLP(width, 4 * width) for _ in range(blocks))
        self.cell = nn.Linear(2 * width, width)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] > self.width:
            x = self.in_proj(x)
        for block in self.blocks:
            x = block(x)
        state = x.new_zeros(x.size(0), self.width)
        for t in range(x.size(1)):
            state = torch.tanh(self.cell(torch.cat([x[:, t], state], dim=-1)))
        return self.head(state)


def root_shape_branch(
    *,
    width: int = 64,
    blocks: int = 6,
    batch: int = 16,
    seq_len: int = 12,
    in_features: int = 96,
    num_classes: int = 10,
    seed: int = 0,
) -> tuple[nn.Module, Tensor]:
    """Shape-branching model; input ``(batch, seq_len, in_features)``.

    ``in_features`` must exceed ``width`` so the projection branch (and its parameters) is used.
    """
    if in_features <= width:
        raise ValueError(f"in_features={in_features} must exceed width={width}")
    torch.manual_seed(seed)
    model = RootShapeBranch(in_features, width, blocks, num_classes)
    x = torch.randn(batch, seq_len, in_features)
    return model.train(), x


# ---------------------------------------------------------------------------------------------
# 8. mlp_mixer
# -- roots that cannot be captured whole (their submodule calls are planned as units) ------


class DropoutMLP(nn.Module):
    """A pre-norm MLP block with dropout and a residual: the layer of the two models below."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.drop(self.fc2(torch.relu(self.fc1(self.norm(x)))))


class LayerDropEncoder(nn.Module):
    """The Wav2Vec2/HuBERT encoder pattern: the root's own loop draws and skips layers, so
    the root cannot be captured and its layers are planned as units."""

    def __init__(self, dim: int = 32, depth: int = 6, p: float = 0.5, features: int = 8) -> None:
        super().__init__()
        self.embed = nn.Linear(features, dim)
        self.layers = nn.ModuleList(DropoutMLP(dim) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x)
        for layer in self.layers:
            if not (self.training and torch.rand([]) < self.p):
                h = layer(h)
        return self.norm(h)


class CheckedLM(nn.Module):
    """The Wav2Vec2ForCTC pattern: a label check by value before the blocks and the loss."""

    def __init__(self, vocab: int = 64, dim: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.vocab = vocab
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(DropoutMLP(dim) for _ in range(depth))
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: Tensor, labels: Tensor) -> Tensor:
        if labels.max() >= self.vocab:
            raise ValueError("labels must be below the vocabulary size")
        h = self.embed(idx)
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


# ---------------------------------------------------------------------------------------------


class MixerLayer(nn.Module):
    """Token-mixing MLP across patches (via transposes), then channel-mixing MLP across features."""

    def __init__(self, tokens: int, channels: int, token_hidden: int, channel_hidden: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(channels)
        self.token_mlp = nn.Sequential(
            nn.Linear(tokens, token_hidden), nn.GELU(), nn.Linear(token_hidden, tokens)
        )
        self.norm2 = nn.LayerNorm(channels)
        self.channel_mlp = nn.Sequential(
            nn.Linear(channels, channel_hidden), nn.GELU(), nn.Linear(channel_hidden, channels)
        )

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.token_mlp(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channel_mlp(self.norm2(x))


class MLPMixer(nn.Module):
    """MLP-Mixer: patch-embedding conv, a stack of :class:`MixerLayer` s, pooled linear head.

    Exercises non-contiguous (transposed) activations flowing into ``Linear``, where saved
    tensors are views and their storage size differs from their logical size, plus a
    conv -> flatten -> transpose reshaping at the stem.
    """

    def __init__(
        self, image_size: int, patch: int, channels: int, depth: int, num_classes: int
    ) -> None:
        super().__init__()
        tokens = (image_size // patch) ** 2
        self.patch_embed = nn.Conv2d(3, channels, patch, stride=patch)
        self.layers = nn.Sequential(
            *(MixerLayer(tokens, channels, tokens // 2, 4 * channels) for _ in range(depth))
        )
        self.norm = nn.LayerNorm(channels)
        self.head = nn.Linear(channels, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = self.norm(self.layers(x))
        return self.head(x.mean(dim=1))


def mlp_mixer(
    *,
    channels: int = 64,
    depth: int = 6,
    patch: int = 4,
    batch: int = 8,
    image_size: int = 32,
    num_classes: int = 10,
    seed: int = 0,
) -> tuple[nn.Module, Tensor]:
    """MLP-Mixer over ``(image_size / patch)**2`` patches; input ``(batch, 3, size, size)``."""
    if image_size % patch != 0:
        raise ValueError(f"image_size={image_size} must be divisible by patch={patch}")
    torch.manual_seed(seed)
    model = MLPMixer(image_size, patch, channels, depth, num_classes)
    x = torch.randn(batch, 3, image_size, image_size)
    return model.train(), x


# ---------------------------------------------------------------------------------------------
# 9. kwargs_model
# ---------------------------------------------------------------------------------------------


@dataclass
class KwargsModelOutput:
    """HF-``ModelOutput``-like result: ``loss`` (``None`` without labels) and ``logits``.

    A custom container rather than a tensor or tuple, so capture has to see through it.  Like
    HF's ``ModelOutput`` it is registered as a pytree node (here with
    ``torch.export.register_dataclass``) so ``torch.export`` accepts it; ``torch.fx`` records
    dataclass outputs natively.
    """

    loss: Tensor | None
    logits: Tensor


torch.export.register_dataclass(KwargsModelOutput)


_MASKED_SCORE = -1.0e4
"""Additive attention bias for padding (BERT's constant): finite, so it stays fp16-safe, and a
Python float, so the mask path has no ``torch.finfo(dtype)`` call that fx cannot trace."""


class EncoderLayer(nn.Module):
    """Bidirectional pre-LN transformer layer taking an additive attention-mask bias."""

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        if dim % heads != 0:
            raise ValueError(f"dim={dim} is not divisible by heads={heads}")
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(dropout)
        )
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, mask_bias: Tensor | None = None) -> Tensor:
        B, T, C = x.size()
        qkv = self.qkv(self.norm1(x)).view(B, T, 3, self.heads, C // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(C // self.heads)
        if mask_bias is not None:
            scores = scores + mask_bias
        att = self.dropout(scores.softmax(dim=-1))
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        x = x + self.dropout(self.out(y))
        return x + self.mlp(self.norm2(x))


class KwargsModel(nn.Module):
    """HF-style token classifier: ``forward(input_ids, attention_mask=None, labels=None)``.

    Exercises keyword-only example inputs, optional arguments that change the graph (the mask
    bias and the loss exist only when given), an integer mask turned into an additive float bias
    (``(1 - mask) * -1e4``), ``ignore_index=-100`` labels on padding, dropout, and a
    dataclass output (:class:`KwargsModelOutput`) read through ``.loss`` / ``.logits``.
    """

    def __init__(
        self,
        vocab_size: int,
        max_len: int,
        layers: int,
        dim: int,
        heads: int,
        num_labels: int,
        dropout: float,
    ) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, dim)
        self.pos_emb = nn.Embedding(max_len, dim)
        self.dropout = nn.Dropout(dropout)
        self.layers = nn.ModuleList(EncoderLayer(dim, heads, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.classifier = nn.Linear(dim, num_labels)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        labels: Tensor | None = None,
    ) -> KwargsModelOutput:
        pos = torch.arange(input_ids.size(1), device=input_ids.device)
        h = self.dropout(self.tok_emb(input_ids) + self.pos_emb(pos))
        mask_bias = None
        if attention_mask is not None:
            mask = attention_mask[:, None, None, :].to(h.dtype)
            mask_bias = (1.0 - mask) * _MASKED_SCORE
        for layer in self.layers:
            h = layer(h, mask_bias)
        logits = self.classifier(self.norm(h))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits.view(-1, logits.size(-1)), labels.view(-1), ignore_index=-100
            )
        return KwargsModelOutput(loss=loss, logits=logits)


def kwargs_model(
    *,
    layers: int = 6,
    dim: int = 64,
    heads: int = 4,
    vocab_size: int = 128,
    num_labels: int = 8,
    batch: int = 4,
    seq_len: int = 32,
    dropout: float = 0.1,
    seed: int = 0,
) -> tuple[nn.Module, dict[str, Tensor]]:
    """Token classifier; inputs ``{"input_ids", "attention_mask", "labels"}``.

    Rows are right-padded to different lengths (row ``i`` keeps ``seq_len - 4 * i`` tokens,
    at least one); padded positions have mask 0 and label -100.
    """
    torch.manual_seed(seed)
    model = KwargsModel(vocab_size, seq_len, layers, dim, heads, num_labels, dropout)
    input_ids = torch.randint(0, vocab_size, (batch, seq_len))
    lengths = torch.tensor([max(1, seq_len - 4 * i) for i in range(batch)])
    attention_mask = (torch.arange(seq_len)[None, :] < lengths[:, None]).long()
    labels = torch.randint(0, num_labels, (batch, seq_len)).masked_fill(attention_mask == 0, -100)
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    return model.train(), inputs


class DenseUnit(nn.Module):
    """``x + down(tanh(up(x)))``: most of its bytes are parameters."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class ParamHeavy(nn.Module):
    """Repeated dense units between an input and an output projection (the root), returning
    the output: a model whose units' parameters are a large part of an FSDP2 rank's peak, so
    which of them are gathered when is what the per-rank memory model is judged on
    (``reshard_after_forward``, segments over several units). Its loss runs outside it
    (:func:`square_mean`)."""

    def __init__(self, dim: int, hidden: int, layers: int, features: int) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(features, dim), nn.Linear(dim, features)
        self.layers = nn.ModuleList(DenseUnit(dim, hidden) for _ in range(layers))

    def forward(self, x: Tensor) -> Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def square_mean(output: Tensor) -> Tensor:
    """The loss :func:`param_heavy` is trained with."""
    return output.square().mean()


def param_heavy(
    *,
    layers: int = 6,
    dim: int = 256,
    hidden: int = 1024,
    features: int = 512,
    batch: int = 256,
    seed: int = 0,
) -> tuple[nn.Module, tuple[Tensor]]:
    """:class:`ParamHeavy` (six units of 2.1 MB, a root of 1 MB) and one batch of inputs."""
    torch.manual_seed(seed)
    model = ParamHeavy(dim, hidden, layers, features)
    return model.train(), (torch.randn(batch, features),)


# ---------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------

ZOO: dict[str, ModelFactory] = {
    "block_stack": block_stack,
    "resnet": resnet,
    "gpt": gpt,
    "unet": unet,
    "two_in_two_out": two_in_two_out,
    "untraceable_submodule": untraceable_submodule,
    "root_shape_branch": root_shape_branch,
    "mlp_mixer": mlp_mixer,
    "kwargs_model": kwargs_model,
    "gpt_checkpointed": gpt_checkpointed,
}
"""Small models, safe to build and run in a loop (each forward + backward well under 0.3 s)."""

HEAVY_ZOO: dict[str, ModelFactory] = {
    "seed_block_stack": seed_block_stack,
}
"""Full-size models, kept out of :data:`ZOO` so iterating it never allocates gigabytes; build
them with ``device="meta"`` unless the memory is really there."""

DEFAULT_MODEL = "block_stack"
