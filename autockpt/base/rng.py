"""Every random-number generator a training step can draw from, as one value.

Planning must leave the global RNGs as it found them (a seeded run's dropout masks must not
depend on whether ``optimize`` was called), and capture must notice randomness drawn while
tracing (a draw executed once at trace time would be baked into the graph as a constant).
Both need the same thing: the state of torch's CPU generator, every CUDA generator, Python's
``random`` and NumPy's global generator, taken and compared or put back together. This
module is the one place that knows the list.

It also holds the two rules that randomness needs elsewhere: :class:`PythonRngStates`, what a
checkpointed segment replays besides torch's state, and :class:`WorstCaseDraws`, the value
planning gives a scalar draw (a random-depth model is planned with every layer running).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

try:  # numpy is a dependency, but a broken install must not break torch-only users
    import numpy as _np
except ImportError:  # pragma: no cover
    _np = None


@dataclass(frozen=True)
class RngStates:
    """The global generators' states at one moment (:meth:`now`); :meth:`restore` puts them
    back, :meth:`changed` names those that moved since."""

    torch_cpu: torch.Tensor
    torch_cuda: tuple[torch.Tensor, ...]
    python: Any
    numpy: Any

    @staticmethod
    def now() -> RngStates:
        cuda = (
            tuple(torch.cuda.get_rng_state_all())
            if torch.cuda.is_available() and torch.cuda.is_initialized()
            else ()
        )
        return RngStates(
            torch_cpu=torch.get_rng_state(),
            torch_cuda=cuda,
            python=random.getstate(),
            numpy=_np.random.get_state() if _np is not None else None,
        )

    def restore(self) -> None:
        torch.set_rng_state(self.torch_cpu)
        if self.torch_cuda:
            torch.cuda.set_rng_state_all(list(self.torch_cuda))
        random.setstate(self.python)
        if _np is not None and self.numpy is not None:
            _np.random.set_state(self.numpy)

    def changed(self, later: RngStates | None = None) -> tuple[str, ...]:
        """Names of the generators whose state differs between ``self`` and ``later``
        (default: now): ``"torch"``, ``"torch.cuda"``, ``"random"``, ``"numpy"``."""
        later = later or RngStates.now()
        moved = []
        if not torch.equal(self.torch_cpu, later.torch_cpu):
            moved.append("torch")
        if len(self.torch_cuda) != len(later.torch_cuda) or any(
            not torch.equal(a, b) for a, b in zip(self.torch_cuda, later.torch_cuda, strict=True)
        ):
            moved.append("torch.cuda")
        if self.python != later.python:
            moved.append("random")
        if not _numpy_equal(self.numpy, later.numpy):
            moved.append("numpy")
        return tuple(moved)


def _numpy_equal(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is b
    # ('MT19937', keys array, pos, has_gauss, cached_gaussian)
    return a[0] == b[0] and bool((a[1] == b[1]).all()) and tuple(a[2:]) == tuple(b[2:])


@contextmanager
def rng_as_found() -> Iterator[RngStates]:
    """Run a block and put every global generator back as it was before it."""
    states = RngStates.now()
    try:
        yield states
    finally:
        states.restore()


@dataclass(frozen=True)
class PythonRngStates:
    """The states of the generators torch's checkpoint does not preserve: Python's
    ``random`` and NumPy's global generator. A checkpointed segment whose Python code draws
    from them stashes them at its forward and replays them at its recompute
    (autockpt/rewrite/), as ``preserve_rng_state`` does for torch's."""

    python: Any
    numpy: Any

    @staticmethod
    def now() -> PythonRngStates:
        return PythonRngStates(
            python=random.getstate(),
            numpy=_np.random.get_state() if _np is not None else None,
        )

    def restore(self) -> None:
        random.setstate(self.python)
        if _np is not None and self.numpy is not None:
            _np.random.set_state(self.numpy)

    def changed(self, later: PythonRngStates | None = None) -> tuple[str, ...]:
        """Names of the generators that moved between ``self`` and ``later`` (default:
        now): ``"random"``, ``"numpy"``."""
        later = later or PythonRngStates.now()
        moved = []
        if self.python != later.python:
            moved.append("random")
        if not _numpy_equal(self.numpy, later.numpy):
            moved.append("numpy")
        return tuple(moved)


class WorstCaseDraws(TorchDispatchMode):
    """Under this mode, a scalar uniform draw (``torch.rand`` / ``torch.rand_like`` of one
    element) draws nothing and returns the top of its range, ``1 - eps/2`` of its dtype,
    as a constant.

    Why: a random-depth model (LayerDrop: ``if torch.rand([]) < p: skip the layer``) takes
    a different path every step, and on fake tensors the comparison has no value at all
    (``bool()`` of a fake tensor raises). Planning sizes the step for its worst case
    instead: with every scalar draw at the top of ``[0, 1)``, ``draw < p`` is False and no
    layer is skipped, so every step that does skip layers needs less. The constant is made
    with ``torch.tensor``, which fake tensors keep as a known value, so branching on it
    works there too. The limit: a model that *keeps* a layer when its draw is low
    (``if draw < p: run the layer``) is planned for its best case. Other draws (normal,
    integer, several elements, Python's ``random``, NumPy) are left as they are.

    A dispatch mode, not a function mode: it stays on while backward runs (torch takes a
    function mode off its stack while it handles ``backward()``), so a checkpoint's
    recompute inside backward gets the same answers as the forward did.

    ``draws`` counts the draws answered: the profile marks a node that made any as random,
    so its checkpointed segment preserves torch's RNG state."""

    def __init__(self) -> None:
        super().__init__()
        self.draws = 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func.overloadpacket in _SCALAR_DRAWS:
            value = _top_of_range(func, args, kwargs)
            if value is not None:
                self.draws += 1
                return value
        return func(*args, **kwargs)


_SCALAR_DRAWS = (torch.ops.aten.rand, torch.ops.aten.rand_like)


def worst_case_draws() -> WorstCaseDraws:
    """A :class:`WorstCaseDraws` mode: ``with worst_case_draws() as drawn: ...``."""
    return WorstCaseDraws()


def _top_of_range(func: Any, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The constant a ``rand`` / ``rand_like`` call gets under :class:`WorstCaseDraws`, or
    ``None`` when it is not a one-element uniform draw (then it runs as usual)."""
    if func.overloadpacket is torch.ops.aten.rand_like:
        like = args[0] if args else kwargs.get("self")
        if not isinstance(like, torch.Tensor):
            return None
        size: tuple[int, ...] = tuple(like.shape)
        dtype = kwargs.get("dtype") or like.dtype
        device = kwargs.get("device") or like.device
    else:
        if func._overloadname not in ("default", "generator"):
            return None  # names=, out=
        given = args[0] if args else kwargs.get("size", ())
        if not all(isinstance(s, int) for s in given):
            return None
        size = tuple(given)
        dtype = kwargs.get("dtype") or torch.get_default_dtype()
        device = kwargs.get("device")
    numel = 1
    for s in size:
        numel *= s
    if numel != 1 or not dtype.is_floating_point:
        return None
    top = 1.0 - torch.finfo(dtype).eps / 2
    return torch.tensor(top, dtype=dtype, device=device).reshape(size)
