"""The probe: what a node costs on real kernels, measured one node at a time.

Kernel workspaces (what a kernel allocates beyond the tensors its operators return) and
seconds are properties of real kernels, so the profile (autockpt/costs/profile.py) measures
them on the device, but never with a whole step alive (NOTE [profile: probe]): each compute
node runs forward and backward alone on copies of its inputs while the graph runs without
autograd. The loss is probed the same way, and the training loop's optimizer once, on
one-element stand-ins of its parameters (NOTE [profile: optimizer probe]). What to recreate
for each node (which arguments need gradients, which are written in place, the layouts of
the gradients it receives) comes from the fake step (autockpt/costs/fake_structure.py).
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from autockpt.base.allocations import (
    StorageSet,
    StorageTracker,
    allocator_events,
    deltas_within,
    marks,
    peak_above_start,
    profiler_session,
    static_bytes,
    storage_key,
)
from autockpt.base.inputs import Inputs
from autockpt.base.optimizer import stand_in, state_tensors
from autockpt.base.optimizer import step as optimizer_step
from autockpt.base.precision import AutocastCasts, empty_autocast_cache, fresh_autocast_cache
from autockpt.base.rng import worst_case_draws
from autockpt.base.runtime import LossFn, device_of, now, tensors_in
from autockpt.capture.captured import Capture
from autockpt.costs.fake_structure import _Recorder
from autockpt.costs.interpret import CaptureInterpreter, run_graph

# NOTE [profile: probe]. Workspaces and times are properties of real kernels, so they are
# measured on the device, but never with a whole step alive: the graph runs forward
# without autograd (values die after their last use: the working set of any plan's
# forward), and at each compute node the node alone runs forward and backward on copies of
# its inputs. Pass 1 runs under the profiler's allocator events and a storage tracker; per
# node and phase, the workspace is the allocator's peak above the phase's start minus the
# tracker's (what operators return). Pass 2 times each node ``repeat`` times; each
# node's seconds are the median over the timing passes.
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
        # the node is probed before its own result is made: the probe's output and the
        # graph's are never alive at once (a lean working set, NOTE [profile: probe])
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
                release_outputs=_saves_through_autograd(n, self.module),
            )
            self.forward_seconds[i], self.backward_seconds[i] = forward, backward
        with torch.no_grad():
            return super().run_node(n)

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
        release_outputs: bool = False,
    ) -> tuple[float, float]:
        """Run ``call`` forward and backward alone on fresh copies of its inputs: leaves
        where the step differentiates them, clones where the call writes in place. Returns
        (forward, backward) seconds; ``on_gradients`` is shown the gradients the backward
        returned. ``release_outputs``: the call saves for backward only through autograd's
        saved tensors, so outputs it does not save are freed before the backward (NOTE
        [profile: probe's working set])."""
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
            saved = _SavedStorages() if release_outputs else contextlib.nullcontext()
            start = now(self.device)
            with self._window(f"f{label}"), AutocastCasts() as casts, saved:
                out = call(args, kwargs)
            forward = now(self.device) - start
            outs, grads = [], []
            for k, t in enumerate(tensors_in(out)):
                if t.requires_grad and t.grad_fn is not None:
                    outs.append(t)
                    grads.append(_gradient_like(t, (grad_layouts or {}).get(k)))
            if isinstance(saved, _SavedStorages):
                saved.release(outs, kept=existing)
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


# NOTE [profile: probe's working set]. The probe is the one place planning runs kernels for
# real, so its peak must stay within what the plans it serves may use (the budget contract:
# nothing runs above the budget, fit_batch included, autockpt/fit/__init__.py). Two things keep it
# lean. A node is probed before the graph makes its own result, so the probe's output and
# the graph's are never alive together. And the outputs the node's backward does not read
# (a convolution's, a matmul's: autograd saved neither) are freed before the backward: their
# storages are resized to nothing, which autograd allows because it checks only their
# shapes. Only for calls whose saves go through autograd's saved tensors (operators and
# torch.nn's modules), never one of the input storages, never a saved one. On a CPU stack of
# 3x3 convolutions (tests/test_fit_contract.py) the probe peaked at 1.29x the answer's budget
# before, 1.12x with the first change alone.


class _SavedStorages:
    """The storages autograd saves while the probe's forward runs (NOTE [profile: probe's
    working set])."""

    def __init__(self) -> None:
        self.keys: set[tuple[str, int]] = set()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.keys.add(storage_key(t))
        return t

    def __enter__(self) -> _SavedStorages:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)

    def release(self, outs: list[torch.Tensor], kept: list[torch.Tensor]) -> None:
        """Free the storages of ``outs`` no saved tensor and no ``kept`` tensor shares."""
        keep = self.keys | {storage_key(t) for t in kept}
        for t in outs:
            storage = t.untyped_storage()
            if storage_key(t) not in keep and type(t) is torch.Tensor and storage.nbytes():
                storage.resize_(0)


def _saves_through_autograd(n: fx.Node, model: nn.Module) -> bool:
    """Whether every tensor ``n``'s backward reads is saved through autograd's saved tensors
    (an operator, a method, a torch.nn module), not kept aside by a custom Function's ``ctx``
    (NOTE [profile: probe's working set])."""
    if n.op == "call_module":
        return type(model.get_submodule(n.target)).__module__.startswith("torch.nn.modules")
    if n.op == "call_method":
        return True
    if n.op != "call_function":
        return False
    target = n.target
    if isinstance(target, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
        return True
    owner = getattr(target, "__self__", None)
    if isinstance(owner, type) and issubclass(owner, torch.autograd.Function):
        return False
    module = getattr(target, "__module__", None) or ""
    return module.startswith("torch") or module == "_operator"


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
    times = [e.time_ns for e in events]
    for mark in marks(session, _PROBE_MARK):
        label = mark.name[len(_PROBE_MARK) :]
        real = deltas_within(events, times, mark)
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


def _first_device(n: fx.Node, env: dict) -> torch.device:
    for t in tensors_in(fx.node.map_arg((n.args, n.kwargs), lambda a: env.get(a))):
        return t.device
    return torch.device("cpu")


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
