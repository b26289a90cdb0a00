"""autockpt: place activation checkpoints so that PyTorch training fits a memory budget.

fast = autockpt.optimize(model, example_inputs, budget_gb=8.0)
loss_fn(fast(*example_inputs)).backward()
fast.plan.save("plan.json")
again = autockpt.apply(model, autockpt.Plan.load("plan.json"))
"""

from autockpt._version import __version__
from autockpt.api import apply, optimize
from autockpt.errors import (
    AutockptError,
    BatchSizeError,
    BudgetError,
    BudgetTypeError,
    CompileError,
    CompileWarning,
    InfeasibleBudgetError,
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
    "UncoveredCallWarning",
    "__version__",
    "apply",
    "fit_batch",
    "measure",
    "optimize",
]
