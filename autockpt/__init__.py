"""autockpt: place activation checkpoints so that PyTorch training fits a memory budget.

    fast = autockpt.optimize(model, example_inputs, budget_gb=8.0)
    loss_fn(fast(*example_inputs)).backward()
    fast.plan.save("plan.json")
    again = autockpt.apply(model, autockpt.Plan.load("plan.json"))
"""

__version__ = "0.1.0"

from autockpt.api import apply, optimize  # noqa: E402
from autockpt.errors import (  # noqa: E402
    AutockptError,
    BudgetError,
    BudgetTypeError,
    CompileError,
    CompileWarning,
    InfeasibleBudgetError,
    PlanFormatError,
    PlanMismatchError,
    PrecisionWarning,
    TraceError,
    UncoveredCallWarning,
)
from autockpt.measure import Measurement, measure  # noqa: E402
from autockpt.plan import MemoryBreakdown, Plan, Segment  # noqa: E402

__all__ = [
    "AutockptError",
    "BudgetError",
    "BudgetTypeError",
    "CompileError",
    "CompileWarning",
    "InfeasibleBudgetError",
    "Measurement",
    "MemoryBreakdown",
    "Plan",
    "PlanFormatError",
    "PlanMismatchError",
    "PrecisionWarning",
    "Segment",
    "TraceError",
    "UncoveredCallWarning",
    "__version__",
    "apply",
    "measure",
    "optimize",
]
