"""What a planner is asked for, in one frozen :class:`Request`, checked before any work.

NOTE [planning: one request]. Every route of planning (autockpt/planning/routes/) reads the
same inputs: the budget's scope, the loss, the leaves of the capture, how the step is run
(sharding, the training loop's optimizer, gradient accumulation), the precision the step
runs in and the device it runs on. They are one frozen record handed to the route the front
door chooses, never attributes set on a planner after the fact: a route cannot see another
route's half-set state, and an input added later (a target device, a precision policy) is
one more field every route receives, not one more branch in a shared class.

The checks here run before capture: a bad budget or iteration is refused before seconds of
capture and profiling, not after them.
"""

from __future__ import annotations

import logging
import math
import numbers
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autockpt.base.optimizer import check_optimizer
from autockpt.base.precision import Precision
from autockpt.base.runtime import LossFn
from autockpt.base.target import Target, resolve_target
from autockpt.errors import GIB, BudgetError, BudgetTypeError, OptimizerError
from autockpt.planning.sharding import Sharding

ProgressFn = Callable[[str], None]
"""Called with a short description (``"profiling"``) as each planning stage begins."""

logger = logging.getLogger("autockpt")
"""Where planning reports its phases: at INFO as each begins (what the progress callback is
told) and ends (its wall seconds). The library adds no handler but a ``NullHandler``:
``logging.basicConfig(level=logging.INFO)`` shows them."""


@dataclass(frozen=True)
class Request:
    """What a planner is asked for, checked before any work: the options every phase and
    every route reads (NOTE [planning: one request])."""

    scope: str
    loss_fn: LossFn | None
    leaf_modules: tuple[str, ...]
    """The user's leaf modules (FSDP units are added to them: :attr:`leaves`)."""
    max_stages: int
    sharding: Sharding
    optimizer: torch.optim.Optimizer | None = None
    """The training loop's optimizer: the budget covers its state and its step (the whole
    iteration from steady state; NOTE [record: optimizer step])."""
    accumulation_steps: int = 1
    probe: bool = True
    """Whether the profile's probe runs (False: shapes alone, a lower bound of the peak)."""
    precision: Precision | None = None
    """The precision the step runs in (autocast around the call, parameter dtypes), read
    when planning begins (autockpt/base/precision.py)."""
    device: torch.device | None = None
    """The device the step runs on (the model's and the inputs')."""
    cache: bool = True
    """Whether an earlier preparation of the same key is reused and this one kept
    (autockpt/planning/cache.py)."""
    target: Target | None = None
    """The device the run will use, when it is not the one planning runs on (NOTE [target:
    planning for another device]): its roofline times where nothing is measured, its
    memory as the default budget."""

    @property
    def leaves(self) -> tuple[str, ...]:
        """Modules captured as single calls: the user's, then the FSDP units, which stay
        module calls so that ``fully_shard``'s hooks fire and checkpoint segments hold
        whole units (autockpt/planning/sharding.py)."""
        given = self.leaf_modules
        return given + tuple(u for u in self.sharding.units if u not in given)


class Phases:
    """Wall seconds per planning phase (capture, profile, record, search, verify), and the
    progress callback told as each begins; both are logged (:data:`logger`). One phase runs
    at a time; starting one ends the one before."""

    def __init__(self, progress: ProgressFn) -> None:
        self.progress = progress
        self.seconds: dict[str, float] = {}
        self._running: tuple[str, float] | None = None

    def start(self, name: str, description: str) -> None:
        self.stop()
        self._running = (name, time.perf_counter())
        logger.info("%s: %s", name, description)
        self.progress(description)

    def stop(self) -> None:
        if self._running is not None:
            name, started = self._running
            seconds = time.perf_counter() - started
            logger.info("%s: done in %.2f s", name, seconds)
            self.add(name, seconds)
        self._running = None

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds


def check_budget_gb(budget_gb: Any) -> float:
    """``budget_gb`` as a float, or :class:`BudgetError` (:class:`BudgetTypeError` for what is
    not a real number). Every front door calls this first: a bad budget is refused before
    seconds of capture and profiling, not after them."""
    if isinstance(budget_gb, bool) or not isinstance(budget_gb, numbers.Real):
        hint = f": pass float({budget_gb!r})" if isinstance(budget_gb, str) else ""
        raise BudgetTypeError(
            f"budget_gb must be a number of GiB (2**30 bytes), e.g. budget_gb=8.0; got "
            f"{type(budget_gb).__name__} {budget_gb!r}{hint}"
        )
    value = float(budget_gb)
    if not (math.isfinite(value) and value > 0 and math.isfinite(value * GIB)):
        raise BudgetError(
            f"budget_gb must be a positive, finite number of GiB (2**30 bytes); got "
            f"{budget_gb!r}. Sensible budgets lie between the leanest plan's peak and the peak "
            "without checkpointing: Planner(model, inputs).minimum_peak_bytes and "
            ".as_written_peak_bytes, or `autockpt frontier`, show both."
        )
    return value


def budget_or_default(budget_gb: Any, target: Target | str | None) -> Any:
    """``budget_gb``, or where it is None the target's memory less its reserve (NOTE
    [target: planning for another device]); None without a target is refused."""
    if budget_gb is not None:
        return budget_gb
    if target is None:
        raise BudgetTypeError(
            "budget_gb is needed (GiB of peak memory per step, e.g. budget_gb=70.0; command "
            "line: --budget-gb), or a target whose memory is the default budget "
            "(target='h100'; --target h100)"
        )
    return resolve_target(target, torch.device("meta")).default_budget_bytes / GIB


def budget_in_bytes(budget_gb: float) -> int:
    """A checked budget in whole bytes. A byte count stated as GiB (``minimum_peak_bytes /
    2**30``) comes back as that count, where the float product may land a hair below it
    (``int`` would then refuse the stated minimum by one byte); a fraction of a byte left
    over is not budget."""
    return math.floor(budget_gb * GIB + 1e-3)


def check_iteration(
    model: nn.Module, scope: str, optimizer: Any, accumulation_steps: Any
) -> torch.optim.Optimizer | None:
    """The training iteration's arguments, checked before any work: an optimizer of the
    model's parameters (``autockpt.base.optimizer.check_optimizer``), only with scope
    "total" (scope "activations" leaves out everything resident, the optimizer's state
    too), and a whole number of micro-batches."""
    if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int):
        raise TypeError(f"accumulation_steps must be an int, got {accumulation_steps!r}")
    if accumulation_steps < 1:
        raise ValueError(f"accumulation_steps must be at least 1, got {accumulation_steps}")
    if optimizer is None:
        return None
    if scope != "total":
        raise OptimizerError(
            f'scope="{scope}" budgets what lies above the resident part of a step, and an '
            'optimizer\'s state is resident: pass scope="total" with an optimizer (the budget '
            "is then the whole iteration's), or leave the optimizer out"
        )
    return check_optimizer(optimizer, model)
