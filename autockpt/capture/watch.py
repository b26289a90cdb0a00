"""The fidelity watch: what the model's Python does while it is traced that a graph would
not keep.

Tracing executes the forward's Python once, so three things it sees would not survive in
an fx graph: a random draw made without a traced input (``torch.rand([]) < p`` for
LayerDrop, ``random.random()``), which fx would bake in as a constant, a switch of the
autograd mode or autocast (``torch.no_grad()``), which fx does not record, and an
assignment to a registered buffer or parameter (``self.steps = self.steps + 1``), whose new
value fx computes but never stores. :class:`_Watch` sees them while tracing; the innermost
submodule whose own code did it becomes a leaf (it runs eagerly inside the graph, so it
draws anew, its mode holds and it assigns), and the root's own code falls back to export,
which keeps torch draws as operators, ``no_grad`` regions as
``wrap_with_set_grad_enabled`` and buffer assignments as in-place updates; an export graph
that baked a Python or NumPy draw, lost a mode switch or an assignment, is refused with a
:class:`~autockpt.errors.TraceError` naming the line.

Whose code is whose: torch's, autockpt's own (every floor of the package) and the
standard library's generators are skipped; everything else, the model zoo in
``autockpt_zoo/`` included, is the model's.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import linecache
import os
import random
import sys
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from autockpt.base.rng import RngStates

_TORCH_DIR = os.path.dirname(torch.__file__)
_AUTOCKPT_DIR = os.path.dirname(os.path.dirname(__file__)) + os.sep
"""autockpt's own code, every floor of it (the package root, with a separator: the model
zoo in ``autockpt_zoo/`` next to it is user code to the watch)."""


_CHECKPOINT_WARNING = (
    "the model already calls torch.utils.checkpoint; graph capture inlines those calls, so "
    "autockpt's plan replaces them (the result no longer checkpoints where the code said)"
)


@dataclass(frozen=True)
class _Sighting:
    """One thing a module's own code did while being traced that a graph does not keep:
    a random draw from a global generator (``generator`` set), an assignment to a
    registered buffer or parameter (``slot``: its qualified name) or a switch of the
    autograd mode or autocast (``before``/``after``: grad mode around a
    ``set_grad_enabled``)."""

    module: str
    what: str
    location: str
    source_line: str
    generator: str | None = None
    before: bool | None = None
    after: bool | None = None
    slot: str | None = None
    parameter: bool = False  # ``slot`` is a parameter's

    def describe(self) -> str:
        return f"{self.what} at {self.location}"


class _Unfaithful(Exception):
    """The root's own code does something fx would not keep (a draw, a mode switch, a
    buffer assignment); no leaf can fix it, so the capture falls back to torch.export or
    refuses."""

    def __init__(self, sightings: list[_Sighting]) -> None:
        self.sightings = sightings
        first = sightings[0]
        self.location, self.source_line = first.location, first.source_line
        super().__init__(_what_fx_loses(sightings))


_GENERATOR_NAMES = {
    "torch": "torch's generator",
    "torch.cuda": "torch's CUDA generator",
    "random": "Python's random",
    "numpy": "NumPy's global generator",
}


def _what_fx_loses(sightings: list[_Sighting]) -> str:
    draws = [s for s in sightings if s.generator is not None]
    assignments = [s for s in sightings if s.slot is not None]
    switches = [s for s in sightings if s.generator is None and s.slot is None]
    parts = []
    if draws:
        parts.append(
            "draws random numbers in Python ("
            + "; ".join(s.describe() for s in draws)
            + "), which fx would run once and bake into the graph as constants"
        )
    if switches:
        parts.append(
            "switches the autograd mode or autocast ("
            + "; ".join(s.describe() for s in switches)
            + "), which fx does not record"
        )
    if assignments:
        parts.append(
            "assigns a registered buffer or parameter ("
            + "; ".join(s.describe() for s in assignments)
            + "), which fx does not record (its graph computes the new value, never stores it)"
        )
    return " and ".join(parts)


_KEPT_WHOLE = " kept whole ("


def leaf_note(modules: list[str], reason: str) -> str:
    """The note that says why ``modules`` (one or more, for one reason) run as opaque
    leaves: one node each to the planner, which cannot checkpoint inside them."""
    what = "opaque leaves" if len(modules) > 1 else "opaque leaf"
    return f"{', '.join(modules)}{_KEPT_WHOLE}{what}): {reason}"


def leaf_notes(notes: Iterable[str], leaves: Iterable[str]) -> list[str]:
    """The notes of :func:`leaf_note` among ``notes`` that name any of ``leaves``."""
    wanted = set(leaves)
    return [
        note
        for note in notes
        if _KEPT_WHOLE in note and set(note.split(_KEPT_WHOLE)[0].split(", ")) & wanted
    ]


def _leaf_note(module: str, sightings: list[_Sighting]) -> str:
    draws = any(s.generator is not None for s in sightings)
    assignments = any(s.slot is not None for s in sightings)
    switches = any(s.generator is None and s.slot is None for s in sightings)
    why = []
    if draws:
        why.append("each step draws anew")
    if switches:
        why.append("the mode it sets holds when it runs")
    if assignments:
        why.append("the value it assigns is stored when it runs")
    because = " and ".join(why)
    return leaf_note(
        [module], f"its own code {_what_fx_loses(sightings)}; it runs as a leaf so {because}"
    )


def _untraceable_reason(error: BaseException) -> str:
    """Why fx could not trace a submodule that became a leaf: the error and the user's line
    that raised it."""
    location, line = _user_frame(error)
    message = str(error).splitlines()[0] if str(error) else ""
    code = f": `{line}`" if line else ""
    return f"fx cannot trace the code at {location}{code} ({type(error).__name__}: {message})"


def _user_frame(error: BaseException) -> tuple[str, str]:
    """The deepest traceback frame outside torch: the user's line that broke tracing."""
    frames = traceback.extract_tb(error.__traceback__)
    for frame in reversed(frames):
        if frame.filename.startswith(_TORCH_DIR) or frame.filename.startswith("<"):
            continue
        if frame.filename.startswith(_AUTOCKPT_DIR):  # autockpt's own code, any floor
            continue
        line = frame.line or linecache.getline(frame.filename, frame.lineno or 0).strip()
        return f"{frame.filename}:{frame.lineno}", line
    return "<unknown>", ""


def _unique(sightings: list[_Sighting]) -> list[_Sighting]:
    seen: set[tuple[str, str]] = set()
    kept = []
    for s in sightings:
        if (s.what, s.location) not in seen:
            seen.add((s.what, s.location))
            kept.append(s)
    return kept


def _definition(fn: Any) -> tuple[str, str]:
    code = getattr(inspect.unwrap(fn), "__code__", None)
    if code is None:
        return "<unknown>", ""
    line = linecache.getline(code.co_filename, code.co_firstlineno).strip()
    return f"{code.co_filename}:{code.co_firstlineno}", line


class CheckpointSink(Protocol):
    """What :class:`_Watch` reports ``torch.utils.checkpoint`` calls to: the fx tracer
    (``autockpt.capture.fx._LeafTracer``), or :class:`_CheckpointSeen` under export."""

    saw_checkpoint: bool


class _CheckpointSeen:
    """What :class:`_Watch` reports checkpoint calls to when there is no fx tracer (export)."""

    saw_checkpoint = False


_TORCH_DRAWS = frozenset(
    """rand randn randint randperm rand_like randn_like randint_like bernoulli bernoulli_
    multinomial normal normal_ poisson uniform_ random_ exponential_ geometric_ cauchy_
    log_normal_ dropout dropout_ feature_dropout alpha_dropout feature_alpha_dropout rrelu
    rrelu_ native_dropout binomial _standard_gamma _sample_dirichlet""".split()
)


_DRAW_NAMES = _TORCH_DRAWS | {"random", "getrandbits", "seed", "randbytes"}
"""Names of the C functions that can draw from a global generator (torch's samplers, the
C methods of Python's ``Random``); NumPy's are not C calls a profile hook sees."""


_GRAD_SWITCHES = {
    "no_grad.__enter__": "torch.no_grad",
    "enable_grad.__enter__": "torch.enable_grad",
    "set_grad_enabled.__init__": "torch.set_grad_enabled",
    "set_grad_enabled.__enter__": "torch.set_grad_enabled",
    "set_grad_enabled.clone": "torch.set_grad_enabled",
}


@dataclass(frozen=True)
class _WatchedCode:
    """Code objects and files :class:`_Watch` looks for (resolved once)."""

    checkpoints: frozenset[Any]
    modes: dict[Any, str]  # __enter__ code of a mode construct -> its name
    set_grad: Any
    grad_file: str
    construct_files: frozenset[str]  # where the mode constructs' own code lives
    contextlib_file: str  # torch's decorator wrapper (``@torch.no_grad()``)
    slot_writers: dict[Any, str]  # code of nn.Module's slot setters -> its value argument


@functools.cache
def _watched_code() -> _WatchedCode:
    import torch.cpu.amp.autocast_mode as cpu_autocast
    import torch.cuda.amp.autocast_mode as cuda_autocast
    from torch.amp import autocast_mode
    from torch.autograd import grad_mode
    from torch.utils import _contextlib
    from torch.utils import checkpoint as ckpt

    return _WatchedCode(
        checkpoints=frozenset(
            inspect.unwrap(fn).__code__ for fn in (ckpt.checkpoint, ckpt.checkpoint_sequential)
        ),
        modes={
            inspect.unwrap(grad_mode.inference_mode.__enter__).__code__: "torch.inference_mode",
            inspect.unwrap(autocast_mode.autocast.__enter__).__code__: "torch.autocast",
        },
        set_grad=torch._C._set_grad_enabled,
        grad_file=grad_mode.__file__,
        construct_files=frozenset(
            m.__file__ for m in (grad_mode, autocast_mode, cpu_autocast, cuda_autocast)
        ),
        contextlib_file=_contextlib.__file__,
        slot_writers={
            nn.Module.__setattr__.__code__: "value",
            nn.Module.register_buffer.__code__: "tensor",
            nn.Module.register_parameter.__code__: "param",
        },
    )


class _Watch:
    """A profile hook over one capture attempt (fx or export).

    Tracing runs the model's Python code once; this hook sees what that code does that the
    graph will not keep, and attributes it to ``scope()`` (the module whose own code runs):

    * calls of ``torch.utils.checkpoint`` (tracing inlines them);
    * draws from a global generator (torch's, Python's ``random``, NumPy's): fx runs them
      once and bakes the value in. The hook compares the generator states around each C
      call that can draw, so only calls that did draw are reported, with their line;
    * switches of the autograd mode (``no_grad``, ``enable_grad``, ``set_grad_enabled``,
      ``inference_mode``, also as decorators) and of ``autocast``: fx records none of
      them. ``before``/``after`` say the grad mode around a ``set_grad_enabled``;
    * assignments to a registered buffer or parameter of ``model``'s tree
      (``self.steps = self.steps + 1``, ``register_buffer`` of an existing name): fx
      computes the new value but stores it nowhere (it leaves a proxy in the slot), so
      the graph would never advance the buffer. Assigning the very tensor the slot holds
      (``self.mask = self.mask.to(x.device)`` on export's fake tensors) is no change.
    """

    def __init__(
        self,
        seen: CheckpointSink,
        scope: Callable[[], str] = lambda: "",
        model: nn.Module | None = None,
    ) -> None:
        self.seen = seen
        self.scope = scope
        self.model = model
        self.draws: list[_Sighting] = []
        self.switches: list[_Sighting] = []
        self.assignments: list[_Sighting] = []
        self.internal: set[str] = set()  # generators torch's helper libraries drew from
        self._pending: dict[int, Any] = {}
        self._code = _watched_code()
        self._paths: dict[int, str] | None = None

    def __enter__(self) -> _Watch:
        self.previous = sys.getprofile()
        sys.setprofile(self._hook)
        return self

    def __exit__(self, *exc: Any) -> None:
        sys.setprofile(self.previous)

    def _hook(self, frame: Any, event: str, arg: Any) -> None:
        # Runs at every call while tracing: the common case returns after a set lookup. It
        # must never raise: Python would drop the hook and raise into the traced code.
        try:
            if event == "c_call":
                if arg is self._code.set_grad:
                    self._pending[id(frame)] = (None, torch.is_grad_enabled())
                elif getattr(arg, "__name__", None) in _DRAW_NAMES:
                    generator = _generator_of(arg)
                    if generator is not None:
                        with _outside_dispatch_modes():
                            self._pending[id(frame)] = ((generator, arg), RngStates.now())
            elif event == "call":
                code = frame.f_code
                if code in self._code.checkpoints:
                    self.seen.saw_checkpoint = True
                elif code in self._code.modes:
                    site = self._switch_site(frame)
                    if site is not None:
                        what = self._code.modes[code]
                        self.switches.append(_Sighting(self.scope(), what, *site))
                elif code in self._code.slot_writers and self.model is not None:
                    self._slot_write(frame, self._code.slot_writers[code])
            elif self._pending and event in ("c_return", "c_exception"):
                pending = self._pending.pop(id(frame), None)
                if pending is not None:
                    self._resolve(frame, *pending)
        except Exception:  # noqa: BLE001 - a sighting lost; the generators are still compared
            self._pending.pop(id(frame), None)

    def _resolve(self, frame: Any, draw: tuple[str, Any] | None, before: Any) -> None:
        if draw is None:  # a set_grad_enabled call returned
            what = self._grad_switch(frame)
            site = self._switch_site(frame) if what is not None else None
            if what is not None and site is not None:
                after = torch.is_grad_enabled()
                sighting = _Sighting(self.scope(), what, *site, before=before, after=after)
                self.switches.append(sighting)
            return
        generator, fn = draw
        with _outside_dispatch_modes():  # export traces under fake-tensor modes
            moved = before.changed()
        if generator not in moved:
            return  # called on traced values (a graph node) or drew nothing
        owner = getattr(fn, "__self__", None)
        prefix = {"random": "random", "numpy": "numpy.random"}.get(generator)
        if prefix is None:
            prefix = "Tensor" if isinstance(owner, torch.Tensor) else "torch"
        location, line = self._site(frame)
        if location.startswith(_TOOL_DIRS):
            self.internal.add(generator)  # torch's own shape reasoning, not the model
            return
        what = f"{prefix}.{getattr(fn, '__name__', fn)}"
        self.draws.append(_Sighting(self.scope(), what, location, line, generator=generator))

    def _slot_write(self, frame: Any, value_name: str) -> None:
        """An ``nn.Module`` slot setter was called: record it when the model's own code
        assigns a buffer or parameter slot of the model's tree (torch's bookkeeping, such as
        export swapping fake tensors in, and plain attributes are not the model's state)."""
        caller = frame.f_back
        if caller is None:
            return
        filename = caller.f_code.co_filename
        if filename.startswith(_SKIPPED_DIRS) or filename.startswith("<"):
            return
        local = frame.f_locals
        owner, name = local.get("self"), local.get("name")
        if not isinstance(owner, nn.Module) or not isinstance(name, str):
            return
        buffers = vars(owner).get("_buffers", {})
        parameters = vars(owner).get("_parameters", {})
        if value_name == "value" and name not in buffers and name not in parameters:
            return  # a plain attribute (or a submodule)
        held = buffers.get(name, parameters.get(name))
        if held is not None and local.get(value_name) is held:
            return  # the tensor the slot holds, put back
        if self._paths is None:
            assert self.model is not None
            self._paths = {
                id(m): path for path, m in self.model.named_modules(remove_duplicate=False)
            }
        path = self._paths.get(id(owner))
        if path is None:
            return  # a module made in forward: not the model's state
        slot = f"{path}.{name}" if path else name
        parameter = name in parameters or value_name == "param"
        what = f"{'parameter' if parameter else 'buffer'} '{slot}' assigned"
        location = f"{filename}:{caller.f_lineno}"
        line = linecache.getline(filename, caller.f_lineno).strip()
        self.assignments.append(
            _Sighting(self.scope(), what, location, line, slot=slot, parameter=parameter)
        )

    def _grad_switch(self, frame: Any) -> str | None:
        """The construct a ``_set_grad_enabled`` call came from (``torch.no_grad``...), or
        ``None`` when it is one restoring the mode on exit."""
        qualname = None
        while frame is not None and frame.f_code.co_filename == self._code.grad_file:
            qualname = getattr(frame.f_code, "co_qualname", frame.f_code.co_name)
            frame = frame.f_back
        if qualname is None:
            return "torch._C._set_grad_enabled"
        if "__exit__" in qualname or qualname.endswith("__call__"):
            return None
        return _GRAD_SWITCHES.get(qualname, f"torch.{qualname}")

    def _switch_site(self, frame: Any) -> tuple[str, str] | None:
        """Where the user's code entered the mode construct that ``frame`` runs in: the
        frame right outside the construct's own code, or a decorated function's definition
        (``@torch.no_grad()``). ``None`` when torch's own code switched (export does,
        around its tracing): that is not the model's."""
        while frame is not None and frame.f_code.co_filename in self._code.construct_files:
            frame = frame.f_back
        if frame is None:
            return None
        name = frame.f_code.co_filename
        if name == self._code.contextlib_file:
            func = frame.f_locals.get("func")
            code = getattr(inspect.unwrap(func), "__code__", None) if func is not None else None
            if code is None or code.co_filename.startswith(_SKIPPED_DIRS):
                return None
            return _definition(func)
        if name.startswith(_SKIPPED_DIRS) or name.startswith("<"):
            return None
        return f"{name}:{frame.f_lineno}", linecache.getline(name, frame.f_lineno).strip()

    def _site(self, frame: Any) -> tuple[str, str]:
        """``file:line`` and source of the user's code behind ``frame``: the first frame
        outside torch, the random modules and this package."""
        while frame is not None:
            name = frame.f_code.co_filename
            if not (name.startswith(_SKIPPED_DIRS) or name.startswith("<")):
                line = linecache.getline(name, frame.f_lineno).strip()
                return f"{name}:{frame.f_lineno}", line
            frame = frame.f_back
        return "<unknown>", ""


def _skipped_dirs() -> tuple[str, ...]:
    dirs = [_TORCH_DIR, _AUTOCKPT_DIR, random.__file__]
    try:
        import numpy

        dirs.append(os.path.dirname(numpy.__file__))
    except ImportError:  # pragma: no cover
        pass
    return tuple(dirs)


_SKIPPED_DIRS = _skipped_dirs()


def _tool_dirs() -> tuple[str, ...]:
    """Libraries torch itself runs while tracing that draw from Python's ``random``:
    SymPy shuffles its assumption checks (``random.shuffle``) when export reasons about
    symbolic sizes. Their draws are not the model's (capture restores the generators)."""
    try:
        import sympy
    except ImportError:  # pragma: no cover
        return ()
    return (os.path.dirname(sympy.__file__),)


_TOOL_DIRS = _tool_dirs()


@contextlib.contextmanager
def _outside_dispatch_modes() -> Iterator[None]:
    """Compare generator states as real tensors also while export traces (its fake-tensor
    mode would refuse ``torch.equal`` on them)."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        yield


def _generator_of(fn: Any) -> str | None:
    """The global generator a C function can draw from, by what it is: a method of
    Python's ``Random`` or a torch function or tensor method that samples; ``None`` for
    anything else."""
    owner = getattr(fn, "__self__", None)
    name = getattr(fn, "__name__", "")
    if isinstance(owner, random.Random):
        return "random"
    if name in _TORCH_DRAWS and (
        isinstance(owner, torch.Tensor) or str(getattr(fn, "__module__", "")).startswith("torch")
    ):
        return "torch"
    return None
