"""The profile's fake step: the structure of one training step, read on fake tensors.

:func:`_fake_structure` runs the captured graph forward and backward once on fake tensors
(:func:`autockpt.base.runtime.fake_step`) under :class:`_Recorder`, which notes per node the
storages it saves, returns and writes, its FLOPs and memory traffic and whether it draws
random numbers (NOTE [profile: fake structure]); it also names the model buffers the forward
changes. Nothing here allocates an activation: it is the part of the profile that sizes the
step, apart from the probe's real kernels (autockpt/costs/probe.py), which read
:class:`_Recorder`'s answers.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from autockpt.base.allocations import StorageSet, storage_key
from autockpt.base.inputs import Inputs
from autockpt.base.rng import worst_case_draws
from autockpt.base.runtime import DATA_DEPENDENT, LossFn, fake_step, loss_on_fake, tensors_in
from autockpt.capture.captured import Capture
from autockpt.costs.interpret import CaptureInterpreter, run_graph
from autockpt.errors import TraceError


def _fake_structure(
    model: nn.Module,
    capture: Capture,
    inputs: Inputs,
    loss_fn: LossFn,
    index_of: dict[fx.Node, int],
) -> tuple[_Recorder, bool, tuple[str, ...]]:
    """One forward and backward of ``capture``'s graph on fake tensors (NOTE [profile: fake
    structure]): the recorder that watched it (its values already let go), whether the loss
    had to be measured rather than run on fake tensors
    (:func:`autockpt.base.runtime.loss_on_fake`), and the names of the model buffers the
    forward changes, sorted: those an operator writes (by schema: kernels update running
    statistics without bumping version counters) and those whose slot the forward fills
    with a new tensor."""
    with fake_step(model, inputs) as fake_inputs:
        fake_static = StorageSet()
        fake_static.add([*model.parameters(), *model.buffers(), *fake_inputs.tensors()])
        static_keys = fake_static.keys
        held = dict(model.named_buffers(remove_duplicate=False))
        buffer_names = {storage_key(b): name for name, b in held.items()}
        structure = _Recorder(model, capture, index_of, static_keys)
        output = run_graph(capture, model, fake_inputs, structure)
        loss, loss_measured = loss_on_fake(loss_fn, output)
        _check_loss(loss)
        del output
        loss.backward()  # on fake tensors: the layouts of the gradients nodes receive
        del loss
        # The values' gradient hooks call the recorder, which holds the values: a cycle
        # through autograd's nodes that the garbage collector cannot see, which kept the
        # model alive after planning. The values go now (the structure is recorded).
        structure.env.clear()
        written = {name for key, name in buffer_names.items() if key in structure.written}
        # A buffer the forward replaces (``self.table = ...``) changes like one written
        # in place: a recompute must see the object and values the forward saw.
        now_held = dict(model.named_buffers(remove_duplicate=False))
        replaced = {name for name, b in held.items() if now_held.get(name) is not b}
        mutated = tuple(sorted(written | replaced))
    return structure, loss_measured, mutated


class _Recorder(CaptureInterpreter):
    """NOTE [profile: fake structure]: runs the graph once on fake tensors and records per node
    the storages it saves for backward, returns and writes in place, its FLOPs and memory
    traffic, whether it draws random numbers, and which of its tensor arguments need gradients
    (the probe recreates exactly those). Values stay alive for the whole run so that storage ids
    are never reused (fake tensors hold no memory)."""

    def __init__(
        self,
        model: nn.Module,
        capture: Capture,
        index_of: dict[fx.Node, int],
        static_keys: set[tuple[str, int]],
    ) -> None:
        super().__init__(model, capture, garbage_collect_values=False)
        self.index_of = index_of
        self.static_keys = static_keys
        n = len(index_of)
        self.saved: list[list[int]] = [[] for _ in range(n)]
        self.outputs: list[list[int]] = [[] for _ in range(n)]
        self.mutates: list[list[int]] = [[] for _ in range(n)]
        self.needs_grad: list[tuple[bool, ...]] = [() for _ in range(n)]
        # per node, per output tensor: (shape, strides) of the gradient backward hands it;
        # filled by hooks during the fake backward
        self.grad_layouts: list[dict[int, tuple[tuple[int, ...], tuple[int, ...]]]] = [
            {} for _ in range(n)
        ]
        self.in_place = [False] * n
        self.flops = [0] * n
        self.traffic = [0] * n
        self.random = [False] * n
        self.written: set[tuple[str, int]] = set()  # every storage written in place
        self.storage_bytes: list[int] = []
        self.storage_index: dict[tuple[str, int], int] = {}
        self.final_output_bytes = 0
        self.worst_case_draws = 0

    def _storage_id(self, tensor: torch.Tensor) -> int | None:
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0:
            return None
        key = storage_key(tensor)
        if key in self.static_keys:
            return None
        if key not in self.storage_index:
            self.storage_index[key] = len(self.storage_bytes)
            self.storage_bytes.append(storage.nbytes())
        return self.storage_index[key]

    def run_node(self, n: fx.Node) -> Any:
        i = self.index_of.get(n)
        if i is None:
            result = super().run_node(n)
            if n.op == "output":
                ids = {self._storage_id(t) for t in tensors_in(result)} - {None}
                self.final_output_bytes = sum(self.storage_bytes[s] for s in ids)
            return result
        saved: set[int] = set()

        def pack(t: torch.Tensor) -> torch.Tensor:
            sid = self._storage_id(t)
            if sid is not None:
                saved.add(sid)
            return t

        args = tensors_in(fx.node.map_arg((n.args, n.kwargs), lambda a: self.env.get(a)))
        versions = [(t, t._version) for t in args]
        watch = _OpWatch()
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                # a scalar draw (LayerDrop) is answered by its worst case (autockpt/base/rng.py)
                with FlopCounterMode(display=False) as counter, watch, worst_case_draws() as drawn:
                    result = super().run_node(n)
        except DATA_DEPENDENT as error:
            raise _data_dependent(n, error) from error
        outputs = tensors_in(result)
        for k, t in enumerate(outputs):
            if t.requires_grad:
                t.register_hook(functools.partial(self._grad_layout, i, k))
        written = {storage_key(t) for t in watch.written}
        written |= {storage_key(t) for t, v in versions if t._version != v}
        self.written |= written
        self.flops[i] = int(counter.get_total_flops())
        # a node whose scalar draw was answered drew nothing here, but draws when it runs:
        # its segment must preserve the RNG state like one with dropout
        self.random[i] = watch.seeded or drawn.draws > 0
        self.worst_case_draws += drawn.draws
        self.traffic[i] = sum(t.nbytes for t in args) + sum(t.nbytes for t in outputs)
        self.needs_grad[i] = tuple(t.requires_grad for t in args)
        self.in_place[i] = bool(written)
        self.saved[i] = sorted(saved)
        self.outputs[i] = sorted({self._storage_id(t) for t in outputs} - {None})
        self.mutates[i] = sorted(
            {self.storage_index[k] for k in written if k in self.storage_index}
        )
        return result

    def _grad_layout(self, i: int, k: int, grad: torch.Tensor | None) -> None:
        if grad is None:  # an output backward reaches without a gradient (CvT)
            return
        self.grad_layouts[i].setdefault(k, (tuple(grad.shape), tuple(grad.stride())))


class _OpWatch(TorchDispatchMode):
    """Notes the tensors operators write in place (by their schemas: batch-norm kernels
    update running statistics without bumping version counters) and whether an operator
    draws random numbers (the ``nondeterministic_seeded`` tag: fake and meta tensors
    consume no random numbers, so the RNG state is no witness there)."""

    def __init__(self) -> None:
        super().__init__()
        self.seeded = False
        self.written: list[torch.Tensor] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.seeded = True
        values = {
            argument.name: args[k] if k < len(args) else kwargs.get(argument.name)
            for k, argument in enumerate(func._schema.arguments)
        }
        for argument in func._schema.arguments:
            if argument.alias_info is not None and argument.alias_info.is_write:
                self.written.extend(tensors_in(values[argument.name]))
        # Batch-norm kernels update running statistics in training without saying so in
        # their schemas (aten::native_batch_norm and its cuDNN/MIOpen twins).
        if "batch_norm" in func._schema.name and values.get("training"):
            for name in ("running_mean", "running_var"):
                self.written.extend(tensors_in(values.get(name)))
        return func(*args, **kwargs)


def _data_dependent(n: fx.Node, error: Exception) -> Exception:
    """The typed error for an operator whose output shape depends on tensor values: such a
    step cannot be sized without running it, and planning never runs it (NOTE [profile: fake
    structure])."""
    op = getattr(error, "func", None)
    stack = n.meta.get("stack_trace") or ""
    location = stack.strip().splitlines()[-2].strip() if stack.strip() else ""
    return TraceError(
        str(n.target) if n.op == "call_module" else "",
        location,
        n.format_node(),
        f"operator {op or n.target} (graph node '{n.name}') returns a tensor whose shape depends "
        "on the values of its inputs (e.g. nonzero, masked_select, boolean indexing); autockpt "
        "sizes a step from shapes alone and cannot plan it. Compute that value outside forward "
        "and pass it in, or use a fixed-shape form (torch.where, masked_fill)",
    )


def _check_loss(loss: Any) -> None:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError(
            f"loss_fn must return a scalar tensor, got {type(loss).__name__}"
            + (f" of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
        )
