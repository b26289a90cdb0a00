"""Every random-number generator a training step can draw from, as one value.

Planning must leave the global RNGs as it found them (a seeded run's dropout masks must not
depend on whether ``optimize`` was called), and capture must notice randomness drawn while
tracing (a draw executed once at trace time would be baked into the graph as a constant).
Both need the same thing: the state of torch's CPU generator, every CUDA generator, Python's
``random`` and NumPy's global generator, taken and compared or put back together. This
module is the one place that knows the list.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

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
            not torch.equal(a, b) for a, b in zip(self.torch_cuda, later.torch_cuda)
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
