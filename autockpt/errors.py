"""Typed errors: every failure a user can cause says what went wrong and what to do next."""

from __future__ import annotations

from decimal import ROUND_CEILING, Decimal

GIB = 2**30


class AutockptError(Exception):
    """Base class of every error autockpt raises on purpose."""


class InfeasibleBudgetError(AutockptError):
    """The budget is below what even the leanest checkpoint plan needs.

    ``minimum_bytes`` (and ``minimum_gb``, the same in GiB) is the least budget that a plan
    reaches, stated only when it is that: asking for it succeeds (``minimum_gb`` is
    ``minimum_bytes / 2**30`` exactly, which ``budget_gb`` takes back to the same byte
    count). ``breakdown`` maps the parts (parameters, gradients, inputs, buffers, ...) to
    bytes so the message can say where the memory goes.

    A budget refused before profiling, below what the step keeps whatever is checkpointed
    (the breakdown's parts: parameters, gradients, buffers, inputs, the optimizer's state),
    states that sum under its own name: ``floor_bytes`` / ``floor_gb``, a bound that every
    plan's peak lies above (activations come on top). ``minimum_bytes`` and ``minimum_gb``
    are then None: the minimum needs the profile, and
    ``Planner(model, inputs).minimum_peak_bytes`` or ``autockpt frontier`` states it.
    ``lower_bound`` (kept for compatibility) is true exactly then.
    """

    def __init__(
        self,
        budget_bytes: int,
        minimum_bytes: int | None,
        breakdown: dict[str, int],
        scope: str = "total",
        hint: str | None = None,
        lower_bound: bool = False,
        *,
        floor_bytes: int | None = None,
    ) -> None:
        if lower_bound and floor_bytes is None:  # the form before floor_bytes existed
            floor_bytes, minimum_bytes = minimum_bytes, None
        if (floor_bytes is None) == (minimum_bytes is None):
            raise TypeError("InfeasibleBudgetError states a minimum or a floor, exactly one")
        self.budget_bytes = int(budget_bytes)
        self.minimum_bytes: int | None = None if minimum_bytes is None else int(minimum_bytes)
        self.minimum_gb: float | None = None if minimum_bytes is None else minimum_bytes / GIB
        self.floor_bytes: int | None = None if floor_bytes is None else int(floor_bytes)
        self.floor_gb: float | None = None if floor_bytes is None else floor_bytes / GIB
        self.breakdown = dict(breakdown)
        self.scope = scope
        self.lower_bound = self.floor_bytes is not None
        parts = ", ".join(f"{name} {_fmt(nbytes)}" for name, nbytes in self.breakdown.items())
        budget = f"budget {_fmt(budget_bytes)} ({self.budget_bytes} bytes, scope={scope})"
        if self.floor_bytes is not None:
            advice = hint or (
                "Shrink what checkpointing cannot touch: a smaller batch or sequence, "
                "lower-precision parameters, an optimizer with less state, or sharding "
                "parameters and gradients across devices (FSDP)."
            )
            super().__init__(
                f"{budget} is below what the step keeps whatever is checkpointed: at least "
                f"{gib_up(self.floor_bytes)} GiB ({self.floor_bytes} bytes). Breakdown: "
                f"{parts}. Refused before profiling: the minimum feasible budget lies above "
                "this, by the leanest plan's activations; "
                "Planner(model, inputs).minimum_peak_bytes or `autockpt frontier` states it. "
                f"{advice}"
            )
            return
        assert self.minimum_bytes is not None
        advice = hint or (
            "Raise the budget to at least the minimum, or shrink what checkpointing cannot "
            "touch: a smaller batch or sequence, lower-precision parameters, or sharding "
            "parameters and gradients across devices (FSDP)."
        )
        super().__init__(
            f"{budget} is below the minimum feasible {gib_up(self.minimum_bytes)} GiB "
            f"({self.minimum_bytes} bytes) that the leanest checkpoint plan needs. "
            f"Breakdown: {parts}. {advice}"
        )


def gib_up(nbytes: int, digits: int = 9) -> str:
    """``nbytes`` in GiB to ``digits`` significant digits, rounded up: a number read off a
    message and passed back as ``budget_gb`` is never below ``nbytes`` (a stated minimum
    rounded down would be refused by the bytes it lost)."""
    value = Decimal(nbytes) / Decimal(GIB)  # exact: a power of two divides
    if value == 0:
        return "0"
    exponent = value.adjusted() - digits + 1
    rounded = value.quantize(Decimal(1).scaleb(exponent), rounding=ROUND_CEILING)
    return f"{rounded.normalize():f}"


class TraceError(AutockptError):
    """The model's forward could not be captured as a graph by any capture path.

    ``module`` is the qualified name of the innermost module that failed ("" for the root),
    ``location`` the ``file:line`` of the offending source line. ``in_root_code`` is true when
    fx failed in the root module's own code and ``torch.export`` failed too: no capture path
    reaches inside the root's forward, so planning may fall back to the submodules it calls
    (autockpt/planning/nested.py).
    """

    def __init__(
        self,
        module: str,
        location: str,
        source_line: str,
        reason: str,
        in_root_code: bool = False,
        tried: tuple[str, ...] = (),
    ) -> None:
        self.module = module
        self.location = location
        self.source_line = source_line
        self.reason = reason
        self.in_root_code = in_root_code
        self.tried = tried
        """Where the root's code could not be captured: the first failure of each level of
        submodule calls tried instead (autockpt/planning/nested.py), one line each."""
        where = f"module '{module}'" if module else "the root module"
        also = "".join(f"\n  {line}" for line in tried)
        super().__init__(
            f"cannot capture {where} at {location}: `{source_line}` ({reason}). "
            + (f"No submodule it calls captures either:{also}\n" if tried else "")
            + "Make the code shape-static (no Python branching on tensor values), or pass "
            "leaf_modules=[...] naming the submodule so it is run as one opaque call."
        )


class PlanMismatchError(AutockptError):
    """A saved plan does not belong to this model, these inputs or this library version."""


class PlanFormatError(AutockptError):
    """A plan file is not valid plan JSON (corrupt, truncated or missing fields)."""


def _fmt(nbytes: int) -> str:
    if abs(nbytes) >= GIB:
        return f"{nbytes / GIB:.3f} GiB"
    return f"{nbytes / 2**20:.2f} MiB"


format_bytes = _fmt


class ShardingError(AutockptError, ValueError):
    """Distributed arguments that cannot work: an already wrapped model (DDP / FSDP), FSDP
    units that do not exist or are not module calls, ``world_size < 1``, an unknown
    ``sharding``. Also a ``ValueError``, since every case is a bad argument."""


class TargetError(AutockptError, ValueError):
    """A ``target`` autockpt cannot plan for: an unknown name, or a device type other than
    the one a real model is on (only a model on the meta device is planned for another
    device: autockpt/base/target.py). Raised before any capture. Also a ``ValueError``."""


class PrecisionError(AutockptError, ValueError):
    """A ``precision`` autockpt cannot plan: an unknown name, or one that asks for parameter
    dtypes the model does not have (convert the model first: free on the meta device).
    Raised before any capture. Also a ``ValueError``."""


class BudgetError(AutockptError, ValueError):
    """A budget that is not a positive, finite number of GiB (zero, negative, NaN, infinite).
    Raised by every front door before any capture or profiling, so a typo costs nothing.
    Also a ``ValueError``, since it is a bad argument."""


class BudgetTypeError(BudgetError, TypeError):
    """A budget that is not a number at all (a string such as ``"8"``, a bool, a tensor).
    Also a ``TypeError``; catch :class:`BudgetError` for every bad budget."""


class OptimizerError(AutockptError, ValueError):
    """An optimizer autockpt cannot budget: not a ``torch.optim.Optimizer``, holding tensors
    that are not the model's parameters, stepped with a closure (L-BFGS), or given with
    ``scope="activations"`` (whose budget leaves out everything resident, the optimizer's
    state included). Raised before any capture or profiling. Also a ``ValueError``."""


class BatchSizeError(AutockptError, ValueError):
    """``fit_batch``'s ``make_inputs`` cannot serve the search: it raised for a size (the
    message names the call), or returns inputs of the same shapes for two sizes (it must
    build inputs of size ``n``); or the model refuses even the smallest size (its own error,
    named in the message, is the cause: larger sizes it refuses only do not fit). Also a
    ``ValueError``."""


class CompileError(AutockptError, TypeError):
    """A ``torch.compile``'d model in a form that planning cannot see through (compiled in
    place with ``Module.compile()``). Plan the eager module first, then compile the result:
    ``torch.compile(autockpt.optimize(model, ...))``."""


class DefaultLossWarning(UserWarning):
    """No ``loss_fn`` was given and the model's output has no ``loss``: autockpt plans and
    checks the budget for the sum of the output's floating tensors, which is rarely the loss
    trained with (said once per process)."""


class UncoveredCallWarning(UserWarning):
    """A training call with autograd on that the plan does not cover: other arguments than
    planned (it runs the original forward, un-checkpointed), or larger tensors with
    ``on_larger_input="warn"`` (the graph runs, but the budget may not hold)."""


class LargerInputWarning(UncoveredCallWarning):
    """A training call with larger tensors than planned, run because the result's
    ``on_larger_input`` is ``"warn"``: the graph runs, but the budget may not hold. A kind of
    :class:`UncoveredCallWarning`, so filters on that one still catch it."""


class PrecisionWarning(UserWarning):
    """A training call of an optimized model under another precision than planned (another
    autocast state or other parameter dtypes): it runs, but the plan's memory prediction and
    budget no longer describe it."""


class CompileWarning(UserWarning):
    """An optimized model traced by ``torch.compile`` whose plan was verified for eager
    steps only (``torch.compile(autockpt.optimize(model, ...))``): the compiled step keeps
    other tensors than the eager one, so its peak may lie above the budget.
    ``autockpt.optimize(torch.compile(model), ...)`` plans and verifies the compiled step."""


class UnusualStateError(AutockptError, TypeError):
    """The captured forward reads a parameter or buffer whose values are not one dense
    strided tensor (sparse, nested, quantized, a wrapper subclass such as DTensor): planning
    sizes a step on fake tensors and times it node by node on the device, and can do
    neither with it (NOTE [runtime: unusual state], autockpt/base/runtime.py). Such tensors that the forward does not
    read are planned around and left as found. Also a ``TypeError``."""


class FakeTensorLeakError(AutockptError):
    """A real training step computed with a fake tensor, one that planning made on fake
    tensors and that the loss (or the model's own code) kept between calls, e.g. targets
    cached per batch size on their first call (NOTE [runtime: the loss on fake tensors], autockpt/base/runtime.py).
    Such a step has no values: its loss is no number and its gradients are fake."""
