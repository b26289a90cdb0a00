"""Survey: real architectures through the whole pipeline, one process per model.

    autockpt bench survey [--quick] [--out out/survey]
    python -m benchmarks.survey [--quick] [--out out/survey] [--models hf_llama,hf_bart]
                                [--no-per-block] [--timeout 300]

Every Hugging Face architecture that builds from a small config (decoders, encoders,
encoder-decoders, vision, audio: random weights, nothing downloaded, no tokenizers) and two
torch-only networks, each planned by ``Planner(...).optimize`` at a budget halfway between
the stated minimum (``Planner.minimum_peak_bytes``) and the no-checkpoint peak. Sizes keep
activations a real share of the eager step's peak (most models 60-95%) while a model plans
in seconds on a CPU.

Per model, in a fresh Python process (a crash, a hang or leaked global state stays with its
model; the parent turns it into a failure row):

* **capture**: the path taken (``plan.capture_method``) and capture's notes (a fallback, an
  opaque leaf, a checkpoint the plan replaces); compute nodes and chain stages;
* **train = eager**: a deep copy of the model taken before planning runs the same seeded
  step (torch, ``random`` and NumPy seeded alike) as the optimized model: loss, outputs,
  every parameter gradient, every buffer and every global generator's state after the step
  must be bitwise equal (``eager_exact``); otherwise the largest absolute difference and
  where it is are recorded (``eager_close``: within the test suite's tolerances). Planning
  itself must leave the global generators and the model's buffers as it found them;
* **memory**: the optimized step's measured peak (``autockpt.measure``, allocator truth)
  against the budget and against the plan's prediction (``plan.predicted_peak_bytes``);
* **plan time**: seconds of ``Planner(...)`` plus ``optimize`` (what ``autockpt.optimize``
  costs), with the planner's seconds per phase;
* **per block** (``--no-per-block`` skips it): the hand plan that checkpoints every repeated
  block (``autockpt.report.repeated_block_segments``), predicted and measured; the stated
  minimum over its measured peak above 1 would mean the "minimum" is beaten by hand.

A failure is a row naming the stage it happened in (build, capture, profile, record,
search, optimize, eager, measure) and its cause (exception class and first line), never a
crash of the survey. ``--quick``: a handful of small models at small sizes (a smoke run).

Writes ``survey.json`` (everything, tracebacks included), ``survey.csv``, ``survey.md``
(counts, the table, the failures) and ``survey.png``.
"""

from __future__ import annotations

import argparse
import copy
import csv
import functools
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("KINETO_LOG_LEVEL", "5")

import torch  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from autockpt_zoo.toy import BasicBlock  # noqa: E402
from benchmarks.planning import gradient_bytes  # noqa: E402

MIB = 2**20
SEED = 1234
Factory = Callable[..., tuple[nn.Module, dict[str, Tensor] | Tensor]]
ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------------------------
# models written here
# ---------------------------------------------------------------------------------------------


class DenseLayer(nn.Module):
    """``BN -> ReLU -> Conv1x1(4k) -> BN -> ReLU -> Conv3x3(k)`` over the concatenation of
    every earlier feature map of its block (DenseNet-BC)."""

    def __init__(self, in_channels: int, growth: int) -> None:
        super().__init__()
        self.bottleneck = nn.Sequential(
            nn.BatchNorm2d(in_channels),
            nn.ReLU(),
            nn.Conv2d(in_channels, 4 * growth, 1, bias=False),
        )
        self.conv = nn.Sequential(
            nn.BatchNorm2d(4 * growth),
            nn.ReLU(),
            nn.Conv2d(4 * growth, growth, 3, 1, 1, bias=False),
        )

    def forward(self, features: list[Tensor]) -> Tensor:
        return self.conv(self.bottleneck(torch.cat(features, 1)))


class DenseBlock(nn.Module):
    """``layers`` dense layers, each adding ``growth`` channels, then a transition (BN, ReLU,
    1x1 conv halving the channels, 2x2 average pooling) unless it is the last block."""

    def __init__(self, in_channels: int, layers: int, growth: int, transition: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            DenseLayer(in_channels + i * growth, growth) for i in range(layers)
        )
        out = in_channels + layers * growth
        self.out_channels = out // 2 if transition else out
        self.transition = (
            nn.Sequential(
                nn.BatchNorm2d(out),
                nn.ReLU(),
                nn.Conv2d(out, out // 2, 1, bias=False),
                nn.AvgPool2d(2),
            )
            if transition
            else nn.Identity()
        )

    def forward(self, x: Tensor) -> Tensor:
        features = [x]
        for layer in self.layers:
            features.append(layer(features))
        return self.transition(torch.cat(features, 1))


class DenseNet(nn.Module):
    """DenseNet-BC: stem, dense blocks (``blocks`` holds them: the repeated container), head."""

    def __init__(self, depths: tuple[int, ...], growth: int, classes: int) -> None:
        super().__init__()
        width = 2 * growth
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        blocks = []
        for i, depth in enumerate(depths):
            block = DenseBlock(width, depth, growth, transition=i < len(depths) - 1)
            blocks.append(block)
            width = block.out_channels
        self.blocks = nn.Sequential(*blocks)
        self.norm = nn.Sequential(nn.BatchNorm2d(width), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
        self.fc = nn.Linear(width, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(torch.flatten(self.norm(self.blocks(self.stem(x))), 1))


def densenet(
    *,
    depths: tuple[int, ...] = (6, 12, 24, 16),
    growth: int = 32,
    batch: int = 6,
    image: int = 32,
    seed: int = 0,
) -> tuple[nn.Module, Tensor]:
    """DenseNet-BC (DenseNet-121's depths and growth by default, a CIFAR-style 3x3 stem);
    input ``(batch, 3, image, image)``."""
    torch.manual_seed(seed)
    model = DenseNet(tuple(depths), growth, 10).train()
    return model, torch.randn(batch, 3, image, image)


class ResNet18(nn.Module):
    """torchvision's ResNet-18 layout without torchvision: 7x7 stem, max pooling, eight
    :class:`autockpt_zoo.toy.BasicBlock` s (64, 64, 128, 128, 256, 256, 512, 512 channels) in one
    ``blocks`` container, pooled linear head."""

    def __init__(self, classes: int, width: int = 64) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 7, 2, 3, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, 2, 1),
        )
        blocks, channels = [], width
        for stage in range(4):
            out = width * 2**stage
            for i in range(2):
                blocks.append(BasicBlock(channels, out, 2 if stage and i == 0 else 1))
                channels = out
        self.blocks = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(torch.flatten(self.pool(self.blocks(self.stem(x))), 1))


def resnet18(
    *, batch: int = 32, image: int = 128, width: int = 64, seed: int = 0
) -> tuple[nn.Module, Tensor]:
    """ResNet-18 (11.7M parameters at ``width=64``); input ``(batch, 3, image, image)``."""
    torch.manual_seed(seed)
    return ResNet18(1000, width).train(), torch.randn(batch, 3, image, image)


# ---------------------------------------------------------------------------------------------
# Hugging Face models from configs
# ---------------------------------------------------------------------------------------------


def _hf(
    config: str, model: str, batch: int, image: int, seed: int, **settings: Any
) -> tuple[nn.Module, dict[str, Tensor]]:
    """An image classifier from ``transformers.<config>(**settings)``, 10 labels, in train
    mode, with ``pixel_values`` and ``labels`` (its output carries the loss)."""
    import transformers

    from autockpt_zoo.hf import quiet_transformers

    with quiet_transformers():
        cfg = getattr(transformers, config)(num_labels=10, **settings)
        torch.manual_seed(seed)
        built = getattr(transformers, model)(cfg).train()
    inputs = {
        "pixel_values": torch.randn(batch, 3, image, image),
        "labels": torch.randint(0, 10, (batch,)),
    }
    return built, inputs


def hf_resnet(
    *, batch: int = 24, image: int = 128, seed: int = 0
) -> tuple[nn.Module, dict[str, Tensor]]:
    """ResNet-18's layout at half width (basic blocks, 2-2-2-2)."""
    return _hf(
        "ResNetConfig",
        "ResNetForImageClassification",
        batch,
        image,
        seed,
        embedding_size=32,
        hidden_sizes=[32, 64, 128, 256],
        depths=[2, 2, 2, 2],
        layer_type="basic",
    )


def hf_convnext(
    *, batch: int = 8, image: int = 128, seed: int = 0
) -> tuple[nn.Module, dict[str, Tensor]]:
    """ConvNeXt-T's depths at half width, with stochastic depth."""
    return _hf(
        "ConvNextConfig",
        "ConvNextForImageClassification",
        batch,
        image,
        seed,
        hidden_sizes=[48, 96, 192, 384],
        depths=[3, 3, 9, 3],
        drop_path_rate=0.1,
    )


def hf_efficientnet(
    *, batch: int = 4, image: int = 128, seed: int = 0
) -> tuple[nn.Module, dict[str, Tensor]]:
    """EfficientNet-B0 (width and depth coefficients 1.0)."""
    return _hf(
        "EfficientNetConfig",
        "EfficientNetForImageClassification",
        batch,
        image,
        seed,
        image_size=image,
        width_coefficient=1.0,
        depth_coefficient=1.0,
        hidden_dim=1280,
        dropout_rate=0.2,
        drop_connect_rate=0.2,
    )


def hf_regnet(
    *, batch: int = 16, image: int = 128, seed: int = 0
) -> tuple[nn.Module, dict[str, Tensor]]:
    """RegNetY-400MF's widths and depths (group width 8)."""
    return _hf(
        "RegNetConfig",
        "RegNetForImageClassification",
        batch,
        image,
        seed,
        embedding_size=32,
        hidden_sizes=[48, 104, 208, 440],
        depths=[1, 3, 6, 6],
        groups_width=8,
        layer_type="y",
    )


def hf_levit(
    *, batch: int = 48, image: int = 128, seed: int = 0
) -> tuple[nn.Module, dict[str, Tensor]]:
    """LeViT-128S (attention biases sized for ``image``)."""
    return _hf(
        "LevitConfig",
        "LevitForImageClassification",
        batch,
        image,
        seed,
        image_size=image,
        hidden_sizes=[128, 256, 384],
        num_attention_heads=[4, 6, 8],
        depths=[2, 3, 4],
        key_dim=[16, 16, 16],
    )


def hf_poolformer(
    *, batch: int = 16, image: int = 128, seed: int = 0
) -> tuple[nn.Module, dict[str, Tensor]]:
    """PoolFormer-S12 (pooling as the token mixer)."""
    return _hf(
        "PoolFormerConfig",
        "PoolFormerForImageClassification",
        batch,
        image,
        seed,
        hidden_sizes=[64, 128, 320, 512],
        depths=[2, 2, 6, 2],
        drop_path_rate=0.1,
    )


def hf_mobilenet_v2(
    *, batch: int = 4, image: int = 128, seed: int = 0
) -> tuple[nn.Module, dict[str, Tensor]]:
    """MobileNetV2 1.0 (inverted residuals, ReLU6, depthwise convolutions)."""
    return _hf(
        "MobileNetV2Config",
        "MobileNetV2ForImageClassification",
        batch,
        image,
        seed,
        image_size=image,
        depth_multiplier=1.0,
    )


def hf_t5(
    *, batch: int = 4, seq_len: int = 256, seed: int = 0
) -> tuple[nn.Module, dict[str, Tensor]]:
    """T5ForConditionalGeneration with ``labels`` (decoder inputs shifted from them inside the
    model): 4 + 4 layers, width 256, 4 heads, vocabulary 256 (autockpt_zoo.hf.t5)."""
    from autockpt_zoo.hf import t5

    return t5(layers=4, hidden=256, heads=4, batch=batch, seq_len=seq_len, seed=seed)


# ---------------------------------------------------------------------------------------------
# optional vision libraries (skipped when they do not import)
# ---------------------------------------------------------------------------------------------


class Unavailable(ImportError):
    """An optional library a model needs is missing or does not load: the model is skipped."""


def _optional(module: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except Exception as error:  # a wheel built for another torch fails with OSError, etc.
        raise Unavailable(f"{module} does not import: {type(error).__name__}: {error}") from error


def torchvision_model(
    name: str, *, batch: int = 8, image: int = 64, seed: int = 0
) -> tuple[nn.Module, Tensor]:
    """``torchvision.models.get_model(name)`` with random weights and 10 classes."""
    models = _optional("torchvision.models")
    torch.manual_seed(seed)
    return models.get_model(name, weights=None, num_classes=10).train(), torch.randn(
        batch, 3, image, image
    )


def timm_model(
    name: str, *, batch: int = 8, image: int = 64, seed: int = 0
) -> tuple[nn.Module, Tensor]:
    """``timm.create_model(name)`` with random weights and 10 classes."""
    timm = _optional("timm")
    torch.manual_seed(seed)
    return timm.create_model(name, pretrained=False, num_classes=10).train(), torch.randn(
        batch, 3, image, image
    )


# ---------------------------------------------------------------------------------------------
# the table
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Model:
    """A surveyed model: its factory, family and the overrides of the ``--quick`` size.
    ``needs`` names the optional package without which it is skipped."""

    name: str
    family: str
    factory: Factory
    quick: dict[str, Any] | None = None
    needs: str = "transformers"


_TEXT = {"vocab_size": 256, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
_DROP = 0.1
_SEQ = {"batch": 4, "seq_len": 64}
_QUICK_TEXT = {"batch": 4, "seq_len": 32}  # the zoo's own sizes


def _arch(
    name: str,
    family: str,
    config: str,
    model: str,
    inputs: str,
    sizes: dict[str, Any],
    quick: dict[str, Any] | None = None,
    **settings: Any,
) -> Model:
    """A row of the table: ``autockpt_zoo.hf.from_config`` with these class names, inputs,
    sizes and config settings."""

    def factory(**overrides: Any) -> tuple[nn.Module, dict[str, Tensor]]:
        from autockpt_zoo.hf import from_config

        return from_config(config, model, inputs, **{**sizes, **overrides}, **settings)

    factory.__name__ = name
    return Model(name, family, factory, quick)


def _zoo(
    name: str, family: str, builder: str, quick: dict[str, Any] | None = None, **sizes: Any
) -> Model:
    """A builder of :mod:`autockpt_zoo.hf` at the survey's size."""

    def factory(**overrides: Any) -> tuple[nn.Module, dict[str, Tensor]]:
        import autockpt_zoo.hf

        return getattr(autockpt_zoo.hf, builder)(**{**sizes, **overrides})

    factory.__name__ = name
    return Model(name, family, factory, quick)


def _decoder(name: str, config: str, model: str, **settings: Any) -> Model:
    return _arch(
        name,
        "decoder",
        config,
        model,
        "causal",
        _SEQ,
        _QUICK_TEXT,
        **{**_TEXT, "use_cache": False, **settings},
    )


def _encoder(name: str, config: str, model: str, inputs: str = "masked", **settings: Any) -> Model:
    return _arch(name, "encoder", config, model, inputs, _SEQ, _QUICK_TEXT, **{**_TEXT, **settings})


def _seq2seq(name: str, config: str, model: str, **settings: Any) -> Model:
    return _arch(
        name,
        "encoder-decoder",
        config,
        model,
        "seq2seq",
        _SEQ,
        _QUICK_TEXT,
        **{**_TEXT, "use_cache": False, "decoder_start_token_id": 0, **settings},
    )


def _vision(
    name: str, config: str, model: str, batch: int = 8, image: int = 64, **settings: Any
) -> Model:
    return _arch(
        name,
        "vision",
        config,
        model,
        "image",
        {"batch": batch, "image": image},
        {"batch": 2},
        **settings,
    )


def _audio(name: str, config: str, model: str, **settings: Any) -> Model:
    return _arch(
        name,
        "audio",
        config,
        model,
        "audio",
        {"batch": 4, "samples": 4000},
        {"batch": 2, "samples": 1600},
        **settings,
    )


_LLAMA_LIKE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 256,
    "attention_dropout": _DROP,
}
_BERT_LIKE = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "max_position_embeddings": 256,
    "hidden_dropout_prob": _DROP,
    "attention_probs_dropout_prob": _DROP,
}
_BART_LIKE = {
    "d_model": 64,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "max_position_embeddings": 256,
    "dropout": _DROP,
    "attention_dropout": _DROP,
}
_T5_LIKE = {
    "d_model": 64,
    "d_kv": 16,
    "d_ff": 128,
    "num_layers": 2,
    "num_decoder_layers": 2,
    "num_heads": 4,
    "relative_attention_num_buckets": 8,
    "dropout_rate": _DROP,
}
_VIT_LIKE = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "patch_size": 4,
    "hidden_dropout_prob": _DROP,
    "attention_probs_dropout_prob": _DROP,
}
# Wav2Vec2's family: a 3-layer convolutional front end (20x down-sampling: 4000 samples ->
# 200 frames). SpecAugment and LayerDrop are off except in `hf_wav2vec2`, which keeps the
# training defaults (masks drawn with NumPy, layers skipped on a torch draw).
_SPEECH = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "conv_dim": (32, 32, 32),
    "conv_stride": (5, 2, 2),
    "conv_kernel": (10, 3, 3),
    "num_conv_pos_embeddings": 16,
    "num_conv_pos_embedding_groups": 4,
    "hidden_dropout": _DROP,
    "attention_dropout": _DROP,
    "feat_proj_dropout": _DROP,
    "classifier_proj_size": 32,
}
_NO_AUGMENT = {"layerdrop": 0.0, "mask_time_prob": 0.0, "mask_feature_prob": 0.0}
_SPEECH_SEQ2SEQ = {
    "d_model": 64,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "max_target_positions": 64,
    "dropout": _DROP,
    "attention_dropout": _DROP,
    "use_cache": False,
}
"""Speech encoder-decoders' shared sizes (Whisper, Speech2Text)."""

MODELS: tuple[Model, ...] = (
    # --- decoders -----------------------------------------------------------------------------
    _zoo("hf_gpt2", "decoder", "gpt2", _QUICK_TEXT, layers=2, **_SEQ),
    _decoder(
        "hf_gpt_neo",
        "GPTNeoConfig",
        "GPTNeoForCausalLM",
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        attention_types=[[["global", "local"], 1]],
        window_size=32,
        intermediate_size=128,
        max_position_embeddings=256,
        embed_dropout=_DROP,
        attention_dropout=_DROP,
        resid_dropout=_DROP,
    ),
    _decoder(
        "hf_gptj",
        "GPTJConfig",
        "GPTJForCausalLM",
        n_embd=64,
        n_layer=2,
        n_head=4,
        rotary_dim=8,
        n_inner=128,
        n_positions=256,
        resid_pdrop=_DROP,
        embd_pdrop=_DROP,
        attn_pdrop=_DROP,
    ),
    _zoo("hf_gpt_neox", "decoder", "gpt_neox", _QUICK_TEXT, layers=2, **_SEQ),
    _decoder(
        "hf_opt",
        "OPTConfig",
        "OPTForCausalLM",
        hidden_size=64,
        num_hidden_layers=2,
        ffn_dim=128,
        num_attention_heads=4,
        max_position_embeddings=256,
        word_embed_proj_dim=64,
        dropout=_DROP,
        attention_dropout=_DROP,
    ),
    _decoder(
        "hf_bloom",
        "BloomConfig",
        "BloomForCausalLM",
        hidden_size=64,
        n_layer=2,
        n_head=4,
        hidden_dropout=_DROP,
        attention_dropout=_DROP,
    ),
    _zoo("hf_llama", "decoder", "llama", _QUICK_TEXT, layers=2, **_SEQ),
    _zoo("hf_mistral", "decoder", "mistral", _QUICK_TEXT, layers=2, **_SEQ),
    _decoder(
        "hf_mixtral",
        "MixtralConfig",
        "MixtralForCausalLM",
        **_LLAMA_LIKE,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
    ),
    _decoder("hf_qwen2", "Qwen2Config", "Qwen2ForCausalLM", **_LLAMA_LIKE, num_key_value_heads=2),
    _decoder(
        "hf_qwen2_moe",
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        **_LLAMA_LIKE,
        num_key_value_heads=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=128,
        num_experts=4,
        num_experts_per_tok=2,
    ),
    _decoder(
        "hf_qwen3",
        "Qwen3Config",
        "Qwen3ForCausalLM",
        **_LLAMA_LIKE,
        num_key_value_heads=2,
        head_dim=16,
    ),
    _decoder(
        "hf_gemma",
        "GemmaConfig",
        "GemmaForCausalLM",
        **_LLAMA_LIKE,
        num_key_value_heads=1,
        head_dim=16,
    ),
    _decoder(
        "hf_gemma2",
        "Gemma2Config",
        "Gemma2ForCausalLM",
        **_LLAMA_LIKE,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=32,
        query_pre_attn_scalar=16,
    ),
    _decoder("hf_olmo", "OlmoConfig", "OlmoForCausalLM", **_LLAMA_LIKE),
    _decoder(
        "hf_phi",
        "PhiConfig",
        "PhiForCausalLM",
        **_LLAMA_LIKE,
        partial_rotary_factor=0.5,
        resid_pdrop=_DROP,
        embd_pdrop=_DROP,
    ),
    _decoder(
        "hf_phi3",
        "Phi3Config",
        "Phi3ForCausalLM",
        **_LLAMA_LIKE,
        num_key_value_heads=2,
        resid_pdrop=_DROP,
        embd_pdrop=_DROP,
        original_max_position_embeddings=256,
    ),
    _decoder(
        "hf_stablelm",
        "StableLmConfig",
        "StableLmForCausalLM",
        **_LLAMA_LIKE,
        num_key_value_heads=4,
        partial_rotary_factor=0.25,
        hidden_dropout=_DROP,
    ),
    _decoder(
        "hf_starcoder2",
        "Starcoder2Config",
        "Starcoder2ForCausalLM",
        **_LLAMA_LIKE,
        num_key_value_heads=2,
        residual_dropout=_DROP,
        embedding_dropout=_DROP,
    ),
    _decoder(
        "hf_falcon",
        "FalconConfig",
        "FalconForCausalLM",
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        hidden_dropout=_DROP,
        attention_dropout=_DROP,
    ),
    _decoder(
        "hf_gpt_bigcode",
        "GPTBigCodeConfig",
        "GPTBigCodeForCausalLM",
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_inner=128,
        n_positions=256,
        multi_query=True,
        resid_pdrop=_DROP,
        embd_pdrop=_DROP,
        attn_pdrop=_DROP,
    ),
    _decoder(
        "hf_codegen",
        "CodeGenConfig",
        "CodeGenForCausalLM",
        n_embd=64,
        n_layer=2,
        n_head=4,
        rotary_dim=8,
        n_inner=128,
        n_positions=256,
        n_ctx=256,
        resid_pdrop=_DROP,
        embd_pdrop=_DROP,
        attn_pdrop=_DROP,
    ),
    _decoder("hf_biogpt", "BioGptConfig", "BioGptForCausalLM", **_BERT_LIKE, layerdrop=0.0),
    _decoder(
        "hf_mamba",
        "MambaConfig",
        "MambaForCausalLM",
        hidden_size=64,
        state_size=8,
        num_hidden_layers=2,
        expand=2,
        conv_kernel=4,
    ),
    # --- encoders -----------------------------------------------------------------------------
    _zoo("hf_bert", "encoder", "bert", _QUICK_TEXT, layers=2, **_SEQ),
    _encoder(
        "hf_roberta",
        "RobertaConfig",
        "RobertaForMaskedLM",
        **{**_BERT_LIKE, "max_position_embeddings": 258},
    ),
    _zoo("hf_distilbert", "encoder", "distilbert", _QUICK_TEXT, layers=2, **_SEQ),
    _encoder("hf_albert", "AlbertConfig", "AlbertForMaskedLM", **_BERT_LIKE, embedding_size=32),
    _encoder("hf_electra", "ElectraConfig", "ElectraForMaskedLM", **_BERT_LIKE, embedding_size=32),
    _encoder(
        "hf_deberta",
        "DebertaConfig",
        "DebertaForMaskedLM",
        **_BERT_LIKE,
        relative_attention=True,
        pos_att_type=["p2c", "c2p"],
    ),
    _encoder(
        "hf_deberta_v2",
        "DebertaV2Config",
        "DebertaV2ForMaskedLM",
        **_BERT_LIKE,
        relative_attention=True,
        position_buckets=32,
        pos_att_type=["p2c", "c2p"],
    ),
    _encoder(
        "hf_xlm_roberta",
        "XLMRobertaConfig",
        "XLMRobertaForMaskedLM",
        **{**_BERT_LIKE, "max_position_embeddings": 258},
    ),
    _encoder(
        "hf_mpnet",
        "MPNetConfig",
        "MPNetForMaskedLM",
        **{**_BERT_LIKE, "max_position_embeddings": 258},
        relative_attention_num_buckets=32,
    ),
    _encoder(
        "hf_convbert",
        "ConvBertConfig",
        "ConvBertForMaskedLM",
        **_BERT_LIKE,
        embedding_size=64,
        head_ratio=2,
        conv_kernel_size=9,
    ),
    _encoder(
        "hf_roformer", "RoFormerConfig", "RoFormerForMaskedLM", **_BERT_LIKE, embedding_size=64
    ),
    _encoder(
        "hf_funnel",
        "FunnelConfig",
        "FunnelForSequenceClassification",
        "classify",
        block_sizes=[1, 1, 1],
        d_model=64,
        n_head=4,
        d_head=16,
        d_inner=128,
        hidden_dropout=_DROP,
        attention_dropout=_DROP,
    ),
    _encoder(
        "hf_modernbert",
        "ModernBertConfig",
        "ModernBertForMaskedLM",
        **_LLAMA_LIKE,
        global_attn_every_n_layers=2,
        local_attention=32,
        embedding_dropout=_DROP,
        mlp_dropout=_DROP,
        cls_token_id=1,
        sep_token_id=2,
        reference_compile=False,
    ),
    # --- encoder-decoders ---------------------------------------------------------------------
    _seq2seq("hf_bart", "BartConfig", "BartForConditionalGeneration", **_BART_LIKE),
    _seq2seq("hf_mbart", "MBartConfig", "MBartForConditionalGeneration", **_BART_LIKE),
    _seq2seq("hf_marian", "MarianConfig", "MarianMTModel", **_BART_LIKE),
    _seq2seq("hf_pegasus", "PegasusConfig", "PegasusForConditionalGeneration", **_BART_LIKE),
    _seq2seq(
        "hf_blenderbot", "BlenderbotConfig", "BlenderbotForConditionalGeneration", **_BART_LIKE
    ),
    _seq2seq("hf_mt5", "MT5Config", "MT5ForConditionalGeneration", **_T5_LIKE),
    _seq2seq(
        "hf_longt5",
        "LongT5Config",
        "LongT5ForConditionalGeneration",
        **_T5_LIKE,
        local_radius=8,
        encoder_attention_type="local",
    ),
    Model("hf_t5", "encoder-decoder", hf_t5, {"batch": 2, "seq_len": 32}),
    # --- vision -------------------------------------------------------------------------------
    _zoo("hf_vit", "vision", "vit", {"batch": 2}, layers=2, batch=8),
    _vision("hf_deit", "DeiTConfig", "DeiTForImageClassification", **_VIT_LIKE, image=32),
    _vision(
        "hf_beit",
        "BeitConfig",
        "BeitForImageClassification",
        **_VIT_LIKE,
        image=32,
        use_relative_position_bias=True,
        use_mean_pooling=True,
        drop_path_rate=_DROP,
    ),
    _vision(
        "hf_data2vec_vision",
        "Data2VecVisionConfig",
        "Data2VecVisionForImageClassification",
        **_VIT_LIKE,
        image=32,
        use_relative_position_bias=True,
        use_mean_pooling=True,
        drop_path_rate=_DROP,
    ),
    _vision(
        "hf_dinov2",
        "Dinov2Config",
        "Dinov2ForImageClassification",
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        mlp_ratio=2,
        patch_size=4,
        image=32,
        hidden_dropout_prob=_DROP,
        drop_path_rate=_DROP,
    ),
    _zoo("hf_swin", "vision", "swin", {"batch": 2}, width=32, batch=8),
    _vision(
        "hf_swinv2",
        "Swinv2Config",
        "Swinv2ForImageClassification",
        image=32,
        patch_size=2,
        embed_dim=32,
        depths=[2, 2],
        num_heads=[2, 4],
        window_size=4,
        hidden_dropout_prob=_DROP,
        attention_probs_dropout_prob=_DROP,
        drop_path_rate=_DROP,
    ),
    _vision(
        "hf_convnextv2",
        "ConvNextV2Config",
        "ConvNextV2ForImageClassification",
        num_stages=3,
        hidden_sizes=[16, 32, 64],
        depths=[2, 2, 2],
        drop_path_rate=_DROP,
    ),
    _vision(
        "hf_mobilenet_v1",
        "MobileNetV1Config",
        "MobileNetV1ForImageClassification",
        depth_multiplier=0.5,
    ),
    _vision(
        "hf_mobilevit",
        "MobileViTConfig",
        "MobileViTForImageClassification",
        batch=4,
        hidden_sizes=[48, 64, 80],
        neck_hidden_sizes=[8, 16, 24, 32, 40, 48, 160],
    ),
    _vision(
        "hf_segformer",
        "SegformerConfig",
        "SegformerForImageClassification",
        hidden_sizes=[16, 32, 64, 128],
        num_attention_heads=[1, 1, 2, 4],
        depths=[1, 1, 2, 1],
        decoder_hidden_size=64,
        drop_path_rate=_DROP,
    ),
    _vision(
        "hf_bit",
        "BitConfig",
        "BitForImageClassification",
        embedding_size=32,
        num_groups=8,
        hidden_sizes=[32, 64, 128, 256],
        depths=[1, 1, 1, 1],
    ),
    _vision(
        "hf_cvt",
        "CvtConfig",
        "CvtForImageClassification",
        embed_dim=[16, 32, 64],
        num_heads=[1, 2, 4],
        depth=[1, 2, 3],  # CvT indexes drop-path rates by stage: depth[k] > k
        drop_path_rate=[0.0, 0.0, _DROP],
    ),
    _vision(
        "hf_focalnet",
        "FocalNetConfig",
        "FocalNetForImageClassification",
        embed_dim=16,
        depths=[1, 1, 2, 1],
        drop_path_rate=_DROP,
    ),
    _vision(
        "hf_pvt",
        "PvtConfig",
        "PvtForImageClassification",
        hidden_sizes=[16, 32, 64, 128],
        depths=[1, 1, 1, 1],
        num_attention_heads=[1, 1, 2, 4],
        drop_path_rate=_DROP,
    ),
    Model("hf_resnet", "vision", hf_resnet, {"batch": 8, "image": 96}),
    Model("hf_convnext", "vision", hf_convnext, {"batch": 2, "image": 64}),
    Model("hf_efficientnet", "vision", hf_efficientnet, {"batch": 2, "image": 64}),
    Model("hf_regnet", "vision", hf_regnet, {"batch": 2, "image": 64}),
    Model("hf_levit", "vision", hf_levit, {"batch": 4, "image": 64}),
    Model("hf_poolformer", "vision", hf_poolformer, {"batch": 2, "image": 64}),
    Model("hf_mobilenet_v2", "vision", hf_mobilenet_v2, {"batch": 2, "image": 64}),
    # --- audio --------------------------------------------------------------------------------
    _audio("hf_wav2vec2", "Wav2Vec2Config", "Wav2Vec2ForSequenceClassification", **_SPEECH),
    _audio(
        "hf_hubert", "HubertConfig", "HubertForSequenceClassification", **_SPEECH, **_NO_AUGMENT
    ),
    _audio(
        "hf_wavlm",
        "WavLMConfig",
        "WavLMForSequenceClassification",
        **_SPEECH,
        **_NO_AUGMENT,
        num_buckets=32,
        max_bucket_distance=100,
    ),
    _audio(
        "hf_data2vec_audio",
        "Data2VecAudioConfig",
        "Data2VecAudioForSequenceClassification",
        **_SPEECH,
        **_NO_AUGMENT,
    ),
    _audio(
        "hf_sew",
        "SEWConfig",
        "SEWForSequenceClassification",
        **_SPEECH,
        **_NO_AUGMENT,
        squeeze_factor=2,
    ),
    _audio(
        "hf_unispeech",
        "UniSpeechConfig",
        "UniSpeechForSequenceClassification",
        **_SPEECH,
        **_NO_AUGMENT,
    ),
    _zoo("hf_whisper_encoder", "audio", "whisper_encoder", {"batch": 2}, layers=2, frames=128),
    _arch(
        "hf_whisper",
        "audio",
        "WhisperConfig",
        "WhisperForConditionalGeneration",
        "whisper",
        {"batch": 4, "frames": 128, "seq_len": 32},
        {"batch": 2},
        **_TEXT,
        **_SPEECH_SEQ2SEQ,
        decoder_start_token_id=1,
    ),
    _arch(
        "hf_speech_to_text",
        "audio",
        "Speech2TextConfig",
        "Speech2TextForConditionalGeneration",
        "speech2text",
        {"batch": 4, "frames": 128, "seq_len": 32},
        {"batch": 2},
        **_TEXT,
        **_SPEECH_SEQ2SEQ,
        conv_channels=32,
        conv_kernel_sizes=(5, 5),
        num_conv_layers=2,
        max_source_positions=256,
        decoder_start_token_id=2,
    ),
    _arch(
        "hf_ast",
        "audio",
        "ASTConfig",
        "ASTForAudioClassification",
        "spectrogram",
        {"batch": 4, "frames": 128, "mel_bins": 32},
        {"batch": 2},
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        frequency_stride=4,
        time_stride=4,
        hidden_dropout_prob=_DROP,
        attention_probs_dropout_prob=_DROP,
    ),
    # --- torch only ---------------------------------------------------------------------------
    Model("densenet", "torch", densenet, {"depths": (3, 4), "batch": 4, "image": 32}, ""),
    Model("resnet18", "torch", resnet18, {"batch": 4, "image": 64}, ""),
    Model(
        "tv_resnet50",
        "torchvision",
        functools.partial(torchvision_model, "resnet50"),
        {"batch": 2},
        "torchvision",
    ),
    Model(
        "tv_mobilenet_v3_small",
        "torchvision",
        functools.partial(torchvision_model, "mobilenet_v3_small"),
        {"batch": 2},
        "torchvision",
    ),
    Model(
        "tv_efficientnet_b0",
        "torchvision",
        functools.partial(torchvision_model, "efficientnet_b0"),
        {"batch": 2},
        "torchvision",
    ),
    Model("timm_resnet18", "timm", functools.partial(timm_model, "resnet18"), {"batch": 2}, "timm"),
    Model(
        "timm_vit_tiny",
        "timm",
        functools.partial(timm_model, "vit_tiny_patch16_224", image=224, batch=2),
        {"batch": 1},
        "timm",
    ),
)
QUICK = ("hf_gpt2", "hf_bert", "hf_resnet", "densenet")
"""A handful of small models for a smoke run (``--quick``)."""


# ---------------------------------------------------------------------------------------------
# one model
# ---------------------------------------------------------------------------------------------

PHASES = {
    "capturing": "capture",
    "profiling": "profile",
    "recording": "record",
    "searching": "search",
    "solving": "optimize",
    "measuring": "optimize",
}
"""Planner progress messages (their first word) -> the stage a failure is reported in."""


@dataclass
class _Stage:
    """Where the row's model has got to (a failure is reported there)."""

    name: str = "build"
    captured: bool = False

    def progress(self, message: str) -> None:
        self.name = PHASES.get(message.split(" ", 1)[0], self.name)
        self.captured = self.captured or self.name not in ("build", "capture")


def _seed_all(seed: int) -> None:
    import numpy

    torch.manual_seed(seed)
    random.seed(seed)
    numpy.random.seed(seed)


@dataclass
class _Step:
    """What one seeded training step leaves behind."""

    loss: Tensor
    outputs: list[Tensor]
    grads: dict[str, Tensor]
    buffers: dict[str, Tensor]
    rng: Any = field(repr=False)


def train_step(model: nn.Module, inputs: Any, seed: int = SEED) -> _Step:
    """One forward + backward from the same seed of every global generator."""
    from autockpt.base.rng import RngStates
    from autockpt.base.runtime import clear_grads, default_loss, tensors_in
    from autockpt.capture import Inputs

    given = Inputs.of(inputs)
    clear_grads(model)
    _seed_all(seed)
    output = model(*given.args, **given.kwargs)
    loss = default_loss(output)
    loss.backward()
    step = _Step(
        loss=loss.detach().clone(),
        outputs=[t.detach().clone() for t in tensors_in(output)],
        grads={n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        buffers={n: b.detach().clone() for n, b in model.named_buffers()},
        rng=RngStates.now(),
    )
    clear_grads(model)
    return step


def _diff(a: Tensor, b: Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    if a.numel() == 0:
        return 0.0
    return float((a.double() - b.double()).abs().max())


def compare_steps(eager: _Step, got: _Step) -> dict[str, Any]:
    """Bitwise equality of two steps, and where they differ most (``eager_worst``)."""
    pairs: list[tuple[str, Tensor, Tensor]] = [("loss", eager.loss, got.loss)]
    shared = zip(eager.outputs, got.outputs, strict=False)  # a count mismatch is noted below
    pairs += [(f"output {i}", a, b) for i, (a, b) in enumerate(shared)]
    pairs += [(f"grad {n}", t, got.grads[n]) for n, t in eager.grads.items() if n in got.grads]
    pairs += [
        (f"buffer {n}", t, got.buffers[n]) for n, t in eager.buffers.items() if n in got.buffers
    ]
    mismatched = []
    if len(eager.outputs) != len(got.outputs):
        mismatched.append(f"{len(got.outputs)} outputs, eager {len(eager.outputs)}")
    for what, mine, theirs in (
        ("grads", got.grads, eager.grads),
        ("buffers", got.buffers, eager.buffers),
    ):
        if mine.keys() != theirs.keys():
            missing = sorted(set(theirs) - set(mine))
            extra = sorted(set(mine) - set(theirs))
            mismatched.append(f"{what}: missing {missing[:3]}, extra {extra[:3]}")
    worst, worst_name = 0.0, ""
    exact, close = True, True
    for name, a, b in pairs:
        d = _diff(a, b)
        exact = exact and d == 0.0 and a.dtype == b.dtype
        if d > worst:
            worst, worst_name = d, name
        rtol = 1e-4 if name.startswith("grad") else 1e-5
        close = close and bool(
            a.shape == b.shape and torch.allclose(b.double(), a.double(), rtol=rtol, atol=1e-6)
        )
    rng_moved = eager.rng.changed(got.rng)
    same = not mismatched and not rng_moved
    return {
        "eager_exact": exact and same,
        "eager_close": close and same,
        "eager_max_abs_diff": worst,
        "eager_worst": worst_name,
        "eager_loss_diff": _diff(eager.loss, got.loss),
        "eager_grads_max_abs_diff": max(
            (_diff(t, got.grads[n]) for n, t in eager.grads.items() if n in got.grads),
            default=0.0,
        ),
        "eager_buffers_max_abs_diff": max(
            (_diff(t, got.buffers[n]) for n, t in eager.buffers.items() if n in got.buffers),
            default=0.0,
        ),
        "eager_rng_differs": list(rng_moved),
        "eager_mismatch": mismatched,
    }


def _cause(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


def survey_one(
    model_spec: Model, overrides: dict[str, Any] | None = None, *, per_block: bool = True
) -> dict[str, Any]:
    """One row: build, plan at the halfway budget, compare a step with eager, measure.
    Never raises: a failure is recorded with the stage it happened in."""
    row: dict[str, Any] = {
        "model": model_spec.name,
        "family": model_spec.family,
        "sizes": overrides or {},
        "status": "ok",
    }
    from autockpt.base.rng import rng_as_found

    stage = _Stage()
    try:
        with rng_as_found():  # the seeded steps leave the caller's generators alone
            _survey(model_spec, overrides, per_block, row, stage)
    except Exception as error:  # a model that cannot be planned is a finding, not a crash
        row.update(
            status="skipped" if isinstance(error, Unavailable) else "failed",
            stage=stage.name,
            error=_cause(error),
            traceback=traceback.format_exc()[-6000:],
        )
    row["captured"] = stage.captured
    return row


def _survey(
    spec: Model,
    overrides: dict[str, Any] | None,
    per_block: bool,
    row: dict[str, Any],
    stage: _Stage,
) -> None:
    from autockpt.api import Planner
    from autockpt.base.rng import RngStates
    from autockpt.errors import GIB
    from autockpt.measure import measure

    with warnings.catch_warnings(), _quiet():
        warnings.simplefilter("ignore")
        model, example = spec.factory(**(overrides or {}))
    row["class"] = type(model).__name__
    row["parameters"] = sum(p.numel() for p in model.parameters())
    eager_model = copy.deepcopy(model)  # untouched by planning: the reference step
    found = RngStates.now()
    stage.name = "capture"
    started = time.perf_counter()
    with warnings.catch_warnings(), _quiet():
        warnings.simplefilter("ignore")
        planner = Planner(model, example, progress=stage.progress)
        low, high = planner.minimum_peak_bytes, planner.no_checkpoint_peak_bytes
        budget = (low + high) // 2
        # A root that cannot be captured has its submodule calls planned as units
        # (autockpt/planning/nested.py): the graph facts are the units' together.
        nested = planner.nested
        inners = [planner] if nested is None else nested.planners
        row.update(
            capture=inners[0].capture.method,
            nested=None if nested is None else f"{len(nested.units)} units",
            capture_notes=sorted({w for p in inners for w in p.capture.warnings}),
            leaf_modules=sorted({leaf for p in inners for leaf in p.capture.leaf_modules}),
            nodes=sum(len(p.capture.compute_nodes()) for p in inners),
            stages=sum(p.chain.num_stages for p in inners),
            minimum_peak_bytes=low,
            no_checkpoint_peak_bytes=high,
            budget_bytes=budget,
        )
        stage.name = "optimize"
        fast = planner.optimize(budget_gb=budget / GIB)
    row["plan_seconds"] = time.perf_counter() - started
    row["phase_seconds"] = dict(planner.phase_seconds)
    plan = fast.plan
    row.update(
        capture=plan.capture_method,
        plan_notes=list(plan.notes),
        budget_bytes=plan.budget_bytes,
        segments=len(plan.segments),
        predicted_peak_bytes=plan.predicted_peak_bytes,
        planning_moved_rng=list(found.changed()),
        planning_changed_buffers=[
            name
            for name, b in model.named_buffers()
            if not torch.equal(b, eager_model.get_buffer(name))
        ],
    )
    found.restore()

    stage.name = "eager"
    with warnings.catch_warnings(), _quiet():
        warnings.simplefilter("ignore")
        expected = train_step(eager_model, example)
        got = train_step(fast, example)
    row.update(compare_steps(expected, got))

    stage.name = "measure"
    with warnings.catch_warnings(), _quiet():
        warnings.simplefilter("ignore")
        eager = measure(eager_model, example, repeat=0)
        measured = measure(fast, example, repeat=0).peak_bytes
    activations = eager.peak_bytes - eager.static_bytes - gradient_bytes(eager_model)
    row.update(
        eager_peak_bytes=eager.peak_bytes,
        activation_share=activations / eager.peak_bytes,
        measured_peak_bytes=measured,
        within_budget=measured <= row["budget_bytes"],
        prediction_error=(row["predicted_peak_bytes"] - measured) / measured,
    )
    if per_block and nested is not None and nested.per_block_peak_bytes is not None:
        # each repeated block checkpointed whole, the rest as written: measured by the
        # planner among its leanest candidates (NOTE [nested: units])
        row.update(
            block_container="units",
            per_block_measured_bytes=nested.per_block_peak_bytes,
            minimum_over_per_block=planner.minimum_peak_bytes / nested.per_block_peak_bytes,
        )
    elif per_block:
        try:
            _per_block(planner, example, row)
        except Exception as error:  # the comparison is extra: its failure is noted only
            row["per_block_error"] = _cause(error)


def _per_block(planner: Any, example: Any, row: dict[str, Any]) -> None:
    """The hand plan that checkpoints every repeated block, predicted and measured."""
    from autockpt.measure import measure
    from autockpt.report import repeated_block_segments

    container, segments = repeated_block_segments(planner)
    row.update(block_container=container, block_segments=len(segments))
    if not segments:
        return
    predicted = planner.predict(segments)
    with warnings.catch_warnings(), _quiet():
        warnings.simplefilter("ignore")
        measured = measure(planner.rewrite(segments), example, repeat=0).peak_bytes
    row.update(
        per_block_predicted_bytes=predicted,
        per_block_measured_bytes=measured,
        minimum_over_per_block=planner.minimum_peak_bytes / measured,
    )


def _quiet() -> Any:
    """Transformers' own logging hushed (a no-op without transformers)."""
    import contextlib

    try:
        from autockpt_zoo.hf import quiet_transformers
    except ImportError:
        return contextlib.nullcontext()
    return quiet_transformers()


# ---------------------------------------------------------------------------------------------
# the survey: one process per model
# ---------------------------------------------------------------------------------------------


def _available(package: str) -> bool:
    import importlib.util

    return not package or importlib.util.find_spec(package) is not None


def _isolated(spec: Model, quick: bool, per_block: bool, timeout: float) -> dict[str, Any]:
    """:func:`survey_one` in a fresh interpreter; a crash or a timeout becomes the row."""
    with tempfile.TemporaryDirectory() as folder:
        target = Path(folder) / "row.json"
        command = [
            sys.executable,
            "-m",
            "benchmarks.survey",
            "--one",
            spec.name,
            "--row",
            str(target),
        ]
        command += ["--quick"] if quick else []
        command += [] if per_block else ["--no-per-block"]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        started = time.perf_counter()
        try:
            done = subprocess.run(
                command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            return _failure(
                spec,
                "process",
                f"TimeoutExpired: no row after {timeout:.0f} s",
                time.perf_counter() - started,
            )
        if done.returncode == 0 and target.exists():
            row = json.loads(target.read_text())
        else:
            tail = (done.stderr or "").strip().splitlines()
            row = _failure(
                spec,
                "process",
                f"ProcessDied: exit code {done.returncode}",
                time.perf_counter() - started,
            )
            row["traceback"] = "\n".join(tail[-40:])
        row["process_seconds"] = time.perf_counter() - started
        return row


def _failure(spec: Model, stage: str, error: str, seconds: float) -> dict[str, Any]:
    return {
        "model": spec.name,
        "family": spec.family,
        "status": "failed",
        "stage": stage,
        "error": error,
        "captured": False,
        "process_seconds": seconds,
    }


def run(
    quick: bool,
    out: Path,
    models: tuple[str, ...] | None = None,
    *,
    per_block: bool = True,
    timeout: float = 300.0,
    isolate: bool = True,
) -> list[dict[str, Any]]:
    """Survey the models (``quick``: :data:`QUICK` at their small sizes, unless ``models``
    names them), each in its own process (``isolate``); write JSON, CSV, markdown and PNG
    into ``out`` and return the rows."""
    table = {m.name: m for m in MODELS}
    names = models or (QUICK if quick else tuple(table))
    unknown = [n for n in names if n not in table]
    if unknown:
        raise SystemExit(f"unknown models {unknown}; choose from {sorted(table)}")
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    rows = []
    for name in names:
        spec = table[name]
        if not _available(spec.needs):
            row = {
                "model": name,
                "family": spec.family,
                "status": "skipped",
                "stage": "build",
                "error": f"Unavailable: {spec.needs} is not installed",
                "captured": False,
            }
        elif isolate:
            row = _isolated(spec, quick, per_block, timeout)
        else:
            row = survey_one(spec, spec.quick if quick else None, per_block=per_block)
        rows.append(row)
        print(_line(row), flush=True)
    seconds = time.perf_counter() - started
    _write(rows, out, seconds, quick)
    print(counts_line(rows, seconds), flush=True)
    return rows


# ---------------------------------------------------------------------------------------------
# reporting
# ---------------------------------------------------------------------------------------------


def _mib(value: int | None) -> str:
    return "" if value is None else f"{value / MIB:.2f}"


def _ok(row: dict[str, Any]) -> bool:
    return row.get("status") == "ok"


def counts(rows: list[dict[str, Any]]) -> dict[str, int]:
    """Models surveyed, skipped, built, captured, planned, equal to eager (bitwise and
    within tolerance), within budget, and failed."""
    tried = [r for r in rows if r.get("status") != "skipped"]
    return {
        "models": len(rows),
        "skipped": len(rows) - len(tried),
        "built": sum(1 for r in tried if "class" in r),
        "captured": sum(1 for r in tried if r.get("captured")),
        "planned": sum(1 for r in tried if "segments" in r),
        "eager_exact": sum(1 for r in tried if r.get("eager_exact")),
        "eager_close": sum(1 for r in tried if r.get("eager_close")),
        "within_budget": sum(1 for r in tried if r.get("within_budget")),
        "failed": sum(1 for r in tried if r.get("status") == "failed"),
    }


def counts_line(rows: list[dict[str, Any]], seconds: float | None = None) -> str:
    c = counts(rows)
    text = (
        f"{c['models']} models ({c['skipped']} skipped): {c['built']} built, {c['captured']} "
        f"captured, {c['planned']} planned, {c['eager_exact']} bitwise equal to eager "
        f"({c['eager_close']} within tolerance), {c['within_budget']} within budget, "
        f"{c['failed']} failed"
    )
    return text if seconds is None else f"{text}; {seconds / 60:.1f} min"


def _line(row: dict[str, Any]) -> str:
    if not _ok(row):
        return f"{row['model']:<22} {row['status']} at {row.get('stage')}: {row.get('error')}"
    equal = "exact" if row["eager_exact"] else f"max diff {row['eager_max_abs_diff']:.2g}"
    return (
        f"{row['model']:<22} {row['capture']:<6} eager {_mib(row['eager_peak_bytes'])} MiB "
        f"({row['activation_share']:.0%} act.), budget {_mib(row['budget_bytes'])}, measured "
        f"{_mib(row['measured_peak_bytes'])} ({'within' if row['within_budget'] else 'OVER'}), "
        f"prediction {row['prediction_error']:+.2%}, eager {equal}, plan "
        f"{row['plan_seconds']:.1f} s"
    )


def _equal_cell(row: dict[str, Any]) -> str:
    if row.get("eager_exact"):
        return "exact"
    parts = []
    if row.get("eager_max_abs_diff"):
        parts.append(f"{row['eager_max_abs_diff']:.1e} ({row.get('eager_worst', '')})")
    if row.get("eager_rng_differs"):
        parts.append("RNG " + ",".join(row["eager_rng_differs"]))
    if row.get("eager_mismatch"):
        parts.append("; ".join(row["eager_mismatch"]))
    verdict = "close" if row.get("eager_close") else "NO"
    return f"{verdict}: {', '.join(parts)}"


def _capture_cell(row: dict[str, Any]) -> str:
    text = row.get("capture", "")
    if row.get("nested"):
        text += f", root eager around {row['nested']}"
    auto = [n for n in row.get("leaf_modules", [])]
    if auto:
        text += f" ({len(auto)} leaves)"
    return text


def _no_backticks(text: str) -> str:
    """An error quoting source code (a TraceError does) inside one markdown code span."""
    return text.replace("`", "'")


def summary_markdown(
    rows: list[dict[str, Any]], seconds: float | None = None, machine: str | None = None
) -> str:
    """Counts, one table row per model, then the failures with their causes."""
    header = (
        "| model | family | class | capture | nodes | eager peak (MiB) | activations "
        "| budget (MiB) | predicted (MiB) | measured (MiB) | prediction error | within budget "
        "| train = eager | plan (s) | stated minimum / per-block |\n"
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|:-:|---|---:|---:|\n"
    )
    lines = []
    if machine:
        lines.append(f"Run on {machine}.\n\n")
    lines.append(counts_line(rows, seconds) + ".\n\n")
    lines.append(header)
    for r in rows:
        if not _ok(r):
            cells = [r["model"], r.get("family", ""), r.get("class", ""), r.get("capture", "")]
            lines.append(
                "| "
                + " | ".join(cells)
                + f" | {r['status']} at {r.get('stage')} "
                + "|" * 11
                + "\n"
            )
            continue
        ratio = r.get("minimum_over_per_block")
        lines.append(
            f"| {r['model']} | {r['family']} | {r['class']} | {_capture_cell(r)} | {r['nodes']} "
            f"| {_mib(r['eager_peak_bytes'])} | {r['activation_share']:.0%} "
            f"| {_mib(r['budget_bytes'])} | {_mib(r['predicted_peak_bytes'])} "
            f"| {_mib(r['measured_peak_bytes'])} | {r['prediction_error']:+.2%} "
            f"| {'yes' if r['within_budget'] else 'NO'} | {_equal_cell(r)} "
            f"| {r['plan_seconds']:.1f} | {'' if ratio is None else f'{ratio:.2f}'} |\n"
        )
    failed = [r for r in rows if not _ok(r)]
    if failed:
        lines.append("\nFailures and skips:\n\n")
        for r in failed:
            lines.append(
                f"- **{r['model']}** ({r['status']} at {r.get('stage')}): "
                f"`{_no_backticks(r.get('error', ''))}`\n"
            )
    # Capture's notes (why a path was taken, what was left out), each once with its models.
    by_note: dict[str, list[str]] = {}
    for r in rows:
        for note in r.get("capture_notes", []) if _ok(r) else []:
            by_note.setdefault(" ".join(note.split())[:300], []).append(r["model"])
    if by_note:
        lines.append("\nCapture notes (each with the models it was given for):\n\n")
        for note, names in sorted(by_note.items(), key=lambda item: -len(item[1])):
            lines.append(f"- {note} ({len(names)}: {', '.join(names)})\n")
    return "".join(lines)


def _machine() -> str:
    gpu = "a GPU" if torch.cuda.is_available() else "no GPU"
    import transformers  # noqa: F401 - its version is part of the record

    return (
        f"{os.cpu_count()}-core {platform.machine()} CPU, {gpu}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}"
    )


def _write(rows: list[dict[str, Any]], out: Path, seconds: float, quick: bool) -> None:
    try:
        machine = _machine()
    except ImportError:
        machine = None
    (out / "survey.json").write_text(
        json.dumps(
            {
                "machine": machine,
                "seconds": seconds,
                "quick": quick,
                "counts": counts(rows),
                "rows": rows,
            },
            indent=2,
            default=str,
        )
        + "\n"
    )
    (out / "survey.md").write_text(summary_markdown(rows, seconds, machine))
    flat = [
        {
            k: (json.dumps(v, default=str) if isinstance(v, (dict, list)) else v)
            for k, v in r.items()
            if k != "traceback"
        }
        for r in rows
    ]
    keys = sorted({k for row in flat for k in row})
    with open(out / "survey.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=keys)
        writer.writeheader()
        writer.writerows(flat)
    _plot([r for r in rows if _ok(r)], out / "survey.png")


def _plot(good: list[dict[str, Any]], path: Path) -> None:
    """Per model, as fractions of its eager peak: the stated minimum, the budget, the
    prediction and the measured peak of the plan (and of the per-block hand plan)."""
    if not good:
        return
    from matplotlib.figure import Figure  # a bare Figure: no pyplot global state

    fig = Figure(figsize=(max(10, 0.22 * len(good)), 5), layout="constrained")
    ax = fig.add_subplot()
    at = list(range(len(good)))

    def share(key: str) -> list[float]:
        return [r[key] / r["eager_peak_bytes"] if r.get(key) else float("nan") for r in good]

    ax.bar(
        at,
        share("measured_peak_bytes"),
        0.6,
        color="tab:green",
        label="plan at the halfway budget, measured",
    )
    ax.plot(at, share("budget_bytes"), "k_", markersize=9, linestyle="none", label="budget")
    ax.plot(at, share("predicted_peak_bytes"), ".", color="tab:olive", label="predicted")
    ax.plot(
        at,
        share("minimum_peak_bytes"),
        "v",
        color="tab:red",
        markersize=4,
        linestyle="none",
        label="stated minimum",
    )
    ax.plot(
        at,
        share("per_block_measured_bytes"),
        "x",
        color="tab:blue",
        markersize=4,
        linestyle="none",
        label="per-block hand plan, measured",
    )
    for i, r in enumerate(good):
        if not (r["within_budget"] and r["eager_exact"]):
            ax.annotate("!", (i, 1.02), ha="center", color="tab:red")
    ax.axhline(1.0, color="grey", linewidth=0.5)
    ax.set_xticks(at, [r["model"] for r in good], rotation=90, fontsize=7)
    ax.set_ylabel("peak / eager peak")
    ax.set_ylim(0, 1.1)
    ax.set_title(
        "every architecture planned halfway between its stated minimum and no "
        "checkpointing ('!': over budget or not bitwise equal to eager)"
    )
    ax.legend(fontsize=7, loc="lower left")
    fig.savefig(path, dpi=120)


BEGIN, END = "<!-- survey:begin -->", "<!-- survey:end -->"


def replace_docs(path: Path, rows: list[dict[str, Any]], seconds: float | None) -> None:
    """Replace the generated part of a markdown file (between :data:`BEGIN` and :data:`END`)
    with this run's counts, table and failures."""
    text = path.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{path} has no {BEGIN} ... {END} section to replace")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    try:
        machine = _machine()
    except ImportError:
        machine = None
    body = summary_markdown(rows, seconds, machine)
    path.write_text(f"{head}{BEGIN}\n{body}{END}{tail}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a handful of small models")
    parser.add_argument("--out", type=Path, default=Path("out/survey"))
    parser.add_argument("--models", default=None, help="comma-separated model names")
    parser.add_argument(
        "--no-per-block",
        dest="per_block",
        action="store_false",
        help="skip the per-block hand plan",
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per model")
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="survey every model in this process (no isolation)",
    )
    parser.add_argument("--list", action="store_true", help="print the model names")
    parser.add_argument(
        "--docs", type=Path, help="markdown file whose survey section to regenerate"
    )
    parser.add_argument(
        "--from-json", type=Path, help="regenerate --docs from a survey.json, running nothing"
    )
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the per-model child process
    parser.add_argument("--row", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    if args.list:
        print("\n".join(f"{m.name} ({m.family})" for m in MODELS))
        return
    if args.one:
        spec = next(m for m in MODELS if m.name == args.one)
        row = survey_one(spec, spec.quick if args.quick else None, per_block=args.per_block)
        args.row.write_text(json.dumps(row, default=str))
        return
    if args.from_json is not None:
        record = json.loads(args.from_json.read_text())
        rows, seconds = record["rows"], record["seconds"]
    else:
        started = time.perf_counter()
        rows = run(
            args.quick,
            args.out,
            tuple(args.models.split(",")) if args.models else None,
            per_block=args.per_block,
            timeout=args.timeout,
            isolate=not args.in_process,
        )
        seconds = time.perf_counter() - started
    if args.docs is not None:
        replace_docs(args.docs, rows, seconds)


if __name__ == "__main__":
    main()
