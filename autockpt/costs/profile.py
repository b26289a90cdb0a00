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

The profile's parts live in modules of their own: the fake step that reads the structure
(autockpt/costs/fake_structure.py), the probe that measures real kernels
(autockpt/costs/probe.py), the nominal cost model used where nothing is measured
(autockpt/costs/cost_model.py) and the attribution of parameter gradients
(autockpt/costs/parameters.py). This module holds the profile's types and :func:`profile`,
which puts them together.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch import nn

from autockpt.base.allocations import StorageSet
from autockpt.base.inputs import Inputs
from autockpt.base.precision import Precision, autocast_dtypes
from autockpt.base.runtime import LossFn, as_found, default_loss, device_of, loss_name
from autockpt.base.target import Target
from autockpt.capture.captured import Capture

# KEEP_OVERHEAD_SECONDS and trained_parameters are re-exported: planning imports them from
# here (autockpt/planning/predict.py, prepared.py).
from autockpt.costs.cost_model import KEEP_OVERHEAD_SECONDS as KEEP_OVERHEAD_SECONDS
from autockpt.costs.cost_model import (
    SEGMENT_OVERHEAD_SECONDS,
    Rates,
    estimated_seconds,
    rates_of,
)
from autockpt.costs.fake_structure import _fake_structure, _Recorder
from autockpt.costs.parameters import _param_grad_attribution
from autockpt.costs.parameters import trained_parameters as trained_parameters
from autockpt.costs.probe import LossProbe, _probe_optimizer, _ProbeResult, _worst_case_probe
from autockpt.costs.timing import Timing, lookup, segment_seconds, settle, timing_key


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
    target: Target | None = None,
) -> Profile:
    """Profile one training step of ``capture``'s graph, node by node, without ever running
    the un-checkpointed step on real tensors.

    Structure (saved, returned and mutated storages, FLOPs, random ops) comes from one
    forward on fake tensors (NOTE [profile: fake structure]); kernel workspaces and times from
    the probe (NOTE [profile: probe]), which runs each node on real tensors while only a lean
    working set is alive. On the meta device (or with ``estimate_times``) there is no probe:
    times are the cost model's (NOTE [profile: cost model]), a roofline of ``target``'s
    rates when one is given (NOTE [target: planning for another device]), and workspaces
    are unknown.
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
        structure, loss_measured, mutated = _fake_structure(
            model, capture, inputs, loss_fn, index_of
        )
        # one time model: measured seconds, the same in every process of this machine
        # (NOTE [timing: one time model], NOTE [timing: stored]); stored ones skip the
        # probe's timing passes
        key = None if estimate_times else _timing_key(model, capture, inputs, loss_fn, device)
        stored = lookup(key, len(nodes)) if key is not None else None
        probe: _ProbeResult | None = None
        if not estimate_times:
            draws = structure.worst_case_draws > 0  # the probe's, as the fake step's: worst case
            passes = 0 if stored is not None else max(1, repeat)
            probe = _worst_case_probe(
                draws, model, capture, inputs, loss_fn, index_of, structure, passes
            )
    rates = rates_of(target, device.type, _compute_dtype(model))
    times = _node_times(structure, probe, key, stored, device, rates)
    return Profile(
        nodes=_node_profiles(nodes, structure, probe, times, grad_bytes_by_node),
        storage_bytes=tuple(structure.storage_bytes),
        param_bytes=param_bytes,
        param_grad_bytes=param_grad_bytes,
        buffer_bytes=buffer_bytes,
        input_bytes=input_bytes,
        output_bytes=structure.final_output_bytes,
        mutated_buffers=mutated,
        device=str(device),
        step_seconds=times.step_seconds,
        times_estimated=estimate_times,
        loss_probe=probe.loss if probe else None,
        timing=times.timing,
        loss_measured=loss_measured,
        optimizer_workspace=(
            _probe_optimizer(optimizer) if probe is not None and optimizer is not None else 0
        ),
        probe_peak_bytes=probe.peak_bytes if probe else None,
        worst_case_draws=structure.worst_case_draws,
    )


def _compute_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the step's matrix multiplies run in: autocast's on the model's device type
    (its planning device's for a meta model), else the parameters' (float32 when mixed)."""
    first = next(iter(model.parameters()), None)
    kind = "cpu" if first is None or first.device.type == "meta" else first.device.type
    cast = autocast_dtypes().get(kind)  # a meta step runs on fake CPU tensors
    if cast is not None:
        return cast
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    return dtypes.pop() if len(dtypes) == 1 else torch.float32


def _timing_key(
    model: nn.Module, capture: Capture, inputs: Inputs, loss_fn: LossFn, device: torch.device
) -> str:
    """What the profile's measured seconds are stored under (NOTE [timing: stored])."""
    return timing_key(
        capture.fingerprint(),
        model,
        inputs.signature(),
        (Precision.now(model).key(), loss_name(loss_fn)),
        device,
    )


@dataclass(frozen=True)
class _NodeTimes:
    """A profile's seconds: per node the cost the solvers rank by (``NodeProfile.cost_seconds``)
    and the forward and backward seconds reported, the step's, and the measured timing they
    come from (``None``: the cost model's)."""

    cost: list[float]
    forward: list[float]
    backward: list[float]
    step_seconds: float
    timing: Timing | None


def _node_times(
    structure: _Recorder,
    probe: _ProbeResult | None,
    key: str | None,
    stored: Timing | None,
    device: torch.device,
    rates: Rates,
) -> _NodeTimes:
    """The seconds of the one time model (NOTE [timing: one time model]): those stored for
    ``key``, else the probe's, stored now (NOTE [timing: stored]); without a probe, the cost
    model's (NOTE [profile: cost model]), backward at twice the forward."""
    costs = [
        estimated_seconds(structure.flops[i], structure.traffic[i], rates)
        for i in range(len(structure.flops))
    ]
    if probe is None or key is None:
        return _NodeTimes(costs, costs, [2 * c for c in costs], 3 * sum(costs), None)
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
    # the step's seconds at the step factors, once stored
    return _NodeTimes(costs, fwd_times, bwd_times, timing.step_seconds(), timing)


def _node_profiles(
    nodes: list[fx.Node],
    structure: _Recorder,
    probe: _ProbeResult | None,
    times: _NodeTimes,
    grad_bytes_by_node: dict[int, int],
) -> tuple[NodeProfile, ...]:
    """Each compute node's :class:`NodeProfile`: the fake step's structure, the probe's
    workspaces (none without a probe) and ``times``."""
    return tuple(
        NodeProfile(
            name=node.name,
            op=node.op,
            saved=tuple(structure.saved[i]),
            outputs=tuple(structure.outputs[i]),
            mutates=tuple(structure.mutates[i]),
            forward_seconds=times.forward[i],
            backward_seconds=times.backward[i],
            flops=structure.flops[i],
            random=structure.random[i],
            param_grad_bytes=grad_bytes_by_node.get(i, 0),
            cost_seconds=times.cost[i],
            forward_workspace=probe.forward_workspace[i] if probe else 0,
            backward_workspace=probe.backward_workspace[i] if probe else 0,
            hidden_saved=probe.hidden_saved[i] if probe else 0,
            device_forward_ops=probe.device_forward_ops[i] if probe else (),
        )
        for i, node in enumerate(nodes)
    )
