"""Stage 2 — profile: what each node of the captured graph costs, without running the step.

Per compute node the profile records

* the storages autograd *saves* for backward (``saved_tensors_hooks``), de-duplicated by
  storage, with parameters, buffers and the model's inputs excluded: these are what
  checkpointing can free, and they are not the same as output sizes (a ReLU that saves its
  output and the next Linear that saves the same tensor as its input share one storage);
* the storages of its outputs and the storages it mutates in place (version counters), so
  that the chain builder never cuts across a tensor that is mutated later;
* forward and backward seconds, each node run alone on the device (its forward, then
  ``torch.autograd.grad`` of its outputs; the median over ``repeat`` runs: NOTE
  [profile: probe]), FLOPs (``torch.utils.flop_counter``) and whether it draws random
  numbers (the operators' ``nondeterministic_seeded`` tag: NOTE [profile: fake structure]);
* the kernels' workspaces beyond what the node's operators return (NOTE [profile: probe]);
* the parameter-gradient bytes that appear when backward reaches the node.

Model buffers that the forward changes (batch-norm running statistics, counters, a table
built on the first call) are those an operator writes during the fake step (by schema:
kernels update running statistics without bumping version counters) and those whose slot
the forward fills with a new tensor. The model, the caller's inputs and the global random
generators are left as found (:func:`autockpt.base.runtime.as_found`): profiling leaves no
trace in training.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from autockpt.base.allocations import (
    StorageSet,
    StorageTracker,
    allocator_events,
    marks,
    peak_above_start,
    profiler_session,
    static_bytes,
    storage_key,
)
from autockpt.base.inputs import Inputs
from autockpt.base.optimizer import stand_in, state_tensors
from autockpt.base.optimizer import step as optimizer_step
from autockpt.base.precision import (
    AutocastCasts,
    Precision,
    empty_autocast_cache,
    fresh_autocast_cache,
)
from autockpt.base.rng import worst_case_draws
from autockpt.base.runtime import (
    DATA_DEPENDENT,
    LossFn,
    as_found,
    default_loss,
    device_of,
    fake_step,
    loss_name,
    loss_on_fake,
    now,
    tensors_in,
)
from autockpt.capture.captured import Capture
from autockpt.costs.interpret import CaptureInterpreter, run_graph
from autockpt.costs.timing import Timing, lookup, segment_seconds, settle, timing_key
from autockpt.errors import TraceError


@dataclass(frozen=True)
class NodeProfile:
    """What one compute node of the graph costs. Storages are indices into
    :attr:`Profile.storage_bytes`.

    ``cost_seconds`` is the node's forward cost as the solvers see it: its measured forward
    seconds (NOTE [timing: one time model]; the same in every process of a machine, NOTE
    [timing: stored]), or without a probe the cost model's function of its FLOPs and bytes
    (NOTE [profile: cost model]). ``forward_seconds``/``backward_seconds`` are measured on the
    device (NOTE [profile: probe]) and used to report times.
    ``forward_workspace``/``backward_workspace`` are the bytes its kernels allocate beyond the
    tensors its operators return."""

    name: str
    op: str
    saved: tuple[int, ...]
    outputs: tuple[int, ...]
    mutates: tuple[int, ...]
    forward_seconds: float
    backward_seconds: float
    flops: int
    random: bool
    param_grad_bytes: int
    cost_seconds: float = 0.0
    forward_workspace: int = 0
    backward_workspace: int = 0
    hidden_saved: int = 0
    """Bytes the node's forward leaves allocated beyond what its operators return (a scalar
    autograd wraps and saves): they live until its backward, like a saved tensor."""
    device_forward_ops: tuple[tuple[str, int], ...] = ()
    """The operators the node's forward called on the device and the bytes of new storage
    each returned (the probe's storage tracker). A fake kernel can return less than the
    real one (an RNN's reserve buffer comes back empty on fake tensors); the recorder
    compares operator by operator and adds the difference (NOTE [record: workspaces])."""


@dataclass(frozen=True)
class Profile:
    """Per-node costs plus the static memory of one training step of the captured graph.

    ``probe_peak_bytes`` is the highest the allocator reached while the probe ran (static
    part included; ``None`` on the meta device): what profiling itself needed."""

    nodes: tuple[NodeProfile, ...]
    storage_bytes: tuple[int, ...]
    param_bytes: int
    param_grad_bytes: int
    buffer_bytes: int
    input_bytes: int
    output_bytes: int
    mutated_buffers: tuple[str, ...]
    device: str
    step_seconds: float
    times_estimated: bool = False
    loss_probe: LossProbe | None = None
    """What the allocator saw while the loss ran on real tensors (None: not probed)."""
    timing: Timing | None = None
    """The measured seconds (None: not probed, the cost model's): NOTE [timing: one time
    model]."""
    loss_measured: bool = False
    """The loss reads a value (``.item()``) and cannot run on fake tensors: its memory is
    the probe's alone (:func:`autockpt.base.runtime.loss_on_fake`)."""
    optimizer_workspace: int = 0
    """What the optimizer's real step allocates beyond what its operators return (a
    0-dim tensor wrapping a Python scalar per parameter on the CPU), when profiled with the
    training loop's optimizer (NOTE [profile: optimizer probe])."""
    probe_peak_bytes: int | None = None
    worst_case_draws: int = 0
    """Scalar draws the fake step answered with their worst case (a random-depth model,
    autockpt/base/rng.py); when any, the probe and the verifying measurement run under the same
    rule, so that all of them size the same step."""

    @property
    def static_bytes(self) -> int:
        """Memory that exists for the whole step whatever the plan: parameters, buffers and
        inputs (gradients are added as backward reaches their parameters)."""
        return self.param_bytes + self.buffer_bytes + self.input_bytes

    def saved_bytes(self) -> int:
        unique = {s for node in self.nodes for s in node.saved}
        return sum(self.storage_bytes[s] for s in unique)

    def with_timing(self, timing: Timing) -> Profile:
        """This profile reporting by ``timing`` (the same node seconds, with step factors
        found or measured since: NOTE [timing: step factors])."""
        return dataclasses.replace(self, timing=timing, step_seconds=timing.step_seconds())

    @property
    def forward_factor(self) -> float:
        """What reported recompute seconds are the ranked ones multiplied by (NOTE [timing:
        step factors]; 1 until a verified plan timed its step, or when nothing is stored)."""
        return self.timing.forward_factor if self.timing is not None else 1.0

    @property
    def segment_overhead_seconds(self) -> float:
        """Fixed cost of one checkpoint segment, in the units of ``cost_seconds``: measured
        with the node times (NOTE [timing: one time model]), else the cost model's."""
        if self.timing is not None and self.timing.ranks:
            return self.timing.segment
        return SEGMENT_OVERHEAD_SECONDS.get(
            self.device.split(":")[0], SEGMENT_OVERHEAD_SECONDS["cuda"]
        )


def profile(
    model: nn.Module,
    capture: Capture,
    inputs: Inputs,
    *,
    loss_fn: LossFn | None = None,
    repeat: int = 1,
    estimate_times: bool | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> Profile:
    """Profile one training step of ``capture``'s graph, node by node, without ever running
    the un-checkpointed step on real tensors.

    Structure (saved, returned and mutated storages, FLOPs, random ops) comes from one
    forward on fake tensors (NOTE [profile: fake structure]); kernel workspaces and times from
    the probe (NOTE [profile: probe]), which runs each node on real tensors while only a lean
    working set is alive. On the meta device (or with ``estimate_times``) there is no probe:
    times are the cost model's (NOTE [profile: cost model]) and workspaces are unknown.
    """
    loss_fn = loss_fn or default_loss
    device = device_of(model, inputs)
    if estimate_times is None:
        estimate_times = device.type == "meta"
    nodes = capture.compute_nodes()
    index_of = {node: i for i, node in enumerate(nodes)}
    static = StorageSet()  # parameters first, then buffers and inputs not shared with them
    param_bytes = static.add(model.parameters())
    buffer_bytes = static.add(model.buffers())
    input_bytes = static.add(inputs.tensors())
    grad_bytes_by_node, param_grad_bytes = _param_grad_attribution(model, capture, index_of)

    # The probe runs real nodes: a forward that updates its input in place writes the
    # caller's tensor, and dropout draws from the global generator; all is put back.
    with as_found(model, inputs):
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
        # one time model: measured seconds, the same in every process of this machine
        # (NOTE [timing: one time model], NOTE [timing: stored]); stored ones skip the
        # probe's timing passes
        key = (
            None
            if estimate_times
            else timing_key(
                capture.fingerprint(),
                model,
                inputs.signature(),
                (Precision.now(model).key(), loss_name(loss_fn)),
                device,
            )
        )
        stored = lookup(key, len(nodes)) if key is not None else None
        probe = (
            None
            if estimate_times
            else _worst_case_probe(
                structure.worst_case_draws > 0,
                model,
                capture,
                inputs,
                loss_fn,
                index_of,
                structure,
                0 if stored is not None else max(1, repeat),
            )
        )
    costs = [
        estimated_seconds(structure.flops[i], structure.traffic[i], device.type)
        for i in range(len(nodes))
    ]
    timing: Timing | None = None
    if probe is None or key is None:
        fwd_times = costs
        bwd_times = [2 * c for c in costs]
        step_seconds = 3 * sum(costs)
    else:
        timing = stored or settle(
            key,
            Timing(
                tuple(probe.forward_seconds),
                tuple(probe.backward_seconds),
                segment_seconds(device),
                probe.loss_seconds,
            ),
        )
        fwd_times, bwd_times = list(timing.forward), list(timing.backward)
        if timing.ranks:  # else: nothing stored, the cost model ranks
            costs = fwd_times
        step_seconds = timing.step_seconds()  # at the step factors, once stored
    profiles = tuple(
        NodeProfile(
            name=node.name,
            op=node.op,
            saved=tuple(structure.saved[i]),
            outputs=tuple(structure.outputs[i]),
            mutates=tuple(structure.mutates[i]),
            forward_seconds=fwd_times[i],
            backward_seconds=bwd_times[i],
            flops=structure.flops[i],
            random=structure.random[i],
            param_grad_bytes=grad_bytes_by_node.get(i, 0),
            cost_seconds=costs[i],
            forward_workspace=probe.forward_workspace[i] if probe else 0,
            backward_workspace=probe.backward_workspace[i] if probe else 0,
            hidden_saved=probe.hidden_saved[i] if probe else 0,
            device_forward_ops=probe.device_forward_ops[i] if probe else (),
        )
        for i, node in enumerate(nodes)
    )
    return Profile(
        nodes=profiles,
        storage_bytes=tuple(structure.storage_bytes),
        param_bytes=param_bytes,
        param_grad_bytes=param_grad_bytes,
        buffer_bytes=buffer_bytes,
        input_bytes=input_bytes,
        output_bytes=structure.final_output_bytes,
        mutated_buffers=mutated,
        device=str(device),
        step_seconds=step_seconds,
        times_estimated=estimate_times,
        loss_probe=probe.loss if probe else None,
        timing=timing,
        loss_measured=loss_measured,
        optimizer_workspace=(
            _probe_optimizer(optimizer) if probe is not None and optimizer is not None else 0
        ),
        probe_peak_bytes=probe.peak_bytes if probe else None,
        worst_case_draws=structure.worst_case_draws,
    )


# NOTE [profile: cost model]. Where nothing is measured (the meta device, a planner without
# a probe), the solvers' recompute cost is a fixed function of the graph: a roofline of each
# node's FLOPs and memory traffic at nominal rates for its device class, plus a fixed
# per-node dispatch cost. Where the probe runs, the measured seconds replace it (NOTE
# [timing: one time model]).
NOMINAL_RATES: dict[str, tuple[float, float, float]] = {
    # device type: (FLOP/s, bytes/s, seconds per node)
    "cpu": (50e9, 10e9, 10e-6),
    "cuda": (100e12, 2e12, 10e-6),
    "meta": (100e12, 2e12, 10e-6),
}


KEEP_OVERHEAD_SECONDS: dict[str, float] = {"cpu": 50e-6, "cuda": 20e-6, "meta": 20e-6}
"""What keeping one node's output inside a segment (selective recompute) costs, in the cost
model's seconds: two marker calls and a dispatch mode around the node's few operators, in
the forward and in the recompute (autockpt/rewrite/, ``_KeepCalls``). A node is kept only
where its own cost is higher. Measured on a 2-core CPU: see docs/design.md, "Selective
recompute"."""


SEGMENT_OVERHEAD_SECONDS: dict[str, float] = {"cpu": 100e-6, "cuda": 50e-6, "meta": 50e-6}
"""Fixed cost of one checkpoint segment (saved-tensor hooks, recompute dispatch) per device
class, in the cost model's seconds: it keeps the solvers from cutting a cheap model into
many tiny segments."""


def estimated_seconds(flops: int, traffic_bytes: int, device_type: str = "cuda") -> float:
    """The cost model's forward seconds of one node (NOTE [profile: cost model]): the slower of
    its arithmetic and its memory traffic (bytes read and written) at the nominal rates of
    ``device_type``, plus a fixed per-node cost."""
    flop_rate, byte_rate, per_node = NOMINAL_RATES.get(device_type, NOMINAL_RATES["cuda"])
    return max(flops / flop_rate, traffic_bytes / byte_rate) + per_node


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


# NOTE [profile: probe]. Workspaces and times are properties of real kernels, so they are
# measured on the device, but never with a whole step alive: the graph runs forward
# without autograd (values die after their last use: the working set of any plan's
# forward), and at each compute node the node alone runs forward and backward on copies of
# its inputs. Pass 1 runs under the profiler's allocator events and a storage tracker; per
# node and phase, the workspace is the allocator's peak above the phase's start minus the
# tracker's (what operators return). Pass 2 times each node ``repeat`` times (minimum).
_PROBE_MARK = "autockpt::probe::"


@dataclass(frozen=True)
class LossProbe:
    """The loss run once on real tensors, like a node (NOTE [record: loss windows]): the
    allocator's peak above the start of its forward, what its forward leaves allocated (its
    result and what it saves for backward, kernels' own saves included), and the peak above
    the start of its own backward. Raw allocator bytes: the recorder compares them with
    what the fake step recorded for the loss, because a loss's operators may run as other
    operators on fake tensors than on real ones (``mse_loss``'s CPU autograd saves a
    difference the fake kernel never makes)."""

    forward_peak: int
    forward_net: int
    backward_peak: int
    saved_output_bytes: int = 0
    """The model's outputs the loss saves for its backward (a logsumexp's input)."""
    output_gradient_bytes: int = 0
    """The gradients of the model's output the loss's backward hands on (distinct storages:
    a summed output's gradient is a broadcast scalar)."""


@dataclass(frozen=True)
class _ProbeResult:
    forward_seconds: list[float]
    backward_seconds: list[float]
    forward_workspace: list[int]
    backward_workspace: list[int]
    hidden_saved: list[int]
    device_forward_ops: list[tuple[tuple[str, int], ...]]
    loss_seconds: float
    loss: LossProbe | None
    peak_bytes: int


class _Prober(CaptureInterpreter):
    """Runs the graph without autograd and probes every compute node (NOTE [profile: probe])."""

    def __init__(
        self,
        model: nn.Module,
        capture: Capture,
        index_of: dict[fx.Node, int],
        structure: _Recorder,
        tracker: StorageTracker | None,
    ) -> None:
        super().__init__(model, capture, garbage_collect_values=True)
        self.index_of = index_of
        self.structure = structure
        self.tracker = tracker
        n = len(index_of)
        self.forward_seconds = [0.0] * n
        self.backward_seconds = [0.0] * n
        self.device: torch.device | None = None

    def run_node(self, n: fx.Node) -> Any:
        with torch.no_grad():
            result = super().run_node(n)
        i = self.index_of.get(n)
        if i is not None:
            self.device = self.device or _first_device(n, self.env)
            forward, backward = self.probe(
                f"{i}",
                lambda args, kwargs, n=n: getattr(self, n.op)(n.target, args, kwargs),
                fx.node.map_arg((n.args, n.kwargs), lambda a: self.env[a]),
                self.structure.needs_grad[i],
                self.structure.in_place[i],
                self._module_parameters(n),
                self.structure.grad_layouts[i],
            )
            self.forward_seconds[i], self.backward_seconds[i] = forward, backward
        return result

    def _module_parameters(self, n: fx.Node) -> list[torch.Tensor]:
        if n.op != "call_module":
            return []
        return [p for p in self.module.get_submodule(n.target).parameters() if p.requires_grad]

    def probe(
        self,
        label: str,
        call: Any,
        args_kwargs: Any,
        needs_grad: tuple[bool, ...],
        in_place: bool,
        parameters: list[torch.Tensor],
        grad_layouts: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] | None = None,
        on_gradients: Callable[[tuple[torch.Tensor | None, ...]], None] | None = None,
    ) -> tuple[float, float]:
        """Run ``call`` forward and backward alone on fresh copies of its inputs: leaves
        where the step differentiates them, clones where the call writes in place. Returns
        (forward, backward) seconds; ``on_gradients`` is shown the gradients the backward
        returned."""
        flat, spec = pytree.tree_flatten(args_kwargs)
        wants = iter(needs_grad)
        leaves: list[torch.Tensor] = []
        fresh = []
        copies: dict[
            int, Any
        ] = {}  # one copy per tensor object: attention(x, x, x) stays self-attention
        for value in flat:
            if isinstance(value, torch.Tensor):
                wanted = next(wants, False)
                if id(value) in copies:
                    value = copies[id(value)]
                elif wanted and (value.is_floating_point() or value.is_complex()):
                    leaf = value.detach().requires_grad_()
                    leaves.append(leaf)
                    value = copies[id(value)] = leaf.clone() if in_place else leaf
                elif in_place:
                    value = copies[id(value)] = value.clone()
            fresh.append(value)
        args, kwargs = pytree.tree_unflatten(fresh, spec)
        existing = [t for t in fresh if isinstance(t, torch.Tensor)] + leaves + parameters
        tracker = self.tracker
        if tracker is not None:
            tracker.static_ids = {id(t.untyped_storage()) for t in existing}
        empty_autocast_cache()  # under autocast: this node's weight casts are made in it
        with torch.enable_grad():
            start = now(self.device)
            with self._window(f"f{label}"), AutocastCasts() as casts:
                out = call(args, kwargs)
            forward = now(self.device) - start
            outs, grads = [], []
            for k, t in enumerate(tensors_in(out)):
                if t.requires_grad and t.grad_fn is not None:
                    outs.append(t)
                    grads.append(_gradient_like(t, (grad_layouts or {}).get(k)))
            targets = casts.instead_of(leaves + parameters)  # under autocast: their casts
            backward = 0.0
            if outs and targets:
                if tracker is not None:
                    tracker.static_ids |= {id(t.untyped_storage()) for t in outs + grads}
                start = now(self.device)
                with self._window(f"b{label}"):
                    given = torch.autograd.grad(outs, targets, grads, allow_unused=True)
                backward = now(self.device) - start
                if on_gradients is not None:
                    on_gradients(given)
                del given
        return forward, backward

    @contextlib.contextmanager
    def _window(self, label: str) -> Any:
        if self.tracker is None:
            yield
            return
        self.tracker.window = label
        with torch.profiler.record_function(_PROBE_MARK + label), self.tracker:
            yield
        self.tracker.window = None


def _worst_case_probe(draws: bool, *args: Any) -> _ProbeResult:
    """The probe, with scalar draws at their worst case when the fake step met any (a
    random-depth model runs every layer: autockpt/base/rng.py)."""
    with worst_case_draws() if draws else contextlib.nullcontext():
        return _probe(*args)


# Under autocast the probe leaves none of the weight casts it makes in autocast's cache
# (autockpt/base/precision.py).
@fresh_autocast_cache()
def _probe(
    model: nn.Module,
    capture: Capture,
    inputs: Inputs,
    loss_fn: LossFn,
    index_of: dict[fx.Node, int],
    structure: _Recorder,
    repeat: int,
) -> _ProbeResult:
    """NOTE [profile: probe]: measure every node's kernel workspaces (pass 1) and times (pass 2)
    on the device with a lean working set; also the loss's, and the allocator's peak
    meanwhile."""
    device = device_of(model, inputs)
    n = len(index_of)
    tracker = StorageTracker()
    tracker.op_calls = {}
    prober = _Prober(model, capture, index_of, structure, tracker=tracker)
    with profiler_session() as session:
        output = run_graph(capture, model, inputs, prober)
        loss_run = _probe_loss(prober, output, loss_fn)
        del output
    events = allocator_events(session, device.type)
    tracked = tracker.deltas_by_window()
    ops = tracker.op_log()
    workspace: dict[str, int] = {}
    hidden: dict[str, int] = {}
    loss_real: dict[str, list[int]] = {}
    for mark in marks(session, _PROBE_MARK):
        label = mark.name[len(_PROBE_MARK) :]
        real = [e.nbytes for e in events if mark.start_ns <= e.time_ns <= mark.end_ns]
        if label in ("floss", "bloss"):
            loss_real[label] = real
        seen = tracked.get(label, [])
        workspace[label] = max(0, peak_above_start(real) - peak_above_start(seen))
        hidden[label] = max(0, sum(real) - sum(seen))
    peak = static_bytes(model, inputs) + peak_above_start([e.nbytes for e in events])
    del session, events, tracked, tracker, prober
    loss = (
        LossProbe(
            forward_peak=peak_above_start(loss_real["floss"]),
            forward_net=sum(loss_real["floss"]),
            backward_peak=peak_above_start(loss_real.get("bloss", [])),
            output_gradient_bytes=loss_run.output_gradient_bytes,
            saved_output_bytes=loss_run.saved_output_bytes,
        )
        if "floss" in loss_real
        else None
    )

    # per node the median over the timing passes (NOTE [timing: one time model]): a step
    # is timed as the median of steps, and the sum of every node's minimum is below any
    # whole step a busy machine runs
    passes: list[tuple[list[float], list[float], float]] = []
    for _ in range(repeat):
        timer = _Prober(model, capture, index_of, structure, tracker=None)
        output = run_graph(capture, model, inputs, timer)
        loss_time = _probe_loss(timer, output, loss_fn).seconds
        del output
        passes.append((timer.forward_seconds, timer.backward_seconds, loss_time))
    forward = [statistics.median(p[0][i] for p in passes) if passes else 0.0 for i in range(n)]
    backward = [statistics.median(p[1][i] for p in passes) if passes else 0.0 for i in range(n)]
    loss_seconds = statistics.median(p[2] for p in passes) if passes else 0.0
    return _ProbeResult(
        forward_seconds=forward,
        backward_seconds=backward,
        forward_workspace=[workspace.get(f"f{i}", 0) for i in range(n)],
        backward_workspace=[workspace.get(f"b{i}", 0) for i in range(n)],
        hidden_saved=[hidden.get(f"f{i}", 0) for i in range(n)],
        device_forward_ops=[tuple(ops.get(f"f{i}", ())) for i in range(n)],
        loss_seconds=loss_seconds,
        loss=loss,
        peak_bytes=peak,
    )


def _probe_optimizer(optimizer: torch.optim.Optimizer) -> int:
    """NOTE [profile: optimizer probe]. A real optimizer step allocates what its operators do
    not return: on the CPU each parameter's update wraps Python scalars (the learning rate,
    the bias corrections) in 0-dim tensors, 4 to 12 bytes at a time. That overhead does not
    grow with the parameters' sizes, so it is measured on a stand-in of the optimizer over
    one-element copies of its parameters (same dtypes, devices and count: a lean working set
    whatever the model's size), under the profiler's allocator events and the storage
    tracker at once, after a first step has made the state: the difference of the two peaks.
    """
    tiny = {
        id(p): torch.zeros((1,) * p.dim(), dtype=p.dtype, device=p.device).requires_grad_(
            p.requires_grad
        )
        for group in optimizer.param_groups
        for p in group["params"]
    }
    stepping = stand_in(optimizer, lambda p: tiny[id(p)])
    for t in tiny.values():
        if t.requires_grad:
            t.grad = torch.ones_like(t)
    optimizer_step(stepping)  # the state, as the steady state holds it
    alive = [*tiny.values(), *state_tensors(stepping)]
    alive += [t.grad for t in tiny.values() if t.grad is not None]
    tracker = StorageTracker({id(t.untyped_storage()) for t in alive})
    device = next(iter(tiny.values())).device if tiny else torch.device("cpu")
    with profiler_session() as session, tracker:
        optimizer_step(stepping)
    real = peak_above_start([e.nbytes for e in allocator_events(session, device.type)])
    seen = tracker.deltas_by_window()
    tracked = peak_above_start([d for window in sorted(seen) for d in seen[window]])
    return max(0, real - tracked)


def _gradient_like(
    t: torch.Tensor, layout: tuple[tuple[int, ...], tuple[int, ...]] | None
) -> torch.Tensor:
    """A gradient for ``t`` laid out as the step's backward hands it over (kernels copy a
    non-contiguous gradient, such as a slice of a concatenation's, into a workspace)."""
    if layout is None or tuple(layout[0]) != tuple(t.shape):
        return torch.ones_like(t)
    shape, stride = layout
    return torch.empty_strided(shape, stride, dtype=t.dtype, device=t.device).fill_(1)


@dataclass(frozen=True)
class _LossRun:
    """One probe of the loss: its forward and backward seconds, the bytes of the model's
    outputs it saves for its backward, and of the gradients it hands back."""

    seconds: float = 0.0
    saved_output_bytes: int = 0
    output_gradient_bytes: int = 0


def _probe_loss(prober: _Prober, output: Any, loss_fn: LossFn) -> _LossRun:
    """Probe the loss like a node: on leaves made of the graph's (autograd-free) outputs.
    What it saves of them and the gradients it returns are what a loss measured rather than
    recorded on fake tensors (:func:`autockpt.base.runtime.loss_on_fake`) holds."""
    made: list[torch.Tensor] = []

    def leaf(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            made.append(t.detach().requires_grad_())
            return made[-1]
        return t

    try:
        fresh = pytree.tree_map_only(torch.Tensor, leaf, output)
    except Exception:  # an output type pytree cannot rebuild: the loss goes unprobed
        return _LossRun()
    leaves = {storage_key(t) for t in made}
    saved = StorageSet()
    saved_bytes = gradient_bytes = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved_bytes
        if storage_key(t) in leaves:
            saved_bytes += saved.add([t])
        return t

    def call(args: Any, kwargs: Any) -> Any:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return loss_fn(args[0])

    def count(given: tuple[torch.Tensor | None, ...]) -> None:
        nonlocal gradient_bytes
        gradient_bytes = StorageSet().add(g for g in given if g is not None)

    forward, backward = prober.probe(
        "loss", call, ((fresh,), {}), tuple(True for _ in made), False, [], on_gradients=count
    )
    return _LossRun(forward + backward, saved_bytes, gradient_bytes)


def trained_parameters(
    model: nn.Module, capture: Capture, index_of: dict[fx.Node, int]
) -> dict[int, tuple[nn.Parameter, int]]:
    """The parameters that require a gradient and that the graph uses, by ``id``, each with
    the index of its *last* forward user (backward meets it first, and creates its
    gradient there)."""
    params = {name: p for name, p in model.named_parameters(remove_duplicate=False)}
    trainable = {id(p) for p in params.values() if p.requires_grad}
    last_user: dict[int, tuple[nn.Parameter, int]] = {}

    def touch(param: nn.Parameter, i: int) -> None:
        if id(param) in trainable:
            last_user[id(param)] = (param, max(last_user.get(id(param), (param, -1))[1], i))

    for node in capture.graph.nodes:
        if node.op == "get_attr" and node.target in params:
            for user in node.users:
                if user in index_of:
                    touch(params[node.target], index_of[user])
        elif node.op == "call_module":
            for p in model.get_submodule(node.target).parameters():
                touch(p, index_of[node])
    return last_user


def _param_grad_attribution(
    model: nn.Module, capture: Capture, index_of: dict[fx.Node, int]
) -> tuple[dict[int, int], int]:
    """Bytes of parameter gradients by the node whose backward creates them: the *last*
    forward user of the parameter (backward meets it first)."""
    grads: dict[int, int] = {}
    for p, i in trained_parameters(model, capture, index_of).values():
        grads[i] = grads.get(i, 0) + p.numel() * p.element_size()
    trainable = {id(p): p for p in model.parameters() if p.requires_grad}
    total = sum(p.numel() * p.element_size() for p in trainable.values())
    return grads, total


def _first_device(n: fx.Node, env: dict) -> torch.device:
    for t in tensors_in(fx.node.map_arg((n.args, n.kwargs), lambda a: env.get(a))):
        return t.device
    return torch.device("cpu")


def _check_loss(loss: Any) -> None:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError(
            f"loss_fn must return a scalar tensor, got {type(loss).__name__}"
            + (f" of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
        )
