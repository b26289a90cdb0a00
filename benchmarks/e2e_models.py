"""Workloads for the end-to-end benchmark (:mod:`benchmarks.e2e`), and how users checkpoint them.

Each :class:`Case` builds a model from a fixed seed (every call gives identical parameters and
inputs, so each method gets its own copy of the same model) and says where its repeated
blocks are, which is what the hand-written baselines need:

* per-block checkpointing wraps every block in
  ``torch.utils.checkpoint.checkpoint(block, ..., use_reentrant=False)`` — what Hugging Face's
  ``gradient_checkpointing_enable`` does (and, for the Hugging Face model, *is* that call);
* ``checkpoint_sequential`` needs the blocks to form a chain of single-tensor modules; where
  they do not (U-Net skips, a library's own layer loop), :attr:`Case.sequential_reason` says
  why;
* selective per-block checkpointing (:func:`op_policy`): the same per-block wrapper with a
  ``context_fn`` from ``create_selective_checkpoint_contexts`` that keeps matmul and attention
  outputs, either all of them or, as torchtitan's op-level policy does, all but every second
  projection matmul.

Models are written with ``torch`` only: a GPT-2-style decoder (the zoo's :class:`GPT`), a
Llama-style decoder (RMSNorm, rotary position embedding, SwiGLU MLP, grouped-query attention),
a ResNet, the seed's block stack, a U-Net, and a held-out model the benchmark was not tuned
on (a Hugging Face ViT built from a config with random weights when ``transformers`` is
installed, else the zoo's MLP-Mixer). Sizes are picked so that activations dominate the
step's memory and one block's forward takes many times the ~0.1 ms fixed cost of a
checkpoint call, while the whole CPU run stays within minutes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    checkpoint_sequential,
    create_selective_checkpoint_contexts,
)

from autockpt_zoo.toy import block_stack, gpt, mlp_mixer, resnet, unet

# ---------------------------------------------------------------------------------------------
# Llama-style decoder
# ---------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale (no mean subtraction, no bias)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary_tables(seq_len: int, head_dim: int, theta: float = 10000.0) -> tuple[Tensor, Tensor]:
    """cos / sin tables of rotary position embedding, shape ``(seq_len, head_dim)``."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos(), angles.sin()


def _rotate_half(x: Tensor) -> Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class LlamaAttention(nn.Module):
    """Causal attention with rotary embedding and grouped-query heads (``kv_heads`` < ``heads``:
    each key/value head serves ``heads // kv_heads`` query heads)."""

    cos: Tensor
    sin: Tensor

    def __init__(self, dim: int, heads: int, kv_heads: int, seq_len: int) -> None:
        super().__init__()
        if dim % heads or heads % kv_heads:
            raise ValueError(f"dim={dim}, heads={heads}, kv_heads={kv_heads} do not divide")
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)
        cos, sin = rotary_tables(seq_len, self.head_dim)
        # Tables cover exactly the benchmark's sequence length, so no slicing by a traced size.
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q = self.q_proj(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        # back to the activations' dtype, as torchtitan's rotary embedding does: under FSDP2's
        # bfloat16 policy the tables (buffers) stay float32 (benchmarks/llama_ranks.py)
        q = (q * self.cos + _rotate_half(q) * self.sin).type_as(x)
        k = (k * self.cos + _rotate_half(k) * self.sin).type_as(x)
        groups = self.heads // self.kv_heads
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, C))


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    """Pre-norm decoder layer: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int, seq_len: int) -> None:
        super().__init__()
        self.input_norm = RMSNorm(dim)
        self.attn = LlamaAttention(dim, heads, kv_heads, seq_len)
        self.post_attention_norm = RMSNorm(dim)
        self.mlp = SwiGLU(dim, hidden)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.input_norm(x))
        return x + self.mlp(self.post_attention_norm(x))


class Llama(nn.Module):
    """Llama-style decoder returning the next-token cross-entropy loss."""

    def __init__(
        self,
        vocab_size: int,
        layers: int,
        dim: int,
        heads: int,
        kv_heads: int,
        hidden: int,
        seq_len: int,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(
            LlamaBlock(dim, heads, kv_heads, hidden, seq_len) for _ in range(layers)
        )
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab_size, bias=False)
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, idx: Tensor, targets: Tensor) -> Tensor:
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def llama(
    *,
    layers: int = 8,
    dim: int = 256,
    heads: int = 8,
    kv_heads: int = 2,
    hidden: int = 688,
    vocab_size: int = 512,
    batch: int = 8,
    seq_len: int = 128,
    seed: int = 0,
) -> tuple[nn.Module, tuple[Tensor, Tensor]]:
    """Llama-style decoder; inputs ``(idx, targets)``, both ``LongTensor(batch, seq_len)``."""
    torch.manual_seed(seed)
    model = Llama(vocab_size, layers, dim, heads, kv_heads, hidden, seq_len)
    idx = torch.randint(0, vocab_size, (batch, seq_len))
    targets = torch.randint(0, vocab_size, (batch, seq_len))
    return model.train(), (idx, targets)


# ---------------------------------------------------------------------------------------------
# Held-out model: a Hugging Face ViT (random weights from a config)
# ---------------------------------------------------------------------------------------------


def hf_vit(
    *,
    layers: int = 6,
    dim: int = 192,
    heads: int = 3,
    image_size: int = 64,
    patch_size: int = 8,
    batch: int = 16,
    seed: int = 0,
) -> tuple[nn.Module, dict[str, Tensor]]:
    """``transformers.ViTForImageClassification`` from a config; input ``{"pixel_values"}``."""
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(seed)
    config = ViTConfig(
        hidden_size=dim,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * dim,
        image_size=image_size,
        patch_size=patch_size,
        num_labels=10,
        attn_implementation="eager",
    )
    model = ViTForImageClassification(config)
    return model.train(), {"pixel_values": torch.randn(batch, 3, image_size, image_size)}


def _has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


# ---------------------------------------------------------------------------------------------
# How users checkpoint by hand
# ---------------------------------------------------------------------------------------------


class CheckpointedBlock(nn.Module):
    """``checkpoint(inner, *args, use_reentrant=False[, context_fn=...])``: per-block
    checkpointing, selective when ``context_fn`` is given."""

    def __init__(self, inner: nn.Module, context_fn: Callable[[], Any] | None = None) -> None:
        super().__init__()
        self.inner = inner
        self.context_fn = context_fn

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.context_fn is None:
            return checkpoint(self.inner, *args, use_reentrant=False, **kwargs)
        return checkpoint(
            self.inner, *args, use_reentrant=False, context_fn=self.context_fn, **kwargs
        )


class SequentialCheckpointed(nn.Module):
    """``checkpoint_sequential(blocks, segments, x, use_reentrant=False)``; like torch's own
    helper, the last segment runs without checkpointing."""

    def __init__(self, blocks: nn.Sequential, segments: int) -> None:
        super().__init__()
        self.blocks = blocks
        self.segments = segments

    def forward(self, x: Tensor) -> Tensor:
        return checkpoint_sequential(self.blocks, self.segments, x, use_reentrant=False)


@dataclass(frozen=True)
class Case:
    """One benchmark workload: its factory and where its blocks are."""

    name: str
    build: Callable[[], tuple[nn.Module, Any]]
    blocks: str
    """Dotted path of the ModuleList / Sequential holding the repeated blocks, or, when the
    blocks are separate attributes, a comma-separated list of their paths."""
    description: str
    sequential_reason: str | None = None
    """Why ``checkpoint_sequential`` does not apply (None: it does)."""
    hf_gradient_checkpointing: bool = False
    held_out: bool = False
    notes: tuple[str, ...] = field(default=())

    def block_paths(self, model: nn.Module) -> list[str]:
        if "," in self.blocks:
            return self.blocks.split(",")
        container = model.get_submodule(self.blocks)
        return [f"{self.blocks}.{i}" for i in range(len(container))]


def per_block(
    case: Case, model: nn.Module, context_fn: Callable[[], Any] | None = None
) -> nn.Module:
    """Wrap every block of ``model`` (in place) in non-reentrant checkpoint; return it.

    ``context_fn`` (selective checkpointing) goes to every block's ``checkpoint`` call; for a
    Hugging Face model through ``gradient_checkpointing_kwargs``, as its users pass it."""
    extra = {} if context_fn is None else {"context_fn": context_fn}
    if case.hf_gradient_checkpointing:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False, **extra}
        )
        return model
    for path in case.block_paths(model):
        parent_path, _, leaf = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        inner = parent.get_submodule(leaf)
        if isinstance(parent, (nn.ModuleList, nn.Sequential)):
            parent[int(leaf)] = CheckpointedBlock(inner, context_fn)
        else:
            setattr(parent, leaf, CheckpointedBlock(inner, context_fn))
    return model


def _ops(*names: str) -> frozenset[Any]:
    """``torch.ops.aten.<name>.default`` for each name this torch build has."""
    found = (getattr(torch.ops.aten, name, None) for name in names)
    return frozenset(op.default for op in found if op is not None)


PROJECTION_OPS = _ops("mm", "addmm")
"""What a ``Linear`` dispatches to: ``aten.mm`` without a bias, ``aten.addmm`` with one."""

SAVED_OPS = PROJECTION_OPS | _ops(
    "bmm",
    "baddbmm",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
)
"""The compute-heavy ops whose outputs the selective baselines keep: matmuls and fused
attention (every ``_scaled_dot_product_*_attention`` kernel this build has)."""


def _save_matmuls(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if func in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def save_matmuls_context() -> Callable[[], Any]:
    """``context_fn`` keeping every output in :data:`SAVED_OPS` (everything else is
    recomputed); stateless, so one ``functools.partial`` serves every call."""
    return functools.partial(create_selective_checkpoint_contexts, _save_matmuls)


class TitanContext:
    """``context_fn`` of torchtitan's op-level selective checkpointing policy: keep matmul and
    attention outputs, except every second projection matmul, which is recomputed (halving
    the projections' saved memory for half their recompute).

    The count restarts at every checkpointed call, so each block keeps the same projections.
    torchtitan counts ``aten.mm`` only, which is every projection of its bias-free Llama; a
    ``Linear`` with a bias (GPT-2) dispatches to ``aten.addmm``, so both count here — counting
    ``mm`` alone would keep all of GPT-2's projections, which the ``matmul_sac`` row does."""

    def __call__(self) -> Any:
        counts = {False: 0, True: 0}  # forward and recompute count separately

        def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            if func in PROJECTION_OPS:
                counts[ctx.is_recompute] += 1
                if counts[ctx.is_recompute] % 2 == 0:
                    return CheckpointPolicy.PREFER_RECOMPUTE
            return _save_matmuls(ctx, func, *args, **kwargs)

        return create_selective_checkpoint_contexts(policy)


def op_policy(case: Case, model: nn.Module, *, every_other: bool = True) -> nn.Module:
    """Per-block selective checkpointing (in place): torchtitan's policy (``every_other``) or
    keep every matmul / attention output; return the model."""
    return per_block(case, model, TitanContext() if every_other else save_matmuls_context())


def sqrt_segments(blocks: int) -> int:
    """``round(sqrt(n))`` segments, the usual choice for ``checkpoint_sequential``."""
    return max(1, round(math.sqrt(blocks)))


def sequential(case: Case, model: nn.Module) -> nn.Module:
    """Replace the block container by one ``checkpoint_sequential`` call over sqrt(n) segments."""
    if case.sequential_reason is not None:
        raise ValueError(case.sequential_reason)
    parent_path, _, leaf = case.blocks.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    container = parent.get_submodule(leaf)
    blocks = nn.Sequential(*container)
    wrapped = SequentialCheckpointed(blocks, sqrt_segments(len(blocks)))
    # A ModuleList is iterated by the model's forward: a one-element list keeps that loop.
    replacement = nn.ModuleList([wrapped]) if isinstance(container, nn.ModuleList) else wrapped
    setattr(parent, leaf, replacement)
    return model


# ---------------------------------------------------------------------------------------------
# The cases, CPU and CUDA sizes
# ---------------------------------------------------------------------------------------------

_UNET_REASON = (
    "not a chain: U-Net encoder outputs are consumed again by the decoder (skip connections), "
    "so its blocks are not a sequence of single-tensor modules"
)
_HF_REASON = (
    "the layer loop lives inside transformers' ViTEncoder.forward, which calls each layer with "
    "extra arguments; checkpoint_sequential cannot stand in for it without editing the library"
)


SIZES: dict[str, dict[str, dict[str, Any]]] = {
    "cpu": {
        "gpt2": dict(
            layers=8,
            dim=128,
            heads=4,
            vocab_size=256,
            block_size=128,
            seq_len=128,
            batch=4,
            dropout=0.1,
        ),
        "llama": dict(
            layers=8, dim=128, heads=4, kv_heads=2, hidden=344, vocab_size=256, seq_len=128, batch=4
        ),
        "resnet": dict(width=16, blocks_per_stage=3, batch=8, image_size=64),
        "block_stack": dict(blocks=16, width=128, batch=2048),
        "unet": dict(width=16, batch=4, image_size=96),
        "hf_vit": dict(layers=6, dim=192, heads=3, image_size=64, patch_size=8, batch=8),
        "mlp_mixer": dict(batch=64),
    },
    # GPT-2 small / ViT-B/16-like widths so one block's forward is milliseconds on a GPU.
    "cuda": {
        "gpt2": dict(
            layers=12,
            dim=768,
            heads=12,
            vocab_size=8192,
            block_size=1024,
            seq_len=1024,
            batch=8,
            dropout=0.1,
        ),
        "llama": dict(
            layers=12,
            dim=1024,
            heads=16,
            kv_heads=4,
            hidden=2816,
            vocab_size=8192,
            seq_len=1024,
            batch=8,
        ),
        "resnet": dict(width=64, blocks_per_stage=3, batch=64, image_size=128),
        "block_stack": dict(blocks=16, width=1024, batch=16384),
        "unet": dict(width=32, batch=16, image_size=256),
        "hf_vit": dict(layers=12, dim=768, heads=12, image_size=224, patch_size=16, batch=64),
        "mlp_mixer": dict(batch=512),
    },
}
"""Per-device sizes: on two CPU cores a step takes a few hundred milliseconds; on one GPU
the whole run is meant to fit in minutes."""


def _sized(name: str, device: str, quick: bool) -> dict[str, Any]:
    sizes = dict(SIZES["cpu" if device == "cpu" else "cuda"][name])
    if quick:
        sizes["batch"] = max(1, sizes["batch"] // 2)
    return sizes


def _describe(title: str, sizes: dict[str, Any]) -> str:
    return f"{title} ({', '.join(f'{k}={v}' for k, v in sizes.items())})"


def cases(device: str = "cpu", quick: bool = False) -> list[Case]:
    """The benchmark's workloads, sized for ``device``; ``quick`` halves every batch."""
    gpt2 = _sized("gpt2", device, quick)
    lla = _sized("llama", device, quick)
    res = _sized("resnet", device, quick)
    stack = _sized("block_stack", device, quick)
    un = _sized("unet", device, quick)
    found = [
        Case(
            "gpt2",
            lambda: gpt(**gpt2),
            "h",
            _describe("GPT-2-style decoder (zoo GPT, tied embeddings, dropout)", gpt2),
        ),
        Case(
            "llama",
            lambda: llama(**lla),
            "layers",
            _describe("Llama-style decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention)", lla),
        ),
        Case("resnet", lambda: resnet(**res), "stages", _describe("ResNet (zoo)", res)),
        Case(
            "block_stack",
            lambda: block_stack(**stack),
            "layers",
            _describe("the seed's block stack, Linear(w,2w)-ReLU-Linear(2w,w) blocks", stack),
        ),
        Case(
            "unet",
            lambda: unet(**un),
            "enc1,enc2,enc3,bottleneck,up3,up2,up1",
            _describe("U-Net (zoo)", un),
            sequential_reason=_UNET_REASON,
        ),
    ]
    if _has_transformers():
        vit = _sized("hf_vit", device, quick)
        found.append(
            Case(
                "hf_vit",
                lambda: hf_vit(**vit),
                "vit.encoder.layer",
                _describe(
                    "held out: Hugging Face ViTForImageClassification from a config, "
                    "per-block = its own gradient_checkpointing_enable",
                    vit,
                ),
                sequential_reason=_HF_REASON,
                hf_gradient_checkpointing=True,
                held_out=True,
            )
        )
    else:
        mixer = _sized("mlp_mixer", device, quick)
        found.append(
            Case(
                "mlp_mixer",
                lambda: mlp_mixer(**mixer),
                "layers",
                _describe("held out: MLP-Mixer (zoo; transformers is not installed)", mixer),
                held_out=True,
            )
        )
    return found
