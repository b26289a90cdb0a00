"""The one recording layer for allocations: what the allocator reports, and what operators
return.

Two witnesses, used together by the profile's probe (see ``autockpt/costs/probe.py``) and alone
elsewhere:

* :func:`allocator_events` reads the PyTorch profiler's allocator events (``profile_memory=
  True``): every allocation and free the device's allocator makes, kernel workspaces
  included. This is the truth ``autockpt.measure`` reports and budgets are judged by.
* :class:`StorageTracker` is a dispatch mode that sees every storage an operator returns
  and, through a weak reference, when it dies. It works on fake and meta tensors (where no
  allocator exists), which is how a step is recorded without allocating it
  (``autockpt/costs/record.py``); on real tensors the difference between the two witnesses over a
  stretch of work is the kernels' private workspace.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import sys
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from autockpt.base.inputs import Inputs
from autockpt.base.runtime import is_fake, tensors_in
from solvers.replay import OpCall

__all__ = [
    "AllocatorEvent",
    "Mark",
    "StorageSet",
    "StorageTracker",
    "allocator_events",
    "marks",
    "peak_above_start",
    "static_bytes",
    "storage_bytes",
    "storage_key",
]


@dataclass(frozen=True)
class AllocatorEvent:
    """One allocation (``nbytes > 0``) or free (``nbytes < 0``) of the device allocator."""

    time_ns: int
    ptr: int
    nbytes: int
    total: int


@dataclass(frozen=True)
class Mark:
    """A ``record_function`` range of a profiler session."""

    name: str
    start_ns: int
    end_ns: int


def _walk(prof: Any) -> list[Any]:
    """Every event of a session, pre-order with siblings in recorded order (a stable sort by
    time then keeps events that share a timestamp in the order they happened)."""
    out: list[Any] = []
    stack = list(reversed(prof.profiler.kineto_results.experimental_event_tree()))
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(reversed(node.children))
    return out


def allocator_events(prof: Any, device_type: str = "cpu") -> list[AllocatorEvent]:
    """The allocator events of ``device_type`` in a finished profiler session, in time
    order. (Allocator events of every device come through the CPU activity.)"""
    allocation = torch._C._profiler._EventType.Allocation
    found = []
    for node in _walk(prof):
        if node.tag == allocation:
            fields = node.extra_fields
            if fields.device.type == device_type and fields.alloc_size:
                found.append(
                    AllocatorEvent(
                        node.start_time_ns, fields.ptr, fields.alloc_size, fields.total_allocated
                    )
                )
    found.sort(key=lambda event: event.time_ns)
    return found


def marks(prof: Any, prefix: str) -> list[Mark]:
    """The ``record_function`` ranges whose name starts with ``prefix``, in start order."""
    found = [
        Mark(node.name, node.start_time_ns, node.end_time_ns)
        for node in _walk(prof)
        if node.name.startswith(prefix)
    ]
    found.sort(key=lambda mark: mark.start_ns)
    return found


def deltas_within(events: list[AllocatorEvent], times: list[int], mark: Mark) -> list[int]:
    """The byte deltas of the allocator ``events`` (in time order, ``times`` their
    timestamps) that fall within ``mark``, its ends included. By bisection: a probe has two
    marks per node, and scanning every event for each made the profile of a graph of a few
    thousand nodes spend seconds here."""
    first = bisect.bisect_left(times, mark.start_ns)
    last = bisect.bisect_right(times, mark.end_ns)
    return [event.nbytes for event in events[first:last]]


def peak_above_start(deltas: list[int]) -> int:
    """The highest running sum of ``deltas`` (0 if it never rises above the start)."""
    current = peak = 0
    for delta in deltas:
        current += delta
        peak = max(peak, current)
    return peak


class StorageTracker(TorchDispatchMode):
    """Sees every storage an operator returns (an allocation) and, through a weak reference,
    when it dies (a free). Events carry the current ``window``; in backward, the window is
    looked up from the running autograd node's sequence number (``backward_window_of``).

    ``events`` holds ``(allocation id, window)`` pairs, the first occurrence of an id being
    its allocation, the second its free; ``sizes[id]`` its bytes. Storages in
    ``static_ids`` (parameters, buffers, inputs: alive for the whole step) are not events.
    """

    def __init__(self, static_ids: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        super().__init__()
        self.static_ids = set(static_ids)
        self.ids: dict[int, int] = {}  # id(storage) -> allocation id
        self.sizes: list[int] = []
        self.events: list[tuple[int, int]] = []
        self.window = 0
        self.backward_window_of: Any = None  # sequence number -> window index
        self.op_calls: dict[int, list[OpCall]] | None = None
        """When a dict: per window, every operator call that returned a tensor, with the
        allocations it made and wrote to (:meth:`op_log`; what selective recompute may keep:
        :mod:`solvers.selective`)."""

    def key(self, t: torch.Tensor) -> int | None:
        return self.ids.get(id(t.untyped_storage()))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.backward_window_of is not None:
            node = torch._C._current_autograd_node()
            if node is not None:
                w = self.backward_window_of(node._sequence_nr())
                if w is not None:
                    self.window = w
        out = func(*args, **(kwargs or {}))
        made: list[int] = []
        outputs = tensors_in(out)
        for t in outputs:
            storage = t.untyped_storage()
            sid = id(storage)
            if sid in self.ids or sid in self.static_ids or storage.nbytes() == 0:
                continue
            a = len(self.sizes)
            self.ids[sid] = a
            self.sizes.append(storage.nbytes())
            self.events.append((a, self.window))
            made.append(a)
            weakref.finalize(storage, self._free, sid, a)
        if self.op_calls is not None and outputs:
            self.op_calls.setdefault(self.window, []).append(
                OpCall(
                    name=str(func),
                    allocations=tuple(made),
                    seeded=torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()),
                    writes=self._written(func, args, kwargs or {}),
                )
            )
        return out

    def _written(self, func: Any, args: Any, kwargs: dict[str, Any]) -> tuple[int, ...]:
        """Allocations an operator writes to (its mutable arguments: ``out=``, in-place)."""
        schema = getattr(func, "_schema", None)
        if schema is None or not schema.is_mutable:
            return ()
        written: list[int] = []
        for k, argument in enumerate(schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = args[k] if k < len(args) else kwargs.get(argument.name)
            for t in tensors_in(value):
                a = self.key(t)
                if a is not None:
                    written.append(a)
        return tuple(sorted(set(written)))

    def op_log(self) -> dict[int, list[tuple[str, int]]]:
        """Per window, ``(operator, bytes of the new storages it returned)`` of each call
        recorded in :attr:`op_calls`."""
        return {
            window: [(call.name, sum(self.sizes[a] for a in call.allocations)) for call in calls]
            for window, calls in (self.op_calls or {}).items()
        }

    def _free(self, sid: int, a: int) -> None:
        if self.ids.get(sid) == a:
            del self.ids[sid]
        self.events.append((a, self.window))

    def deltas_by_window(self) -> dict[int, list[int]]:
        """Signed byte changes per window, in order."""
        seen: set[int] = set()
        out: dict[int, list[int]] = {}
        for a, w in self.events:
            out.setdefault(w, []).append(-self.sizes[a] if a in seen else self.sizes[a])
            seen.add(a)
        return out


@contextlib.contextmanager
def profiler_session() -> Iterator[Any]:
    """A CPU-activity profiler session with allocator events (``profile_memory``), started
    and stopped without the profiler's native chatter on stderr. Read it after the block
    with :func:`allocator_events` and :func:`marks`."""
    from torch.profiler import ProfilerActivity, profile

    session = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with quiet_native_stderr():
        session.start()
    try:
        yield session
    finally:
        with quiet_native_stderr():
            session.stop()


@contextlib.contextmanager
def quiet_native_stderr() -> Iterator[None]:
    """Silence the profiler's native start/stop chatter, which is written straight to file
    descriptor 2 (no Python logging switch reaches it)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    """The one identity of a tensor's storage: its device and address, or for fake and meta
    tensors (which have no address) the storage object itself, which PyTorch keeps unique
    while it lives (callers keep the tensors they compare alive). A tensor without one
    storage (sparse, nested, a wrapper subclass such as DTensor) is its own identity, the
    object (NOTE [runtime: unusual state])."""
    storage = _storage_or_none(tensor)
    if storage is None:
        return ("object", id(tensor))
    if is_fake(tensor):
        return ("fake", id(storage))
    return (str(tensor.device), storage.data_ptr())


def storage_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the memory ``tensor`` holds: its storage's, or for a tensor without one
    (NOTE [runtime: unusual state]) the storages of the tensors it is made of (a sparse
    tensor's indices and values, a wrapper subclass's inner tensors), each once."""
    storage = _storage_or_none(tensor)
    if storage is not None:
        return storage.nbytes()
    return StorageSet().add(_parts(tensor))


def _storage_or_none(tensor: torch.Tensor) -> torch.UntypedStorage | None:
    """``tensor``'s storage; None for a non-strided layout (sparse and nested tensors raise
    for theirs) and a wrapper subclass (whose memory is its inner tensors')."""
    if tensor.layout != torch.strided or hasattr(tensor, "__tensor_flatten__"):
        return None
    return tensor.untyped_storage()


def _parts(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The tensors ``tensor`` is made of, when it has no storage of its own."""
    layout = tensor.layout
    if layout == torch.sparse_coo:
        return [tensor._indices(), tensor._values()]
    if layout in (torch.sparse_csr, torch.sparse_bsr):
        return [tensor.crow_indices(), tensor.col_indices(), tensor.values()]
    if layout in (torch.sparse_csc, torch.sparse_bsc):
        return [tensor.ccol_indices(), tensor.row_indices(), tensor.values()]
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is not None:  # DTensor, float8 and other traceable wrapper subclasses
        names, _ = flatten()
        return [getattr(tensor, name) for name in names]
    return []


class StorageSet:
    """Distinct storages, told apart by :func:`storage_key`: tied weights, views and an
    input that is also a buffer count once. ``skip_meta`` leaves meta tensors out (what a
    measured step holds: a meta tensor holds no memory); fake tensors count at their size
    (what a real step would hold)."""

    def __init__(self, *, skip_meta: bool = False) -> None:
        self.skip_meta = skip_meta
        self.keys: set[tuple[str, int]] = set()

    def add(self, tensors: Iterable[torch.Tensor]) -> int:
        """Bytes of the storages among ``tensors`` not seen before (now seen)."""
        total = 0
        for t in tensors:
            if self.skip_meta and t.device.type == "meta":
                continue
            key = storage_key(t)
            if key not in self.keys:
                self.keys.add(key)
                total += storage_bytes(t)
        return total


def static_bytes(model: nn.Module, inputs: Inputs, *, skip_meta: bool = False) -> int:
    """Bytes of the distinct storages of parameters, buffers and input tensors: what lives
    for the whole step whatever the plan (:class:`StorageSet`)."""
    return StorageSet(skip_meta=skip_meta).add(
        [*model.parameters(), *model.buffers(), *inputs.tensors()]
    )


def returned_short(fake: list[tuple[str, int]], real: list[tuple[str, int]]) -> int:
    """Bytes the real kernels returned beyond the fake ones, operator by operator, for one
    node run both ways. The two runs are aligned on operator names (a fake run may skip an
    operator such as ``detach`` that the real one dispatches); unmatched ones count 0."""
    import difflib

    matcher = difflib.SequenceMatcher(
        a=[op for op, _ in fake], b=[op for op, _ in real], autojunk=False
    )
    missed = 0
    for block in matcher.get_matching_blocks():
        for k in range(block.size):
            missed += max(0, real[block.b + k][1] - fake[block.a + k][1])
    return missed
