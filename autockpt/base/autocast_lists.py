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

import inspect
from typing import Any

import torch
import torch.nn.functional as F
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
"""CUDA autocast's float32 operators: lower-precision floating inputs are cast to float32.
``cross_entropy`` with class targets is not one of them on CUDA (:func:`_cross_entropy_as_cuda`);
its other forms are run so."""

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
        if func is F.cross_entropy:
            found = _cross_entropy_as_cuda(args, kwargs)
            if found is not None:
                return found
        # a dtype given (by keyword, or positionally as an export graph writes it) is kept
        dtype_given = kwargs.get("dtype") is not None or any(
            isinstance(a, torch.dtype) for a in args
        )
        if name in CUDA_FP32_OUTPUT and not dtype_given:
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


def _cross_entropy_as_cuda(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """``F.cross_entropy`` of lower-precision logits and class targets as CUDA autocast runs
    it, or None for the forms it does not cover (probability targets, label smoothing, the
    legacy reduction flags), which run as a float32 operator.

    Why: CUDA autocast does not list ``cross_entropy_loss`` (CPU autocast does): its
    composite runs ``log_softmax`` in the logits' dtype (saved for backward: the logits'
    size in bfloat16) and casts that to float32 for ``nll_loss``, which CUDA runs in
    float32. Run as a float32 operator, the step instead casts the logits to float32 first:
    a float32 copy more while the loss runs and the bfloat16 result not saved. On a 1B
    Llama with a 128256-word vocabulary at 8192 tokens that was 2 GiB above the H200's
    measured peak (docs/large-runs.md, "On an H200")."""
    try:
        bound = inspect.signature(F.cross_entropy).bind(*args, **kwargs).arguments
    except TypeError:
        return None
    logits, target = bound["input"], bound["target"]
    plain = (
        bound.get("label_smoothing", 0.0) == 0.0
        and bound.get("size_average") is None
        and bound.get("reduce") is None
    )
    if not (_floating(logits, _LOWER) and isinstance(target, torch.Tensor) and plain):
        return None
    if target.is_floating_point():
        return None
    weight = bound.get("weight")
    with torch.autocast("cpu", enabled=False):
        scores = torch.log_softmax(logits, 1 if logits.dim() > 1 else 0, dtype=logits.dtype)
        return F.nll_loss(
            scores.float(),
            target,
            weight=weight.float() if isinstance(weight, torch.Tensor) else weight,
            ignore_index=bound.get("ignore_index", -100),
            reduction=bound.get("reduction", "mean"),
        )


def _cast(tree: Any, source: tuple[torch.dtype, ...], dtype: torch.dtype) -> Any:
    """``tree`` with its floating tensors of a ``source`` dtype cast to ``dtype``."""
    return pytree.tree_map_only(
        torch.Tensor, lambda t: t.to(dtype) if _floating(t, source) else t, tree
    )
