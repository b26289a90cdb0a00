"""Stage 2 — profile: run the captured graph node by node and record what each node costs.

Per compute node the profile records

* the storages autograd *saves* for backward (``saved_tensors_hooks``), de-duplicated by
  storage, with parameters, buffers and the model's inputs excluded: these are what
  checkpointing can free, and they are not the same as output sizes (a ReLU that saves its
  output and the next Linear that saves the same tensor as its input share one storage);
* the storages of its outputs and the storages it mutates in place (version counters), so
  that the chain builder never cuts across a tensor that is mutated later;
* forward seconds (median over ``repeat`` timed runs), backward seconds (time from the
  node's gradient arriving to the next node's, read from autograd pre-hooks), FLOPs
  (``torch.utils.flop_counter``) and whether it consumes random numbers (RNG state changes);
* the parameter-gradient bytes that appear when backward reaches the node.

Model buffers that the forward changes (batch-norm running statistics, counters) are found
by comparing values before and after one forward: kernels update running statistics without
bumping version counters, so values are the only reliable witness. The model's state
(buffers, ``.grad``, RNG) is restored afterwards: profiling leaves no trace in training.
"""

from __future__ import annotations

import contextlib
import statistics
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from autockpt.runtime import (
    LossFn,
    clear_grads,
    default_loss,
    device_of,
    now,
    preserved_training_state,
    tensors_in,
)
from autockpt.trace import Capture, Inputs


@dataclass(frozen=True)
class NodeProfile:
    """What one compute node of the graph costs. Storages are indices into
    :attr:`Profile.storage_bytes`."""

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


@dataclass(frozen=True)
class Profile:
    """Per-node costs plus the static memory of one training step of the captured graph."""

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

    @property
    def static_bytes(self) -> int:
        """Memory that exists for the whole step whatever the plan: parameters, buffers and
        inputs (gradients are added as backward reaches their parameters)."""
        return self.param_bytes + self.buffer_bytes + self.input_bytes

    def saved_bytes(self) -> int:
        unique = {s for node in self.nodes for s in node.saved}
        return sum(self.storage_bytes[s] for s in unique)


def placeholder_values(capture: Capture, model: nn.Module, inputs: Inputs) -> list[Any]:
    """The flat list of values for the graph's placeholders, in graph order."""
    placeholders = [n for n in capture.graph.nodes if n.op == "placeholder"]
    spec = capture.extra_attributes.get("_in_spec")
    if spec is not None:
        from torch.fx._pytree import tree_flatten_spec

        return list(tree_flatten_spec((list(inputs.args), inputs.kwargs), spec))
    import inspect

    bound = inspect.signature(model.forward).bind(*inputs.args, **inputs.kwargs)
    values = []
    for node in placeholders:
        name = str(node.target)
        if name in bound.arguments:
            values.append(bound.arguments[name])
        elif node.args:
            values.append(node.args[0])
        else:
            raise TypeError(f"no value for the graph input '{name}'")
    return values


def run_graph(capture: Capture, model: nn.Module, inputs: Inputs, interpreter: fx.Interpreter | None = None) -> Any:
    """Run the captured graph on the original module tree and return the user-facing output."""
    interp = interpreter or CaptureInterpreter(model, capture)
    # Inputs are flattened and outputs rebuilt here, once (the interpreter would otherwise
    # rebuild an export graph's pytree output a second time).
    flat = interp.run(*placeholder_values(capture, model, inputs), enable_io_processing=False)
    return capture.graph._codegen.process_outputs(flat)


def profile(
    model: nn.Module,
    capture: Capture,
    inputs: Inputs,
    *,
    loss_fn: LossFn | None = None,
    repeat: int = 3,
    estimate_times: bool | None = None,
) -> Profile:
    """Profile one training step of ``capture``'s graph, node by node, on real inputs.

    ``estimate_times`` replaces timed runs by FLOP-based estimates (see
    :func:`estimated_seconds`); it defaults to on for the meta device, where tensors have
    shapes but no data, so that a model whose parameters do not fit in memory can be
    planned without allocating them.
    """
    loss_fn = loss_fn or default_loss
    if estimate_times is None:
        estimate_times = device_of(model, inputs).type == "meta"
    nodes = capture.compute_nodes()
    index_of = {node: i for i, node in enumerate(nodes)}
    device = device_of(model, inputs)
    static_keys, param_bytes, buffer_bytes, input_bytes = _static_storages(model, inputs)
    grad_bytes_by_node, param_grad_bytes = _param_grad_attribution(model, capture, index_of)

    with preserved_training_state(model):
        buffers_before = {name: b.detach().clone() for name, b in model.named_buffers()}
        recorder = _Recorder(model, capture, index_of, static_keys, record=True)
        output = run_graph(capture, model, inputs, recorder)
        mutated = tuple(
            name for name, b in model.named_buffers()
            if (_named_like_running_statistics(name) if b.device.type == "meta"
                else not _same(b, buffers_before[name]))
        )
        del buffers_before
        _backward(loss_fn(output), None)
        del output
        structure = recorder
        clear_grads(model)

        fwd_times: list[list[float]] = [[] for _ in nodes]
        bwd_times: list[list[float]] = [[] for _ in nodes]
        step_times: list[float] = []
        for _ in range(0 if estimate_times else max(1, repeat)):
            timer = _Recorder(model, capture, index_of, static_keys, record=False)
            start = now(device)
            output = run_graph(capture, model, inputs, timer)
            loss = loss_fn(output)
            stamps = timer.backward_stamps()
            _backward(loss, None)
            end = now(device)
            del output, loss
            step_times.append(end - start)
            for i, seconds in enumerate(timer.forward_seconds):
                fwd_times[i].append(seconds)
            for i, seconds in _backward_durations(stamps, end).items():
                bwd_times[i].append(seconds)
            clear_grads(model)

    if estimate_times:
        for i in range(len(nodes)):
            out_bytes = sum(structure.storage_bytes[s] for s in structure.outputs[i])
            fwd_times[i] = [estimated_seconds(structure.flops[i], out_bytes)]
            bwd_times[i] = [2 * fwd_times[i][0]]
        step_times = [sum(3 * t[0] for t in fwd_times)] if nodes else [0.0]
    profiles = tuple(
        NodeProfile(
            name=node.name,
            op=node.op,
            saved=tuple(structure.saved[i]),
            outputs=tuple(structure.outputs[i]),
            mutates=tuple(structure.mutates[i]),
            forward_seconds=statistics.median(fwd_times[i]) if fwd_times[i] else 0.0,
            backward_seconds=statistics.median(bwd_times[i]) if bwd_times[i] else 0.0,
            flops=structure.flops[i],
            random=structure.random[i],
            param_grad_bytes=grad_bytes_by_node.get(i, 0),
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
        step_seconds=statistics.median(step_times),
        times_estimated=estimate_times,
    )


ESTIMATED_FLOPS_PER_SECOND = 100e12
"""Throughput assumed by FLOP-based time estimates (an accelerator's dense matmul rate)."""
ESTIMATED_BYTES_PER_SECOND = 1e12
"""Memory bandwidth assumed by FLOP-based time estimates (for ops that do little arithmetic)."""


def estimated_seconds(flops: int, output_bytes: int) -> float:
    """A roofline estimate of one node's forward time: the slower of its arithmetic at
    :data:`ESTIMATED_FLOPS_PER_SECOND` and writing its outputs at
    :data:`ESTIMATED_BYTES_PER_SECOND`. Only the *relative* cost of nodes matters to the
    solvers, so the constants set the scale of reported seconds, not the plan."""
    return max(flops / ESTIMATED_FLOPS_PER_SECOND, output_bytes / ESTIMATED_BYTES_PER_SECOND)


def checkpoint_overhead_seconds(device: torch.device, repeat: int = 50) -> float:
    """Fixed cost of one ``torch.utils.checkpoint`` segment on ``device`` (forward bookkeeping,
    recompute dispatch, saved-tensor hooks), measured on a trivial function: the median extra
    time of a checkpointed step over a plain one. Solvers charge it once per segment, so
    they do not cut a cheap model into many tiny segments."""
    from torch.utils.checkpoint import checkpoint

    x = torch.ones(8, device=device, requires_grad=True)

    def body(t: torch.Tensor) -> torch.Tensor:
        return t.sin()

    def plain() -> None:
        body(x).sum().backward()

    def checkpointed() -> None:
        checkpoint(body, x, use_reentrant=False).sum().backward()

    extra = []
    for _ in range(repeat):
        start = now(device)
        plain()
        middle = now(device)
        checkpointed()
        extra.append((now(device) - middle) - (middle - start))
    return max(0.0, statistics.median(extra))


class CaptureInterpreter(fx.Interpreter):
    """Runs a capture's graph on the user's module tree. Attributes the tree lacks are
    constants that capture created (torch.export lifts tensors a forward builds, e.g. with
    ``torch.tensor``, into ``lifted_tensor_<k>``); they are read from the capture."""

    def __init__(self, model: nn.Module, capture: Capture, **kwargs: Any) -> None:
        super().__init__(model, graph=capture.graph, **kwargs)
        self.capture_module = capture.graph_module

    def fetch_attr(self, target: str) -> Any:
        try:
            return super().fetch_attr(target)
        except RuntimeError:
            obj: Any = self.capture_module
            for part in target.split("."):
                obj = getattr(obj, part)
            return obj


class _Recorder(CaptureInterpreter):
    """An interpreter that records, per node, saved/output/mutated storages (``record``) or
    forward wall time (timing runs). Values are kept alive for the whole run so that storage
    addresses are never reused within one profile."""

    def __init__(self, model: nn.Module, capture: Capture, index_of: dict[fx.Node, int],
                 static_keys: set[tuple[str, int]], record: bool) -> None:
        super().__init__(model, capture, garbage_collect_values=not record)
        self.index_of = index_of
        self.static_keys = static_keys
        self.record = record
        n = len(index_of)
        self.saved: list[list[int]] = [[] for _ in range(n)]
        self.outputs: list[list[int]] = [[] for _ in range(n)]
        self.mutates: list[list[int]] = [[] for _ in range(n)]
        self.flops = [0] * n
        self.random = [False] * n
        self.forward_seconds = [0.0] * n
        self.storage_bytes: list[int] = []
        self.storage_index: dict[tuple[str, int], int] = {}
        self.keep_alive: list[Any] = []
        self.grad_fns: dict[int, Any] = {}
        self.final_output_bytes = 0
        self.device: torch.device | None = None

    def _storage_id(self, tensor: torch.Tensor) -> int | None:
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0:
            return None
        key = _storage_key(tensor)
        if key in self.static_keys:
            return None
        if key not in self.storage_index:
            self.storage_index[key] = len(self.storage_bytes)
            self.storage_bytes.append(storage.nbytes())
            self.keep_alive.append(storage)
        return self.storage_index[key]

    def run_node(self, n: fx.Node) -> Any:
        i = self.index_of.get(n)
        if i is None:
            result = super().run_node(n)
            if n.op == "output" and self.record:
                ids = {self._storage_id(t) for t in tensors_in(result)} - {None}
                self.final_output_bytes = sum(self.storage_bytes[s] for s in ids)
            return result
        if not self.record:
            self.device = self.device or _first_device(n, self.env)
            start = now(self.device)
            result = super().run_node(n)
            self.forward_seconds[i] = now(self.device) - start
            self._remember_grad_fn(i, result)
            return result

        saved: set[int] = set()

        def pack(t: torch.Tensor) -> torch.Tensor:
            sid = self._storage_id(t)
            if sid is not None:
                saved.add(sid)
            return t

        args = [t for t in tensors_in(self._lookup_args(n))]
        versions = [(t, t._version) for t in args]
        rng = torch.get_rng_state()
        cuda_rng = _cuda_rng_state()
        seeded = _SeededOpWatch() if _on_meta(args) else contextlib.nullcontext()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with FlopCounterMode(display=False) as counter, seeded:
                result = super().run_node(n)
        self.flops[i] = int(counter.get_total_flops())
        self.random[i] = not torch.equal(rng, torch.get_rng_state()) or cuda_rng != _cuda_rng_state()
        if isinstance(seeded, _SeededOpWatch):
            self.random[i] = seeded.seen
        self.saved[i] = sorted(saved)
        self.outputs[i] = sorted({self._storage_id(t) for t in tensors_in(result)} - {None})
        self.mutates[i] = sorted(
            {self._storage_id(t) for t, v in versions if t._version != v} - {None}
        )
        return result

    def _lookup_args(self, n: fx.Node) -> Any:
        return fx.node.map_arg((n.args, n.kwargs), lambda a: self.env.get(a))

    def _remember_grad_fn(self, i: int, result: Any) -> None:
        for t in tensors_in(result):
            if t.grad_fn is not None:
                self.grad_fns[i] = t.grad_fn
                return

    def backward_stamps(self) -> dict[int, list[float]]:
        """Register pre-hooks that stamp when backward reaches each node's output."""
        stamps: dict[int, list[float]] = {}
        for i, grad_fn in self.grad_fns.items():
            def hook(grad_outputs: Any, i: int = i) -> None:
                stamps.setdefault(i, []).append(now(self.device))

            grad_fn.register_prehook(hook)
        return stamps


class _SeededOpWatch(TorchDispatchMode):
    """Notes whether any operator that draws random numbers runs. Meta tensors consume no
    random numbers, so the RNG-state witness used on real devices sees nothing there; the
    operator's ``nondeterministic_seeded`` tag (dropout, bernoulli, randn_like) says it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.seen = True
        return func(*args, **(kwargs or {}))


def _on_meta(values: list[torch.Tensor]) -> bool:
    return any(t.device.type == "meta" for t in values)


def _backward_durations(stamps: dict[int, list[float]], end: float) -> dict[int, float]:
    """Attribute backward time to nodes: from a node's first stamp to the next stamp."""
    order = sorted((times[0], i) for i, times in stamps.items())
    durations: dict[int, float] = {}
    for k, (t, i) in enumerate(order):
        nxt = order[k + 1][0] if k + 1 < len(order) else end
        durations[i] = max(0.0, nxt - t)
    return durations


def _backward(loss: torch.Tensor, grad: torch.Tensor | None) -> None:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError(
            f"loss_fn must return a scalar tensor, got {type(loss).__name__}"
            + (f" of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
        )
    loss.backward(grad)


def _named_like_running_statistics(name: str) -> bool:
    """Meta tensors have no values to compare: buffers named like normalisation statistics
    are taken as mutated by the forward (the conservative choice: restored after recompute)."""
    leaf = name.rsplit(".", 1)[-1]
    return leaf.startswith("running_") or leaf == "num_batches_tracked"


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(torch.equal(a, b))


def _static_storages(model: nn.Module, inputs: Inputs) -> tuple[set[tuple[str, int]], int, int, int]:
    """Storages that live for the whole step whatever the plan, and their byte totals."""
    keys: set[tuple[str, int]] = set()

    def add(t: torch.Tensor) -> int:
        key = _storage_key(t)
        if key in keys:
            return 0
        keys.add(key)
        return t.untyped_storage().nbytes()

    params = sum(add(p) for p in model.parameters())
    buffers = sum(add(b) for b in model.buffers())
    inputs_bytes = sum(add(t) for t in inputs.tensors())
    return keys, params, buffers, inputs_bytes


def _storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    """Identity of a tensor's storage: its address, or on the meta device (where every
    address is 0) the storage object itself, which PyTorch keeps unique while it lives
    (the recorder and the model keep every profiled storage alive)."""
    storage = tensor.untyped_storage()
    if tensor.device.type == "meta":
        return ("meta", id(storage))
    return (str(tensor.device), storage.data_ptr())


def _param_grad_attribution(
    model: nn.Module, capture: Capture, index_of: dict[fx.Node, int]
) -> tuple[dict[int, int], int]:
    """Bytes of parameter gradients by the node whose backward creates them: the *last*
    forward user of the parameter (backward meets it first)."""
    params = {name: p for name, p in model.named_parameters(remove_duplicate=False)}
    by_id = {id(p): p for p in params.values() if p.requires_grad}
    last_user: dict[int, int] = {}

    def touch(param: nn.Parameter, i: int) -> None:
        if id(param) in by_id:
            last_user[id(param)] = max(last_user.get(id(param), -1), i)

    for node in capture.graph.nodes:
        if node.op == "get_attr" and node.target in params:
            for user in node.users:
                if user in index_of:
                    touch(params[node.target], index_of[user])
        elif node.op == "call_module":
            for p in model.get_submodule(node.target).parameters():
                touch(p, index_of[node])
    grads: dict[int, int] = {}
    for pid, i in last_user.items():
        p = by_id[pid]
        grads[i] = grads.get(i, 0) + p.numel() * p.element_size()
    total = sum(p.numel() * p.element_size() for p in by_id.values())
    return grads, total


def _cuda_rng_state() -> Any:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return None


def _first_device(n: fx.Node, env: dict) -> torch.device:
    for t in tensors_in(fx.node.map_arg((n.args, n.kwargs), lambda a: env.get(a))):
        return t.device
    return torch.device("cpu")
