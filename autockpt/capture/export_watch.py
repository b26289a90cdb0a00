"""What the export path watches: the model's Python while it is traced for torch.export.

Export traces the forward on fake tensors; what its graph does not keep (a Python draw it
runs once, a mode switch that changes nothing while it traces, ``inference_mode``) is found
by the watch (``autockpt/capture/watch.py``) and refused by name
(:func:`_check_export_kept`). The watch covers the model's call alone
(:class:`_WatchedCall`), over one forward on fake tensors where it can
(:func:`_watched_on_fakes`, NOTE [capture: one export]), else over a static-shape export
(``export.py``'s ``_export_watched``).
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from autockpt.base.inputs import Inputs
from autockpt.base.rng import RngStates, rng_as_found
from autockpt.base.runtime import caches_as_found
from autockpt.capture.causal_masks import eager_causal_masks
from autockpt.capture.fx import _slots_as_found
from autockpt.capture.on_device import traced_as_device
from autockpt.capture.watch import (
    _GENERATOR_NAMES,
    _CheckpointSeen,
    _definition,
    _outside_dispatch_modes,
    _Sighting,
    _Watch,
)
from autockpt.errors import TraceError


class _WatchedCall:
    """The watch over the model's own call while export traces it: entered by a forward
    pre-hook registered first, left by a forward hook that runs last and also when the call
    raises, so the root's hooks and forward are watched and export's passes after the call
    are not. ``moved`` lists the global generators the call moved (compared as real
    tensors under export's modes).

    Why the call alone: export's passes after tracing (turning grad-mode regions into
    higher-order ops, naming, runtime asserts) are torch's Python, where the profile hook
    only costs: on a 2,924-node U-Net they took three times as long watched (17.6% of the
    capture's samples, against 5.5% in the unwatched second export; 5.2% since). Nothing
    there is the model's: a generator one of them moves is not the model's draw either."""

    def __init__(self, watch: _Watch) -> None:
        self.watch = watch
        self.moved: list[str] = []
        self._before: list[RngStates] = []

    @contextlib.contextmanager
    def around(self, model: nn.Module) -> Iterator[None]:
        """The hooks on ``model`` until exit."""
        enter = model.register_forward_pre_hook(self._enter, prepend=True)
        leave = model.register_forward_hook(self._leave, always_call=True)
        try:
            yield
        finally:
            enter.remove()
            leave.remove()
            while self._before:  # a call that left without its hook (never, in torch 2.14)
                self._leave(model, (), None)

    def _enter(self, module: nn.Module, args: Any) -> None:
        with _outside_dispatch_modes():
            self._before.append(RngStates.now())
        self.watch.__enter__()

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self._before:
            return
        self.watch.__exit__(None, None, None)
        with _outside_dispatch_modes():
            moved = self._before.pop().changed()
        self.moved.extend(g for g in moved if g not in self.moved)


def _watched_on_fakes(
    model: nn.Module, inputs: Inputs, fx_failure: tuple[str, BaseException] | str | None
) -> tuple[_Watch, _CheckpointSeen] | None:
    """NOTE [capture: one export]. The watch (what the model's Python does that a graph
    does not keep, :func:`_check_export_kept`) over one run of the forward on fake tensors
    of the example's sizes, instead of over a static-shape export: the watch, a profile
    hook on every Python call, more than doubled that export (a 2,804-node Karras U-Net:
    26.4 s watched, 10.9 s not, 3.1 s for this run), and the static export itself is then
    needed only where the dynamic one fails or reads values. The forward takes the path the
    static export would: the same sizes, as plain integers, the same modes, Hugging Face's
    eager mask (as :func:`eager_causal_masks` makes export take). Refused by :func:`_check_export_kept`
    as before; None where the forward cannot run on fake tensors (a value read), so the
    export watched as before says why."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    seen = _CheckpointSeen()
    call = _WatchedCall(_Watch(seen, model=model))
    with (
        rng_as_found(),
        warnings.catch_warnings(),
        _quiet_torch_logs(),
        caches_as_found(model),
        _slots_as_found(model),  # a forward that assigns a buffer leaves a fake in its slot
        _attributes_as_found(model),  # and one that keeps a tensor in an attribute
        eager_causal_masks([]),
        traced_as_device(model, inputs) as traced,
    ):
        warnings.simplefilter("ignore")
        mode = detect_fake_mode(traced.tensors()) or FakeTensorMode(allow_non_fake_inputs=True)

        def fake(t: torch.Tensor) -> torch.Tensor:
            return t if isinstance(t, FakeTensor) else mode.from_tensor(t)

        try:
            with mode:
                args, kwargs = torch.utils._pytree.tree_map_only(
                    torch.Tensor, fake, (traced.args, traced.kwargs)
                )
                with call.around(model):
                    model(*args, **kwargs)
        except Exception:  # noqa: BLE001 - the watched export says why
            return None
    _check_export_kept(model, call.watch, tuple(call.moved), fx_failure)
    return call.watch, seen


def _check_export_kept(
    model: nn.Module,
    watch: _Watch,
    moved: tuple[str, ...],
    fx_failure: tuple[str, BaseException] | str | None,
) -> None:
    """Refuse an export graph that does not run what the model runs. Export traces on fake
    tensors, so a torch draw stays an operator of the graph, but a draw from Python's
    ``random`` or NumPy runs once and its value is baked in (any generator that moved
    while export traced the model's call drew for real: ``moved``). A mode switch that
    changes nothing while export traces (``enable_grad`` with grad already on, matters only
    under a caller's ``no_grad``) and ``inference_mode`` leave no trace in its graph;
    ``no_grad`` and ``set_grad_enabled`` regions that do change the mode are kept
    (``wrap_with_set_grad_enabled``), as are ``autocast`` regions."""
    in_root = isinstance(fx_failure, tuple) and not fx_failure[0]
    drawn = {d.generator for d in watch.draws}
    moved = tuple(g for g in moved if g not in watch.internal or g in drawn)
    if moved:
        draws = [d for d in watch.draws if d.generator in moved]
        if not draws:
            location, line = _definition(type(model).forward)
            what = "a draw from " + ", ".join(_GENERATOR_NAMES.get(g, g) for g in moved)
            draws = [_Sighting("", what, location, line, moved[0])]
        raise _not_kept(
            draws,
            "the forward draws random numbers in Python (",
            "): torch.export ran the draw once and baked its value into the graph, and fx "
            "cannot keep it either in code that cannot run as a leaf",
            in_root,
        )
    lost = [
        s
        for s in watch.switches
        if s.what == "torch.inference_mode" or (s.before is not None and s.before == s.after)
    ]
    if lost:
        raise _not_kept(
            lost,
            "the forward switches the autograd mode in a way torch.export does not record (",
            ": a switch that changes nothing while it traces, or inference_mode), and fx "
            "cannot keep it either in code that cannot run as a leaf",
            in_root,
        )


def _not_kept(found: list[Any], opening: str, closing: str, in_root: bool) -> TraceError:
    """The error for model code an export capture did not keep: every sighting listed
    between ``opening`` and ``closing``, located at the first one."""
    first = found[0]
    reason = opening + "; ".join(s.describe() for s in found) + closing
    return TraceError(first.module, first.location, first.source_line, reason, in_root_code=in_root)


@contextlib.contextmanager
def _quiet_torch_logs() -> Iterator[None]:
    """torch.export logs whole graphs and guard diagnostics when it fails; we report the
    failure ourselves in one line, so its own loggers are hushed for the attempt."""
    loggers = [
        logging.getLogger(name)
        for name in list(logging.root.manager.loggerDict)
        if name.startswith("torch")
    ]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


@contextlib.contextmanager
def _attributes_as_found(model: nn.Module) -> Iterator[None]:
    """Put back, on exit, every plain attribute of ``model``'s modules that the block set
    or added (a forward that keeps a tensor, ``self.last = x``): a fake tensor left there
    by the watched forward would reach export's trace, made under another fake mode. The
    slots of buffers and parameters are ``_slots_as_found``'s."""
    held = [(m, dict(m.__dict__)) for m in model.modules()]
    try:
        yield
    finally:
        for module, found in held:
            attributes = module.__dict__
            for name in [n for n in attributes if n not in found]:
                del attributes[name]
            for name, value in found.items():
                if attributes.get(name, _MISSING) is not value:
                    attributes[name] = value


_MISSING = object()
