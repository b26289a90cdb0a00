"""The model as written against its captured graph: how much higher (or lower) one training
step of the user's own module peaks than the same step of the graph autockpt plans.

Every prediction autockpt makes is of the captured graph (the rewritten module runs it), so
the no-checkpoint prediction is the graph's. The graph can be leaner than the model as
written: it frees each value after its last use and drops what nothing uses (torch.export
eliminates dead code), where the model's own Python keeps tensors alive in variables and
returned structures until its forward returns (x-transformers keeps every layer's attention
scores, their clone and its keys and values in ``Intermediates`` until the forward ends:
24 MiB of a 107 MiB step, docs/memory.md). What a user compares a plan with is the model as
written, so that is the baseline ("without checkpointing").

Planning never runs the un-checkpointed step with real tensors (it must fit where the plan
fits, NOTE [record: fake sizes]). Both steps run here on fake tensors
(:func:`autockpt.base.runtime.fake_step`) under the same dispatch tracker
(:class:`autockpt.base.allocations.StorageTracker`), so what only the real kernels allocate
(workspaces) is missing from both alike, and their difference is what the graph changes.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from autockpt.base.allocations import StorageTracker, peak_above_start
from autockpt.base.inputs import Inputs
from autockpt.base.precision import fresh_autocast_cache
from autockpt.base.rng import worst_case_draws
from autockpt.base.runtime import (
    LossFn,
    default_loss,
    fake_step,
    loss_on_fake,
    preserved_training_state,
)
from autockpt.capture.captured import Capture
from autockpt.capture.causal_masks import eager_causal_masks
from autockpt.costs.interpret import CaptureInterpreter, placeholder_values

__all__ = ["as_written_shift"]

logger = logging.getLogger("autockpt")


def as_written_shift(
    model: nn.Module, capture: Capture, inputs: Inputs, loss_fn: LossFn | None = None
) -> int | None:
    """Bytes by which one step (forward, loss, backward) of ``model`` as written peaks above
    the same step of ``capture``'s graph (negative where the graph is heavier), both on fake
    tensors under the same tracker; None when the model as written does not run on fake
    tensors (its peak is then unknown, and nothing is claimed). The model, its gradients,
    buffers and the random generators are as they were afterwards."""
    loss_fn = loss_fn or default_loss
    try:
        as_written = _fake_peak(model, inputs, loss_fn, capture, graph=False)
    except Exception as error:  # noqa: BLE001 - any failure only means "unknown"
        logger.info(
            "the model as written does not run on fake tensors (%r): its peak is unknown", error
        )
        return None
    return as_written - _fake_peak(model, inputs, loss_fn, capture, graph=True)


def _fake_peak(
    model: nn.Module, inputs: Inputs, loss_fn: LossFn, capture: Capture, *, graph: bool
) -> int:
    """The highest the step's own allocations reach above parameters, buffers and inputs:
    the model's forward called as the user calls it, with attention masks made as the
    capture made them (NOTE [capture: Hugging Face's causal mask]), or (``graph``) the
    captured graph run as the recorder runs it (values die after their last use)."""
    with (
        fresh_autocast_cache(),
        preserved_training_state(model),
        fake_step(model, inputs) as fake_inputs,
        worst_case_draws(),
    ):
        statics = [*model.parameters(), *model.buffers(), *fake_inputs.tensors()]
        storages = [t.untyped_storage() for t in statics]  # kept alive: ids stay unique
        tracker = StorageTracker({id(s) for s in storages})
        with tracker:
            output = _forward(model, fake_inputs, capture, graph)
            loss, _ = loss_on_fake(loss_fn, output)
            del output
            loss.backward()
            del loss
        del storages
    return peak_above_start(tracker.deltas_by_window().get(0, []))


def _forward(model: nn.Module, inputs: Inputs, capture: Capture, graph: bool) -> Any:
    if not graph:
        with eager_causal_masks(counted_out=capture.counted_out_positions):
            return model(*inputs.args, **inputs.kwargs)
    runner = CaptureInterpreter(model, capture, garbage_collect_values=True)
    flat = runner.run(*placeholder_values(capture, model, inputs), enable_io_processing=False)
    runner.env.clear()  # the interpreter would hold the graph's outputs through backward
    return capture.graph._codegen.process_outputs(flat)
