"""A GPU's autocast, run on fake CPU tensors: what planning for a GPU from a machine without
one needs (NOTE [precision: a GPU's autocast on the CPU]).

NOTE [precision: a GPU's autocast on the CPU]. ``torch.autocast("cuda")`` turns itself off
where CUDA is not available, and a fake CUDA tensor cannot run a backward there (the
autograd engine's device threads need a CUDA context). A meta model's planning step runs on
fake CPU tensors (NOTE [runtime: meta runs as a device]), which CPU autocast casts. CPU and
CUDA autocast agree on what runs in lower precision (matrix multiplies, convolutions,
attention) but not on what runs in float32: CUDA runs normalisations, softmax, exp, pow, sums
and most losses in float32 (their outputs are float32 activations), CPU leaves most of them
in the input's dtype. :class:`CudaAutocastOnCpu`, entered inside CPU autocast, applies CUDA's
rules where they differ: it sees every torch function and ``torch.ops`` call (a
``TorchFunctionMode``, above autograd, so its casts are recorded as autocast's are) and

* casts lower-precision floating inputs of CUDA's float32 operators to float32
  (:data:`CUDA_FP32`), or, for the reductions CUDA runs "in float32 unless a dtype is given"
  (:data:`CUDA_FP32_OUTPUT`), passes ``dtype=torch.float32`` (no float32 copy of the input);
* casts float32 inputs of the few lower-precision operators CPU autocast does not list
  (:data:`CUDA_LOWER_ONLY`) to the autocast dtype.

The lists are CUDA autocast's (``aten/src/ATen/autocast_mode.cpp``, torch 2.x) by operator
name; an operator not listed runs as CPU autocast runs it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

__all__ = ["CUDA_FP32", "CUDA_FP32_OUTPUT", "CUDA_LOWER_ONLY", "CudaAutocastOnCpu"]

CUDA_FP32 = frozenset(
    """acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow
    __pow__ __rpow__ softplus layer_norm native_layer_norm group_norm native_group_norm
    frobenius_norm nuclear_norm cosine_similarity poisson_nll_loss cosine_embedding_loss
    nll_loss nll_loss2d nll_loss_nd hinge_embedding_loss kl_div l1_loss smooth_l1_loss
    huber_loss mse_loss margin_ranking_loss multilabel_margin_loss soft_margin_loss
    triplet_margin_loss multi_margin_loss binary_cross_entropy_with_logits dist pdist cdist
    renorm logsumexp upsample_nearest1d upsample_nearest2d upsample_nearest3d
    upsample_linear1d upsample_bilinear2d upsample_trilinear3d upsample_bicubic2d
    cross_entropy cross_entropy_loss""".split()
)
"""CUDA autocast's float32 operators: lower-precision floating inputs are cast to float32."""

CUDA_FP32_OUTPUT = frozenset(
    "prod softmax log_softmax _softmax _log_softmax cumprod cumsum linalg_vector_norm "
    "linalg_matrix_norm sum".split()
)
"""CUDA autocast's "float32 unless a dtype is given" reductions: run with ``dtype=float32``
when an input is in lower precision."""

CUDA_LOWER_ONLY = frozenset(
    "einsum mv addmv addr chain_matmul linalg_multi_dot _thnn_fused_lstm_cell "
    "_thnn_fused_gru_cell lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell".split()
)
"""Operators CUDA autocast runs in lower precision that CPU autocast does not list."""

_LOWER = (torch.float16, torch.bfloat16)


def _name(func: Any) -> str:
    """An operator's name without overload or namespace: ``aten.softmax.int`` -> softmax."""
    name = getattr(func, "__name__", "") or ""
    if isinstance(func, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
        name = func._schema.name.split("::")[-1] if hasattr(func, "_schema") else name
    return name.split(".")[0]


def _floating(value: Any, dtypes: tuple[torch.dtype, ...]) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype in dtypes and value.device.type != "meta"


class CudaAutocastOnCpu(TorchFunctionMode):
    """CUDA autocast's rules where they differ from CPU autocast's, for a block run inside
    CPU autocast at ``dtype`` (NOTE [precision: a GPU's autocast on the CPU])."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if not torch.is_autocast_enabled("cpu"):
            return func(*args, **kwargs)
        name = _name(func)
        flat = pytree.tree_leaves((args, kwargs))
        if name in CUDA_FP32_OUTPUT and kwargs.get("dtype") is None:
            if any(_floating(v, _LOWER) for v in flat):
                with torch.autocast("cpu", enabled=False):
                    try:
                        return func(*args, **{**kwargs, "dtype": torch.float32})
                    except TypeError:  # this form takes no dtype: cast as float32 ops do
                        return func(*_cast(args, _LOWER, torch.float32), **kwargs)
        elif name in CUDA_FP32:
            if any(_floating(v, _LOWER) for v in flat):
                args, kwargs = _cast((args, kwargs), _LOWER, torch.float32)
                with torch.autocast("cpu", enabled=False):
                    return func(*args, **kwargs)
        elif name in CUDA_LOWER_ONLY:
            if any(_floating(v, (torch.float32,)) for v in flat):
                args, kwargs = _cast((args, kwargs), (torch.float32,), self.dtype)
                with torch.autocast("cpu", enabled=False):
                    return func(*args, **kwargs)
        return func(*args, **kwargs)


def _cast(tree: Any, source: tuple[torch.dtype, ...], dtype: torch.dtype) -> Any:
    """``tree`` with its floating tensors of a ``source`` dtype cast to ``dtype``."""
    return pytree.tree_map_only(
        torch.Tensor, lambda t: t.to(dtype) if _floating(t, source) else t, tree
    )
