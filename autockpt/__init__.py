"""autockpt: place activation checkpoints so that PyTorch training fits a memory budget.

fast = autockpt.optimize(model, example_inputs, budget_gb=8.0)
loss_fn(fast(*example_inputs)).backward()
fast.plan.save("plan.json")
again = autockpt.apply(model, autockpt.Plan.load("plan.json"))

Planning logs its phases on the ``"autockpt"`` logger at INFO; the library adds only a
``NullHandler`` (``logging.basicConfig(level=logging.INFO)`` shows them).
"""

import logging

from autockpt._version import __version__
from autockpt.api import apply, clear_cache, optimize
from autockpt.errors import (
    AutockptError,
    BatchSizeError,
    BudgetError,
    BudgetTypeError,
    CompileError,
    CompileWarning,
    DefaultLossWarning,
    InfeasibleBudgetError,
    LargerInputWarning,
    OptimizerError,
    PlanFormatError,
    PlanMismatchError,
    PrecisionWarning,
    TraceError,
    UncoveredCallWarning,
)
from autockpt.fit import BatchCandidate, BatchFit, fit_batch
from autockpt.measure import Measurement, measure
from autockpt.plan import MemoryBreakdown, OptimizerRecord, Plan, Segment

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
    "InfeasibleBudgetError",
    "LargerInputWarning",
    "Measurement",
    "MemoryBreakdown",
    "OptimizerError",
    "OptimizerRecord",
    "Plan",
    "PlanFormatError",
    "PlanMismatchError",
    "PrecisionWarning",
    "Segment",
    "TraceError",
    "DefaultLossWarning",
    "UncoveredCallWarning",
    "__version__",
    "apply",
    "clear_cache",
    "fit_batch",
    "measure",
    "optimize",
]
