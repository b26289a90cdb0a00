"""autockpt: place activation checkpoints so that PyTorch training fits a memory budget.

fast = autockpt.optimize(model, example_inputs, budget_gb=8.0)
loss_fn(fast(*example_inputs)).backward()
fast.plan.save("plan.json")
again = autockpt.apply(model, autockpt.Plan.load("plan.json"))

Planning logs its phases on the ``"autockpt"`` logger at INFO; the library adds only a
``NullHandler`` (``logging.basicConfig(level=logging.INFO)`` shows them).
"""

from __future__ import annotations

import importlib
import logging
import sys
import types
from typing import TYPE_CHECKING, Any

from autockpt._version import __version__

if TYPE_CHECKING:  # what the names below resolve to, for readers and type checkers
    from autockpt.api import apply, clear_cache, optimize
    from autockpt.base.target import TARGETS, Target
    from autockpt.errors import (
        AutockptError,
        BatchSizeError,
        BudgetError,
        BudgetTypeError,
        CompileError,
        CompileWarning,
        DefaultLossWarning,
        FakeTensorLeakError,
        InfeasibleBudgetError,
        LargerInputWarning,
        OptimizerError,
        PlanFormatError,
        PlanMismatchError,
        PrecisionError,
        PrecisionWarning,
        TargetError,
        TraceError,
        UncoveredCallWarning,
        UnusualStateError,
    )
    from autockpt.fit import BatchCandidate, BatchFit, fit_batch
    from autockpt.measure import Measurement, measure
    from autockpt.plan import MemoryBreakdown, OptimizerRecord, Plan, Segment

# The public names load on first use (PEP 562), so that importing the package does not load
# torch: `autockpt --help` answers at once, and the command line sets torch's environment
# (OpenMP's wait policy, read once when torch loads) before torch loads.
_HOME = {
    **dict.fromkeys(("apply", "clear_cache", "optimize"), "autockpt.api"),
    **dict.fromkeys(
        (
            "AutockptError",
            "BatchSizeError",
            "BudgetError",
            "BudgetTypeError",
            "CompileError",
            "CompileWarning",
            "DefaultLossWarning",
            "FakeTensorLeakError",
            "InfeasibleBudgetError",
            "LargerInputWarning",
            "OptimizerError",
            "PlanFormatError",
            "PlanMismatchError",
            "PrecisionError",
            "PrecisionWarning",
            "TargetError",
            "TraceError",
            "UncoveredCallWarning",
            "UnusualStateError",
        ),
        "autockpt.errors",
    ),
    **dict.fromkeys(("BatchCandidate", "BatchFit", "fit_batch"), "autockpt.fit"),
    **dict.fromkeys(("Measurement", "measure"), "autockpt.measure"),
    **dict.fromkeys(("TARGETS", "Target"), "autockpt.base.target"),
    **dict.fromkeys(("MemoryBreakdown", "OptimizerRecord", "Plan", "Segment"), "autockpt.plan"),
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        try:  # a submodule not loaded yet (`autockpt.api` after `import autockpt`)
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as error:
            if error.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOME))


class _Package(types.ModuleType):
    """``autockpt.measure`` is the function, as it was when the package loaded everything:
    loading the submodule of that name (which any planning does) would otherwise bind the
    module over it. The submodule stays ``sys.modules["autockpt.measure"]``."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and name in _HOME:
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

logging.getLogger("autockpt").addHandler(logging.NullHandler())

__all__ = [
    "AutockptError",
    "BatchCandidate",
    "BatchFit",
    "BatchSizeError",
    "BudgetError",
    "BudgetTypeError",
    "CompileError",
    "CompileWarning",
    "FakeTensorLeakError",
    "InfeasibleBudgetError",
    "LargerInputWarning",
    "Measurement",
    "MemoryBreakdown",
    "OptimizerError",
    "OptimizerRecord",
    "Plan",
    "PlanFormatError",
    "PlanMismatchError",
    "PrecisionError",
    "PrecisionWarning",
    "Segment",
    "TARGETS",
    "Target",
    "TargetError",
    "TraceError",
    "DefaultLossWarning",
    "UncoveredCallWarning",
    "UnusualStateError",
    "__version__",
    "apply",
    "clear_cache",
    "fit_batch",
    "measure",
    "optimize",
]
