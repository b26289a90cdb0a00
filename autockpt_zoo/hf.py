"""Hugging Face model zoo: real architectures built from configs, random weights, small sizes.

Every factory has the zoo signature ``name(**overrides) -> (model, example_inputs)`` (see
:mod:`autockpt.zoo`): the model is built under a fixed seed, in training mode, with nonzero
dropout wherever the architecture has it, and ``example_inputs`` is a dict of the keyword
inputs a Hugging Face training loop passes (``input_ids=``, ``attention_mask=``,
``labels=``, ``pixel_values=``), so the output carries its own ``loss``. Nothing is
downloaded: configs are written here and weights are random.

Sizes are small (2 layers, hidden 64, sequence 32, batch 2..4) so that a whole zoo trains in
seconds on a CPU. Caching is off (``use_cache=False``): a training step has no use for a
key/value cache, and a cache object in the output is not a tensor a loss can use.

``transformers`` is an optional dependency (the ``hf`` extra); importing this module without
it raises ImportError with the install command.

:data:`HF_ZOO` lists the architectures the project is tested on; :data:`HF_HELD_OUT` lists
further architectures that were never used while building graph capture, run the same way to
check that capture works on models in general.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from autockpt_zoo.toy import ModelFactory

try:
    import transformers
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "autockpt.zoo_hf needs Hugging Face transformers: pip install 'autockpt[hf]'"
    ) from error

__all__ = [
    "HF_HELD_OUT",
    "HF_ZOO",
    "INPUT_KINDS",
    "bert",
    "convnext",
    "distilbert",
    "from_config",
    "gpt2",
    "gpt_neox",
    "llama",
    "mistral",
    "resnet",
    "swin",
    "t5",
    "vit",
    "whisper_encoder",
]

_VOCAB = 256
_DROPOUT = 0.1


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Config validation logs warnings about token ids of the tiny vocabularies; hush them."""
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _build(config_cls: type, model_cls: type, seed: int, **config: Any) -> nn.Module:
    with quiet_transformers():
        cfg = config_cls(**config)
        torch.manual_seed(seed)
        model = model_cls(cfg)
    return model.train()


def _tokens(batch: int, seq_len: int, vocab: int = _VOCAB) -> dict[str, Tensor]:
    input_ids = torch.randint(0, vocab, (batch, seq_len))
    attention_mask = torch.ones(batch, seq_len, dtype=torch.long)
    attention_mask[0, -seq_len // 4 :] = 0  # one padded sequence: the mask really matters
    return {"input_ids": input_ids, "attention_mask": attention_mask}


# ---------------------------------------------------------------------------------------------
# decoders


def gpt2(
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    batch: int = 4,
    seq_len: int = 32,
    dropout: float = _DROPOUT,
    seed: int = 0,
) -> tuple[nn.Module, dict[str, Tensor]]:
    """GPT-2 language model: learned positions, fused QKV (Conv1D), tied embeddings."""
    model = _build(
        transformers.GPT2Config,
        transformers.GPT2LMHeadModel,
        seed,
        vocab_size=_VOCAB,
        n_positions=2 * seq_len,
        n_embd=hidden,
        n_layer=layers,
        n_head=heads,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    inputs = _tokens(batch, seq_len)
    inputs["labels"] = inputs["input_ids"].clone()
    return model, inputs


def llama(
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    batch: int = 4,
    seq_len: int = 32,
    dropout: float = _DROPOUT,
    seed: int = 0,
) -> tuple[nn.Module, dict[str, Tensor]]:
    """Llama: grouped-query attention (``kv_heads < heads``), rotary embeddings, RMSNorm,
    SwiGLU MLP, attention dropout."""
    model = _build(
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        seed,
        vocab_size=_VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2 * seq_len,
        attention_dropout=dropout,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    inputs = _tokens(batch, seq_len)
    inputs["labels"] = inputs["input_ids"].clone()
    return model, inputs


# ---------------------------------------------------------------------------------------------
# encoders


def bert(
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    batch: int = 4,
    seq_len: int = 32,
    dropout: float = _DROPOUT,
    seed: int = 0,
) -> tuple[nn.Module, dict[str, Tensor]]:
    """BERT masked language model: padding mask, token types, GELU, tied decoder."""
    model = _build(
        transformers.BertConfig,
        transformers.BertForMaskedLM,
        seed,
        vocab_size=_VOCAB,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=2 * hidden,
        max_position_embeddings=2 * seq_len,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        pad_token_id=0,
    )
    inputs = _tokens(batch, seq_len)
    labels = inputs["input_ids"].clone()
    labels[:, ::2] = -100  # only every other position is scored, as in masked LM
    inputs["token_type_ids"] = torch.zeros_like(inputs["input_ids"])
    inputs["labels"] = labels
    return model, inputs


def t5(
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    batch: int = 4,
    seq_len: int = 32,
    dropout: float = _DROPOUT,
    seed: int = 0,
) -> tuple[nn.Module, dict[str, Tensor]]:
    """T5 encoder-decoder: relative position bias, cross-attention, decoder inputs shifted
    from ``labels`` inside the model."""
    model = _build(
        transformers.T5Config,
        transformers.T5ForConditionalGeneration,
        seed,
        vocab_size=_VOCAB,
        d_model=hidden,
        d_kv=hidden // heads,
        d_ff=2 * hidden,
        num_layers=layers,
        num_decoder_layers=layers,
        num_heads=heads,
        relative_attention_num_buckets=8,
        dropout_rate=dropout,
        use_cache=False,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    inputs = _tokens(batch, seq_len)
    inputs["labels"] = torch.randint(2, _VOCAB, (batch, seq_len // 2))
    return model, inputs


# ---------------------------------------------------------------------------------------------
# vision


def _images(batch: int, size: int, num_labels: int) -> dict[str, Tensor]:
    return {
        "pixel_values": torch.randn(batch, 3, size, size),
        "labels": torch.randint(0, num_labels, (batch,)),
    }


def vit(
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    batch: int = 4,
    image: int = 32,
    patch: int = 4,
    dropout: float = _DROPOUT,
    seed: int = 0,
) -> tuple[nn.Module, dict[str, Tensor]]:
    """ViT image classifier: patch embedding convolution, class token, 64 patches."""
    model = _build(
        transformers.ViTConfig,
        transformers.ViTForImageClassification,
        seed,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=2 * hidden,
        image_size=image,
        patch_size=patch,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        num_labels=10,
    )
    return model, _images(batch, image, 10)


def convnext(
    *,
    stages: int = 3,
    width: int = 16,
    batch: int = 4,
    image: int = 64,
    drop_path: float = _DROPOUT,
    seed: int = 0,
) -> tuple[nn.Module, dict[str, Tensor]]:
    """ConvNeXt image classifier: depthwise 7x7 convolutions, LayerNorm over channels,
    layer scale and stochastic depth (drop path, random like dropout)."""
    model = _build(
        transformers.ConvNextConfig,
        transformers.ConvNextForImageClassification,
        seed,
        num_stages=stages,
        hidden_sizes=[width * 2**i for i in range(stages)],
        depths=[2] * stages,
        drop_path_rate=drop_path,
        num_labels=10,
    )
    return model, _images(batch, image, 10)


def resnet(
    *,
    width: int = 8,
    depth: int = 4,
    batch: int = 4,
    image: int = 64,
    seed: int = 0,
) -> tuple[nn.Module, dict[str, Tensor]]:
    """Hugging Face ResNet classifier: two stages of ``depth`` basic blocks with BatchNorm
    (running statistics are buffers the forward updates in place) and in-place residual
    additions. Deep stages rather than wide ones, so activations lie along the chain and
    not only in the full-resolution stem."""
    model = _build(
        transformers.ResNetConfig,
        transformers.ResNetForImageClassification,
        seed,
        embedding_size=width,
        hidden_sizes=[2 * width, 4 * width],
        depths=[depth, depth],
        layer_type="basic",
        num_labels=10,
    )
    return model, _images(batch, image, 10)


# ---------------------------------------------------------------------------------------------
# held out: architectures not used while building capture


def mistral(
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 1,
    batch: int = 4,
    seq_len: int = 32,
    dropout: float = _DROPOUT,
    seed: int = 0,
) -> tuple[nn.Module, dict[str, Tensor]]:
    """Mistral: sliding-window attention, grouped-query attention with one key/value head."""
    model = _build(
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        seed,
        vocab_size=_VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2 * seq_len,
        sliding_window=seq_len // 2,
        attention_dropout=dropout,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    inputs = _tokens(batch, seq_len)
    inputs["labels"] = inputs["input_ids"].clone()
    return model, inputs


def distilbert(
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    batch: int = 4,
    seq_len: int = 32,
    dropout: float = _DROPOUT,
    seed: int = 0,
) -> tuple[nn.Module, dict[str, Tensor]]:
    """DistilBERT sequence classifier: no token types, pre-classifier dropout."""
    model = _build(
        transformers.DistilBertConfig,
        transformers.DistilBertForSequenceClassification,
        seed,
        vocab_size=_VOCAB,
        dim=hidden,
        n_layers=layers,
        n_heads=heads,
        hidden_dim=2 * hidden,
        max_position_embeddings=2 * seq_len,
        dropout=dropout,
        attention_dropout=dropout,
        seq_classif_dropout=dropout,
        num_labels=3,
        pad_token_id=0,
    )
    inputs = _tokens(batch, seq_len)
    inputs["labels"] = torch.randint(0, 3, (batch,))
    return model, inputs


def gpt_neox(
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    batch: int = 4,
    seq_len: int = 32,
    dropout: float = _DROPOUT,
    seed: int = 0,
) -> tuple[nn.Module, dict[str, Tensor]]:
    """GPT-NeoX: parallel attention + MLP residual, partial rotary embeddings."""
    model = _build(
        transformers.GPTNeoXConfig,
        transformers.GPTNeoXForCausalLM,
        seed,
        vocab_size=_VOCAB,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=2 * hidden,
        max_position_embeddings=2 * seq_len,
        rotary_pct=0.5,
        attention_dropout=dropout,
        hidden_dropout=dropout,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    inputs = _tokens(batch, seq_len)
    inputs["labels"] = inputs["input_ids"].clone()
    return model, inputs


def swin(
    *,
    width: int = 16,
    batch: int = 4,
    image: int = 32,
    dropout: float = _DROPOUT,
    seed: int = 0,
) -> tuple[nn.Module, dict[str, Tensor]]:
    """Swin Transformer classifier: shifted-window attention (rolls, window partition
    reshapes, an attention mask built from the image size), patch merging, drop path."""
    model = _build(
        transformers.SwinConfig,
        transformers.SwinForImageClassification,
        seed,
        image_size=image,
        patch_size=2,
        embed_dim=width,
        depths=[2, 2],
        num_heads=[2, 4],
        window_size=4,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        drop_path_rate=dropout,
        num_labels=10,
    )
    return model, _images(batch, image, 10)


def whisper_encoder(
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    mel_bins: int = 16,
    frames: int = 64,
    batch: int = 4,
    dropout: float = _DROPOUT,
    seed: int = 0,
) -> tuple[nn.Module, dict[str, Tensor]]:
    """Whisper encoder as an audio classifier: a strided 1-d convolution front end over mel
    features, sinusoidal positions, pre-norm encoder layers, mean-pooled head."""
    model = _build(
        transformers.WhisperConfig,
        transformers.WhisperForAudioClassification,
        seed,
        num_mel_bins=mel_bins,
        d_model=hidden,
        encoder_layers=layers,
        encoder_attention_heads=heads,
        encoder_ffn_dim=2 * hidden,
        decoder_layers=1,
        decoder_attention_heads=heads,
        decoder_ffn_dim=2 * hidden,
        max_source_positions=frames // 2,
        dropout=dropout,
        attention_dropout=dropout,
        activation_dropout=dropout,
        vocab_size=_VOCAB,
        num_labels=5,
    )
    inputs = {
        "input_features": torch.randn(batch, mel_bins, frames),
        "labels": torch.randint(0, 5, (batch,)),
    }
    return model, inputs


HF_ZOO: dict[str, ModelFactory] = {
    "hf_gpt2": gpt2,
    "hf_llama": llama,
    "hf_bert": bert,
    "hf_t5": t5,
    "hf_vit": vit,
    "hf_convnext": convnext,
    "hf_resnet": resnet,
}
"""The architectures graph capture is built and tested against."""

HF_HELD_OUT: dict[str, ModelFactory] = {
    "hf_mistral": mistral,
    "hf_distilbert": distilbert,
    "hf_gpt_neox": gpt_neox,
    "hf_swin": swin,
    "hf_whisper_encoder": whisper_encoder,
}
"""Architectures kept out of development: run the same checks to see whether capture
generalises (results in docs/models.md)."""


# ---------------------------------------------------------------------------------------------
# any architecture from a config (the survey's builders: benchmarks/survey.py)

INPUT_KINDS = (
    "causal",
    "masked",
    "classify",
    "seq2seq",
    "image",
    "audio",
    "whisper",
    "speech2text",
    "spectrogram",
)
"""What :func:`from_config` feeds a model, by kind of head: ``causal`` (tokens, labels = the
tokens), ``masked`` (tokens, every other position scored), ``classify`` (tokens, one class
per sequence), ``seq2seq`` (tokens, label tokens half as long), ``image`` (pixels, a class),
``audio`` (a waveform, a class), ``whisper`` (mel features ``(batch, mel_bins, frames)``,
label tokens), ``speech2text`` (features ``(batch, frames, mel_bins)``, label tokens),
``spectrogram`` (``(batch, frames, mel_bins)``, a class)."""

_SPECIAL_TOKENS = 3  # ids 0, 1, 2 are pad / bos / eos in every config here: text avoids them


def from_config(
    config: str,
    model: str,
    inputs: str,
    *,
    batch: int = 4,
    seq_len: int = 32,
    image: int = 32,
    samples: int = 4000,
    mel_bins: int = 16,
    frames: int = 64,
    num_labels: int = 10,
    seed: int = 0,
    **settings: Any,
) -> tuple[nn.Module, dict[str, Tensor]]:
    """``transformers.<model>(transformers.<config>(**settings))`` under ``seed``, in training
    mode, with a batch of the given ``inputs`` kind (:data:`INPUT_KINDS`) whose output carries
    the loss. One builder for every architecture a survey names by its class names, so a new
    architecture is a row of settings rather than a function.

    Text kinds draw tokens from ``settings["vocab_size"]`` (default 256) avoiding ids 0-2,
    which the settings should make pad / bos / eos; one sequence is padded in the mask.
    ``image`` sets ``image_size`` (when not given) and ``num_labels``; the audio kinds set the
    config's feature sizes from ``mel_bins`` and ``frames``.
    """
    if inputs not in INPUT_KINDS:
        raise ValueError(f"inputs must be one of {INPUT_KINDS}, got {inputs!r}")
    vocab = int(settings.get("vocab_size", _VOCAB))
    classes = inputs in ("classify", "image", "audio", "spectrogram")
    if classes:
        settings.setdefault("num_labels", num_labels)
    if inputs == "image":
        settings.setdefault("image_size", image)
    elif inputs == "whisper":
        settings.setdefault("num_mel_bins", mel_bins)
        settings.setdefault("max_source_positions", frames // 2)  # two strided convolutions
    elif inputs == "speech2text":
        settings.setdefault("input_feat_per_channel", mel_bins)
    elif inputs == "spectrogram":
        settings.setdefault("num_mel_bins", mel_bins)
        settings.setdefault("max_length", frames)
    built = _build(getattr(transformers, config), getattr(transformers, model), seed, **settings)
    example: dict[str, Tensor] = {}
    if inputs in ("causal", "masked", "classify", "seq2seq"):
        ids = torch.randint(_SPECIAL_TOKENS, vocab, (batch, seq_len))
        mask = torch.ones(batch, seq_len, dtype=torch.long)
        mask[0, -seq_len // 4 :] = 0  # one padded sequence: the mask really matters
        example = {"input_ids": ids, "attention_mask": mask}
    elif inputs == "image":
        example = {"pixel_values": torch.randn(batch, 3, image, image)}
    elif inputs == "audio":
        example = {"input_values": torch.randn(batch, samples)}
    elif inputs == "whisper":
        example = {"input_features": torch.randn(batch, mel_bins, frames)}
    elif inputs == "speech2text":
        example = {
            "input_features": torch.randn(batch, frames, mel_bins),
            "attention_mask": torch.ones(batch, frames, dtype=torch.long),
        }
    else:  # spectrogram
        example = {"input_values": torch.randn(batch, frames, mel_bins)}
    if inputs == "causal":
        example["labels"] = example["input_ids"].clone()
    elif inputs == "masked":
        labels = example["input_ids"].clone()
        labels[:, ::2] = -100  # only every other position is scored, as in masked LM
        example["labels"] = labels
    elif classes:
        example["labels"] = torch.randint(0, num_labels, (batch,))
    else:  # seq2seq, whisper, speech2text: decoder inputs are shifted from the labels
        example["labels"] = torch.randint(_SPECIAL_TOKENS, vocab, (batch, max(2, seq_len // 2)))
    return built, example
