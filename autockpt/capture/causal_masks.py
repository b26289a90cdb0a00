"""Hugging Face's causal mask as its eager call makes it, while torch.export traces the model.

NOTE [capture: Hugging Face's causal mask]. transformers decides per call whether scaled-dot-
product attention needs a mask: with no padding mask and as many queries as keys (training),
eager calls skip it and pass ``is_causal=True`` (and ``enable_gqa=True`` for grouped key/value
heads), which GPUs run as flash attention. Under torch.export it never skips
(``masking_utils._ignore_causal_mask_sdpa`` returns False when
``is_torchdynamo_exporting()``): an exported graph is meant for any later call, whose mask
it cannot read. So the exported graph of a Llama materialised a batch x seq x seq mask and
repeated the key/value heads, and the GPU ran SDPA with a mask: on an H200 (Llama 3.2 1B's
shape, 8,192 tokens, bf16) 316 ms and 50,655 MiB without checkpointing, where eager ran in
229 ms and 47,839 MiB. The plan predicted the graph exactly; the graph was not the model.

autockpt's graph serves one kind of call, checked before it runs (the input check of
autockpt/capture/export.py): the captured inputs, with batch and sequence sizes free. While
capturing, transformers' exporting test reads False (:func:`eager_causal_masks`), so its
mask functions decide as in eager: from the sizes and from whether a padding mask was
passed. A padding mask given as an input is a traced tensor, whose values transformers does
not read while tracing (``is_tracing(padding_mask)``): the mask is then built as before,
which any later padding mask needs.

Without a cache (``use_cache=False``, what a training step runs) transformers also looks for
packed sequences in the position ids (``find_packed_sequence_indices``): eager reads their
values, a trace cannot, and a mask is built. Position ids the model counts out itself (an
``arange`` plus an offset, reshaped: what Llama, Qwen, Mistral and Gemma make when the call
passes none) hold one sequence per row whatever the sizes, so for those alone the capture
answers "not packed", as eager would (:func:`_counted_out`); any that derive from an input's
or a buffer's values keep transformers' answer, and the mask. The model as written is also
stepped on fake tensors (autockpt/costs/as_written.py, the "without checkpointing" baseline),
where no graph tells where positions come from: it is given the capture's answer
(``Capture.counted_out_positions``), so both steps are eager's.

Only ``transformers.masking_utils`` is changed, only while the graph is traced, and only if
the user's process has imported it; a transformers without these functions traces as it
always did.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

_MODULE = "transformers.masking_utils"
_EXPORTING_TEST = "is_torchdynamo_exporting"
_PACKING_TEST = "find_packed_sequence_indices"

# ops through which positions counted out by an arange stay one unbroken run per row
_RESHAPES = frozenset(
    ("unsqueeze", "expand", "view", "reshape", "_to_copy", "alias", "detach", "clone")
)


def _not_exporting() -> bool:
    return False


def _counted_out(positions: Any) -> bool:
    """Whether the traced ``positions`` were made inside the model from sizes alone: an
    ``arange`` of step 1, plus a number, reshaped or cast (NOTE [capture: Hugging Face's
    causal mask]). Read from the graph being traced; False wherever that cannot be read."""
    from torch.fx.experimental import proxy_tensor

    try:
        mode = proxy_tensor.get_proxy_mode()
        slot = proxy_tensor.get_proxy_slot(positions, mode.tracer, None) if mode else None
    except Exception:  # noqa: BLE001 - torch's tracing internals moved: transformers decides
        return False
    node = slot.proxy.node if slot is not None else None
    while node is not None and node.op == "call_function":
        name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
        tensors = [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
        if name == "arange":
            step = node.args[2] if len(node.args) > 2 else node.kwargs.get("step", 1)
            return not tensors and step == 1
        if len(tensors) != 1 or (name != "add" and name not in _RESHAPES):
            return False
        if name == "add" and node.kwargs.get("alpha", 1) != 1:
            return False
        node = tensors[0]
    return False


def _packing_test(
    found: Callable[[Any], Any], answers: list[bool] | None, counted_out: bool
) -> Callable[[Any], Any]:
    def find_packed_sequence_indices(position_ids: Any) -> Any:
        mine = counted_out or _counted_out(position_ids)
        if answers is not None:
            answers.append(mine)
        return None if mine else found(position_ids)

    return find_packed_sequence_indices


@contextlib.contextmanager
def eager_causal_masks(
    answers: list[bool] | None = None, *, counted_out: bool = False
) -> Iterator[None]:
    """Inside, transformers' mask functions decide as its eager calls do (NOTE [capture:
    Hugging Face's causal mask]); outside, everything is as found. ``answers`` collects,
    per packing test, whether the positions were counted out; ``counted_out`` answers yes
    for every one: what a fake step of the model as written (no graph to read provenance
    from) is told after its capture found every one counted out."""
    masking = sys.modules.get(_MODULE)
    found = {name: getattr(masking, name, None) for name in (_EXPORTING_TEST, _PACKING_TEST)}
    if not all(callable(f) for f in found.values()):
        yield
        return
    setattr(masking, _EXPORTING_TEST, _not_exporting)
    setattr(masking, _PACKING_TEST, _packing_test(found[_PACKING_TEST], answers, counted_out))
    try:
        yield
    finally:
        for name, function in found.items():
            setattr(masking, name, function)
